"""What reporting a command's Landlock refusals costs `kbd exec` (docs/sandbox.md "Refusals the
kernel reports"), beside ``python3 -S -c pass`` measured in the same run (this machine is noisy).

Rows, under the Landlock-only backend, in-process (`KBD_NO_DAEMON=1`, as root: CAP_AUDIT_READ):
``/bin/true`` with reports off and on (the pid channel, the collector's start and the end-of-command
settle), and a command refused once (``cat`` of a hidden file) with reports off and on (on: the
refusal explained as ``kbd why`` explains it). Kernel audit is turned on
for the run (it is left on). Interleaved rounds (``KBD_BENCH_ROUNDS``, default 3), samples pooled;
p50 and min in ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.features import enable_kernel_audit, missing_landlock_audit
from tests.helpers import KbRoot

ROUNDS = int(os.environ.get("KBD_BENCH_ROUNDS", "3"))
N = 15  # runs per row per round


def run(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return (time.perf_counter() - t) * 1000


def main() -> None:
    if (why := missing_landlock_audit()) is not None:
        print(f"refusal reports: not measured ({why})")
        return
    enable_kernel_audit()
    with tempfile.TemporaryDirectory(prefix="kbd-bench-refusals-") as tmp:
        kb = KbRoot.create(Path(tmp) / "root")
        kb.workflow("src", access={"owners": ["alice"]})
        kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
        cfg = kb.root / "kbd.yaml"
        base = cfg.read_text().replace("backend: auto", "backend: landlock")
        on, off = base, base.replace("sandbox:\n", "sandbox:\n  report_denials: false\n")
        r = kb.call("session", "open", "con", "--kind", "reviewer_strategic", "--as", "alice", "--json")
        sid = str(r.json()["session_id"])
        env = kb.cli_env("exec", sid, "--", "true")
        refused = f"cat {kb.workflows}/src/workflow.json"
        rows = {
            "python3 -S -c pass (anchor)": (None, ["/usr/bin/python3", "-S", "-c", "pass"]),
            "kbd exec /bin/true, reports off": (off, kb.cli_argv("exec", sid, "--", "/bin/true")),
            "kbd exec /bin/true, reports on": (on, kb.cli_argv("exec", sid, "--", "/bin/true")),
            "kbd exec, one refusal, reports off": (off, kb.cli_argv("exec", sid, "--", "sh", "-c", refused)),
            "kbd exec, one refusal, reports on": (on, kb.cli_argv("exec", sid, "--", "sh", "-c", refused)),
        }
        samples: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(ROUNDS):
            for name, (config, argv) in rows.items():
                if config is not None:
                    cfg.write_text(config)
                samples[name] += [run(argv, env) for _ in range(N)]
    anchor = statistics.median(samples["python3 -S -c pass (anchor)"])
    print(f"refusal reports: kbd exec wall time, {ROUNDS} rounds x {N} (ms): p50, min, p50 / anchor")
    for name, xs in samples.items():
        p50 = statistics.median(xs)
        print(f"  {name:<40} {p50:8.1f} {min(xs):8.1f} {p50 / anchor:6.1f}x")
    print(
        "  budget: none of its own in docs/performance.md; reports on must stay within a few ms of off "
        "for a command nothing refused"
    )


if __name__ == "__main__":
    main()
