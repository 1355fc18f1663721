"""Mount destinations cannot be redirected (the race test is a stress test, the
argv-order and helper tests below are the deterministic guard): a source that swaps a mount destination in its own
notes/ for a symlink while `kbd exec` sets up the sandbox must never land its
file anywhere else in the consumer's sandbox. bwrap looks destinations up by
path; kbd mounts everything executable after the grants and the inner helper
verifies the mount table before running anything."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import KbRoot

RUNS = 40


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
def test_a_swapped_index_destination_never_reaches_the_consumer(kb: KbRoot) -> None:
    src = kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    con = kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    (con / "victim.txt").write_text("genuine\n")
    notes = src / "knowledgebase" / "notes"
    (notes / "_index.json").write_text("PAYLOAD\n")
    # The redirect target as bwrap sees it while it builds the new root.
    (notes / "lnk").symlink_to(f"/newroot{con.resolve()}/victim.txt")
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    stop = kb.root / "stop-swapper"
    swapper = subprocess.Popen(
        [sys.executable, "-m", "tests.security.swapper", str(notes), "_index.json", "lnk", str(stop)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(str(stop) + ".ready").exists():
            assert swapper.poll() is None and time.monotonic() < deadline
            os.sched_yield()
        outcomes = []
        for _ in range(RUNS):
            r = kb.cli("exec", sid, "--", "cat", "victim.txt")
            assert "PAYLOAD" not in r.out, "a source's file was mounted over the consumer's"
            if r.code == 0:
                assert r.out == "genuine\n"
            else:
                # Refused before the command ran: by kbd (77, 69) or by bwrap's own
                # setup (1, "bwrap: ..." when the swapped name was not where it looked).
                assert r.out == "" and (r.code in (69, 77) or "bwrap:" in r.err), (r.code, r.err)
            outcomes.append(r.code)
        assert 0 in outcomes, "the command never ran: the test exercised nothing"
    finally:
        stop.write_text("stop")
        swapper.wait(timeout=30)
    assert (con / "victim.txt").read_text() == "genuine\n"


@pytest.mark.requires_landlock
def test_the_helper_refuses_an_unexpected_mount_table() -> None:
    helper = Path(__file__).resolve().parents[2] / "kbd" / "sandbox" / "landlock_helper.py"
    spec = '{"handled": ["make_sym"], "rules": [], "mounts": ["/"], "mount_prefixes": []}'
    r = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", str(helper), spec, "--", "true"], capture_output=True, check=False
    )
    assert r.returncode == 69 and b"unexpected mount point" in r.stderr
    spec = (
        '{"handled": ["make_sym"], "rules": [], "mounts": ["/", "/no/such/mount"], "mount_prefixes": ["/"]}'
    )
    r = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", str(helper), spec, "--", "true"], capture_output=True, check=False
    )
    assert r.returncode == 69 and b"is missing" in r.stderr


def test_everything_executable_is_mounted_after_the_grants(kb: KbRoot) -> None:
    """Deterministic half of the guard: in the bwrap argv, /usr, /proc, /dev and
    the helper come after every grant, and the helper is told the exact mount
    points to expect."""
    import json

    from kbd.sandbox import bwrap
    from kbd.sandbox.spec import HELPER_DEST, HELPER_PYC_DEST
    from kbd.service import sessions as session_ops
    from kbd.service.sessions import RootSessions

    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    h = kb.host()
    s = RootSessions(h)
    plan = session_ops.open_session(
        s, "con", actor=h.actor("alice"), kind="execution", kb_access="read-write"
    )
    bwrap.prepare(plan)
    fds = bwrap.Fds()
    r, w = os.pipe()
    try:
        argv = bwrap.build_argv(
            plan, ["true"], cwd=plan.workflow_folder, network="none", status_fd=w, fds=fds
        )
    finally:
        fds.close()
        os.close(r)
        os.close(w)
    grant_positions = [
        i
        for i, a in enumerate(argv)
        if a in ("--bind-fd", "--ro-bind-fd") and argv[i + 2] not in (HELPER_DEST, HELPER_PYC_DEST)
    ]
    system_positions = [
        i
        for i, a in enumerate(argv)
        if a in ("--proc", "--dev") or (a == "--ro-bind" and argv[i + 1] == "/usr")
    ]
    assert grant_positions and system_positions
    assert max(grant_positions) < min(system_positions)
    helper_at = argv.index("-S", argv.index("--") + 1) + 1
    assert argv[helper_at] in (HELPER_DEST, HELPER_PYC_DEST)
    spec = json.loads(argv[helper_at + 1])
    index = str(plan.workflow_folder.parent / "src" / "knowledgebase" / "notes" / "_index.json")
    assert (
        index in spec["mounts"] and "/usr" in spec["mounts"] and spec["mount_prefixes"] == ["/dev/", "/proc/"]
    )


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_host_mount_beneath_a_system_folder_is_expected_and_read_only(kb: KbRoot) -> None:
    """A host whose /usr/local (or a certificate folder under /etc/ssl) is a mount
    of its own: bubblewrap binds it with /usr, so the inner helper expects it
    (it refused every command of a write plan on such a host), and it is as
    read-only in the sandbox as the rest of /usr. A redirect elsewhere is still
    refused: the test above and test_the_helper_refuses_an_unexpected_mount_table."""
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]},
                sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])  # fmt: skip
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    games = "/usr/local/games"
    script = (
        f"mkdir -p {games} && mount -t tmpfs -o size=1m kbd-test {games} && echo host-mounted > {games}/x && "
        f"exec {shlex.join(kb.cli_argv('exec', sid, '--', 'sh', '-c', f'cat {games}/x; echo y > {games}/x'))}"
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, env=kb.cli_env("exec"), timeout=60, check=False)  # fmt: skip
    out, err = r.stdout.decode(), r.stderr.decode()
    assert "unexpected mount point" not in err, err
    assert out == "host-mounted\n" and "Read-only file system" in err and r.returncode == 2, (
        r.returncode,
        err,
    )
