"""`kbd exec` as a process (docs/sandbox.md, docs/cli.md): what a sandboxed command can leave
behind, what it inherits, and what `kbd exec` reports — real shells, real
kernel, real bubblewrap (and the inner Landlock helper for write plans).

Source ``src`` (bob's, readable by alice, ``allowed_kb_writers: ["con"]``) is
attached with access ``write`` by alice's ``con``. Two sessions: ``read``
(execution, kb_access read: plain bwrap) and ``write`` (execution, kb_access
read-write: bwrap plus the inner Landlock helper).
"""

from __future__ import annotations

import errno
import shlex
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kbd.core.knowledge import body_of
from tests.helpers import CliResult, KbRoot, exec_mode_for, live_processes, snapshot
from tests.waiting import holds_for, wait_for

# Real commands under bubblewrap; the write session adds the inner Landlock helper.
# Every test runs on both exec paths: in-process and through the daemon's broker.
pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_landlock(abi=2),
    pytest.mark.usefixtures("exec_mode"),
]

MODES = {"read": "read", "write": "read-write"}
# docs/sessions.md / kbd.service.execute: the environment is built, never inherited (PWD is set by
# bwrap's --chdir to the command's working folder).
ALLOWED_ENV = {
    "PATH", "HOME", "TMPDIR", "LANG", "TERM", "PWD", "KBD_SESSION", "WORKFLOW_KB_ACCESS", "WORKFLOW_KB_SRC",
}  # fmt: skip


# -- helpers ------------------------------------------------------------------------------


def open_session(kb: KbRoot, kb_access: str) -> dict[str, Any]:
    r = kb.call(
        "session", "open", "con", "--kind", "execution", "--kb-access", kb_access, "--as", "alice", "--json"
    )
    assert r.code == 0, r.err
    doc: dict[str, Any] = r.json()
    return doc


def sh(kb: KbRoot, sid: str, script: str, *, env: dict[str, str] | None = None) -> CliResult:
    return kb.cli("exec", sid, "--", "sh", "-c", script, env=env)


def build(kb: KbRoot) -> tuple[Path, Path]:
    src = kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    con = kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    return src, con


def survivors(marker: str) -> list[int]:
    """PIDs of live processes (any namespace: the host sees them all) whose command
    line mentions ``marker``."""
    return [pid for pid, cmdline in live_processes() if any(marker in part for part in cmdline)]


@dataclass(frozen=True)
class ProcWorld:
    kb: KbRoot
    src: Path
    con: Path
    sids: dict[str, str]  # "read" | "write" -> session id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, exec_mode: str) -> Iterator[ProcWorld]:
    kb = KbRoot.create(tmp_path_factory.mktemp("sandbox-process") / "root")
    src, con = build(kb)
    (con / "escape").symlink_to(src / "knowledgebase")  # a folder link leaving the workflow
    sids = {name: open_session(kb, mode)["session_id"] for name, mode in MODES.items()}
    with exec_mode_for(kb, exec_mode):
        yield ProcWorld(kb, src, con, sids)


# -- background processes die with the command -------------------------------------------------


def test_a_background_process_cannot_touch_the_kb_after_the_command_returns(kb: KbRoot) -> None:
    """``setsid … &`` escapes the command's session and process group but not its
    PID namespace: when the command (the namespace's only child of bwrap's init)
    returns, the kernel kills everything left in the namespace.

    Waiting: the writer sleeps 1 s and then writes. Polling is fine here because
    both checks are about *absence* with a known cause: once no process carrying
    the marker in its command line is alive, nothing can ever write ``late-…md``
    (the writer is that very shell — ``echo`` is a builtin), so finding no
    survivor is the deterministic proof; watching the folder until well past the
    sleep (≥ 2 s after launch, ≤ 3 s after return) is a second, independent
    witness. The control run shows the same write succeeds when the writer is
    allowed to live, so the test cannot pass vacuously."""
    src, _ = build(kb)
    notes = src / "knowledgebase" / "notes"
    sid = open_session(kb, "read-write")["session_id"]

    control = f"control-{uuid.uuid4().hex}.md"
    r = sh(kb, sid, f'sh -c "sleep 1; echo late > $WORKFLOW_KB_SRC/notes/{control}"')
    assert r.code == 0, r.err
    assert (
        body_of((notes / control).read_text()) == "late\n"
    )  # committed at exit (docs/notes.md "Staged contributions")

    marker = f"late-{uuid.uuid4().hex}.md"
    before = snapshot(src)
    started = time.monotonic()
    r = sh(kb, sid, f'setsid sh -c "sleep 1; echo late > $WORKFLOW_KB_SRC/notes/{marker}" & exit 0')
    returned = time.monotonic()
    assert r.code == 0, r.err

    wait_for(lambda: not survivors(marker), max(0.5, returned + 3.0 - time.monotonic()),
             "every process carrying the marker to be gone", detail=lambda: survivors(marker))  # fmt: skip
    # A negative window until well past the writer's sleep (2 s after launch).
    holds_for(lambda: not (notes / marker).exists(), max(0.0, started + 2.0 - time.monotonic()),
              "no note written after the command returned")  # fmt: skip
    assert snapshot(src) == before


# -- privileges and environment ----------------------------------------------------------------


@pytest.mark.parametrize("session", sorted(MODES))
def test_no_new_privs_is_set(world: ProcWorld, session: str) -> None:
    r = world.kb.cli("exec", world.sids[session], "--", "grep", "NoNewPrivs", "/proc/self/status")
    assert r.code == 0, r.err
    assert r.out.split() == ["NoNewPrivs:", "1"]


@pytest.mark.parametrize("session", sorted(MODES))
def test_the_callers_environment_is_not_inherited(world: ProcWorld, session: str) -> None:
    canaries = {"CANARY_TOKEN": f"canary-{uuid.uuid4().hex}", "KBD_CANARY": f"kbd-canary-{uuid.uuid4().hex}"}
    r = world.kb.cli("exec", world.sids[session], "--", "env", env=canaries)
    assert r.code == 0, r.err
    env = dict(line.split("=", 1) for line in r.out.splitlines())
    assert set(env) <= ALLOWED_ENV, set(env) - ALLOWED_ENV
    assert env["KBD_SESSION"] == world.sids[session]
    assert env.get("PWD", str(world.con)) == str(world.con)
    # No process in the sandbox (bwrap's init included) carries the canaries either.
    everyone = sh(world.kb, world.sids[session], "cat /proc/[0-9]*/environ | tr '\\0' '\\n'", env=canaries)
    assert everyone.code == 0, everyone.err
    for name, value in canaries.items():
        for out in (r.out, everyone.out):
            assert name not in out
            assert value not in out


# -- exit statuses ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [0, 7, 42])
@pytest.mark.parametrize("session", sorted(MODES))
def test_the_commands_exit_status_is_returned(world: ProcWorld, session: str, status: int) -> None:
    r = sh(world.kb, world.sids[session], f"exit {status}")
    assert r.code == status, r.err
    assert "error[" not in r.err


@pytest.mark.parametrize("command", ["kbd-no-such-command", "/nonexistent/kbd-no-such-command"])
@pytest.mark.parametrize("session", sorted(MODES))
def test_a_missing_command_exits_127(world: ProcWorld, session: str, command: str) -> None:
    r = world.kb.cli("exec", world.sids[session], "--", command)
    assert r.code == 127, (r.code, r.err)
    assert r.out == ""


def test_a_closed_session_refuses_with_77_and_runs_nothing(world: ProcWorld) -> None:
    sid = open_session(world.kb, "read-write")["session_id"]
    closed = world.kb.cli("session", "close", sid)
    assert closed.code == 0, closed.err
    ran = world.con / f"ran-{uuid.uuid4().hex}"
    note = world.src / "knowledgebase" / "notes" / f"ran-{uuid.uuid4().hex}.md"
    before = {"src": snapshot(world.src), "con": snapshot(world.con)}
    script = f"touch {shlex.quote(str(ran))}; echo ran > {shlex.quote(str(note))}; echo ran"
    r = sh(world.kb, sid, script)
    assert r.code == 77, (r.code, r.err)
    assert r.out == ""
    assert r.err.startswith("error[")
    assert not ran.exists() and not note.exists()
    assert {"src": snapshot(world.src), "con": snapshot(world.con)} == before


# -- --cwd -----------------------------------------------------------------------------------------


def _outside(world: ProcWorld) -> dict[str, str]:
    return {
        "tmp": "/tmp",
        "slash": "/",
        "source-kb": str(world.src / "knowledgebase"),
        "source-folder": str(world.src),
        "workflows": str(world.con.parent),
        "dotdot": "..",
        "dotdot-abs": f"{world.con}/../src",
        "dotdot-inside": "runs/../../src",
    }


@pytest.mark.parametrize(
    "case",
    ["tmp", "slash", "source-kb", "source-folder", "workflows", "dotdot", "dotdot-abs", "dotdot-inside"],
)
def test_cwd_outside_the_workflow_folder_is_refused_with_65(world: ProcWorld, case: str) -> None:
    ran = world.con / f"ran-{uuid.uuid4().hex}"
    r = world.kb.cli("exec", "--cwd", _outside(world)[case], world.sids["read"], "--", "touch", str(ran))
    assert r.code == 65, (r.code, r.err)
    assert r.err.startswith("error[")
    assert not ran.exists()


def test_cwd_through_a_symlinked_folder_is_refused(world: ProcWorld) -> None:
    """``con/escape`` is a link to the source KB: lexically inside, really outside.
    kbd refuses links on the way (exit 77, path refused) rather than 65."""
    ran = world.con / f"ran-{uuid.uuid4().hex}"
    r = world.kb.cli("exec", "--cwd", "escape", world.sids["read"], "--", "touch", str(ran))
    assert r.code in (65, 77), (r.code, r.err)
    assert r.err.startswith("error[")
    assert not ran.exists()


@pytest.mark.parametrize("cwd", ["runs", "ABS/learnings", "ABS"])
def test_cwd_inside_the_workflow_folder_is_used(world: ProcWorld, cwd: str) -> None:
    cwd = cwd.replace("ABS", str(world.con))
    r = world.kb.cli("exec", "--cwd", cwd, world.sids["read"], "--", "pwd")
    assert r.code == 0, r.err
    expected = Path(cwd) if cwd.startswith("/") else world.con / cwd
    assert r.out == f"{expected.resolve()}\n"


# -- network ------------------------------------------------------------------------------------------


CONNECT = """
import socket, time
t = time.monotonic()
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(("1.1.1.1", 53))
except OSError as e:
    print("refused", e.errno, time.monotonic() - t)
else:
    print("connected")
"""


@pytest.mark.parametrize("session", sorted(MODES))
def test_network_is_off_by_default(world: ProcWorld, session: str) -> None:
    """In a fresh network namespace only ``lo`` exists, and with ``network: none``
    the seccomp allow-list refuses IPv4 sockets outright (EAFNOSUPPORT; before the socket allow-list of
    docs/sandbox.md "seccomp" the socket opened and the connect failed with ENETUNREACH): it fails
    at once, whatever the host's own network."""
    r = world.kb.cli("exec", world.sids[session], "--", "cat", "/proc/net/dev")
    assert r.code == 0, r.err
    interfaces = {line.split(":", 1)[0].strip() for line in r.out.splitlines()[2:] if ":" in line}
    assert interfaces == {"lo"}

    r = world.kb.cli("exec", world.sids[session], "--", "/usr/bin/python3", "-I", "-S", "-c", CONNECT)
    assert r.code == 0, r.err
    words = r.out.split()
    assert words[0] == "refused", r.out
    assert int(words[1]) == errno.EAFNOSUPPORT
    assert float(words[2]) < 1.0  # failed fast, not a timeout
