"""`kbd exec` cost (DESIGN §8): bare /bin/true, kbd's own bwrap argv for a
read and a write plan run directly (beside the anchor), the §8 anchor bwrap command, `python3 -S -c pass`, and
`kbd exec SID -- /bin/true` for a read plan and for a write plan (with the
inner Landlock helper), in-process and through the daemon's exec broker
(DESIGN §9), with their ratios. Medians (and minimums: on this shared host the
minimum is the floor) of N runs, interleaved so that load hits every row alike."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from kbd.core.config import LimitsConfig
from kbd.core.plan import Plan
from kbd.core.principals import LocalOperator
from kbd.sandbox import bwrap
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

RUNS = 30
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import KbRoot  # noqa: E402
from tests.integration.daemon import map_uid  # noqa: E402
from tests.integration.daemon import start as daemon_start  # noqa: E402

ANCHOR_BWRAP = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
                "--die-with-parent", "--new-session", "/bin/true"]  # fmt: skip


def median_ms(argv: list[str], *, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> float:
    samples = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, pass_fds=pass_fds, check=True, stdout=subprocess.DEVNULL)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def interleaved(rows: dict[str, tuple[list[str], dict[str, str] | None]]) -> dict[str, list[float]]:
    """Each row once per round, RUNS rounds: every row sees the same load."""
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(RUNS):
        for name, (argv, env) in rows.items():
            t0 = time.perf_counter()
            subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
            samples[name].append((time.perf_counter() - t0) * 1000)
    return samples


def bwrap_direct(read: Plan, write: Plan, limits: LimitsConfig) -> dict[str, list[float]]:
    """kbd's own bwrap argv (kbd.yaml's limits, so with the rlimit step) for a
    read and a write plan, run directly, interleaved with the anchor bwrap.
    Rebuilt every run, as kbd does: bwrap consumes the seccomp, /etc copy and
    bind descriptors."""
    out: dict[str, list[float]] = {"direct_read": [], "direct_write": [], "direct_anchor": []}

    def once(plan: Plan) -> float:
        fds = bwrap.Fds()
        r, w = os.pipe()
        try:
            argv = bwrap.build_argv(plan, ["/bin/true"], cwd=plan.workflow_folder, network="none",
                                    status_fd=w, fds=fds, limits=limits)  # fmt: skip
            t0 = time.perf_counter()
            subprocess.run(argv, pass_fds=(*fds.handed, w), check=True, stdout=subprocess.DEVNULL)
            return (time.perf_counter() - t0) * 1000
        finally:
            fds.close()
            os.close(r)
            os.close(w)

    for _ in range(RUNS):
        out["direct_read"].append(once(read))
        out["direct_write"].append(once(write))
        t0 = time.perf_counter()
        subprocess.run(ANCHOR_BWRAP, check=True, stdout=subprocess.DEVNULL)
        out["direct_anchor"].append((time.perf_counter() - t0) * 1000)
    return out


def library_runs(sock: Path, sid: str) -> dict[str, list[float]]:
    """`kbd.client.Client.exec` of /bin/true from this (running) process, each
    run interleaved with one anchor bwrap run: an execution host's cost per
    command, beside its floor."""
    from kbd.client import Client

    devnull = os.open(os.devnull, os.O_RDWR)
    out: dict[str, list[float]] = {"lib": [], "lib_anchor": []}
    try:
        with Client(sock) as client:
            client.exec(sid, ["/bin/true"], stdin=devnull, stdout=devnull, stderr=devnull)  # warm
            for _ in range(RUNS):
                t0 = time.perf_counter()
                assert client.exec(sid, ["/bin/true"], stdin=devnull, stdout=devnull, stderr=devnull) == 0
                t1 = time.perf_counter()
                subprocess.run(ANCHOR_BWRAP, check=True, stdout=devnull, stderr=devnull)
                t2 = time.perf_counter()
                out["lib"].append((t1 - t0) * 1000)
                out["lib_anchor"].append((t2 - t1) * 1000)
    finally:
        os.close(devnull)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb = KbRoot.create(Path(tmp) / "root")
        kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
        kb.workflow(
            "con",
            access={"owners": ["alice"]},
            sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
        )
        # Let the racy-timestamp window pass so caches are trusted, as on a live host.
        time.sleep(0.3)
        env = {**os.environ, "KBD_ROOT": str(kb.root)}
        kbd = [str(Path(sys.executable).with_name("kbd"))]
        opened = {}
        for mode in ("read", "read-write"):
            out = subprocess.run([*kbd, "session", "open", "con", "--kind", "execution", "--kb-access", mode,
                                  "--as", "alice", "--json"], env=env, check=True, capture_output=True).stdout  # fmt: skip
            opened[mode] = orjson.loads(out)["session_id"]
        subprocess.run([*kbd, "exec", opened["read"], "--", "/bin/true"], env=env, check=True)
        host = Root(kb.root)

        plans = {
            mode: RootSessions(host).plan(sid, actor=LocalOperator.current()) for mode, sid in opened.items()
        }
        for each in plans.values():
            bwrap.prepare(each)
        direct = bwrap_direct(plans["read"], plans["read-write"], host.config.limits)
        bare = median_ms(["/bin/true"])
        inproc = {**env, "KBD_NO_DAEMON": "1"}
        map_uid(kb.root, "ops", os.getuid())  # the daemon authenticates this uid as ops (admin)
        served = daemon_start(kb.root)
        try:
            brokered = {**env, "KBD_SOCKET": str(served.sock)}
            subprocess.run([*kbd, "exec", opened["read"], "--", "/bin/true"], env=brokered, check=True)
            got = interleaved({
                "python": (["/usr/bin/python3", "-S", "-c", "pass"], None),
                "anchor": (ANCHOR_BWRAP, None),
                "read": ([*kbd, "exec", opened["read"], "--", "/bin/true"], inproc),
                "write": ([*kbd, "exec", opened["read-write"], "--", "/bin/true"], inproc),
                "b_read": ([*kbd, "exec", opened["read"], "--", "/bin/true"], brokered),
                "b_write": ([*kbd, "exec", opened["read-write"], "--", "/bin/true"], brokered),
            })  # fmt: skip
            got.update(library_runs(served.sock, opened["read"]))
            got.update(direct)
        finally:
            served.stop()
    p50 = {name: statistics.median(v) for name, v in got.items()}
    low = {name: min(v) for name, v in got.items()}
    print(f"kbd exec wall time over {RUNS} interleaved runs (ms): p50, min")
    rows = [
        ("bare /bin/true", bare, None, ""),
        ("/usr/bin/python3 -S -c pass", p50["python"], low["python"], ""),
        ("kbd's bwrap argv, read plan, run directly", p50["direct_read"], low["direct_read"],
         f"anchor interleaved: {p50['direct_anchor']:.1f}"),
        ("kbd's bwrap argv, write plan (+ Landlock helper), directly", p50["direct_write"], low["direct_write"], ""),
        ("§8 anchor: bwrap --ro-bind / / ... /bin/true", p50["anchor"], low["anchor"], ""),
        ("kbd exec SID -- /bin/true (read plan, in-process)", p50["read"], low["read"], ""),
        ("kbd exec SID -- /bin/true (write plan, in-process)", p50["write"], low["write"], ""),
        ("kbd exec via the daemon (read plan)", p50["b_read"], low["b_read"], "<= 25"),
        ("kbd exec via the daemon (write plan, inner Landlock)", p50["b_write"], low["b_write"], "<= 35"),
        ("kbd.client exec from a running process (read plan)", p50["lib"], low["lib"],
         f"<= anchor + 5 = {p50['lib_anchor'] + 5:.1f}"),
        ("  its anchor bwrap, interleaved with it", p50["lib_anchor"], low["lib_anchor"], ""),
    ]  # fmt: skip
    for name, ms, floor, budget in rows:
        lowest = f"{floor:8.1f}" if floor is not None else " " * 8
        print(f"{name:<56} {ms:8.1f} {lowest}  {budget}")
    print(
        f"ratios (p50): brokered read/anchor bwrap {p50['b_read'] / p50['anchor']:.1f}x, "
        f"brokered read/python {p50['b_read'] / p50['python']:.1f}x, "
        f"brokered write/anchor bwrap {p50['b_write'] / p50['anchor']:.1f}x, "
        f"in-process read/brokered read {p50['read'] / p50['b_read']:.1f}x"
    )


if __name__ == "__main__":
    main()
