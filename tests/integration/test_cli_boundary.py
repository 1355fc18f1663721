"""docs/cli.md "Global options" and "Errors": identity never defaults open, a complete and
readable audit log, no tracebacks and quiet pipes, and the new-user findings.

Everything runs the real ``kbd`` on a real root: in real processes for exec,
pipes, signals, terminals and each command's smoke test; cases whose subject is
the message, exit code, audit record or unchanged files run its real entry
point in this process (KbRoot.call).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kbd.errors import InvalidInput
from kbd.sandbox.probe import landlock_only_kinds
from kbd.service import browse, execute, workflows
from kbd.service import notes as note_ops
from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from kbd.state import audit
from tests.helpers import OPERATOR, CliResult, KbRoot, snapshot

KBD = [sys.executable, "-m", "kbd"]
ERROR_LINE = re.compile(r"^error\[(?P<code>[a-z-]+)\]: (?P<message>.+)$")


def env_for(kb: KbRoot, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    env["KBD_ROOT"] = str(kb.root)
    env.update(extra)
    return env


def assert_error(r: CliResult, code: str, exit_code: int) -> str:
    lines = r.err.strip().splitlines()
    assert lines, f"no error output (exit {r.code}, stdout {r.out!r})"
    m = ERROR_LINE.match(lines[0])
    assert m is not None, r.err
    assert (m.group("code"), r.code) == (code, exit_code), r.err
    assert "Traceback" not in r.err
    return m.group("message")


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    """con (alice owns, bob reads) attaches src for writing; priv is alice's only."""
    kb.workflow("src", access={"owners": ["alice"], "readers": ["bob"], "allowed_kb_writers": ["con"]})
    kb.workflow("priv", access={"owners": ["alice"]})
    kb.workflow("spare", access={"owners": ["alice"], "readers": ["bob"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"], "readers": ["bob"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    return kb


def open_session(kb: KbRoot, kind: str = "execution", mode: str = "read-write") -> str:
    r = kb.call("session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


def audit_log(kb: KbRoot) -> bytes:
    path = kb.root / "state" / audit.AUDIT_NAME
    return path.read_bytes() if path.exists() else b""


# -- item 10: identity never defaults open -------------------------------------------------


def _commands(sid: str) -> list[list[str]]:
    """A command of every kind that takes --as (management, browsing, sessions, notes, exec)."""
    return [
        ["workflows", "list"],
        ["workflows", "show", "con"],
        ["sources", "list", "con"],
        ["sources", "attach", "con", "spare", "--alias", "spare"],
        ["sources", "detach", "con", "src"],
        ["writers", "grant", "spare", "con"],
        ["writers", "revoke", "src", "con"],
        ["read", "con", "src", "notes/fact.md"],
        ["ls", "con", "src"],
        ["session", "open", "con", "--kind", "execution"],
        ["session", "show", sid],
        ["session", "env", sid],
        ["session", "list"],
        ["session", "revoke", sid, "--immediate"],
        ["session", "close", sid],
        ["check", sid, "/etc/passwd", "--mode", "read"],
        ["notes", "write", sid, "src", "new.md", "--file", "-"],
        ["exec", sid, "--", "touch", "marker"],
    ]


@pytest.mark.parametrize("how", ["flag", "flag-blank", "env", "env-blank"])
def test_empty_principal_is_a_usage_error_everywhere_and_changes_nothing(world: KbRoot, how: str) -> None:
    sid = open_session(world)
    before, log = snapshot(world.root, skip=("state",)), audit_log(world)
    value = "" if how.endswith("flag") or how.endswith("env") else "  "
    for args in _commands(sid):
        if how.startswith("flag"):
            # --as goes before `--` for exec (the full CLI parses it), elsewhere at the end.
            cut = args.index("--") if "--" in args else len(args)
            argv, env = [*args[:cut], "--as", value, *args[cut:]], {}
        else:
            argv, env = args, {"KBD_AS": value}
        # The lean exec path and one click command (the smoke test) run as real
        # processes; the other click commands run kbd's real entry point in this
        # process (same argv, environment, exit code and stderr; KbRoot.call).
        run = world.cli if args[0] == "exec" or args == ["workflows", "list"] else world.call
        r = run(*argv, input=b"a note\n", env=env)
        message = assert_error(r, "usage", 2)
        assert ("--as" if how.startswith("flag") else "KBD_AS") in message, (argv, r.err)
    assert snapshot(world.root, skip=("state",)) == before
    assert audit_log(world) == log, "a refused empty principal must not act (nor be logged as acting)"
    assert not (world.workflows / "con" / "marker").exists()
    rows = world.cli("session", "list", "--json").json()["sessions"]
    assert [r["session_id"] for r in rows] == [sid], "the session must still be open"


@pytest.mark.requires_bwrap
def test_lean_exec_path_refuses_empty_kbd_as(world: KbRoot) -> None:
    """`kbd exec SID -- CMD` never reaches click; it must refuse KBD_AS= on its own."""
    sid = open_session(world)
    r = world.cli("exec", sid, "--", "touch", "marker", env={"KBD_AS": ""})
    assert "KBD_AS" in assert_error(r, "usage", 2)
    assert not (world.workflows / "con" / "marker").exists()
    # A named principal is honoured on the lean path too: bob did not open the session.
    r = world.cli("exec", sid, "--", "touch", "marker", env={"KBD_AS": "bob"})
    assert_error(r, "not-found", 66)
    assert not (world.workflows / "con" / "marker").exists()
    ok = world.cli("exec", sid, "--", "touch", "marker", env={"KBD_AS": "alice"})
    assert ok.code == 0, ok.err
    assert (world.workflows / "con" / "marker").exists()


def _actor_functions() -> list[tuple[str, Callable[..., Any]]]:
    out: list[tuple[str, Callable[..., Any]]] = []
    for owner in (Root, workflows, RootSessions, session_ops, note_ops, browse, execute):
        for name, fn in inspect.getmembers(owner, callable):
            if name.startswith("_") or not hasattr(fn, "__code__"):
                continue
            if "actor" in inspect.signature(fn).parameters:
                out.append((f"{getattr(owner, '__name__', owner)}.{name}", fn))
    return out


def test_every_actor_parameter_is_required() -> None:
    found = dict(_actor_functions())
    # The session and note operations (docs/cli.md "Global options": no default actor) must be among those checked.
    for name in ("RootSessions.plan", "kbd.service.sessions.close", "kbd.service.sessions.list_sessions",
                 "kbd.service.sessions.revoke", "kbd.service.sessions.check", "kbd.service.sessions.open_session",
                 "kbd.service.sessions.open_child", "kbd.service.sessions.show",
                 "kbd.service.notes.write", "kbd.service.notes.prepare", "kbd.service.execute.run",
                 "kbd.service.browse.read", "kbd.service.browse.ls", "kbd.service.browse.attachment",
                 "kbd.service.workflows.attach", "kbd.service.workflows.grant",
                 "kbd.service.workflows.sources", "Root.audit_refusal"):  # fmt: skip
        assert name in found, sorted(found)
    for name, fn in found.items():
        param = inspect.signature(fn).parameters["actor"]
        assert param.default is inspect.Parameter.empty, f"{name}: actor defaults to {param.default!r}"


def test_type_checker_catches_an_omitted_actor(tmp_path: Path) -> None:
    snippet = tmp_path / "omits_actor.py"
    snippet.write_text(
        "from pathlib import Path\n"
        "from kbd.service.notes import write\n"
        "from kbd.service.root import Root\n"
        "from kbd.service.sessions import RootSessions, close\n"
        "s = RootSessions(Root(Path('/r')))\n"
        "s.plan('sid')\n"
        "close(s, 'sid', actor=None)\n"
        "write(s, 'sid', 'a', 'x.md', b'x')\n"
    )
    mypy = Path(sys.executable).with_name("mypy")
    r = subprocess.run(
        [str(mypy), "--strict", "--follow-imports=silent", str(snippet)],
        capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'omits_actor.py:6: error: Missing named argument "actor"' in r.stdout, r.stdout
    assert "omits_actor.py:7: error: Argument" in r.stdout, r.stdout  # None is not an actor
    assert 'omits_actor.py:8: error: Missing named argument "actor"' in r.stdout, r.stdout


def test_local_operator_is_created_only_at_the_cli_entry_points() -> None:
    package = Path(__file__).parents[2] / "kbd"
    makers: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                if name == "LocalOperator" or (base == "LocalOperator" and name == "current"):
                    makers.add(path.name)
    # ops.py: the CLI's direct mode (Direct.actor); exec_run.py: kbd exec in-process.
    assert makers == {"ops.py", "exec_run.py"}


# -- item 12: the audit log is complete and readable ------------------------------------------


def records(kb: KbRoot, event: str) -> list[dict[str, Any]]:
    return [e for e in audit.read(kb.root / "state") if e["event"] == event]


def test_refusals_record_who_what_target_and_reason(world: KbRoot) -> None:
    # audience_denied: priv's readers do not include con's reader bob.
    r = world.cli("sources", "attach", "con", "priv", "--alias", "priv", "--as", "alice")
    assert_error(r, "source-unusable", 77)
    # not a manager: bob only reads con.
    r = world.cli("sources", "attach", "con", "spare", "--alias", "spare", "--as", "bob")
    assert_error(r, "permission-denied", 77)
    # not the source's owner.
    r = world.cli("writers", "grant", "spare", "con", "--as", "bob")
    assert_error(r, "permission-denied", 77)
    refused = records(world, "sources_refused")
    assert [
        (e["actor"], e["action"], e["workflow_id"], e["source"], e["code"], e["reason"]) for e in refused
    ] == [
        ("alice", "attach", "con", "priv", "source-unusable", "audience_denied"),
        ("bob", "attach", "con", "spare", "permission-denied", "not_manager"),
    ]
    (grant,) = records(world, "writer_grant_refused")
    assert (grant["actor"], grant["source"], grant["consumer"], grant["code"], grant["reason"]) == (
        "bob", "spare", "con", "permission-denied", "not_owner",
    )  # fmt: skip
    assert all(e["message"] for e in [*refused, grant])


def test_session_refusals_are_recorded(world: KbRoot) -> None:
    sid = open_session(world)
    # bob only reads con: no execution session, and no use of alice's.
    r = world.cli("session", "open", "con", "--kind", "execution", "--as", "bob")
    assert_error(r, "permission-denied", 77)
    r = world.cli("session", "close", sid, "--as", "bob")
    assert_error(r, "not-found", 66)
    assert world.cli("session", "close", sid).code == 0
    r = world.cli("exec", sid, "--", "true")  # closed: refused on the lean exec path too
    assert r.code == 77, r.err
    got = [(e["actor"], e["action"], e.get("workflow_id") or e.get("session"), e["code"])
           for e in records(world, "session_refused")]  # fmt: skip
    assert got == [
        ("bob", "open", "con", "permission-denied"),
        ("bob", "close", sid, "not-found"),
        (f"local:{OPERATOR.user}", "plan", sid, "session-closed"),
    ], got


def test_local_operator_is_named_in_the_log(world: KbRoot) -> None:
    sid = open_session(world)
    assert world.cli("session", "revoke", sid).code == 0
    assert world.cli("session", "close", sid).code == 0
    for event in ("session_revoke", "session_closed"):
        (e,) = records(world, event)
        assert (e["actor"], e["actor_uid"]) == (f"local:{OPERATOR.user}", os.getuid()), e


def test_text_output_has_no_python_reprs_and_skips_torn_lines(world: KbRoot) -> None:
    open_session(world)  # session_opened has parent=None
    state = world.root / "state"
    audit.append(state, "notes_changed_by_command", session="s_x", flagged={}, changed=["a.md"])
    with open(state / audit.AUDIT_NAME, "ab") as fh:
        fh.write(b'{"ts":"2026-01-01T00:00:00Z","ev\n')  # a torn line in the middle
    audit.append(state, "after_the_tear", workflow_id="con", label="two words")
    r = world.cli("audit")
    assert r.code == 0 and "Traceback" not in r.err, r.err
    assert r.err.strip() == "kbd audit: skipped 1 torn line(s) that are not a JSON record"
    lines = r.out.splitlines()
    assert [line.split()[1] for line in lines] == [
        "session_opened",
        "notes_changed_by_command",
        "after_the_tear",
    ]
    assert "None" not in r.out and "{}" not in r.out and "'" not in r.out, r.out
    assert 'changed=["a.md"]' in lines[1] and 'label="two words"' in lines[2]
    j = world.cli("audit", "--json")
    assert j.code == 0 and j.json()["skipped_lines"] == 1 and len(j.json()["events"]) == 3


def test_since_and_workflow_select_records(world: KbRoot) -> None:
    state = world.root / "state"
    old = {"ts": "2020-01-01T00:00:00Z", "event": "sources_changed", "workflow_id": "con", "actor": "alice"}
    with open(state / audit.AUDIT_NAME, "ab") as fh:
        fh.write(json.dumps(old).encode() + b"\n")
    sid = open_session(world)
    assert world.cli("session", "close", sid).code == 0
    audit.append(state, "writer_granted", source="spare", consumer="priv", actor="alice", changed=True)

    def events(*args: str) -> list[str]:
        r = world.cli("audit", "--json", *args)
        assert r.code == 0, r.err
        return [e["event"] for e in r.json()["events"]]

    assert events() == ["sources_changed", "session_opened", "session_closed", "writer_granted"]
    assert events("--since", "10m") == ["session_opened", "session_closed", "writer_granted"]
    assert events("--since", "2019-12-31T23:00:00Z") == events()
    assert events("--since", "2019-12-31T23:00:00") == events()  # no zone: UTC, as the log
    # A session's records belong to its workflow even when they only name the session.
    assert events("--workflow", "con") == ["sources_changed", "session_opened", "session_closed"]
    assert events("--workflow", "priv") == ["writer_granted"]
    assert events("--workflow", "con", "--since", "10m") == ["session_opened", "session_closed"]
    for bad in ("yesterday", "10x", ""):
        r = world.cli("audit", "--since", bad)
        assert "--since" in assert_error(r, "usage", 2)


def _read_line(stream: Any, deadline: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"no complete line before the deadline (got {buf!r})"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 1)
            assert chunk, f"stream closed (got {buf!r})"
            buf += chunk
    return buf


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_follow_prints_new_records_and_stops_cleanly(world: KbRoot, sig: signal.Signals) -> None:
    state = world.root / "state"
    audit.append(state, "first", workflow_id="con")
    with subprocess.Popen(
        [*KBD, "audit", "--follow", "--json", "--workflow", "con"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(world),
    ) as proc:  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            assert json.loads(_read_line(proc.stdout, deadline))["event"] == "first"
            audit.append(state, "other_workflow", workflow_id="priv")
            audit.append(state, "second", workflow_id="con", actor="alice")
            assert json.loads(_read_line(proc.stdout, deadline))["event"] == "second"
            proc.send_signal(sig)
            assert proc.wait(timeout=10) == 0
            assert proc.stderr is not None
            err = proc.stderr.read().decode()
            assert "Traceback" not in err and "error[" not in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- item 13: no tracebacks, quiet pipes ----------------------------------------------------------


def _run_with_fault(kb: KbRoot, target: str, argv: list[str], *, debug: bool = False) -> CliResult:
    """Run the real entry point in a fresh interpreter where ``target`` (module:attr)
    raises an unexpected exception: a stand-in for a bug kbd does not know about."""
    module, attr = target.rsplit(".", 1)
    code = (
        f"import sys, {module} as m\n"
        "def boom(*a, **k):\n"
        "    raise RuntimeError('boom')\n"
        f"setattr(m, {attr!r}, boom)\n"
        "from kbd.cli.entry import main\n"
        f"sys.argv = ['kbd', *{argv!r}]\n"
        "main()\n"
    )
    env = env_for(kb, **({"KBD_DEBUG": "1"} if debug else {}))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60, check=False)
    return CliResult(p.returncode, p.stdout.decode(), p.stderr.decode())


@pytest.mark.parametrize(
    ("target", "argv"),
    [
        pytest.param("kbd.state.audit.Selection", ["audit"], id="click-cli"),
        pytest.param("kbd.service.execute.run", ["exec", "SID", "--", "true"], id="lean-exec-path"),
    ],
)
def test_unexpected_errors_print_one_line_and_exit_70(world: KbRoot, target: str, argv: list[str]) -> None:
    r = _run_with_fault(world, target, argv)
    assert r.err.splitlines()[0] == "error[internal]: unexpected RuntimeError: boom", r.err
    assert r.err.splitlines()[1].startswith("hint: "), r.err
    assert (r.code, len(r.err.splitlines())) == (70, 2), r.err
    assert "Traceback" not in r.err
    debug = _run_with_fault(world, target, argv, debug=True)
    assert debug.code == 70 and debug.err.startswith("error[internal]: unexpected RuntimeError: boom")
    assert "Traceback (most recent call last)" in debug.err and "RuntimeError: boom" in debug.err


def test_error_lines_are_printed_in_one_place() -> None:
    package = Path(__file__).parents[2] / "kbd"
    printers = {
        p.relative_to(package).as_posix() for p in package.rglob("*.py") if 'f"error[{' in p.read_text()
    }
    assert printers == {"errors/render.py"}


def _big_log(kb: KbRoot, n: int = 20_000) -> None:
    state = kb.root / "state"
    state.mkdir(exist_ok=True)
    line = {"ts": "2026-01-01T00:00:00Z", "event": "sources_changed", "workflow_id": "con", "actor": "alice"}
    with open(state / audit.AUDIT_NAME, "ab") as fh:
        fh.write((json.dumps(line) + "\n").encode() * n)


@pytest.mark.parametrize("as_json", [False, True])
def test_reader_closing_the_pipe_ends_kbd_quietly_like_git(kb: KbRoot, as_json: bool) -> None:
    _big_log(kb)  # far more than a pipe buffer: kbd is still writing when the reader leaves
    with subprocess.Popen(
        [*KBD, "audit", *(["--json"] if as_json else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(kb),
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        _read_line(proc.stdout, time.monotonic() + 30)
        proc.stdout.close()
        assert proc.wait(timeout=30) == -signal.SIGPIPE  # as git: killed by SIGPIPE, shell status 141
        assert proc.stderr.read() == b""


def test_shell_pipeline_to_head(kb: KbRoot) -> None:
    _big_log(kb)
    script = f"set -o pipefail; {' '.join(KBD)} audit | head -1"
    r = subprocess.run(["bash", "-c", script], capture_output=True, env=env_for(kb), timeout=60, check=False)
    assert r.returncode == 141 and r.stderr == b"", r.stderr
    assert r.stdout.decode().count("\n") == 1


# -- item 14: new-user findings ---------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_empty_note_is_refused(world: KbRoot, content: bytes) -> None:
    sid = open_session(world)
    notes_dir = world.workflows / "src" / "knowledgebase" / "notes"
    before = snapshot(notes_dir)
    r = world.call("notes", "write", sid, "src", "empty.md", input=content)
    assert "empty" in assert_error(r, "invalid-input", 65)
    assert snapshot(notes_dir) == before
    (refused,) = records(world, "note_refused")
    assert (
        refused["code"] == "invalid-input" and refused["path"] == "notes/empty.md"
    )  # from the KB root (docs/notes.md "Paths")
    assert (refused["actor"], refused["actor_uid"]) == (f"local:{OPERATOR.user}", os.getuid())


def test_notes_write_from_a_terminal_says_what_to_do(world: KbRoot) -> None:
    sid = open_session(world)
    leader, follower = os.openpty()
    try:
        with subprocess.Popen(
            [*KBD, "notes", "write", sid, "src", "typed.md"],
            stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(world),
        ) as proc:  # fmt: skip
            try:
                _out, err = proc.communicate(timeout=30)  # before the fix: waits for typing forever
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 2, err
    assert err.decode().startswith("error[usage]: no note content: pass --file F, or pipe the content in")
    assert not (world.workflows / "src" / "knowledgebase" / "notes" / "typed.md").exists()


def test_doctor_names_the_kinds_that_run_under_landlock_alone(kb: KbRoot) -> None:
    r = kb.cli("doctor", "--json")
    detail = next(c["detail"] for c in r.json()["checks"] if c["check"] == "landlock-only kinds")
    runs = landlock_only_kinds()
    # Derived from the shipped policy: reviewers (read) and kb_maintenance run, the rest do not.
    assert set(runs) == {"reviewer_strategic", "reviewer_architecture", "kb_maintenance"}
    for kind, modes in runs.items():
        assert f"{kind} (kb_access {', '.join(modes)})" in detail
    for kind in ("builder", "execution", "scripted", "message_sequence"):
        assert kind in detail.split("Refused: ")[1]


@pytest.mark.requires_landlock
def test_landlock_only_kinds_match_what_the_runner_does(world: KbRoot) -> None:
    """The doctor's claim, checked against real Landlock-only runs of every kind."""
    cfg = world.root / "kbd.yaml"
    cfg.write_text(cfg.read_text().replace("backend: auto", "backend: landlock"))
    runs = landlock_only_kinds()
    for kind in ("builder", "execution", "scripted", "message_sequence", "reviewer_strategic",
                 "reviewer_architecture", "kb_maintenance"):  # fmt: skip
        for mode in ("none", "read", "write", "read-write"):
            sid = open_session(world, kind, mode)
            r = world.cli("exec", sid, "--", "true")
            expected = 0 if mode in runs.get(kind, []) else 69
            assert r.code == expected, (kind, mode, r.err)


def test_principals_token_for_an_unknown_name_is_not_found(kb: KbRoot) -> None:
    before = (kb.root / "principals.yaml").read_bytes()
    r = kb.cli("principals", "token", "nobody")
    assert "'nobody'" in assert_error(r, "not-found", 66)
    assert (kb.root / "principals.yaml").read_bytes() == before


def test_attach_names_the_alias_flag(world: KbRoot) -> None:
    before = KbRoot.read_manifest(world.workflows / "con")
    r = world.cli("sources", "attach", "con", "spare", "--alias", "Bad-1", "--as", "alice")
    message = assert_error(r, "invalid-input", 65)
    assert message.startswith("--alias 'Bad-1' must be") and "knowledgebase_sources" not in message
    assert KbRoot.read_manifest(world.workflows / "con") == before


def test_validate_reports_every_problem_of_an_entry(tmp_path: Path) -> None:
    f = tmp_path / "workflow.json"
    bad = {"workflow_id": "a/b", "alias": "Bad-1", "access": "admin", "path": "/srv"}
    f.write_text(json.dumps({"id": "wf_x", "knowledgebase_sources": [bad]}))
    r = KbRoot(tmp_path / "no-root").cli("validate", str(f))
    assert r.code == 65
    lines = r.out.splitlines()
    assert len(lines) == 4 and all(line.startswith(f"{f}: knowledgebase_sources[0]: ") for line in lines)
    for what in ("unknown key 'path'", "workflow_id must not contain", "alias 'Bad-1'", "access 'admin'"):
        assert sum(what in line for line in lines) == 1, (what, lines)
    assert " | " not in r.err
    j = KbRoot(tmp_path / "no-root").cli("validate", str(f), "--json")
    assert j.code == 65 and len(j.json()["problems"]) == 4


@pytest.mark.parametrize(
    ("content", "code", "exit_code"),
    [
        (None, "not-found", 66),
        (b"{not json", "manifest-unreadable", 65),
        (b'{"id": 3}', None, 65),  # a field's problem: listed with the others, not a whole-file error
    ],
)
def test_validate_json_is_json_on_errors_too(
    tmp_path: Path, content: bytes | None, code: str | None, exit_code: int
) -> None:
    f = tmp_path / "workflow.json"
    if content is not None:
        f.write_bytes(content)
    r = KbRoot(tmp_path / "no-root").call("validate", str(f), "--json")
    assert r.code == exit_code, r.err
    data = r.json()
    assert data["valid"] is False and data["problems"]
    assert (data["error"]["code"] if "error" in data else None) == code


def test_empty_note_refused_by_the_shared_entry_point(world: KbRoot) -> None:
    """The API and the CLI share kbd.service.notes.write: the library itself refuses."""
    host = world.host()
    sessions = RootSessions(host)
    plan = session_ops.open_session(
        sessions, "con", actor=host.actor("alice"), kind="execution", kb_access="read-write"
    )
    with pytest.raises(InvalidInput, match="empty") as info:
        note_ops.write(sessions, str(plan.session_id), "src", "e.md", b"\n", actor=OPERATOR)
    assert info.value.exit_code == 65


# -- one operations layer: the CLI opens a copied child the way the API does -----------------


def test_a_child_session_keeps_its_parents_kind_in_the_cli_too(world: KbRoot) -> None:
    """Like POST /v1/sessions/{sid}/children: --kind may be left out for a child
    (it keeps its parent's); a different kind is refused; a session without a
    parent still needs --kind (click's usage error, unchanged)."""
    parent = open_session(world, kind="execution", mode="read")
    r = world.cli("session", "open", "con", "--parent", parent, "--as", "alice", "--json")
    assert r.code == 0, r.err
    child = r.json()
    assert (child["kind"], child["kb_access"], child["parent"]) == ("execution", "read", parent)
    r = world.cli("session", "open", "con", "--parent", parent, "--kind", "builder", "--as", "alice")
    assert "keeps its parent's kind" in assert_error(r, "permission-denied", 77)
    r = world.cli("session", "open", "con", "--as", "alice")
    assert "Missing option '--kind'" in assert_error(r, "usage", 2)


def test_an_empty_list_says_so(tmp_path: Path) -> None:
    """A list with nothing in it prints one "no …" line, never nothing at all (--json: an empty list)."""
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("lone", access={"owners": ["alice"]})
    for args, line in (
        (["sources", "list", "lone"], "lone has no attached sources"),
        (["sources", "candidates", "lone"], "no workflow lone could attach now"),
        (["writers", "list", "lone"], "no workflow may write into lone's notes/"),
        (["session", "list"], "no open sessions (--all shows closed ones too)"),
        (["session", "list", "--all"], "no sessions"),
        (["notes", "rejected", "lone"], "no rejected notes kept for lone"),
    ):
        r = kb.call(*args, "--as", "alice")
        assert (r.code, r.out) == (0, line + "\n"), (args, r.out, r.err)
    assert kb.call("sources", "list", "lone", "--as", "alice", "--json").json()["sources"] == []
