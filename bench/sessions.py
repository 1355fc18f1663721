"""Plan lookup and session open with 20 sources (docs/performance.md), in process.

A consumer attaches 20 sources (4 of them write-granted); the figures are
medians over many calls on a warm process: ``RootSessions.plan(sid)`` (what
every lookup does: the session row, every manifest checked against the disk
and every KB probed, 20 sources; the resolution, plan and digest are taken
from the session's verified memo when every answer is unchanged), the same
with the memo forgotten before each call (the full rebuild a changed answer
costs), and ``open_session`` (a rebuild plus one SQLite insert).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from kbd.core import layout
from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import KbRoot

LOOKUPS = 3000
OPENS = 300


def median_ms(fn: object, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb = KbRoot.create(Path(tmp) / "root")
        for i in range(20):
            kb.workflow(
                f"s{i:02d}", access={"owners": ["alice"], "allowed_kb_writers": ["con"] if i < 4 else []}
            )
        kb.workflow(
            "con",
            access={"owners": ["alice"]},
            sources=[{"workflow_id": f"s{i:02d}", "alias": f"a{i:02d}", "access": "write" if i < 4 else "read"}
                     for i in range(20)],
        )  # fmt: skip
        time.sleep(layout.RACY_NS / 1e9 * 1.5)  # let timestamps age out of the racy window, as on a live host
        host = Root(kb.root)  # default sweep_interval, as in the daemon
        sessions = RootSessions(host)
        alice = host.actor("alice")
        plan = session_ops.open_session(
            sessions, "con", actor=alice, kind="execution", kb_access="read-write"
        )
        sid = str(plan.session_id)
        assert len(plan.sources) == 20 and all(a.available for a in plan.sources)
        for _ in range(200):
            sessions.plan(sid, actor=alice)
        lookup = median_ms(lambda: sessions.plan(sid, actor=alice), LOOKUPS)

        def rebuild() -> None:
            sessions._memos.clear()  # as after a changed answer: resolve, plan and digest again
            sessions.plan(sid, actor=alice)

        rebuilt = median_ms(rebuild, LOOKUPS)
        opened = median_ms(
            lambda: session_ops.open_session(
                sessions, "con", actor=alice, kind="execution", kb_access="read-write"
            ),
            OPENS,
        )
    print(f"sessions bench: 20 sources (4 writable), warm process; {LOOKUPS} lookups, {OPENS} opens")
    print(f"{'measure':<44} {'median':>9} {'p99':>9}  budget")
    print(f"{'plan lookup, 20 sources, warm':<44} {lookup[0]:>7.3f}ms {lookup[1]:>7.3f}ms  <= 0.5 ms")
    print(f"{'  the same, memo forgotten (full rebuild)':<44} {rebuilt[0]:>7.3f}ms {rebuilt[1]:>7.3f}ms")
    print(f"{'session open, 20 sources':<44} {opened[0]:>7.3f}ms {opened[1]:>7.3f}ms  <= 3 ms")


if __name__ == "__main__":
    main()
