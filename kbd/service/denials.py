"""A command's refusals by its Landlock layers, told in the plan's words
(docs/sandbox.md "Refusals the kernel reports").

The kernel names what was refused and where (:mod:`kbd.sandbox.denials`); this module
says why, with the same explanation ``kbd why`` gives the same caller
(:func:`kbd.service.why.why_path`), spells each path as the command knew it
(``$WORKFLOW_KB_RTS/context/a.md``), and keeps the report in the audit log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kbd.core.config import SandboxConfig
from kbd.core.plan import Plan
from kbd.core.principals import Actor
from kbd.core.records import Record, key
from kbd.errors import KbdError
from kbd.sandbox.denials import Collected, Refused

if TYPE_CHECKING:
    import socket

    from kbd.sandbox.denials import Collector, Mark
    from kbd.service.root import Root
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
MAX_EXPLAINED = 50  # distinct refusals explained with kbd why (each a plan lookup under the root's lock)
JSON_MAX = 60_000  # bytes of the --json record: it travels in one frame of the exec protocol
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


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped: a byte that is not UTF-8
    as ``\\xNN`` (:func:`kbd.core.importing.shown`), a control or format character as its Python
    escape (:func:`kbd.core.identifiers.one_line`): a file's name never writes a line of its own."""
    if text.isprintable():
        return text
    from kbd.core.identifiers import one_line  # only for a name that needs it: the exec path pays imports
    from kbd.core.importing import shown

    return one_line(shown(text), limit=1 << 16)


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


def explain(
    collected: Collected,
    *,
    plan: Plan,
    sid: str,
    network: str,
    ask: Ask,
    layers: list[dict[str, Any]] | None = None,
) -> DenialReport:
    """The report of ``collected`` for a command of session ``sid`` under ``plan``, whose sandbox
    kbd built with the Landlock ``layers`` (helper specs; None: not known, every refusal is taken
    for kbd's)."""
    if collected.stopped is not None and not collected.refused:
        return not_reported(collected.stopped)
    _real.cache_clear()  # resolved once per report, never across commands
    ordered = sorted(collected.refused, key=lambda r: (r.path or "", r.blockers))
    listed = [_one(r, plan=plan, sid=sid, network=network, ask=ask if i < MAX_EXPLAINED else None, layers=layers)
              for i, r in enumerate(ordered[:LISTED])]  # fmt: skip
    more = max(0, len(ordered) - LISTED)
    return DenialReport(True, None, tuple(listed), more, collected.lost, incomplete=collected.stopped)


def asker(
    sessions: RootSessions, sid: str, actor: Actor, lock: contextlib.AbstractContextManager[Any]
) -> Ask:
    """``kbd why`` for one (path, mode), as the command's caller would ask it:
    (allowed, first reason's code, its message). ``lock`` (the daemon's, on its shared root)
    is held for each question, not across them."""

    from kbd.service.why import why_path  # only once something was refused: it costs imports

    def ask(path: str, mode: str) -> tuple[bool, str, str]:
        try:
            with lock:
                answer = why_path(sessions, sid, path, mode, actor=actor)
        except KbdError as err:  # the session closed meanwhile, the principal was disabled …
            return False, err.code, err.message
        if answer.allowed or not answer.reasons:
            return True, "", ""
        return False, answer.reasons[0].code, answer.reasons[0].message

    return ask


def _one(
    r: Refused, *, plan: Plan, sid: str, network: str, ask: Ask | None, layers: list[dict[str, Any]] | None
) -> Denial:
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
    shown = printable(spelled(plan, r.path))
    mode = "read" if set(r.blockers) <= READS else "write"
    if layers is not None and allowed_by(layers, r.blockers, r.path):
        # Every layer kbd made allows it: a layer the command applied itself refused it.
        return Denial(action, r.blockers, shown, "not_kbd_rule",
                      "kbd's sandbox allows this: a Landlock layer the command applied itself refused it", r.count)  # fmt: skip
    if ask is None:
        return Denial(action, r.blockers, shown, "unexplained",
                      f"not explained: more than {MAX_EXPLAINED} distinct refusals", r.count)  # fmt: skip
    if not _utf8(asked):
        return Denial(action, r.blockers, shown, "unexplained",
                      "not explained: kbd why takes only UTF-8 paths", r.count)  # fmt: skip
    allowed, code, message = ask(asked, mode)
    if allowed:
        # The path is granted: what was refused is the kind of change, not the place.
        if set(r.blockers) & KINDS:
            return Denial(action, r.blockers, shown, "not_regular",
                          "only regular files and folders may be made in a source's notes/ (no symlinks, devices, "
                          "FIFOs or sockets, and no links or moves from another folder)", r.count)  # fmt: skip
        return Denial(action, r.blockers, shown, "refused",
                      "the sandbox refused this access, though the plan allows it", r.count)  # fmt: skip
    target = spelled(plan, asked)
    why = None
    if printable(target) == target:  # a pointer a person can paste
        why = f"kbd why {shlex.quote(sid)} {shlex.quote(target)}" + (
            " --mode write" if mode == "write" else ""
        )
    return Denial(action, r.blockers, shown, code, message, r.count, why)


def allowed_by(layers: list[dict[str, Any]], blockers: tuple[str, ...], path: str) -> bool:
    """Whether kbd's Landlock ``layers`` (helper specs, as kbd.sandbox.landlock_helper reads them)
    allow each of Landlock's ``blockers`` (``fs.read_file`` …) at ``path``: a right a layer does
    not handle is allowed by it; a handled one only beneath a rule that grants it."""
    if not path.startswith("/") or not blockers or not all(b.startswith("fs.") for b in blockers):
        return False
    rights = [b.removeprefix("fs.") for b in blockers]
    for layer in layers:
        handled = set(layer.get("handled", ()))
        for right in rights:
            if right in handled and not any(
                right in rule["access"] and _beneath(path, str(rule["path"])) for rule in layer["rules"]
            ):
                return False
    return True


def _beneath(path: str, top: str) -> bool:
    real = _real(top)  # a rule holds on what its path resolves to (/lib -> usr/lib)
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in {top, real})


@functools.lru_cache(maxsize=1024)
def _real(path: str) -> str:
    return os.path.realpath(path)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def fitted(report: DenialReport, limit: int = JSON_MAX) -> DenialReport:
    """``report`` with as many refusals listed as its JSON fits in ``limit`` bytes (the rest
    counted in ``more``)."""
    while report.refused and len(_json(report)) > limit:
        keep = len(report.refused) // 2
        report = replace(report, refused=report.refused[:keep], more=report.more + len(report.refused) - keep)
    return report


def _json(report: DenialReport) -> bytes:
    return json.dumps({"denials": report.to_json()}, ensure_ascii=False).encode()


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


# -- one command's watch ------------------------------------------------------------


NO_LAYER = (
    "this sandbox has no Landlock layer: bubblewrap's mounts refuse what it does not grant "
    "(EROFS, ENOENT), which the kernel does not report"
)


class Watch:
    """The watch on one command's Landlock refusals: the helper's pid channel while the
    command starts, its report once it ended. ``why_not`` says why there is nothing to
    report (never an empty list by pretence)."""

    def __init__(self, config: SandboxConfig, backend: str) -> None:
        self.why_not: str | None = None
        self.collector: Collector | None = None
        self.reader: socket.socket | None = None
        self.fd: int | None = None  # the helper's end, until the command holds it
        self.mark: Mark | None = None
        self.pid: int | None = None  # the helper's, once it told
        self.layers: list[dict[str, Any]] = []  # kbd's Landlock layers in the command's sandbox
        if not config.report_denials:
            self.why_not = "sandbox.report_denials is off in kbd.yaml"
        elif backend not in ("bwrap", "landlock"):
            self.why_not = "this command runs without a sandbox"

    def handed(self, layers: list[dict[str, Any]]) -> int | None:
        """The descriptor to hand the helper that applies ``layers`` (helper specs), or None
        (reports off, no layer — nothing the kernel could report —, or a kernel that cannot
        report). The collector is asked only here, so that a command with no Landlock layer
        (a bubblewrap read plan: most commands) pays for none of it."""
        self.layers = layers
        if self.why_not is not None:
            return None
        if not layers:
            self.why_not = NO_LAYER
            return None
        from kbd.sandbox import denials

        self.collector = denials.shared()
        if self.collector is None:
            self.why_not = denials.unavailable() or "the kernel's audit records cannot be read"
            return None
        self.reader, self.fd = denials.pid_channel()
        self.mark = self.collector.mark()
        return self.fd

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def collect(self) -> Collected | str:
        """What the kernel reported once the command's tree is dead, or why nothing could be
        (never under the daemon's lock: it may wait for the kernel)."""
        if self.why_not is not None or self.collector is None or self.reader is None or self.mark is None:
            return self.why_not or NO_LAYER
        from kbd.sandbox.denials import sender

        told = sender(self.reader)
        if told is None:  # the helper never ran: the sandbox failed before it
            return "the command's Landlock layer did not start"
        self.pid = told[0]
        return self.collector.claim(told[0], told[1], self.mark)


@dataclass
class Teller:
    """Where a command's report goes: ``say`` (a line to its stderr), ``json`` (``--json``),
    ``lock`` (the daemon's, held for each plan lookup)."""

    say: Callable[[str], None]
    json: bool
    lock: contextlib.AbstractContextManager[Any]


def finish(
    watch: Watch, host: Root, sessions: RootSessions, plan: Plan, sid: str, who: Actor, to: Teller
) -> None:
    """After the command: one line per distinct refusal on its stderr, with ``--json`` the report
    as one JSON line, the audit record. Whatever fails here is said, never the exit status."""
    if watch.why_not is not None and not to.json:
        return  # nothing to say, and no one asked to be told so
    try:
        collected = watch.collect()
        if not to.json and not isinstance(collected, str) and collected.empty:
            return  # nothing refused: no explanation to import or build
        if isinstance(collected, str):
            report = not_reported(collected)
        else:
            report = explain(collected, plan=plan, sid=sid, network=host.config.sandbox.network,
                             ask=asker(sessions, sid, who, to.lock), layers=watch.layers)  # fmt: skip
        if report.refused or report.lost:
            with to.lock:
                host.audit("sandbox_refusals", session=sid, workflow_id=plan.workflow_id, pid=watch.pid,
                           **audit_fields(report))  # fmt: skip
        for line in report.lines():
            to.say(line)
        if to.json:
            to.say(_json(fitted(report)).decode())
    except Exception as exc:  # the command has run: its status stands whatever happens here
        reason = printable(str(exc))[:300]
        with contextlib.suppress(Exception), to.lock:  # kept, even when it cannot be said
            host.audit("sandbox_refusals_failed", session=sid, workflow_id=plan.workflow_id, reason=reason)
        with contextlib.suppress(Exception):  # saying it may fail the same way (a client gone)
            to.say(f"kbd: the sandbox's refusals could not be reported: {reason}")
