"""docs/sandbox.md "Process containment" with real processes: nothing a command starts outlives
its ``kbd exec``, its session's close, or ``revoke --immediate`` — on both
backends — and ``kbd exec`` forwards signals only to its own, unreaped child."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.sandbox import start as process_start
from tests.features import backends
from tests.helpers import KbRoot
from tests.waiting import holds_for, wait_for

BACKENDS = backends("bwrap", "landlock")

# Every test runs on both exec paths: in-process and through the daemon's broker.
pytestmark = pytest.mark.usefixtures("exec_mode")


def world(kb: KbRoot, backend: str) -> str:
    cfg = kb.root / "kbd.yaml"
    cfg.write_text(cfg.read_text().replace("backend: auto", f"backend: {backend}"))
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
    r = kb.call("session", "open", "con", "--kind", "reviewer_strategic", "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


def survivor(token: str) -> str:
    """A detached background loop that keeps reading the attached KB (the survivor docs/sandbox.md "Process
    containment" is about), tagged with ``token`` so the test can find it in /proc."""
    loop = f'while :; do cat "$WORKFLOW_KB_SRC/notes/fact.md" >/dev/null; sleep 0.1; done; : {token}'
    return f"setsid sh -c '{loop}' </dev/null >/dev/null 2>&1 &"


def tagged(token: str) -> list[int]:
    """PIDs on this host running the loop tagged with ``token`` (``sh -c 'while …'``;
    the kbd exec and the outer shell carry the token too, but not as that argv)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if len(argv) >= 3 and argv[2].startswith(b"while :") and token.encode() in argv[2]:
            out.append(int(entry))
    return out


def _carrying(token: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as fh:
            if entry.isdigit() and int(entry) != os.getpid() and token.encode() in fh.read():
                out.append(int(entry))
    return out


@pytest.fixture
def token() -> Iterator[str]:
    value = f"kbd-survivor-{os.urandom(6).hex()}"
    yield value
    for pid in _carrying(value):  # never leave a loop (or its shell) behind, whatever failed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start(kb: KbRoot, sid: str, script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c", script],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_setsid_loop_dies_when_kbd_exec_returns(kb: KbRoot, backend: str, token: str) -> None:
    sid = world(kb, backend)
    r = kb.cli("exec", sid, "--", "sh", "-c", f"{survivor(token)} sleep 0.3; echo started")
    assert r.code == 0 and r.out.strip() == "started", (r.code, r.err)
    wait_for(lambda: not tagged(token), 3, f"{backend}: the background loop to die with kbd exec")


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_close_kills_the_whole_tree(kb: KbRoot, backend: str, token: str) -> None:
    sid = world(kb, backend)
    proc = start(kb, sid, f"{survivor(token)} sleep 60")
    try:
        wait_for(lambda: tagged(token), 10, "the survivor to start")
        assert kb.cli("session", "close", sid).code == 0
        wait_for(lambda: not tagged(token), 3, f"{backend}: session close to kill the background loop")
        proc.wait(timeout=30)
        closes = [e for e in kb.cli("audit", "--json").json()["events"] if e["event"] == "session_closed"]
        assert len(closes[-1]["terminated"]) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_revoke_immediate_kills_the_whole_tree_and_lists_it(kb: KbRoot, backend: str, token: str) -> None:
    sid = world(kb, backend)
    proc = start(kb, sid, f"{survivor(token)} sleep 60")
    try:
        wait_for(lambda: tagged(token), 10, "the survivor to start")
        running = kb.cli("session", "show", sid, "--json").json()["running"]
        assert len(running) == 1
        # The grants shrink: the running command is now stale.
        assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
        r = kb.cli("session", "revoke", sid, "--immediate", "--json").json()
        assert r["terminated"] == [running[0]["pid"]] and r["still_running"] == []
        wait_for(lambda: not tagged(token), 3, f"{backend}: revoke --immediate to kill the background loop")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.in_process_only(
    "a killed in-process recorder; a brokered client's death kills the tree at once (test_exec_broker)"
)
@pytest.mark.requires_landlock
@pytest.mark.requires_cgroup
def test_revoke_finds_a_tree_whose_kbd_exec_was_killed(kb: KbRoot, token: str) -> None:
    """Landlock-only: SIGKILL the recording ``kbd exec`` and its command's main
    process; only the detached loop is left. Its cgroup still names it, so the
    session still lists it and ``revoke --immediate`` ends it."""
    sid = world(kb, "landlock")
    proc = start(kb, sid, f"{survivor(token)} sleep 60")
    try:
        wait_for(lambda: tagged(token), 10, "the survivor to start")
        main = kb.cli("session", "show", sid, "--json").json()["running"][0]["pid"]
        proc.kill()
        proc.wait(timeout=30)
        os.killpg(main, signal.SIGKILL)
        wait_for(
            lambda: not os.path.exists(f"/proc/{main}") or _zombie(main),
            10,
            "the killed main process to be gone",
        )
        assert tagged(token), "the loop should still be running: nothing else killed it"
        running = kb.cli("session", "show", sid, "--json").json()["running"]
        assert [p["pid"] for p in running] == [main]
        assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
        r = kb.cli("session", "revoke", sid, "--immediate", "--json").json()
        assert r["terminated"] == [main]
        wait_for(lambda: not tagged(token), 3, "the background loop to be gone")
        assert kb.cli("session", "show", sid, "--json").json()["running"] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- item 18: signals go only to the live child ------------------------------------------------
def test_the_forwarder_reaches_the_child_and_is_disarmed_before_it_is_reaped() -> None:
    forward = process_start.ForwardOwnSignals()
    try:
        child = subprocess.Popen(["sleep", "30"], start_new_session=True)
        forward.pgid = child.pid
        # A SIGTERM to kbd exec while the command runs reaches the command's group...
        os.kill(os.getpid(), signal.SIGTERM)
        assert process_start.wait_child(child, forward) == -signal.SIGTERM
        # ...and once it is reaped (its PID free for reuse) nothing is forwarded any more.
        assert forward.pgid is None
        bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            # A negative window: a stale forward would have signalled the bystander by now.
            holds_for(lambda: bystander.poll() is None, 0.1, "the bystander running")
        finally:
            bystander.kill()
            bystander.wait()
    finally:
        forward.restore()


# -- the fallback without a cgroup: kbd exec as the command's subreaper ------------------------
REAPER = """
import subprocess, sys
from kbd.sandbox import reaper
from tests.waiting import wait_for
assert reaper.become_subreaper()
loop = "while :; do sleep 0.1; done; : " + sys.argv[1]
p = subprocess.Popen(["sh", "-c", f"setsid sh -c '{loop}' </dev/null >/dev/null 2>&1 & exit 0"], start_new_session=True)
p.wait()
def looping():  # the reparented loop has a child of its own (a sleep): a whole tree to kill
    return any(open(f"/proc/{c}/task/{c}/children").read().split() for c in reaper.children())
wait_for(looping, 30, "the detached loop to run a sleep")
print(len(reaper.children()), reaper.kill_descendants(), len(reaper.children()))
"""


def test_the_subreaper_fallback_kills_a_detached_tree(token: str) -> None:
    """Real processes: the detached loop is reparented to the subreaper (not to
    init) once its shell exits, and kill_descendants ends it and its children."""
    r = subprocess.run(
        [sys.executable, "-c", REAPER, token], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "True", "0"]
    assert not tagged(token)


def recorded_cgroups(kb: KbRoot, sid: str) -> set[str]:
    """The cgroups named in the session's process records."""
    folder = kb.root / "state" / "procs" / sid
    records = list(folder.glob("*.json")) if folder.exists() else []
    return {str(json.loads(r.read_text())["cgroup"]) for r in records}


@pytest.mark.requires_bwrap
@pytest.mark.requires_cgroup
def test_a_killed_kbd_exec_leaves_no_cgroup_behind(kb: KbRoot, token: str) -> None:
    """bubblewrap: SIGKILL the recording kbd exec; its sandbox dies with it
    (--die-with-parent) and the next listing removes the empty cgroup and the record."""
    from kbd.sandbox import cgroup

    sid = world(kb, "bwrap")
    proc = start(kb, sid, f"{survivor(token)} sleep 60")
    try:
        wait_for(lambda: tagged(token), 10, "the survivor to start")
        v2 = cgroup.detect().v2 or "/nonexistent"
        # In-process: named after the session. Brokered: a launcher stub's
        # cgroup (b_…, made before the session was known), named in the record.
        before = {n for n in os.listdir(v2) if n.startswith(sid)} | recorded_cgroups(kb, sid)
        assert len(before) == 1
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not tagged(token), 5, "the background loop to be gone")
        wait_for(
            lambda: kb.cli("session", "show", sid, "--json").json()["running"] == [],
            10,
            "the session to list no running command",
        )
        assert not [n for n in os.listdir(v2) if n.startswith(sid)]
        wait_for(
            lambda: not [n for n in before if os.path.exists(f"{v2}/{n}")],
            10,
            "the empty cgroup to be removed",
        )
        assert not list((kb.root / "state" / "procs" / sid).iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.in_process_only(
    "the in-process exec sweeps as it prepares its cgroup; the daemon sweeps at start"
)
@pytest.mark.requires_landlock
@pytest.mark.requires_cgroup
def test_kbd_exec_sweeps_the_empty_cgroups_of_killed_execs(kb: KbRoot) -> None:
    from kbd.sandbox import cgroup

    sid = world(kb, "landlock")
    dead = subprocess.Popen(["true"])  # a PID that has just exited
    dead.wait()
    subtree = cgroup.detect().v2
    assert subtree is not None
    stale = f"{subtree}/{sid}.{dead.pid}.{os.urandom(4).hex()}"
    Path(stale).mkdir()
    try:
        assert kb.cli("exec", sid, "--", "true").code == 0
        assert not os.path.exists(stale)
    finally:
        with contextlib.suppress(OSError):
            Path(stale).rmdir()


@pytest.mark.in_process_only(
    "the in-process exec sweeps as it prepares its cgroup; the daemon sweeps at start"
)
@pytest.mark.requires_landlock
@pytest.mark.requires_cgroup
def test_the_v1_cgroups_of_a_command_are_removed_on_exit_and_swept(kb: KbRoot) -> None:
    """Hybrid hosts: each command also gets a cgroup in every v1 hierarchy that
    bounds what v2 cannot (pids, memory, cpu); none is left after it exits, and a
    v1 one left by a killed exec (with no v2 sibling any more) is swept."""
    from kbd.sandbox import cgroup

    sid = world(kb, "landlock")
    subtrees = [h.subtree for h in cgroup.detect().v1 if h.subtree is not None]
    controllers = {c for h in cgroup.detect().v1 if h.subtree is not None for c in h.controllers}
    assert controllers | cgroup.detect().controllers >= {"pids", "memory", "cpu"}, cgroup.detect()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [f"{s}/{sid}.{dead.pid}.{os.urandom(4).hex()}" for s in subtrees]
    for path in stale:
        Path(path).mkdir()
    try:
        r = kb.cli("exec", sid, "--", "true")
        assert r.code == 0, r.err
        assert not [p for p in stale if os.path.exists(p)]
        assert not [(s, n) for s in subtrees for n in os.listdir(s) if n.startswith(sid)]
    finally:
        for path in stale:
            with contextlib.suppress(OSError):
                Path(path).rmdir()


def test_close_kills_a_tree_no_record_names(kb: KbRoot) -> None:
    """A ``kbd exec`` SIGKILLed between starting its command and recording it
    leaves a tree that only its cgroup's name ties to the session: ``session
    close`` ends it too (found by review)."""
    from kbd.sandbox import cgroup

    sid = world(kb, "bwrap")
    hierarchy = cgroup.detect()
    assert hierarchy.v2 is not None, hierarchy.problem
    name = f"{sid}.{os.getpid()}.{os.urandom(4).hex()}"
    path = f"{hierarchy.v2}/{name}"
    os.mkdir(path)
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        with open(f"{path}/cgroup.procs", "w") as fh:
            fh.write(str(orphan.pid))
        r = kb.cli("session", "close", sid)
        assert r.code == 0, r.err
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(path)
        log = (kb.root / "state" / "audit.log").read_text().splitlines()
        closed = [e for e in map(json.loads, log) if e["event"] == "session_closed"]
        assert closed[-1]["terminated_unrecorded"] == [name]
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        with contextlib.suppress(OSError):
            os.rmdir(path)  # noqa: PTH106 - cgroupfs paths stay plain strings
