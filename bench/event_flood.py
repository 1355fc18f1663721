"""Multi-user: a stale event replay flood (docs/daemon.md "The change feed" and docs/multi-user.md "Threat
model"). Budget: health p99 <= 100 ms and daemon RSS growth <= 200 MiB
while 50 subscribers are connected, beside the idle floor of the same run.

A real `kbd serve` on its Unix socket, its event log full: 42,000 events
appended by kbd's own log writer before it starts and 5,000 more while it runs
(its in-memory ring of the newest 4,096 is full). The subscribers connect as
another uid (nobody, when run as root) with a reader's token and never read
their answer; the health probes come from this process on one keep-alive
connection (200 probes). Loads:
- 50 subscribers asking for everything (``since=<epoch>-0``): each gets one
  ``resync``;
- 50 subscribers asking for the newest 4,000 events (replays the ring holds):
  4 are served (a uid's share of the replays), the rest refused at once.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kbd.core.events import parse_id
from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving
from tests.integration.event_loads import Stream, connect_as, fill_log, health_ms, pct, rss_mib
from tests.integration.loads import NOBODY

FULL = 42_000
RING_FILL = 5_000
FLOOD = 50
PROBES = 200
DEEP = 4_000
WORKFLOWS = [f"wf{i:02d}" for i in range(40)]


def measure(sock: Path, pid: int) -> tuple[list[float], float]:
    """Health latencies (ms) and the highest RSS (MiB) seen meanwhile."""
    rss = [rss_mib(pid)]
    ms, failed = health_ms(sock, PROBES, each=lambda: rss.append(rss_mib(pid)), within=60)
    if failed:
        print(f"  {len(failed)} of {len(ms)} health probes failed, e.g. {failed[0]}")
    return ms, max(rss)


def row(name: str, ms: list[float], rss: float, base: float, budget: str) -> None:
    print(f"{name:<44} {pct(ms, 0.5):7.2f} {pct(ms, 0.99):8.2f} {rss:8.0f} {rss - base:+8.0f}   {budget}")


def main() -> None:
    base_dir = Path(tempfile.mkdtemp(prefix="kbd-bench-events-", dir="/tmp"))
    try:
        os.chmod(base_dir, 0o750)  # noqa: S103 - the subscribers (nobody, group 0) must reach the socket
        kb = KbRoot.create(base_dir / "root")
        for i, wid in enumerate(WORKFLOWS):
            kb.workflow(
                wid, access={"owners": ["alice"], "readers": ["bob"]} if i % 2 == 0 else {"owners": ["alice"]}
            )
        tokens = issue_tokens(kb.root, ["bob", "ops"])
        token = tokens["bob"]
        fill_log(kb.root / "state", FULL, WORKFLOWS)
        sock = base_dir / "run" / "kbd.sock"
        uid = NOBODY if os.getuid() == 0 else os.getuid()

        def conns(n: int) -> list[socket.socket | Path]:
            return list(connect_as(uid, sock, n)) if uid != os.getuid() else [sock] * n

        with serving(kb.root, sock=sock) as daemon:
            last = fill_log(kb.root / "state", RING_FILL, WORKFLOWS)
            parsed = parse_id(last)
            assert parsed is not None
            epoch, seq = parsed
            warm = Stream(sock, tokens["ops"], since=f"{epoch}-{seq - 1}")
            warm.events(lambda e: e["id"] == last)  # the daemon has followed the whole log
            warm.close()
            pid = daemon.proc.pid
            health_ms(sock, 50)  # warm up
            print(f"health under a change-feed flood: {FLOOD} subscribers as uid {uid}, never reading;")
            print(f"log of {FULL + RING_FILL:,} events, {PROBES} probes a row")
            print(f"{'load':<44} {'p50 ms':>7} {'p99 ms':>8} {'RSS MiB':>8} {'growth':>8}   budget")
            ms, idle_rss = measure(sock, pid)
            row("idle (floor)", ms, idle_rss, idle_rss, "")
            for name, since in (
                (f"{FLOOD} stale subscribers (since=<epoch>-0)", f"{epoch}-0"),
                (f"{FLOOD} replays of the newest {DEEP:,} events", f"{epoch}-{seq - DEEP}"),
            ):
                base = rss_mib(pid)
                streams = [Stream(c, token, since=since) for c in conns(FLOOD)]
                try:
                    ms, peak = measure(sock, pid)
                    row(name, ms, peak, base, "p99 <= 100 ms, growth <= 200 MiB")
                    served = sum(s.status == 200 for s in streams)
                    refused = sum(s.status == 503 and s.error()["code"] == "stream-limit" for s in streams)
                    print(f"  {served} served, {refused} refused (503 stream-limit)")
                finally:
                    for s in streams:
                        s.close()
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
