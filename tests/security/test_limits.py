"""docs/sandbox.md "Resource limits" with real commands: a bounded fork bomb, a memory bomb and a
large write are stopped on both backends (through the v1 memory and cpu
hierarchies on hybrid hosts), the sandbox's tmpfs mounts are bounded, the rlimits
cannot be raised again, and ``kbd doctor`` says what this host enforces."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kbd.sandbox import cgroup
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from tests.features import backends
from tests.helpers import KbRoot
from tests.waiting import wait_for

BACKENDS = backends("bwrap", "landlock")

# Every bound here is a cgroup limit or is checked beside one.
pytestmark = pytest.mark.requires_cgroup


def world(kb: KbRoot, backend: str, **limits: Any) -> str:
    cfg = kb.root / "kbd.yaml"
    doc = yaml.safe_load(cfg.read_text())
    doc["sandbox"]["backend"] = backend
    doc["limits"] = {**(doc.get("limits") or {}), **limits}
    cfg.write_text(yaml.safe_dump(doc))
    kb.workflow("con", access={"owners": ["alice"]})
    r = kb.call("session", "open", "con", "--kind", "reviewer_strategic", "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


FORK_BOMB = """
import subprocess
kids = []
try:
    for _ in range(200):
        kids.append(subprocess.Popen(["sleep", "5"]))
except OSError as exc:
    print("refused", exc.errno)
print(len(kids))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_bomb_stops_at_pids_max_and_the_host_stays_responsive(kb: KbRoot, backend: str) -> None:
    sid = world(kb, backend, pids_max=16)
    t0 = time.monotonic()
    r = kb.cli("exec", sid, "--", "python3", "-c", FORK_BOMB)
    took = time.monotonic() - t0
    lines = r.out.split("\n")
    assert r.code == 0 and lines[0] == "refused 11", (r.out, r.err)  # EAGAIN from fork
    assert int(lines[1]) < 16
    assert took < 20
    t0 = time.monotonic()
    subprocess.run(["true"], check=True)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_write_stops_at_file_size_max(kb: KbRoot, backend: str) -> None:
    sid = world(kb, backend, file_size_max="10M")
    script = (
        'head -c 100M /dev/zero > "$TMPDIR/big"; echo "rc=$?"; wc -c < "$TMPDIR/big"; rm -f "$TMPDIR/big"'
    )
    r = kb.cli("exec", sid, "--", "sh", "-c", script)
    assert r.code == 0, r.err
    assert r.out.split() == ["rc=153", str(10 << 20)]  # 128 + SIGXFSZ, stopped at the limit


@pytest.mark.parametrize("backend", BACKENDS)
def test_rlimits_are_set_hard_and_core_dumps_are_off(kb: KbRoot, backend: str) -> None:
    sid = world(kb, backend, open_files_max=100)
    r = kb.cli(
        "exec",
        sid,
        "--",
        "sh",
        "-c",
        "ulimit -n; ulimit -Hn; ulimit -Hc; ulimit -n 200 2>/dev/null || echo raise-refused",
    )
    assert r.out.split() == ["100", "100", "0", "raise-refused"], (r.out, r.err)


@pytest.mark.requires_bwrap
def test_the_sandbox_tmpfs_mounts_are_bounded(kb: KbRoot) -> None:
    sid = world(kb, "bwrap", tmpfs_size="4M", file_size_max="100M")
    script = (
        "head -c 10M /dev/zero > /tmp/big 2>/dev/null; echo tmp=$?; wc -c < /tmp/big; "
        "head -c 10M /dev/zero > /dev/shm/big 2>/dev/null; echo shm=$?; wc -c < /dev/shm/big; "
        "touch /dev/planted 2>/dev/null || echo dev-read-only"
    )
    r = kb.cli("exec", sid, "--", "sh", "-c", script)
    assert r.out.split() == ["tmp=1", str(4 << 20), "shm=1", str(4 << 20), "dev-read-only"], (r.out, r.err)


def test_doctor_reports_containment_and_each_limit(kb: KbRoot) -> None:
    r = kb.cli("doctor", "--json")
    checks = {c["check"]: c for c in r.json()["checks"]}
    assert checks["containment"]["ok"] and "cgroup" in checks["containment"]["detail"]
    keys = ["pids_max", "memory_max", "cpu_weight", "cpu_max", "file_size_max", "open_files_max",
            "address_space_max", "cpu_time_max", "core_dumps", "tmpfs_size"]  # fmt: skip
    for key in keys:
        detail = checks[f"limit {key}"]["detail"]
        assert detail.startswith(("enforced", "not enforceable here", "off", "always off")), (key, detail)
    # On this host the pids bound is real (cgroup v2 pids, or a v1 pids hierarchy),
    # and so are the memory and cpu ones (v2, or the v1 memory and cpu hierarchies).
    assert checks["limit pids_max"]["detail"].startswith("enforced")
    for key in ("memory_max", "cpu_weight"):
        assert checks[f"limit {key}"]["detail"].startswith("enforced: cgroup"), checks[f"limit {key}"]
        assert checks[f"limit {key}"]["ok"]


MEMORY = """
import sys
chunks = []
for _ in range(int(sys.argv[1])):
    chunks.append(b"\\x01" * (10 << 20))  # 10 MiB, every page written (charged)
print("allocated", len(chunks) * 10, flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_memory_bomb_is_killed_at_memory_max_and_the_host_stays_responsive(
    kb: KbRoot, backend: str
) -> None:
    sid = world(kb, backend, memory_max="256M")
    r = kb.cli("exec", sid, "--", "python3", "-c", MEMORY, "6")  # 60 MiB: well inside the bound
    assert (r.code, r.out.strip()) == (0, "allocated 60"), (r.out, r.err)
    t0 = time.monotonic()
    r = kb.cli("exec", sid, "--", "python3", "-c", MEMORY, "60")  # 600 MiB on a host with far more
    took = time.monotonic() - t0
    assert "allocated" not in r.out, f"{backend}: 600 MiB allocated under memory_max 256M ({r.out!r})"
    assert r.code == 128 + signal.SIGKILL, (r.code, r.err)  # the OOM killer, inside the command's cgroup
    assert took < 30
    t0 = time.monotonic()
    subprocess.run(["true"], check=True)
    assert time.monotonic() - t0 < 1.0


def _own_v1_cgroup(pid: int, controller: str) -> str:
    """The v1 ``controller`` cgroup folder of host process ``pid``, found through
    /proc/PID/cgroup and this host's mount table (never an assumed path)."""
    _, mounts = cgroup.parse_mounts(Path("/proc/self/mountinfo").read_text())
    _, own = cgroup.parse_own(Path(f"/proc/{pid}/cgroup").read_text())
    assert controller in mounts and controller in own, (controller, mounts, own)
    return mounts[controller].rstrip("/") + own[controller]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_command_cgroups_carry_the_configured_values(kb: KbRoot, backend: str) -> None:
    """Read from the host side while the command runs, through the session's
    process record: the command's own v1 memory and cpu cgroups (hybrid hosts;
    where v2 offers the controller, its files instead) hold what kbd.yaml says."""
    sid = world(kb, backend, memory_max="256M", cpu_weight=25, cpu_max=0.5, pids_max=64)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sleep", "30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        rows: list[Any] = wait_for(lambda: RootSessions(Root(kb.root)).commands.of_session(sid), 15,
                                   "the command's process record")  # fmt: skip
        assert len(rows) == 1 and rows[0].cgroup, rows
        pid, name = rows[0].pid, rows[0].cgroup
        hierarchy = cgroup.detect()
        files: dict[str, str] = {}
        for controller in ("memory", "cpu", "pids"):
            if controller in hierarchy.controllers:  # pure v2 host: the v2 cgroup has them
                folder = hierarchy.path(name)
                assert folder is not None
            else:
                folder = _own_v1_cgroup(pid, controller)
                assert folder.endswith(f"/kbd/{name}"), (controller, folder)
            wanted = ("memory.", "cpu.shares", "cpu.cfs_", "cpu.weight", "cpu.max", "pids.max")
            for f in os.listdir(folder):
                if f.startswith(wanted) and os.access(f"{folder}/{f}", os.R_OK):
                    with contextlib.suppress(OSError):  # write-only files (memory.force_empty)
                        files[f] = (Path(folder) / f).read_text()
        if "memory" in hierarchy.controllers:
            assert files["memory.max"].strip() == str(256 << 20)
            assert files["cpu.weight"].strip() == "25" and files["cpu.max"].split() == ["50000", "100000"]
        else:
            assert files["memory.limit_in_bytes"].strip() == str(256 << 20)
            if "memory.memsw.limit_in_bytes" in files:  # swap accounting on: swap cannot bypass the bound
                assert files["memory.memsw.limit_in_bytes"].strip() == str(256 << 20)
            assert "oom_kill_disable 0" in files["memory.oom_control"]
            assert files["cpu.shares"].strip() == "256"  # 25 * 1024 / 100
            assert files["cpu.cfs_period_us"].strip() == "100000"
            assert files["cpu.cfs_quota_us"].strip() == "50000"
        assert files["pids.max"].strip() == "64"
    finally:
        proc.kill()
        proc.wait(timeout=30)
