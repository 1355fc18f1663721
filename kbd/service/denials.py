"""A command's refusals by its Landlock layers, told in the plan's words
(docs/sandbox.md "Refusals the kernel reports").

The kernel names what was refused and where (:mod:`kbd.sandbox.denials`); this module
says why, with the same explanation ``kbd why`` gives the same caller
(:func:`kbd.service.why.why_path`), spells each path as the command knew it
(``$WORKFLOW_KB_RTS/context/a.md``), and keeps the report in the audit log.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kbd.core.plan import Plan
from kbd.core.principals import Actor
from kbd.core.records import Record, key
from kbd.errors import KbdError
from kbd.sandbox.denials import Collected, Refused

if TYPE_CHECKING:
    from kbd.service.sessions import RootSessions

Ask = Callable[[str, str], "tuple[bool, str, str]"]

# Landlock's right → the word a refusal line uses (a folder's rights read "… in FOLDER").
ACTIONS = {
    "fs.execute": "execute",
    "fs.read_file": "read",
    "fs.read_dir": "list",
    "fs.write_file": "write",
    "fs.truncate": "truncate",
    "fs.ioctl_dev": "use the device",
    "fs.remove_dir": "remove a folder in",
    "fs.remove_file": "remove a file in",
    "fs.make_reg": "create a file in",
    "fs.make_dir": "create a folder in",
    "fs.make_sym": "create a symlink in",
    "fs.make_fifo": "create a FIFO in",
    "fs.make_sock": "create a socket in",
    "fs.make_char": "create a device in",
    "fs.make_block": "create a device in",
    "fs.refer": "link or move a file from another folder into",
    "net.bind_tcp": "listen on TCP",
    "net.connect_tcp": "connect over TCP to",
    "scope.signal": "signal",
    "scope.abstract_unix_socket": "connect to an abstract Unix socket of",
}
READS = frozenset({"fs.execute", "fs.read_file", "fs.read_dir"})
# Rights the inner layer withholds in a source's notes/ even where writing is granted
# (docs/sandbox.md "Contributed notes/"): only regular files and folders land there.
KINDS = frozenset(
    {"fs.make_sym", "fs.make_fifo", "fs.make_sock", "fs.make_char", "fs.make_block", "fs.refer"}
)
# Rights on an entry itself (its path is in the record); the others are a folder's.
ENTRY_RIGHTS = frozenset(
    {"fs.execute", "fs.read_file", "fs.read_dir", "fs.write_file", "fs.truncate", "fs.ioctl_dev"}
)
NEW_ENTRY = "new.md"
LINES = 20  # refusal lines printed after a command; the --json record lists up to LISTED
LISTED = 200


@dataclass(frozen=True)
class Denial(Record):
    """One distinct refusal, explained."""

    action: str
    blockers: tuple[str, ...]
    #: As the command knew it: ``$WORKFLOW_KB_<ALIAS>/…`` under an attachment, else the sandbox's path.
    path: str | None
    code: str
    message: str
    count: int
    #: The ``kbd why`` command that explains it further (None where kbd why has nothing to add).
    why: str | None = field(default=None, metadata=key(omit_none=True))


@dataclass(frozen=True)
class DenialReport(Record):
    """What ``kbd exec --json`` says of the sandbox's refusals: ``reported`` false (and
    ``why_not``) where the kernel cannot report them, so that no refusal list is empty by
    pretence; ``more``: distinct refusals beyond those listed; ``lost``: refusals the kernel
    counted but did not deliver."""

    reported: bool
    why_not: str | None
    refused: tuple[Denial, ...]
    more: int = 0
    lost: int = 0
    #: Why the list may miss some refusals (an overflowed socket), when it may.
    incomplete: str | None = field(default=None, metadata=key(omit_none=True))

    def lines(self) -> list[str]:
        out = []
        for d in self.refused[:LINES]:
            times = f" ({d.count} times)" if d.count > 1 else ""
            where = f" {d.path}" if d.path else ""
            see = f"; see {d.why}" if d.why else ""
            out.append(f"kbd: refused {d.action}{where}{times} — {d.message}{see}")
        hidden = max(0, len(self.refused) - LINES) + self.more
        if hidden:
            out.append(f"kbd: … and {hidden} more refused accesses (kbd exec --json lists them)")
        if self.lost:
            out.append(
                f"kbd: the kernel dropped {self.lost} more refusal reports (audit rate limit or backlog)"
            )
        if self.incomplete:
            out.append(f"kbd: {self.incomplete}")
        return out


def not_reported(why_not: str) -> DenialReport:
    return DenialReport(False, why_not, ())


def spelled(plan: Plan, path: str) -> str:
    """``path`` as ``$VAR/rest`` under the plan's longest matching path variable."""
    best = ""
    for name, value in plan.env.items():
        under = path == value or path.startswith(value.rstrip("/") + "/")
        if value.startswith("/") and under and len(value) > len(plan.env.get(best, "")):
            best = name
    if not best:
        return path
    return f"${best}{path[len(plan.env[best].rstrip('/')) :]}"


def explain(collected: Collected, *, plan: Plan, sid: str, network: str, ask: Ask) -> DenialReport:
    """The report of ``collected`` for a command of session ``sid`` under ``plan``."""
    if collected.stopped is not None and not collected.refused:
        return not_reported(collected.stopped)
    ordered = sorted(collected.refused, key=lambda r: (r.path or "", r.blockers))
    listed = [_one(r, plan=plan, sid=sid, network=network, ask=ask) for r in ordered[:LISTED]]
    more = max(0, len(ordered) - LISTED)
    return DenialReport(True, None, tuple(listed), more, collected.lost, incomplete=collected.stopped)


def asker(sessions: RootSessions, sid: str, actor: Actor) -> Ask:
    """``kbd why`` for one (path, mode), as the command's caller would ask it:
    (allowed, first reason's code, its message)."""

    from kbd.service.why import why_path  # only once something was refused: it costs imports

    def ask(path: str, mode: str) -> tuple[bool, str, str]:
        try:
            answer = why_path(sessions, sid, path, mode, actor=actor)
        except KbdError as err:  # the session closed meanwhile, the principal was disabled …
            return False, err.code, err.message
        if answer.allowed or not answer.reasons:
            return True, "", ""
        return False, answer.reasons[0].code, answer.reasons[0].message

    return ask


def _one(r: Refused, *, plan: Plan, sid: str, network: str, ask: Ask) -> Denial:
    head = r.blockers[0] if r.blockers else "?"
    action = ACTIONS.get(head, head)
    if head.startswith("net."):
        return Denial(action, r.blockers, r.detail, "no_network",
                      f"this sandbox has no network (sandbox.network: {network})", r.count)  # fmt: skip
    if head.startswith("scope."):
        return Denial(action, r.blockers, r.detail, "outside_sandbox",
                      "a process outside the sandbox is out of its reach", r.count)  # fmt: skip
    if r.path is None:
        return Denial(action, r.blockers, None, "refused", "the sandbox refused it", r.count)
    # A folder's rights (make, remove, refer) name the folder, not the entry: kbd why is asked
    # about a new note in it, which is what a write there would be.
    asked = f"{r.path.rstrip('/')}/{NEW_ENTRY}" if not set(r.blockers) & ENTRY_RIGHTS else r.path
    shown = spelled(plan, r.path)
    mode = "read" if set(r.blockers) <= READS else "write"
    allowed, code, message = ask(asked, mode)
    if allowed:
        # The path is granted: what was refused is the kind of change, not the place.
        if set(r.blockers) & KINDS:
            return Denial(action, r.blockers, shown, "not_regular",
                          "only regular files and folders may be made in a source's notes/ (no symlinks, devices, "
                          "FIFOs or sockets, and no links or moves from another folder)", r.count)  # fmt: skip
        return Denial(action, r.blockers, shown, "refused", "the sandbox refused this access here", r.count)
    target = spelled(plan, asked)
    why = f"kbd why {shlex.quote(sid)} {shlex.quote(target)}" + (" --mode write" if mode == "write" else "")
    return Denial(action, r.blockers, shown, code, message, r.count, why)


def audit_fields(report: DenialReport) -> dict[str, object]:
    """The audit record's fields (bounded: the first LINES refusals)."""
    refused = [
        {"action": d.action, "path": d.path, "code": d.code, "count": d.count} for d in report.refused[:LINES]
    ]
    return {
        "refused": refused,
        "distinct": len(report.refused) + report.more,
        "lost": report.lost,
    }
