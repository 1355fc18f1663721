"""Telling a command's refusals in the plan's words (docs/sandbox.md "Refusals the kernel
reports"): paths spelled as the command knew them, a folder's rights asked about an entry in
it, a granted path refused for its kind, the network and other processes, and the lines."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from kbd.core.plan import Plan
from kbd.sandbox.denials import Collected, Refused
from kbd.service import denials
from kbd.service.sessions import RootSessions
from tests.helpers import OPERATOR, KbRoot


@pytest.fixture
def plan(tmp_path: Path) -> Plan:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]},
                sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])  # fmt: skip
    r = kb.call(
        "session",
        "open",
        "con",
        "--kind",
        "execution",
        "--kb-access",
        "read-write",
        "--as",
        "alice",
        "--json",
    )
    assert r.code == 0, r.err
    return RootSessions(kb.host()).plan(str(r.json()["session_id"]), actor=OPERATOR)


def kb_path(plan: Plan) -> str:
    return plan.env["WORKFLOW_KB_SRC"]


def test_spelled_uses_the_longest_variable(plan: Plan) -> None:
    kb = kb_path(plan)
    assert denials.spelled(plan, f"{kb}/notes/a.md") == "$WORKFLOW_KB_SRC/notes/a.md"
    assert denials.spelled(plan, kb) == "$WORKFLOW_KB_SRC"
    assert denials.spelled(plan, f"{kb}x/a") == f"{kb}x/a"  # a sibling is not beneath it
    assert denials.spelled(plan, "/etc/shadow") == "/etc/shadow"


def test_explain(plan: Plan) -> None:
    kb = kb_path(plan)
    asked: list[tuple[str, str]] = []

    def ask(path: str, mode: str) -> tuple[bool, str, str]:
        asked.append((path, mode))
        if path.startswith(f"{kb}/notes/"):
            return True, "", ""
        return False, "protected", "context/ is the owner's"

    collected = Collected(
        (
            Refused(("fs.write_file",), f"{kb}/context/a.md", None, 1),
            Refused(("fs.make_sym",), f"{kb}/notes", None, 2),
            Refused(("fs.make_reg",), f"{kb}/context", None, 1),
            Refused(("net.connect_tcp",), None, "port 443", 1),
            Refused(("scope.signal",), None, "process sshd", 1),
        ),
        lost=3,
        final=True,
    )
    report = denials.explain(collected, plan=plan, sid="s_1", network="none", ask=ask)
    # A folder's right is asked about a new entry in it; an entry's about itself.
    assert sorted(asked) == sorted([(f"{kb}/context/a.md", "write"), (f"{kb}/notes/new.md", "write"),
                                    (f"{kb}/context/new.md", "write")])  # fmt: skip
    got = {(d.action, d.path): d for d in report.refused}
    write = got[("write", "$WORKFLOW_KB_SRC/context/a.md")]
    assert (write.code, write.why) == (
        "protected",
        "kbd why s_1 '$WORKFLOW_KB_SRC/context/a.md' --mode write",
    )
    sym = got[("create a symlink in", "$WORKFLOW_KB_SRC/notes")]
    assert (sym.code, sym.why, sym.count) == ("not_regular", None, 2)
    make = got[("create a file in", "$WORKFLOW_KB_SRC/context")]
    assert make.why == "kbd why s_1 '$WORKFLOW_KB_SRC/context/new.md' --mode write"
    assert got[("connect over TCP to", "port 443")].code == "no_network"
    assert got[("signal", "process sshd")].code == "outside_sandbox"
    lines = report.lines()
    assert (
        "kbd: refused create a symlink in $WORKFLOW_KB_SRC/notes (2 times) — only regular files"
        in "\n".join(lines)
    )
    assert lines[-1] == "kbd: the kernel dropped 3 more refusal reports (audit rate limit or backlog)"


def test_lines_are_bounded(plan: Plan) -> None:
    many = tuple(Refused(("fs.read_file",), f"/x/{i:03}", None, 1) for i in range(denials.LISTED + 5))
    report = denials.explain(Collected(many, 0, True), plan=plan, sid="s", network="none",
                             ask=lambda p, m: (False, "outside_grants", "not granted"))  # fmt: skip
    assert len(report.refused) == denials.LISTED and report.more == 5
    lines = report.lines()
    assert len(lines) == denials.LINES + 1
    assert (
        lines[-1]
        == f"kbd: … and {denials.LISTED - denials.LINES + 5} more refused accesses (kbd exec --json lists them)"
    )


def test_a_stopped_kernel_is_said_not_hidden(plan: Plan) -> None:
    report = denials.explain(Collected((), 0, True, "kernel audit was turned off"), plan=plan, sid="s",
                             network="none", ask=lambda p, m: (True, "", ""))  # fmt: skip
    assert (report.reported, report.why_not) == (False, "kernel audit was turned off")
    partial = denials.explain(Collected((Refused(("fs.read_file",), "/x", None, 1),), 0, False, "overflowed"),
                              plan=plan, sid="s", network="none", ask=lambda p, m: (False, "c", "m"))  # fmt: skip
    assert (
        partial.reported and partial.incomplete == "overflowed" and partial.lines()[-1] == "kbd: overflowed"
    )
    assert denials.DenialReport.from_json(partial.to_json()) == partial


def test_a_refusal_kbds_layers_allow_is_the_commands_own(plan: Plan) -> None:
    kb = kb_path(plan)
    layers: list[dict[str, Any]] = [
        {"handled": ["read_file", "write_file"], "rules": [{"path": kb, "access": ["read_file"]}]}
    ]
    read = Refused(("fs.read_file",), f"{kb}/notes/fact.md", None, 1)
    write = Refused(("fs.write_file",), f"{kb}/notes/fact.md", None, 1)
    report = denials.explain(Collected((read, write), 0, True), plan=plan, sid="s", network="none",
                             ask=lambda p, m: (True, "", ""), layers=layers)  # fmt: skip
    got = {d.action: d for d in report.refused}
    assert (got["read"].code, got["read"].why) == ("not_kbd_rule", None)
    # kbd's layer does refuse the write, though the plan would allow it: said as such.
    assert got["write"].code == "refused"


def test_allowed_by_follows_the_helpers_rules() -> None:
    layers: list[dict[str, Any]] = [
        {"handled": ["read_file", "make_sym"], "rules": [{"path": "/srv/a", "access": ["read_file"]}]},
        {"handled": ["make_sym"], "rules": [{"path": "/srv", "access": ["make_sym"]}]},
    ]
    assert denials.allowed_by(layers, ("fs.read_file",), "/srv/a/x")
    assert not denials.allowed_by(layers, ("fs.read_file",), "/srv/ab")  # a sibling is not beneath
    assert denials.allowed_by(layers, ("fs.write_file",), "/anything")  # handled by no layer
    assert not denials.allowed_by(layers, ("fs.make_sym",), "/srv/a")  # the first layer refuses it
    assert not denials.allowed_by(layers, ("net.connect_tcp",), "/srv/a")
    assert not denials.allowed_by(layers, ("fs.read_file",), "relative")
    assert denials.allowed_by([], ("fs.read_file",), "/x")  # no layer of kbd's


def test_names_never_write_lines_of_their_own(plan: Plan) -> None:
    """A command names its files: a newline, an escape sequence or a byte that is not UTF-8
    reaches the caller's terminal escaped, and kbd why is not pointed at what it cannot take."""
    asked: list[str] = []

    def ask(path: str, mode: str) -> tuple[bool, str, str]:
        asked.append(path)
        return False, "outside_grants", "not granted"

    names = ["/w/a\nkbd: refused write \x1b[31mRED", "/w/b\udcff"]
    report = denials.explain(Collected(tuple(Refused(("fs.read_file",), n, None, 1) for n in names), 0, True),
                             plan=plan, sid="s", network="none", ask=ask)  # fmt: skip
    lines = report.lines()
    assert len(lines) == 2 and all(x.startswith("kbd: refused read /w/") for x in lines)
    assert "\x1b" not in "".join(lines) and "\\n" in lines[0] and "\\x1b" in lines[0]
    by_code = {d.path: d for d in report.refused}
    assert by_code["/w/b\\xff"].code == "unexplained" and by_code["/w/b\\xff"].why is None
    assert asked == [names[0]]  # asked with the real name; no pointer a person could not paste
    assert by_code["/w/a\\nkbd: refused write \\x1b[31mRED"].why is None
    encoded = json.dumps(report.to_json(), ensure_ascii=False).encode()  # never a surrogate in the JSON
    assert b"\\x1b" in encoded


def test_only_the_first_refusals_are_explained(plan: Plan) -> None:
    asked: list[str] = []

    def ask(path: str, mode: str) -> tuple[bool, str, str]:
        asked.append(path)
        return False, "outside_grants", "not granted"

    many = tuple(Refused(("fs.read_file",), f"/x/{i:03}", None, 1) for i in range(denials.MAX_EXPLAINED + 3))
    report = denials.explain(Collected(many, 0, True), plan=plan, sid="s", network="none", ask=ask)
    assert len(asked) == denials.MAX_EXPLAINED
    assert [d.code for d in report.refused[-3:]] == ["unexplained"] * 3


def test_the_json_record_fits_one_frame(plan: Plan) -> None:
    long = tuple(
        Refused(("fs.read_file",), f"/x/{i:03}/" + "n" * 300, None, 1) for i in range(denials.LISTED)
    )
    report = denials.explain(Collected(long, 0, True), plan=plan, sid="s", network="none",
                             ask=lambda p, m: (False, "outside_grants", "not granted"))  # fmt: skip
    fitted = denials.fitted(report)
    encoded = json.dumps({"denials": fitted.to_json()}, ensure_ascii=False).encode()
    assert len(encoded) <= denials.JSON_MAX
    assert len(fitted.refused) + fitted.more == denials.LISTED and fitted.more > 0


def test_nothing_in_the_report_reaches_the_exit_status(plan: Plan, tmp_path: Path) -> None:
    """A report that cannot be made, or said (the broker's client gone), is never an exception
    out of the command's end."""

    class Broken(denials.Watch):
        def __init__(self) -> None:
            self.why_not = None
            self.layers = []
            self.pid = None

        def collect(self) -> Collected | str:
            raise OSError("the audit socket went away")

    host = KbRoot.create(tmp_path / "other").host()
    sessions = RootSessions(host)
    said: list[str] = []
    teller = denials.Teller(said.append, False, contextlib.nullcontext())
    denials.finish(Broken(), host, sessions, plan, "s", OPERATOR, teller)
    assert said == ["kbd: the sandbox's refusals could not be reported: the audit socket went away"]
    (kept,) = [e for e in KbRoot(tmp_path / "other").audit_events("sandbox_refusals_failed")]
    assert kept["reason"] == "the audit socket went away"

    def gone(line: str) -> None:
        raise BrokenPipeError("client gone")

    denials.finish(
        Broken(), host, sessions, plan, "s", OPERATOR, denials.Teller(gone, True, contextlib.nullcontext())
    )
