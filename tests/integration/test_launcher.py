"""The daemon's pre-forked launcher (kbd.sandbox.launcher / kbd.sandbox.spawn),
tested against the real launcher process, real cgroups and real commands, and
end to end through the real daemon: stubs sit in their cgroups before they are
taken, the pool refills, descriptors arrive at exactly their numbers, a failed
exec is reported, the command gets exactly the caller's identity and default
signal dispositions, a killed daemon takes launcher, stubs and every running
tree along, and nothing of a stub is left after shutdown."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kbd.core.config import LimitsConfig
from kbd.core.layout import BROKER_NAME
from kbd.sandbox import cgroup, spawn
from tests.helpers import IN_PROCESS_ENV, KbRoot, alive, live_processes
from tests.integration import daemon
from tests.integration.test_exec_broker import _build, _client, _tree, _wait_line
from tests.waiting import wait_for

LIMITS = LimitsConfig()


def _wait(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    wait_for(predicate, timeout, what, max_interval=0.02)


def _pool(launcher: spawn.Launcher) -> list[spawn.Stub]:
    return list(launcher._pool)


def _stub_cgroups(pid: int) -> list[str]:
    """The kbd cgroups process ``pid`` is in (v2 and v1), as /proc shows them."""
    text = Path(f"/proc/{pid}/cgroup").read_text()
    return [line.rsplit(":", 1)[1] for line in text.splitlines() if "/kbd/" in line]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(p) for p in fh.read().split()]
        except FileNotFoundError:
            continue  # a thread that ended since the listing (the daemon's pools come and go)
    return out


def _named(prefix: str) -> list[str]:
    """Every cgroup whose name starts with ``prefix``, in v2 and the v1 subtrees."""
    h = cgroup.detect()
    subtrees = [h.v2, *(v.subtree for v in h.v1)]
    return [f"{s}/{n}" for s in subtrees if s is not None for n in os.listdir(s) if n.startswith(prefix)]


@pytest.fixture
def launcher() -> Iterator[spawn.Launcher]:
    hierarchy = cgroup.detect()
    if hierarchy.v2 is None:
        pytest.fail(f"these tests need cgroup v2: {hierarchy.problem}")
    started = spawn.Launcher.start(hierarchy, LIMITS, pool_size=2)
    assert started is not None
    try:
        _wait(lambda: len(_pool(started)) == 2, "the pool never filled")
        yield started
    finally:
        started.close()
        assert not alive(started.proc.pid)
        assert [p for p in _named("b_") if f".{started.proc.pid}." in p] == [], (
            "stub cgroups left after close"
        )


def _run(stub: spawn.Stub, argv: list[str], *, fds: list[int], targets: list[int], **ids: object) -> int:
    caller = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "umask": 0o022,
              "rlimits": {}, **ids}  # fmt: skip
    child = stub.launch(argv, env={"PATH": "/usr/bin:/bin"}, fds=fds, targets=targets, **caller)  # type: ignore[arg-type]
    child.exited()
    # Exited, and kept a zombie until the daemon says reap (no pid reuse before that).
    assert Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    rc = child.wait()
    _wait(lambda: not os.path.exists(f"/proc/{child.pid}"), "the command was not reaped")
    return rc


def test_stubs_wait_in_their_own_limited_cgroups_and_the_pool_refills(launcher: spawn.Launcher) -> None:
    stubs = _pool(launcher)
    for stub in stubs:
        assert BROKER_NAME.fullmatch(stub.name), stub.name
        assert stub.name.split(".")[1] == str(launcher.proc.pid)
        # In the v2 cgroup and in every v1 sibling this host needs, already.
        box = stub.box()
        assert {p.rsplit("/", 1)[1] for p in _stub_cgroups(stub.pid)} == {stub.name}
        assert len(_stub_cgroups(stub.pid)) == 1 + len(box.v1)
        for h, path in box.v1:
            if "pids" in h.controllers:
                assert Path(f"{path}/pids.max").read_text().strip() == str(LIMITS.pids_max)
    taken = launcher.take(LIMITS)
    assert taken is not None and taken.pid == stubs[0].pid
    _wait(lambda: len(_pool(launcher)) == 2, "the pool did not refill after a take")
    assert taken.pid not in {s.pid for s in _pool(launcher)}
    box = taken.box()
    taken.close()  # let go unused: the stub exits and its cgroups are removed
    _wait(lambda: not alive(taken.pid), "a stub let go did not exit")
    _wait(lambda: not os.path.exists(box.path), "a stub let go kept its cgroup")


def test_a_take_that_defers_its_refill_asks_only_when_no_stub_is_left(launcher: spawn.Launcher) -> None:
    # The broker's stub asks for its replacement once it has its command (no
    # fork of the launcher on the way to the command's start), as long as the
    # next command still finds a stub; the last one taken is replaced at once.
    first = launcher.take(LIMITS, refill=False)
    assert first is not None
    assert len(_pool(launcher)) == 1 and not launcher._asked, "a deferred refill asked at once"
    assert _run(first, ["/bin/true"], fds=[], targets=[]) == 0
    _wait(lambda: len(_pool(launcher)) == 2, "a launched stub was not replaced")
    second = launcher.take(LIMITS, refill=False)
    third = launcher.take(LIMITS, refill=False)
    assert second is not None and third is not None
    assert len(launcher._asked) + len(_pool(launcher)) == 2, "the last stub taken was not replaced at once"
    _wait(lambda: len(_pool(launcher)) == 2, "the pool did not refill after its last stub was taken")
    launcher.refill(LIMITS)  # the pool is full: nothing more is made
    assert len(_pool(launcher)) == 2 and not launcher._asked
    for stub in (second, third):
        stub.close()


def test_changed_limits_let_the_old_stubs_go(launcher: spawn.Launcher) -> None:
    old = _pool(launcher)
    other = replace(LIMITS, pids_max=77)
    assert launcher.take(other, wait=0) is None  # none made with these limits yet: the caller falls back
    _wait(lambda: len(_pool(launcher)) == 2 and all(s.key != old[0].key for s in _pool(launcher)),
          "no stubs with the new limits")  # fmt: skip
    _wait(lambda: not any(alive(s.pid) for s in old), "an outdated stub lived on")
    fresh = launcher.take(other)
    assert fresh is not None
    for h, path in fresh.box().v1:
        if "pids" in h.controllers:
            assert Path(f"{path}/pids.max").read_text().strip() == "77"
    fresh.close()


def test_descriptors_land_on_exactly_their_numbers_even_when_they_collide(
    launcher: spawn.Launcher, tmp_path: Path
) -> None:
    """Descriptor A must become B and B become A (a naive dup2 loop would
    overwrite one with the other); nothing else is open in the command. A and B
    are the pipes' own numbers: dup2 over fixed numbers in this process would
    close whatever else holds them (a flake seen under the full suite)."""
    (a, w1), (b, w2) = os.pipe(), os.pipe()
    os.write(w1, b"one")
    os.write(w2, b"two")
    os.close(w1)
    os.close(w2)
    out = tmp_path / "out"
    script = (
        "import os\n"
        "def is_open(fd):\n"
        "    try:\n"
        "        return bool(os.fstat(fd))\n"
        "    except OSError:\n"
        "        return False\n"
        f"print(os.read({a}, 9).decode(), os.read({b}, 9).decode(), [fd for fd in range(1024) if is_open(fd)])\n"
    )
    try:
        with open(out, "wb") as fh, open(os.devnull, "rb") as null:
            stub = launcher.take(LIMITS)
            assert stub is not None
            rc = _run(stub, ["/usr/bin/python3", "-I", "-S", "-c", script],
                      fds=[null.fileno(), fh.fileno(), fh.fileno(), b, a], targets=[0, 1, 2, a, b])  # fmt: skip
    finally:
        os.close(a)
        os.close(b)
    assert (rc, out.read_text()) == (0, f"two one {sorted([0, 1, 2, a, b])}\n")


def test_a_failed_exec_is_reported_and_the_stub_is_reaped(launcher: spawn.Launcher) -> None:
    stub = launcher.take(LIMITS)
    assert stub is not None
    with open(os.devnull, "rb") as null:
        rc = _run(stub, ["/nonexistent/kbd-test"], fds=[null.fileno()] * 3, targets=[0, 1, 2])
    assert rc == 127
    stub.box().remove()


def test_a_failed_exec_is_an_unavailable_error_through_the_exec_path(launcher: spawn.Launcher) -> None:
    """The stub's report reaches the exec path: 69 and the reason, never the
    127 of a command that ran."""
    from kbd.errors import Unavailable
    from kbd.sandbox.start import check_exec

    stub = launcher.take(LIMITS)
    assert stub is not None
    with open(os.devnull, "rb") as null:
        fds = [null.fileno()] * 3
        child = stub.launch(["/nonexistent/kbd-test"], env={}, fds=fds, targets=[0, 1, 2], uid=0, gid=0,
                            groups=os.getgroups(), umask=0o22, rlimits={})  # fmt: skip
        assert child.wait() == 127
    with pytest.raises(
        Unavailable, match=r"cannot start the command \(exec: No such file or directory\)"
    ) as info:
        check_exec(child)
    assert info.value.exit_code == 69
    stub.box().remove()


def test_the_command_gets_default_signal_dispositions_and_exactly_the_given_identity(
    launcher: spawn.Launcher, tmp_path: Path
) -> None:
    """Python (the launcher) ignores SIGPIPE and SIGXFSZ: the command must
    not. Groups, ids, umask and lowered rlimits are exactly as given; an
    rlimit is never raised above the launcher's own."""
    out = tmp_path / "out"
    own_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    rl = {resource.RLIMIT_NOFILE: (100, 200), resource.RLIMIT_CORE: (0, 0),
          resource.RLIMIT_FSIZE: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}  # fmt: skip
    os.chmod(tmp_path, 0o755)  # noqa: S103 - the command runs as nobody
    script = 'grep -E "^(SigIgn|SigBlk|Uid|Gid|Groups):" /proc/self/status; umask; ulimit -Sn; ulimit -Hn; ulimit -Hf'
    with open(out, "wb") as fh, open(os.devnull, "rb") as null:
        os.chmod(out, 0o666)  # noqa: S103 - written by nobody
        stub = launcher.take(LIMITS)
        assert stub is not None
        rc = _run(stub, ["/bin/sh", "-c", script], fds=[null.fileno(), fh.fileno(), fh.fileno()],
                  targets=[0, 1, 2], uid=65534, gid=65534, groups=[65534, 4], umask=0o027, rlimits=rl)  # fmt: skip
    fsize_hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    fsize = "unlimited" if fsize_hard == resource.RLIM_INFINITY else str(fsize_hard // 512)
    assert (rc, out.read_text().split("\n")) == (0, [
        "Uid:\t65534\t65534\t65534\t65534", "Gid:\t65534\t65534\t65534\t65534", "Groups:\t4 65534 ",
        "SigBlk:\t0000000000000000", "SigIgn:\t0000000000000000", "0027", "100", str(min(200, own_nofile[1])),
        fsize, "",
    ])  # fmt: skip


# -- through the real daemon ---------------------------------------------------------------


def _launcher_of(daemon_pid: int) -> int:
    (pid,) = [p for p in _children(daemon_pid) if any("launcher.py" in a for a in _cmdline(p))]
    return pid


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KbRoot, str, daemon.Daemon]]:
    kb = KbRoot.create(tmp_path_factory.mktemp("launcher") / "root")
    read_sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    with daemon.serving(kb.root) as d:
        yield kb, read_sid, d


def _fresh_session(kb: KbRoot) -> str:
    r = kb.call(
        "session", "open", "con", "--kind", "execution", "--kb-access", "read", "--as", "alice", "--json"
    )
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


def test_a_brokered_command_runs_in_a_stub_recorded_before_it_ran(
    served: tuple[KbRoot, str, daemon.Daemon],
) -> None:
    kb, _, d = served
    sid = _fresh_session(kb)  # closed at the end
    launcher_pid = _launcher_of(d.proc.pid)
    _wait(lambda: len(_children(launcher_pid)) >= 2, "the pool never filled")
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    proc = _client(kb, sid, f"echo ready; exec sleep {marker}", {"KBD_SOCKET": str(d.sock)})
    try:
        _wait_line(proc, b"ready\n")
        _wait(lambda: _tree(marker), "the command never ran")
        (pid,) = _tree(marker)
        names = {p.rsplit("/", 1)[1] for p in _stub_cgroups(pid)}
        assert len(names) == 1 and BROKER_NAME.fullmatch(next(iter(names))), names
        assert next(iter(names)).split(".")[1] == str(launcher_pid)
        # The record names the stub cgroup and says so; session show finds it.
        records = list((kb.root / "state" / "procs" / sid).iterdir())
        assert len(records) == 1
        show = kb.call("session", "show", sid, "--json")
        assert show.code == 0, show.err
        # Closing the session finds and kills the tree through that record.
        closed = kb.call("session", "close", sid, "--json")
        assert closed.code == 0, closed.err
        proc.communicate(timeout=10)
        assert _tree(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_identity_umask_and_rlimits_equal_the_in_process_path(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    script = 'umask; id; grep -E "^(SigIgn|SigBlk|Cap[A-Za-z]+|NoNewPrivs):" /proc/self/status; cat /proc/self/limits'
    wrapper = 'ulimit -n 300 && ulimit -Sv 8000000 && umask 027 && exec "$@"'
    with daemon.serving(kb.root) as d:
        argv = ["/bin/sh", "-c", wrapper, "sh", sys.executable, "-m", "kbd", "--root", str(kb.root), "exec",
                sid, "--", "sh", "-c", script]  # fmt: skip
        base = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
        outs = []
        for env in ({**base, **IN_PROCESS_ENV}, {**base, "KBD_SOCKET": str(d.sock)}):
            r = subprocess.run(argv, capture_output=True, env=env, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            outs.append(r.stdout.decode())
    # Ignored signals are not identity: in-process, the command inherits what
    # its caller ignores (nohup, or GNU make's 32 and 33); a brokered command
    # starts with every disposition at the default, whatever the daemon's are.
    in_process, brokered = (re.sub(r"SigIgn:\t\w+\n", "", out) for out in outs)
    assert in_process == brokered
    assert "0027\n" in brokered and "SigIgn:\t0000000000000000\n" in outs[1]


def test_a_killed_daemon_takes_launcher_stubs_and_a_setsid_loop_and_the_next_start_sweeps(
    tmp_path: Path,
) -> None:
    kb = KbRoot.create(tmp_path / "root")
    sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    d = daemon.start(kb.root)
    try:
        launcher_pid = _launcher_of(d.proc.pid)
        _wait(lambda: len(_children(launcher_pid)) >= 2, "the pool never filled")
        marker = f"300.{uuid.uuid4().int % 10**9:09d}"
        script = (
            f"setsid sh -c 'while :; do sleep {marker}; done' & sleep 0.1; echo ready; exec sleep {marker}"
        )
        proc = _client(kb, sid, script, {"KBD_SOCKET": str(d.sock)})
        try:
            _wait_line(proc, b"ready\n")
            _wait(lambda: len(_tree(marker)) == 2, "the command and its setsid loop never both ran")
            stubs = [p for p in _children(launcher_pid) if not any(marker in a for a in _cmdline(p))]
            doomed = [launcher_pid, *stubs]
            mine = [p for p in _named("b_") if p.rsplit("/", 1)[1].split(".")[1] == str(launcher_pid)]
            assert len(mine) >= 3 * (1 + len(cgroup.detect().v1)), mine  # the command's and two stubs'
            d.proc.kill()
            d.proc.wait(timeout=10)
            proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
        assert proc.returncode == 69
        _wait(lambda: not _tree(marker) and not any(alive(p) for p in doomed),
              "the command's tree and the doomed processes to be gone", timeout=1.0)  # fmt: skip
        # The launcher may have seen the daemon's socket close before its own
        # SIGKILL (and cleaned up); whatever it could not remove, the next start does.
        with daemon.serving(kb.root):
            assert [p for p in mine if os.path.exists(p)] == []
    finally:
        d.kill()


def test_no_stub_cgroup_is_left_after_shutdown(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    with daemon.serving(kb.root) as d:
        launcher_pid = _launcher_of(d.proc.pid)
        for _ in range(3):
            r = kb.cli("exec", sid, "--", "true", env={"KBD_SOCKET": str(d.sock)})
            assert r.code == 0, r
        _wait(lambda: len(_children(launcher_pid)) >= 2, "the pool never refilled")
        stubs = _children(launcher_pid)
    assert not alive(launcher_pid) and [p for p in stubs if alive(p)] == []
    assert [p for p in _named("b_") if p.rsplit("/", 1)[1].split(".")[1] == str(launcher_pid)] == []
    assert [p for p, _ in live_processes() if p == launcher_pid] == []


def _pids_max_of_running(marker: str) -> str:
    """pids.max of the cgroup (v2, else the v1 pids hierarchy) holding ``sleep MARKER``."""
    h = cgroup.detect()
    (pid,) = _tree(marker)
    name = _stub_cgroups(pid)[0].rsplit("/", 1)[1]
    where = h.v2 if "pids" in h.controllers else next(v.subtree for v in h.v1 if "pids" in v.controllers)
    return Path(f"{where}/{name}/pids.max").read_text().strip()


def test_a_changed_limit_reaches_the_next_command_and_a_dead_launcher_is_replaced(tmp_path: Path) -> None:
    """kbd.yaml's limits change while the daemon runs: the next command's
    cgroup carries the new limit (pooled stubs made with the old one are
    let go). Then the launcher is killed: commands still run, correctly
    contained (through the slower in-daemon start until the daemon has
    started a new launcher, a second later), and the new one serves them."""
    kb = KbRoot.create(tmp_path / "root")
    sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    cfg = kb.root / "kbd.yaml"
    with daemon.serving(kb.root) as d:
        launcher_pid = _launcher_of(d.proc.pid)
        env = {"KBD_SOCKET": str(d.sock)}
        # The first command after the change may not find a stub with the new
        # limit yet (None: either way); the next one does.
        for pids_max, expect_stub in ((LIMITS.pids_max, True), (77, None), (77, True), (78, None)):
            cfg.write_text(re.sub(r"(?m)^  pids_max: \S+", f"  pids_max: {pids_max}", cfg.read_text()))
            if pids_max == 78:
                os.kill(launcher_pid, signal.SIGKILL)
                _wait(lambda: not alive(launcher_pid), "the launcher did not die")
            marker = f"300.{uuid.uuid4().int % 10**9:09d}"
            proc = _client(kb, sid, f"echo ready; exec sleep {marker}", env)
            try:
                _wait_line(proc, b"ready\n")
                _wait(lambda m=marker: _tree(m), "the command never ran")  # type: ignore[misc]
                assert _pids_max_of_running(marker) == str(pids_max)
                (pid,) = _tree(marker)
                names = [p.rsplit("/", 1)[1] for p in _stub_cgroups(pid)]
                if expect_stub is not None:
                    assert bool(BROKER_NAME.fullmatch(names[0])) is expect_stub, names
            finally:
                proc.kill()
                proc.communicate(timeout=10)
            _wait(lambda m=marker: not _tree(m), "the command's tree to be gone", timeout=2.0)  # type: ignore[misc]
        r = kb.cli("exec", sid, "--", "sh", "-c", "echo fine", env=env)
        assert (r.code, r.out) == (0, "fine\n"), r
        # The daemon started a new launcher; the old one's stub cgroups are gone.
        _wait(lambda: [p for p in _children(d.proc.pid) if any("launcher.py" in a for a in _cmdline(p))],
              "no new launcher")  # fmt: skip
        successor = _launcher_of(d.proc.pid)
        assert successor != launcher_pid
        _wait(lambda: len(_children(successor)) >= 2, "the new launcher's pool never filled")
        _wait(
            lambda: not [p for p in _named("b_") if f".{launcher_pid}." in p],
            "the old stub cgroups were left",
        )
        marker = f"300.{uuid.uuid4().int % 10**9:09d}"
        proc = _client(kb, sid, f"echo ready; exec sleep {marker}", env)
        try:
            _wait_line(proc, b"ready\n")
            _wait(lambda: _tree(marker), "the command never ran")
            (pid,) = _tree(marker)
            (name,) = {p.rsplit("/", 1)[1] for p in _stub_cgroups(pid)}
            assert BROKER_NAME.fullmatch(name) and name.split(".")[1] == str(successor), name
        finally:
            proc.kill()
            proc.communicate(timeout=10)


def test_a_pooled_stub_that_dies_leaves_the_pool_and_is_replaced(launcher: spawn.Launcher) -> None:
    victim = _pool(launcher)[0]
    box = victim.box()
    os.kill(victim.pid, signal.SIGKILL)
    _wait(lambda: victim.pid not in {s.pid for s in _pool(launcher)} and len(_pool(launcher)) == 2,
          "the dead stub was not replaced")  # fmt: skip
    _wait(lambda: not os.path.exists(box.path), "the dead stub's cgroup was left")
    _wait(lambda: not os.path.exists(f"/proc/{victim.pid}"), "the dead stub was not reaped")


def test_a_stub_dead_before_its_request_falls_back_instead_of_failing(launcher: spawn.Launcher) -> None:
    """Killed between take and launch: the request cannot be sent, nothing ran,
    and the caller is told to take the slow path (Unusable), not to fail."""
    stub = launcher.take(LIMITS)
    assert stub is not None
    os.kill(stub.pid, signal.SIGKILL)
    _wait(lambda: not alive(stub.pid), "the stub did not die")
    with open(os.devnull, "rb") as null, pytest.raises(spawn.Unusable):
        stub.launch(["/bin/true"], env={}, fds=[null.fileno()] * 3, targets=[0, 1, 2], uid=0, gid=0,
                    groups=os.getgroups(), umask=0o22, rlimits={})  # fmt: skip
    _wait(lambda: not os.path.exists(f"/proc/{stub.pid}"), "the dead stub was not reaped")
    stub.box().remove()


def test_a_command_too_large_for_a_stub_runs_the_slow_way_in_its_cgroup(
    served: tuple[KbRoot, str, daemon.Daemon],
) -> None:
    """An argv beyond one stub packet: the stub is let go, the command runs in
    its cgroup through the in-daemon start, and nothing is left behind."""
    kb, sid, d = served
    launcher_pid = _launcher_of(d.proc.pid)
    words = ["x" * 50_000 for _ in range(4)]
    before = _stubs_of(launcher_pid)
    r = kb.cli(
        "exec", sid, "--", "sh", "-c", 'echo "$# ${#1}"', "sh", *words, env={"KBD_SOCKET": str(d.sock)}
    )
    assert (r.code, r.out) == (0, "4 50000\n"), r.err
    _wait(lambda: len(_children(launcher_pid)) >= 2, "the pool did not refill")
    pooled = {p for p in _stubs_of(launcher_pid) if any(f"/{n}" in p for n in _pool_names(launcher_pid))}
    assert _stubs_of(launcher_pid) - before - pooled == set(), "a stub cgroup was left behind"


def _stubs_of(launcher_pid: int) -> set[str]:
    """The stub cgroups of one launcher (b_<id>.<launcher pid>.<n>): the daemons of
    tests running in parallel have launchers and stubs of their own."""
    return {p for p in _named("b_") if p.rsplit("/", 1)[1].split(".")[1] == str(launcher_pid)}


def _pool_names(launcher_pid: int) -> set[str]:
    """The cgroup names of the launcher's living children (its pooled stubs)."""
    return {p.rsplit("/", 1)[1] for c in _children(launcher_pid) for p in _stub_cgroups(c)}


def test_a_launcher_that_cannot_make_stubs_stops_asking_and_commands_take_the_slow_path() -> None:
    """Stub cgroups that cannot be made (here: a v2 subtree that does not
    exist): no stub, no wait, and after a few failures no more asking."""
    h = cgroup.detect()
    broken = replace(h, v2="/nonexistent/kbd-test")
    started = spawn.Launcher.start(broken, LIMITS, pool_size=2)
    assert started is not None
    try:
        assert started.ready.wait(10), "a pool that cannot fill must not hold the daemon's start"
        _wait(lambda: started._failures >= 2, "the failures were not reported")
        t0 = time.monotonic()
        assert started.take(LIMITS) is None
        _wait(lambda: started._failures >= spawn.FAILURES, "the failures were not counted")
        assert started.take(LIMITS) is None
        assert time.monotonic() - t0 < 1.0
        assert list(started._asked) == [] and started.proc.poll() is None
    finally:
        started.close()


def test_a_stub_is_labelled_by_the_request_it_answers_not_by_arrival_order() -> None:
    """Stubs get ready in any order (each pays its own cgroup move): a stub made
    under the old limits that answers after a limits change must never be taken
    for the new limits (review finding: the oldest request's key went to the
    first stub to arrive)."""
    h = cgroup.detect()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    launcher = spawn.Launcher(proc=None, sock=ours, hierarchy=h, pool_size=1)  # type: ignore[arg-type]
    old, new = LimitsConfig(pids_max=4096), LimitsConfig(pids_max=16)
    try:
        launcher.refill(old)
        launcher.refill(new)
        asked = [json.loads(theirs.recv(65536)) for _ in range(2)]
        tags = {json.dumps(a["dirs"]) == launcher._key_of(new): a["tag"] for a in asked}
        # The new-limits stub answers first, then the old-limits one.
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launcher._handle({"op": "stub", "pid": 222, "cgroup": "b_new", "tag": tags[True]}, [a.detach()])
        launcher._handle({"op": "stub", "pid": 111, "cgroup": "b_old", "tag": tags[False]}, [c.detach()])
        stub = launcher.take(new, wait=0, refill=False)
        assert stub is not None and stub.name == "b_new"
        stub.close()
        assert launcher.take(new, wait=0, refill=False) is None  # the old one was let go, never pooled
    finally:
        for sock in (ours, theirs, b, d):
            sock.close()
