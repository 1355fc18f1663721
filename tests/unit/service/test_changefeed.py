"""The daemon's change feed, its bounds (kbd/service/changefeed.py; docs/daemon.md "The change feed" and
docs/multi-user.md "Threat model"), in process on a real root and a real
event log.

- A subscriber's backlog comes from the ring only: an id older than the ring
  reaches is one ``resync`` (``too-old``), however much the log files hold.
- The caps count streams and replays per uid and in all; a refusal is
  StreamLimit (503, ``stream-limit``), and slots come back exactly once.
- Visibility is decided on what short holds of the state lock read: never
  more than LOOKUP_BATCH registry lookups a hold, the same answer as before.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kbd.core.events import CHUNK, StreamCaps
from kbd.errors import StreamLimit, http_answer
from kbd.service.changefeed import LOOKUP_BATCH, Feed, StreamLimits
from kbd.service.root import Root
from kbd.state.events import EventLog
from tests.helpers import KbRoot

TEAM = {"owners": ["alice"], "readers": ["bob"]}


def test_a_backlog_comes_from_the_ring_only(kb: KbRoot) -> None:
    host = Root(kb.root, sweep_interval=0)
    with EventLog(host.config.state_dir, ring=8, sync_interval=0) as log:
        ids = [log.append("workflow.changed", workflow_id=f"wf_{i}").id for i in range(20)]
        feed = Feed(host, log, lock=threading.RLock())
        assert [e.id for e in feed._replay(ids[13])] == ids[14:]  # within the ring
        (resync,) = feed._replay(ids[2])  # the files hold it; the ring does not
        assert (resync.type, resync.fields["reason"], resync.id) == ("resync", "too-old", ids[-1])
        assert [e.id for e in feed._recent()] == ids[-8:]


def test_streams_and_replays_are_counted_per_uid_and_in_all() -> None:
    limits = StreamLimits(StreamCaps(streams_per_uid=3, replays=3, replays_per_uid=2))
    a1 = limits.admit(1, replay=True)
    limits.admit(1, replay=True)
    with pytest.raises(StreamLimit, match="2 replays from this client") as refused:
        limits.admit(1, replay=True)
    assert http_answer(refused.value)[:2] == (
        503,
        {"error": {"code": "stream-limit", "message": refused.value.message, "hint": refused.value.hint}},
    )
    assert http_answer(refused.value)[2] == {"Retry-After": "1"}
    live = limits.admit(1, replay=False)  # no replay: only the stream cap applies
    with pytest.raises(StreamLimit, match="3 event streams"):
        limits.admit(1, replay=False)
    b1 = limits.admit(2, replay=True)
    with pytest.raises(StreamLimit, match="3 replays in progress"):
        limits.admit(3, replay=True)
    a1.replayed()  # its replay was sent: the slot is free, the stream still counts
    a1.replayed()
    limits.admit(3, replay=True)
    with pytest.raises(StreamLimit, match="3 event streams"):
        limits.admit(1, replay=False)
    for ticket in (a1, a1, live, b1, b1):
        ticket.close()  # each slot given back once
    assert limits.streams == {1: 1, 3: 1} and limits.replays == {1: 1, 3: 1}


class CountingLock:
    """The state lock, counting the registry lookups made during each hold."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.holds: list[int] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.holds.append(0)
        return got

    def release(self) -> None:
        self._lock.release()


def test_visibility_takes_the_state_lock_for_a_bounded_number_of_lookups(kb: KbRoot) -> None:
    wids = [f"wf_{i:03d}" for i in range(3 * LOOKUP_BATCH + 5)]
    for i, wid in enumerate(wids):
        kb.workflow(wid, access=TEAM if i % 3 else {"owners": ["alice"]})
    host = Root(kb.root, sweep_interval=0)
    lock = CountingLock()
    find = host.registry.find

    def counted(wid: str) -> Any:
        lock.holds[-1] += 1
        return find(wid)

    host.registry.find = counted  # type: ignore[method-assign,assignment]
    with EventLog(host.config.state_dir, sync_interval=0) as log:
        events = log.append_many([("workflow.changed", wid, {}) for wid in wids] * 2)
        events.append(log.append("resync", workflow_id=None, reason="restart"))
        feed = Feed(host, log, lock=lock)  # type: ignore[arg-type]
        assert len(events) <= CHUNK
        bob, ops = host.principals.get("bob"), host.principals.get("ops")
        assert bob is not None and ops is not None
        shown = asyncio.run(feed._visible(lambda: bob, events))
        assert shown is not None
        assert [e.workflow_id for e in shown] == [w for w in wids if int(w[3:]) % 3] * 2 + [None]
        assert max(lock.holds) == LOOKUP_BATCH and sum(lock.holds) == len(wids), lock.holds
        lock.holds.clear()
        assert asyncio.run(feed._visible(lambda: ops, events)) == events  # an admin: no lookup at all
        assert lock.holds == [0]
        assert asyncio.run(feed._visible(lambda: None, events)) is None  # no longer authenticated
