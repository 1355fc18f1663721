"""Why the unit leaves some hardening out (systemd/kbd.service's header): the
real `kbd exec`, run in a private mount namespace prepared the way systemd
prepares a service's, fails under exactly those directives. If a kernel ever
accepts them, these tests fail and the unit can be hardened further."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import KbRoot

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_cgroup]

REPO = Path(__file__).resolve().parents[2]
# The mount each directive makes (systemd 252, src/core/namespace.c): a
# read-only bind over the path, or an inaccessible node over a file.
READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
COVERED = 'mount --bind /dev/null "$1" && shift && exec "$@"'


def exec_under(kb: KbRoot, sid: str, script: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    env.update(PYTHONPATH=str(REPO), KBD_NO_DAEMON="1")
    argv = [
        sys.executable,
        "-m",
        "kbd",
        "--root",
        str(kb.root),
        "exec",
        sid,
        "--",
        "cat",
        "knowledgebase/notes/fact.md",
    ]
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", path, *argv],
                          capture_output=True, text=True, env=env, timeout=60, check=False)  # fmt: skip


@pytest.fixture
def session(tmp_path: Path) -> tuple[KbRoot, str]:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("w", access={"owners": ["alice"]})
    return kb, kb.open_session("w", kind="execution", kb_access="read", actor="alice")


def test_exec_works_in_a_private_mount_namespace(session: tuple[KbRoot, str]) -> None:
    """The control: PrivateMounts= alone (a private namespace) keeps exec working."""
    kb, sid = session
    r = exec_under(kb, sid, 'shift; exec "$@"', "-")
    assert (r.returncode, r.stdout) == (0, "w\n"), r.stderr


@pytest.mark.parametrize(
    ("directive", "script", "path"),
    [
        pytest.param("ProtectKernelTunables", READ_ONLY, "/proc/sys", id="ProtectKernelTunables"),
        pytest.param("ProtectKernelLogs", COVERED, "/proc/kmsg", id="ProtectKernelLogs"),
    ],
)
def test_a_covered_proc_breaks_the_sandbox(session: tuple[KbRoot, str], directive: str, script: str,
                                           path: str) -> None:  # fmt: skip
    kb, sid = session
    r = exec_under(kb, sid, script, path)
    assert r.returncode != 0 and r.stdout == "", f"{directive} no longer breaks bwrap: harden the unit"
    assert "Can't mount proc" in r.stderr, r.stderr
    # bwrap's own exit 1 is never passed off as the command's: kbd says nothing ran.
    assert r.returncode == 69, r.stderr
    assert "error[unavailable]: bubblewrap could not set up the sandbox (exit 1); nothing was run" in r.stderr


def test_a_read_only_cgroupfs_leaves_no_per_command_cgroup(session: tuple[KbRoot, str]) -> None:
    """ProtectControlGroups=yes: kbd refuses (fails closed) rather than run uncontained."""
    kb, sid = session
    v2 = next(
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split(" - ")[1].startswith("cgroup2 ")
    )  # fmt: skip
    r = exec_under(kb, sid, READ_ONLY, v2)
    assert r.returncode == 69 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error[containment-unavailable]:"), r.stderr
