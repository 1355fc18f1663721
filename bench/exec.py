"""`kbd exec` cost (DESIGN §8): bare /bin/true, the same bwrap command run
directly, and `kbd exec SID -- /bin/true` for a read plan and for a write plan
(with the inner Landlock helper), with their ratios. Medians of N runs."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from kbd.core.principals import LocalOperator
from kbd.sandbox import bwrap
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

RUNS = 30
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import KbRoot  # noqa: E402


def median_ms(argv: list[str], *, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> float:
    samples = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, pass_fds=pass_fds, check=True, stdout=subprocess.DEVNULL)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


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
        plan = RootSessions(host).plan(opened["read"], actor=LocalOperator.current())

        def bwrap_direct() -> float:
            # Rebuilt every run, as kbd does: bwrap consumes the seccomp memfd and the bind fds.
            samples = []
            for _ in range(RUNS):
                fds = bwrap.Fds()
                r, w = os.pipe()
                argv = bwrap.build_argv(
                    plan, ["/bin/true"], cwd=plan.workflow_folder, network="none", status_fd=w, fds=fds
                )
                t0 = time.perf_counter()
                subprocess.run(argv, pass_fds=(*fds.handed, w), check=True, stdout=subprocess.DEVNULL)
                samples.append((time.perf_counter() - t0) * 1000)
                fds.close()
                os.close(r)
                os.close(w)
            return statistics.median(samples)

        bare = median_ms(["/bin/true"])
        direct = bwrap_direct()
        read = median_ms([*kbd, "exec", opened["read"], "--", "/bin/true"], env=env)
        write = median_ms([*kbd, "exec", opened["read-write"], "--", "/bin/true"], env=env)
        py = median_ms(["/usr/bin/python3", "-S", "-c", "pass"])
    print(f"kbd exec wall time, median of {RUNS} runs (ms)")
    rows = [
        ("bare /bin/true", bare, ""),
        ("/usr/bin/python3 -S -c pass", py, ""),
        ("same bwrap command, run directly", direct, ""),
        ("kbd exec SID -- /bin/true (read plan)", read, "<= 25 (<= 20 above bwrap)"),
        ("kbd exec SID -- /bin/true (write plan, inner Landlock)", write, "<= 35"),
    ]
    for name, ms, budget in rows:
        print(f"{name:<56} {ms:8.1f}  {budget}")
    print(
        f"ratios: read/bwrap {read / direct:.1f}x, read - bwrap {read - direct:.1f} ms, write/read {write / read:.2f}x"
    )


if __name__ == "__main__":
    main()
