"""No client starves the daemon through the change feed (docs/daemon.md "The change feed" and
docs/multi-user.md "Threat model"): the REAL daemon on its real socket, its event log
full (42,000 events appended by kbd's own log writer before it starts, 5,000
more while it runs, so its in-memory ring of the newest 4,096 is full too).

- 50 subscribers from one uid asking for everything (``since=<epoch>-0``) and
  never reading: health p99 within 100 ms while they are connected, the
  daemon's RSS grows by at most 200 MiB, another principal's ``notes log`` and
  sources still answer, and each subscriber got one ``resync`` (``too-old``).
- The caps: event streams per peer uid, and replays (a ``since`` the ring
  still holds, more than one chunk of events) in all and per uid. One over a
  cap is answered 503 ``stream-limit`` with ``Retry-After``; a slot freed (its
  subscriber hung up) is taken again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kbd.core.events import CHUNK, STREAM_CAPS, parse_id
from tests.helpers import PRINCIPALS, KbRoot
from tests.integration.daemon import Daemon, issue_tokens, serving
from tests.integration.event_loads import Stream, connect_as, fill_log, health_ms, pct, rss_mib
from tests.waiting import wait_for

FULL = 42_000
RING_FILL = 5_000
FLOOD = 50
PROBES = 200
HEALTH_P99_MS = 100.0
RSS_GROWTH_MIB = 200.0
TEAM = {"owners": ["alice"], "readers": ["bob"]}
PRIVATE = {"owners": ["alice"]}
WORKFLOWS = [f"wf{i:02d}" for i in range(40)]
#: Uids with no passwd entry: connections from four other users (tokens authenticate them).
UIDS = [61001, 61002, 61003, 61004, 61005]
#: A replay that blocks: far more than the socket's buffers hold, never read.
DEEP = 4000


@dataclass
class Feed:
    kb: KbRoot
    daemon: Daemon
    sock: Path
    tokens: dict[str, str]
    last: str  # the newest event's id

    @property
    def epoch(self) -> str:
        parsed = parse_id(self.last)
        assert parsed is not None
        return parsed[0]

    def client(self, pid: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://kbd",
                            headers={"Authorization": f"Bearer {self.tokens[pid]}"}, timeout=15)  # fmt: skip

    def deep(self) -> str:
        """An id the ring still holds, DEEP events back: a replay of DEEP events."""
        parsed = parse_id(self.last)
        assert parsed is not None
        return f"{parsed[0]}-{parsed[1] - DEEP}"


@pytest.fixture(scope="module")
def feed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feed]:
    base = tmp_path_factory.mktemp("flood")
    kb = KbRoot.create(base / "root")
    for i, wid in enumerate(WORKFLOWS):
        kb.workflow(wid, access=TEAM if i % 2 == 0 else PRIVATE)
    tokens = issue_tokens(kb.root, [str(p["id"]) for p in PRINCIPALS])
    state_dir = kb.root / "state"
    fill_log(state_dir, FULL, WORKFLOWS)
    # Other uids connect too: the socket must be outside pytest's 0700 folder.
    sockdir = Path(tempfile.mkdtemp(prefix="kbd-flood-", dir="/tmp"))
    os.chmod(sockdir, 0o750)  # noqa: S103 - group 0 traverses, as group kbd would
    sock = sockdir / "run" / "kbd.sock"
    try:
        with serving(kb.root, sock=sock, home=base / "home") as daemon:
            last = fill_log(state_dir, RING_FILL, WORKFLOWS)  # followed by the daemon: its ring fills
            parsed = parse_id(last)
            assert parsed is not None
            probe = Stream(sock, tokens["ops"], since=f"{parsed[0]}-{parsed[1] - 1}")
            assert probe.events(lambda e: e["id"] == last)[-1]["id"] == last  # the daemon has them all
            probe.close()
            yield Feed(kb, daemon, sock, tokens, last)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_stale_replay_flood_from_one_uid_starves_nobody(feed: Feed) -> None:
    pid = feed.daemon.proc.pid
    assert not health_ms(feed.sock, 20)[1]  # warm
    base = rss_mib(pid)
    streams = [Stream(feed.sock, feed.tokens["bob"], since=f"{feed.epoch}-0") for _ in range(FLOOD)]
    try:
        assert [s.status for s in streams] == [200] * FLOOD
        rss = [rss_mib(pid)]
        latencies, failed = health_ms(feed.sock, PROBES, each=lambda: rss.append(rss_mib(pid)), within=30)
        print(
            f"health p50 {pct(latencies, 0.5):.1f} ms, p99 {pct(latencies, 0.99):.1f} ms over "
            f"{len(latencies)} probes ({len(failed)} failed); RSS {base:.0f} -> {max(rss):.0f} MiB"
        )
        # Another principal's ordinary requests, each needing the state lock.
        with feed.client("alice") as alice:
            notes_log = alice.get(
                f"/v1/workflows/{WORKFLOWS[1]}/notes/history", params={"path": "notes/fact.md"}
            )
            sources = alice.get(f"/v1/workflows/{WORKFLOWS[1]}/sources")
        rss.append(rss_mib(pid))
        p99, growth = pct(latencies, 0.99), max(rss) - base
        assert (notes_log.status_code, sources.status_code) == (200, 200), (notes_log.text, sources.text)
        assert not failed, f"{len(failed)} of {len(latencies)} health probes failed: {failed[:3]}"
        assert len(latencies) == PROBES, f"only {len(latencies)} health answers in 30 s (p99 {p99:.0f} ms)"
        assert p99 <= HEALTH_P99_MS, f"health p99 {p99:.1f} ms with {FLOOD} stale subscribers connected"
        assert growth <= RSS_GROWTH_MIB, f"the daemon grew by {growth:.0f} MiB (from {base:.0f} MiB)"
        # What each got: one resync, carrying the id to continue from after reloading.
        for s in streams:
            (resync,) = s.events(lambda e: True)
            assert resync["type"] == "resync" and resync["reason"] == "too-old", resync
            assert resync["id"] == feed.last
    finally:
        for s in streams:
            s.close()


def _admitted(open_one: Callable[[], Stream], timeout: float = 10.0) -> Stream:
    """The first stream ``open_one()`` gets admitted (a slot frees when the
    daemon sees its subscriber hang up), within ``timeout``."""

    def admitted() -> Stream | None:
        s = open_one()
        if s.status == 200:
            return s
        assert s.status == 503 and s.error()["code"] == "stream-limit", (s.status, s.raw)
        s.close()
        return None

    return wait_for(admitted, timeout, "a stream slot to be freed", max_interval=0.02)


def _refused(s: Stream, words: str) -> None:
    assert s.status == 503, (s.status, s.raw)
    assert s.headers["retry-after"] == "1"
    err = s.error()
    assert err["code"] == "stream-limit" and words in err["message"], err
    s.close()


def test_event_streams_are_capped_per_uid_and_a_freed_slot_is_taken_again(feed: Feed) -> None:
    per_uid = STREAM_CAPS.streams_per_uid
    live: list[Stream] = []
    try:
        # Live streams (no replay) of this uid, under any principal: the cap is the uid's.
        live.append(_admitted(lambda: Stream(feed.sock, feed.tokens["bob"])))
        while len(live) < per_uid:
            s = Stream(feed.sock, feed.tokens["alice" if len(live) % 2 else "bob"])
            if s.status != 200:  # a stream of an earlier test not yet seen gone: wait for it
                s.close()
                live.append(_admitted(lambda: Stream(feed.sock, feed.tokens["bob"])))
                continue
            live.append(s)
        _refused(Stream(feed.sock, feed.tokens["alice"]), f"{per_uid} event streams")
        # Another uid is not affected.
        (other,) = connect_as(UIDS[0], feed.sock, 1)
        elsewhere = Stream(other, feed.tokens["alice"])
        assert elsewhere.status == 200, elsewhere.raw
        elsewhere.close()
        live.pop().close()
        live.append(_admitted(lambda: Stream(feed.sock, feed.tokens["alice"])))
        _refused(Stream(feed.sock, feed.tokens["bob"]), f"{per_uid} event streams")
    finally:
        for s in live:
            s.close()


@pytest.mark.requires_root
def test_replays_are_capped_in_all_and_per_uid_and_a_freed_slot_is_taken_again(feed: Feed) -> None:
    caps = STREAM_CAPS
    assert DEEP > CHUNK and caps.replays == caps.replays_per_uid * (len(UIDS) - 1), caps
    since = feed.deep()
    conns = {uid: connect_as(uid, feed.sock, caps.replays_per_uid + 2) for uid in UIDS}
    held: dict[int, list[Stream]] = {uid: [] for uid in UIDS}
    try:
        for uid in UIDS[:-1]:
            ours = conns[uid]
            for _ in range(caps.replays_per_uid):
                held[uid].append(_admitted(lambda: Stream(ours.pop(), feed.tokens["ops"], since=since)))  # noqa: B023
            if uid == UIDS[0]:  # its share is full, while replays remain in all: refused
                _refused(
                    Stream(conns[uid].pop(), feed.tokens["ops"], since=since), "replays from this client"
                )
        # Every replay is taken: refused for a uid with none.
        _refused(Stream(conns[UIDS[-1]].pop(), feed.tokens["ops"], since=since), "replays in progress")
        # Live streams and stale ones (a resync: no replay) are still admitted.
        live = Stream(feed.sock, feed.tokens["ops"])
        stale = Stream(feed.sock, feed.tokens["ops"], since=f"{feed.epoch}-0")
        assert (live.status, stale.status) == (200, 200)
        assert stale.events(lambda e: True)[0]["reason"] == "too-old"
        live.close()
        stale.close()
        # A replay that ends frees its slot: another uid's subscriber hangs up.
        held[UIDS[1]].pop().close()
        freed = _admitted(lambda: Stream(feed.sock, feed.tokens["ops"], since=since))
        freed.close()
        # And the full uid gets one when one of its own hangs up.
        held[UIDS[0]].pop().close()
        mine = _admitted(
            lambda: Stream(connect_as(UIDS[0], feed.sock, 1)[0], feed.tokens["ops"], since=since)
        )
        # Its replay is whole and in order when it reads.
        got = mine.events(lambda e: e["id"] == feed.last, timeout=30)
        seqs = [parse_id(e["id"]) for e in got]
        assert [s[1] for s in seqs if s] == list(
            range(int(since.split("-")[1]) + 1, int(feed.last.split("-")[1]) + 1)
        )
        mine.close()
    finally:
        for streams in held.values():
            for s in streams:
                s.close()
        for left in conns.values():
            for c in left:
                c.close()
