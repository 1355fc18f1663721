"""``kbd why`` and previews through the real daemon (docs/access.md "Why", "Previews"), each figure
beside an anchor measured in the same run on the same socket (this machine is noisy).

- ``why``: ``POST /v1/sessions/{sid}/why`` for a refused write (every reason, the fix found by
  rebuilding the plan) and for an allowed read, beside the plan lookup ``GET /v1/sessions/{sid}``
  (the §8 API policy lookup) over the same connection; and the CLI's ``kbd why`` through the daemon
  beside ``python3 -S -c pass``.
- ``preview``: ``DELETE /v1/workflows/src/writers/con?dry_run=true`` — a revoke that would narrow 100
  open sessions — beside 100 plan lookups of those sessions over the same connection.

Interleaved rounds (``KBD_BENCH_ROUNDS``, default 3), samples pooled; p50 and min in ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import KbRoot, issue_token
from tests.integration.daemon import serving

ROUNDS = int(os.environ.get("KBD_BENCH_ROUNDS", "3"))
N = 60  # requests per measure per round
SESSIONS = 100


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def build(root: Path) -> tuple[KbRoot, str, list[str]]:
    kb = KbRoot.create(root)
    team = {"owners": ["alice"], "readers": ["bob"]}
    for i in range(19):  # and src: 20, the most a workflow attaches
        kb.workflow(f"s{i:02}", access=team)
    kb.workflow("src", access={**team, "allowed_kb_writers": ["con"]})
    sources = [{"workflow_id": f"s{i:02}", "alias": f"s{i:02}"} for i in range(19)]
    sources.append({"workflow_id": "src", "alias": "src", "access": "write"})
    kb.workflow("con", access=team, sources=sources)
    sids = [
        kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
        for _ in range(SESSIONS)
    ]
    return kb, sids[0], sids


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb, sid, sids = build(Path(tmp) / "root")
        token = issue_token(kb.root, "alice")
        samples: dict[str, list[float]] = {k: [] for k in ("lookup", "why_refused", "why_allowed", "lookups_100",
                                                            "preview_100", "python_s", "cli_why")}  # fmt: skip
        with serving(kb.root) as daemon:
            c = daemon.client(token)
            env = {**os.environ, "KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": token}
            env = {k: v for k, v in env.items() if k != "KBD_ROOT"}

            def why(path: str, mode: str) -> None:
                r = c.post(f"/v1/sessions/{sid}/why", json={"path": path, "mode": mode})
                assert r.status_code == 200, r.text

            def lookups() -> None:
                for s in sids:
                    assert c.get(f"/v1/sessions/{s}").status_code == 200

            def preview() -> None:
                r = c.delete("/v1/workflows/src/writers/con", params={"dry_run": "true"})
                assert r.status_code == 200 and len(r.json()["sessions"]) == SESSIONS, r.text

            def cli() -> None:
                subprocess.run([sys.executable, "-m", "kbd", "why", sid, "s00:notes/x.md", "--mode", "write"],
                               env=env, stdout=subprocess.DEVNULL, check=False)  # fmt: skip

            for _ in range(ROUNDS):
                samples["lookup"] += timed(lambda: c.get(f"/v1/sessions/{sid}"), N)
                samples["why_refused"] += timed(lambda: why("s00:notes/x.md", "write"), N)
                samples["why_allowed"] += timed(lambda: why("s00:notes/fact.md", "read"), N)
                samples["lookups_100"] += timed(lookups, 3)
                samples["preview_100"] += timed(preview, 3)
                samples["python_s"] += timed(
                    lambda: subprocess.run([sys.executable, "-S", "-c", "pass"], check=True), 5
                )
                samples["cli_why"] += timed(cli, 5)
            httpx.Client.close(c)

    def row(name: str, key: str, anchor: str) -> str:
        s = samples[key]
        return f"| {name} | {statistics.median(s):.2f} | {min(s):.2f} | {anchor} |"

    def times(key: str, base: float, what: str) -> str:
        return f"{statistics.median(samples[key]) / base:.1f}x {what}"

    print("## kbd why and previews through the daemon (p50 / min ms)")
    print("| measure | p50 | min | anchor |")
    print("|---|---|---|---|")
    lookup = statistics.median(samples["lookup"])
    print(row("anchor: plan lookup GET /v1/sessions/{sid} (20 sources)", "lookup", "§8 API policy lookup"))
    print(
        row(
            "POST …/why, refused write (reasons + fix)",
            "why_refused",
            times("why_refused", lookup, "the lookup"),
        )
    )
    print(row("POST …/why, allowed read", "why_allowed", times("why_allowed", lookup, "the lookup")))
    py = statistics.median(samples["python_s"])
    print(row("anchor: python3 -S -c pass", "python_s", "interpreter start"))
    print(row("`kbd why` CLI through the daemon", "cli_why", times("cli_why", py, "python3 -S")))
    hundred = statistics.median(samples["lookups_100"])
    print(row(f"anchor: {SESSIONS} plan lookups over the socket", "lookups_100", "one per affected session"))
    print(row(f"preview of a writer revoke narrowing {SESSIONS} sessions", "preview_100",
              f"{statistics.median(samples['preview_100']) / hundred:.2f}x the {SESSIONS} lookups"))  # fmt: skip


if __name__ == "__main__":
    main()
