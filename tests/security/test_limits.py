"""Issue 9 item 6 with real commands: a bounded fork bomb and a large write are
stopped on both backends, the sandbox's tmpfs mounts are bounded, the rlimits
cannot be raised again, and ``kbd doctor`` says what this host enforces."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
import yaml

from tests.helpers import KbRoot

BACKENDS = ["bwrap", "landlock"]


def world(kb: KbRoot, backend: str, **limits: Any) -> str:
    cfg = kb.root / "kbd.yaml"
    doc = yaml.safe_load(cfg.read_text())
    doc["sandbox"]["backend"] = backend
    doc["limits"] = {**(doc.get("limits") or {}), **limits}
    cfg.write_text(yaml.safe_dump(doc))
    kb.workflow("con", access={"owners": ["alice"]})
    r = kb.cli("session", "open", "con", "--kind", "reviewer_strategic", "--as", "alice", "--json")
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
    # On this host the pids bound is real (cgroup v2 pids, or a v1 pids hierarchy).
    assert checks["limit pids_max"]["detail"].startswith("enforced")
