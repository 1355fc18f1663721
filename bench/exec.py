"""`kbd exec` cost (docs/performance.md): bare /bin/true, kbd's own bwrap argv for a
read and a write plan run directly (beside the anchor), the anchor bwrap command (docs/performance.md), `python3 -S -c pass`, and
`kbd exec SID -- /bin/true` for a read plan and for a write plan (with the
inner Landlock helper), in-process and through the daemon's exec broker
(docs/daemon.md), with their ratios. Medians (and minimums: on this shared host the
minimum is the floor) of N runs, interleaved so that load hits every row alike.

The `kbd` measured is the one a host runs: this checkout installed without -e
into a fresh venv by its own (upgraded) pip, bytecode compiled by pip, run by
its console script (tests/integration/hostinstall.py); its dependencies come
from this venv through a .pth line.
The development venv's own `kbd` (an editable install) is a row of its own. The
client's share of a brokered command is `kbd exec` minus a `kbd.client` exec of
the same command from this process, both in the same round."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from kbd.client import Client
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
from tests.integration import hostinstall  # noqa: E402
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


Row = Callable[[], None]


def command(argv: list[str], env: dict[str, str] | None) -> Row:
    def run() -> None:
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)

    return run


def children_cpu_ms() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (used.ru_utime + used.ru_stime) * 1000


def interleaved(rows: dict[str, Row]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each row once per round, RUNS rounds: every row sees the same load. The
    wall time of each run, and the CPU time of the process it started (user +
    system: what waiting for the daemon or for a busy core does not inflate)."""
    samples: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(RUNS):
        for name, run in rows.items():
            c0, t0 = children_cpu_ms(), time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - t0) * 1000)
            cpu[name].append(children_cpu_ms() - c0)
    return samples, cpu


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


def client_share_runs(sock: Path, sid: str, kbd_exec: Row) -> dict[str, list[float]]:
    """The brokered `kbd exec`'s own cost: RUNS pairs of it and a `kbd.client`
    exec of the same command from this process, in alternating order, each
    pair after an unmeasured exec (a daemon that idled pays more for its next
    command: the cgroup move's RCU grace period; that is not the client's)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    out: dict[str, list[float]] = {"pair_kbd": [], "pair_lib": []}

    def timed(run: Row) -> float:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1000

    try:
        with Client(sock) as client:

            def library_exec() -> None:
                assert client.exec(sid, ["/bin/true"], stdin=devnull, stdout=devnull, stderr=devnull) == 0

            for n in range(RUNS):
                library_exec()  # the unmeasured one
                if n % 2:
                    lib, own = timed(library_exec), timed(kbd_exec)
                else:
                    own, lib = timed(kbd_exec), timed(library_exec)
                out["pair_kbd"].append(own)
                out["pair_lib"].append(lib)
    finally:
        os.close(devnull)
    return out


COMMIT_RUNS = 7
# 100 notes into a source's notes/ (staged, committed at exit through the note
# write path), or the same 100 files into the sandbox's private /tmp (nothing to
# commit): the difference is the commit.
HUNDRED = 'for i in $(seq 100); do echo "note $i of run $1" > "{where}/n$i.md"; done'


def commit_runs(kbd: list[str], sid: str, env: dict[str, str]) -> dict[str, list[float]]:
    """docs/notes.md "Staged contributions": the cost of committing 100 staged notes,
    beside the same command writing where nothing is committed, interleaved."""
    out: dict[str, list[float]] = {"commit100": [], "tmp100": []}
    for n in range(COMMIT_RUNS):
        for name, where in (("commit100", "$WORKFLOW_KB_SRC/notes"), ("tmp100", "/tmp")):
            argv = [*kbd, "exec", sid, "--", "sh", "-c", HUNDRED.format(where=where), "sh", str(n)]
            t0 = time.perf_counter()
            subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
            out[name].append((time.perf_counter() - t0) * 1000)
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
        dev_kbd = [str(Path(sys.executable).with_name("kbd"))]
        kbd = [str(hostinstall.install(Path(tmp) / "host"))]
        pip = hostinstall.pip_version(Path(kbd[0]))
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
            got, cpu = interleaved({
                "python": command(["/usr/bin/python3", "-S", "-c", "pass"], None),
                "anchor": command(ANCHOR_BWRAP, None),
                "read": command([*kbd, "exec", opened["read"], "--", "/bin/true"], inproc),
                "write": command([*kbd, "exec", opened["read-write"], "--", "/bin/true"], inproc),
                "b_read": command([*kbd, "exec", opened["read"], "--", "/bin/true"], brokered),
                "b_write": command([*kbd, "exec", opened["read-write"], "--", "/bin/true"], brokered),
                "b_dev": command([*dev_kbd, "exec", opened["read"], "--", "/bin/true"], brokered),
            })  # fmt: skip
            brokered_read = command([*kbd, "exec", opened["read"], "--", "/bin/true"], brokered)
            got.update(client_share_runs(served.sock, opened["read"], brokered_read))
            got.update(library_runs(served.sock, opened["read"]))
            got.update(commit_runs(kbd, opened["read-write"], brokered))
            got.update(direct)
        finally:
            served.stop()
    got["client"] = [a - b for a, b in zip(got["pair_kbd"], got["pair_lib"], strict=True)]
    got["commit"] = [a - b for a, b in zip(got["commit100"], got["tmp100"], strict=True)]
    p50 = {name: statistics.median(v) for name, v in got.items()}
    low = {name: min(v) for name, v in got.items()}
    print(f"kbd: {kbd[0]}: this checkout installed as a host installs it (python3 -m venv, pip install --upgrade "
          f"pip, pip install without -e; its console script written by pip {pip}), dependencies from this venv")  # fmt: skip
    print(f"kbd exec wall time over {RUNS} interleaved runs (ms): p50, min")
    rows = [
        ("bare /bin/true", bare, None, ""),
        ("/usr/bin/python3 -S -c pass", p50["python"], low["python"], ""),
        ("kbd's bwrap argv, read plan, run directly", p50["direct_read"], low["direct_read"],
         f"anchor interleaved: {p50['direct_anchor']:.1f}"),
        ("kbd's bwrap argv, write plan (+ Landlock helper), directly", p50["direct_write"], low["direct_write"], ""),
        ("anchor: bwrap --ro-bind / / ... /bin/true", p50["anchor"], low["anchor"], ""),
        ("kbd exec SID -- /bin/true (read plan, in-process)", p50["read"], low["read"], ""),
        ("kbd exec SID -- /bin/true (write plan, in-process)", p50["write"], low["write"], ""),
        ("kbd exec via the daemon (read plan)", p50["b_read"], low["b_read"], "<= 25"),
        ("kbd exec via the daemon (write plan, inner Landlock)", p50["b_write"], low["b_write"], "<= 35"),
        ("  read plan, the development venv's kbd (editable)", p50["b_dev"], low["b_dev"], ""),
        ("  read plan, kbd exec again, paired with kbd.client exec", p50["pair_kbd"], low["pair_kbd"], ""),
        ("  read plan, kbd.client exec in the same pairs", p50["pair_lib"], low["pair_lib"], ""),
        # A difference of two noisy figures: its minimum says nothing, so none is shown.
        ("  the client's share: kbd exec - kbd.client, per pair", p50["client"], None, "~ 9"),
        ("  CPU time of the kbd exec process (read plan)", statistics.median(cpu["b_read"]), min(cpu["b_read"]),
         f"python3 -S: {statistics.median(cpu['python']):.1f}"),
        ("  CPU time of the development venv's kbd exec", statistics.median(cpu["b_dev"]), min(cpu["b_dev"]), ""),
        ("kbd.client exec from a running process (read plan)", p50["lib"], low["lib"],
         f"<= anchor + 5 = {p50['lib_anchor'] + 5:.1f}"),
        ("  its anchor bwrap, interleaved with it", p50["lib_anchor"], low["lib_anchor"], ""),
        ("brokered write plan, 100 staged notes committed at exit", p50["commit100"], low["commit100"], ""),
        ("  the same 100 files into the sandbox's /tmp (no commit)", p50["tmp100"], low["tmp100"], ""),
        ("  the commit of 100 notes (difference per pair)", p50["commit"], None,
         f"{p50['commit'] / 100:.2f} ms a note"),
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
