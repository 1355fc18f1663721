"""The change feed with the REAL daemon on its real socket (docs/daemon.md "The change feed")
and the host-side client library (item 3).

- Producers: kbd's own writes through the API and through the CLI (a separate
  process appending to the shared log) give session, note and manifest events;
  a command that writes notes/ under the real sandbox gives ``note.written``.
- Delivery: ``id:`` on every event, only the documented fields (docs/daemon.md "The change feed"; no content),
  filtered when delivered: a reader removed from a source's audience stops
  receiving its events, live and in replays.
- Continuity: ``Last-Event-ID`` (or ``since``) resumes with exactly the missed
  events in order; ``resync`` for an unknown epoch, a slow subscriber whose
  queue overflowed, and a daemon restart.
- ``kbd events --json --since`` prints exactly the SSE data; no daemon → 69.
- ``kbd.client``: sessions, env, typed errors, and an event iterator that
  resumes across a daemon restart.

SSE is read from a raw socket (HTTP/1.1, chunked) so a test controls exactly
when it reads: the slow subscriber simply stops reading.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kbd.client import Client
from kbd.client.library import parse_sse
from kbd.core.events import EVENT_FIELDS, parse_id
from kbd.errors import InvalidInput, NotFound, SessionClosed, Unauthenticated, Unavailable
from kbd.service.changefeed import QUEUE_SIZE
from kbd.state.events import EventLog
from tests.helpers import PRINCIPALS, KbRoot
from tests.integration.daemon import Daemon, issue_tokens, serving, start
from tests.waiting import wait_for

TIMEOUT = 15.0
TEAM = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}


class Sse:
    """One ``GET /v1/events`` over a raw socket: the frames as they arrive."""

    def __init__(
        self,
        sock: Path,
        token: str,
        *,
        last_id: str | None = None,
        since: str | None = None,
        follow: bool = True,
    ) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(str(sock))
        self.s.settimeout(TIMEOUT)
        query = f"follow={'true' if follow else 'false'}" + (f"&since={since}" if since else "")
        head = f"GET /v1/events?{query} HTTP/1.1\r\nHost: kbd\r\nAuthorization: Bearer {token}\r\n"
        if last_id is not None:
            head += f"Last-Event-ID: {last_id}\r\n"
        self.s.sendall((head + "\r\n").encode())
        self.raw = b""
        self.body = b""
        self.ended = False
        while b"\r\n\r\n" not in self.raw:
            self._recv()
        header, self.raw = self.raw.split(b"\r\n\r\n", 1)
        self.status = int(header.split(b" ", 2)[1])
        self.headers = header.decode()
        self.frames: deque[str] = deque()
        self.all_frames: list[str] = []

    def error(self) -> dict[str, Any]:
        """The error envelope of a refused request (a plain body with a content-length)."""
        length = next(
            int(h.split(":", 1)[1])
            for h in self.headers.lower().split("\r\n")
            if h.startswith("content-length:")
        )
        while len(self.raw) < length:
            self._recv()
        body: dict[str, Any] = json.loads(self.raw[:length])["error"]
        return body

    def _recv(self) -> None:
        data = self.s.recv(65536)
        if not data:
            self.ended = True
            raise EOFError
        self.raw += data

    def _dechunk(self) -> None:
        while True:
            line_end = self.raw.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self.raw[:line_end], 16)
            if size == 0:
                self.ended = True
                self.raw = b""
                return
            if len(self.raw) < line_end + 2 + size + 2:
                return
            self.body += self.raw[line_end + 2 : line_end + 2 + size]
            self.raw = self.raw[line_end + 2 + size + 2 :]

    def _split(self) -> None:
        while b"\n\n" in self.body:
            frame, self.body = self.body.split(b"\n\n", 1)
            self.frames.append(frame.decode())
            self.all_frames.append(frame.decode())

    def frame(self, timeout: float = TIMEOUT) -> str | None:
        """The next frame (comments included), or None at the end of the stream."""
        deadline = time.monotonic() + timeout
        while not self.frames:
            self._dechunk()
            self._split()
            if self.frames:
                break
            if self.ended:
                return None
            self.s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                self._recv()
            except EOFError:
                return None
        return self.frames.popleft()

    def event(self, timeout: float = TIMEOUT) -> dict[str, Any] | None:
        """The next event (comments skipped), checked for the frame's shape; None at the end."""
        while True:
            frame = self.frame(timeout)
            if frame is None:
                return None
            events = list(parse_sse(iter([*frame.split("\n"), ""])))
            if not events:
                continue  # a comment: the opening line or a ping
            (eid, etype, data) = events[0]
            event: dict[str, Any] = json.loads(data)
            assert frame.startswith(f"id: {event['id']}\nevent: {event['type']}\ndata: "), frame
            assert eid == event["id"] and etype == event["type"]
            assert set(event) == {"id", "type", "at", *EVENT_FIELDS[event["type"]]}, event
            return event

    def rest(self, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """Every event until the stream ends (a finite replay)."""
        out = []
        while (e := self.event(timeout)) is not None:
            out.append(e)
        return out

    def skim_past(self, target: tuple[str, int], timeout: float) -> None:
        """Read raw bytes, parsing no frame, until an event id at or past ``target``
        went by. As fast as the daemon writes: a reader parsing every frame can, on
        a loaded host, fall behind the daemon for longer than its write-stall
        timeout. (A chunk boundary may split one ``id:`` line; a later id matches.)
        The stream is spent afterwards."""
        deadline = time.monotonic() + timeout
        data, self.raw = self.raw, b""
        while True:
            for m in re.finditer(rb"\nid: ([0-9A-Za-z_-]+)\n", data):
                p = parse_id(m.group(1).decode())
                if p is not None and p[0] == target[0] and p[1] >= target[1]:
                    return
            data = data[-200:]
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no event at or past {target} within {timeout} s"
            self.s.settimeout(remaining)
            chunk = self.s.recv(1 << 20)
            assert chunk, f"the stream ended before an event at or past {target}"
            data += chunk

    def until(self, pred: Any, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """Events up to and including the first for which ``pred`` holds."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            e = self.event(max(0.01, deadline - time.monotonic()))
            assert e is not None, f"stream ended or timed out; got {out}"
            out.append(e)
            if pred(e):
                return out

    def close(self) -> None:
        self.s.close()


@dataclass
class World:
    kb: KbRoot
    daemon: Daemon
    tokens: dict[str, str]
    streams: list[Sse] = field(default_factory=list)
    clients: dict[str, Client] = field(default_factory=dict)

    def sse(self, pid: str, **kw: Any) -> Sse:
        s = Sse(self.daemon.sock, self.tokens[pid], **kw)
        assert s.status == 200, (s.status, s.raw)
        self.streams.append(s)
        return s

    def client(self, pid: str) -> Client:
        """One client per principal, closed with the world."""
        if pid not in self.clients:
            self.clients[pid] = Client(self.daemon.sock, token=self.tokens[pid])
        return self.clients[pid]

    def mark(self) -> str:
        """The id of the newest event now (a replay starting point): a finite replay's last event."""
        sse = Sse(self.daemon.sock, self.tokens["ops"], follow=False)
        try:
            events = sse.rest()
        finally:
            sse.close()
        return str(events[-1]["id"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("feed")
    kb = KbRoot.create(base / "root")
    tokens = issue_tokens(kb.root, [str(p["id"]) for p in PRINCIPALS])
    with serving(kb.root, home=base / "home") as daemon:
        w = World(kb, daemon, tokens)
        yield w
        for s in w.streams:
            s.close()
        for c in w.clients.values():
            c.close()


_prefixes = itertools.count()


def pair(world: World) -> tuple[str, str]:
    """A source (alice owns, carol edits, bob reads) and a consumer attaching it, unique to the test."""
    p = f"f{next(_prefixes):03d}-"
    world.kb.workflow(f"{p}src", access=TEAM)
    world.kb.workflow(f"{p}con", access=TEAM, sources=[{"workflow_id": f"{p}src", "alias": "rts"}])
    c = world.client("ops")

    def seen() -> bool:
        try:
            c.request("GET", f"/v1/workflows/{p}con")
            c.request("GET", f"/v1/workflows/{p}src")
        except NotFound:
            return False
        return True

    # The daemon sees folders made behind its back at its next sweep (≤ 1 s).
    wait_for(seen, 10, f"the daemon to see {p}src and {p}con")
    return f"{p}src", f"{p}con"


def open_api(world: World, pid: str, wid: str, kind: str = "builder") -> str:
    return str(world.client(pid).open_session(wid, kind=kind)["session_id"])


# -- producers and delivery -------------------------------------------------------------------


def test_kbd_writes_through_api_and_cli_are_delivered_with_ids(world: World) -> None:
    src, con = pair(world)
    sub = world.sse("alice")
    assert sub.frame() == ": kbd events"
    alice = world.client("alice")
    sid = open_api(world, "alice", con)
    r = world.kb.cli("session", "open", con, "--kind", "builder", "--as", "alice", "--json")
    assert r.code == 0, r.err
    cli_sid = r.json()["session_id"]
    alice.close_session(sid)
    alice.request("DELETE", f"/v1/workflows/{con}/sources/rts")
    alice.request("POST", f"/v1/workflows/{src}/writers", json={"workflow_id": con})
    got = sub.until(lambda e: e["type"] == "writers.changed")
    # The detach changes the plan of the CLI's open builder session: whether its
    # session.plan_changed comes here depends on whether the daemon had read the
    # CLI's session.opened from the shared log by then (a loaded host: not
    # always). Pushed plan changes are tested in test_live.py.
    mine = [
        (e["type"], e.get("workflow_id"), e.get("session_id"))
        for e in got
        if e["type"] != "session.plan_changed"
    ]
    assert mine == [
        ("session.opened", con, sid),
        ("session.opened", con, cli_sid),  # appended by the CLI process, delivered by the daemon
        ("session.closed", con, sid),
        ("workflow.changed", con, None),
        ("sources.changed", con, None),
        ("workflow.changed", src, None),
        ("writers.changed", src, None),
    ]
    seqs = [parse_id(e["id"]) for e in got]
    assert all(s is not None for s in seqs)
    assert [s[1] for s in seqs if s] == sorted({s[1] for s in seqs if s}), "ids strictly increase"


def test_a_note_written_through_the_api_is_a_content_free_notice(world: World) -> None:
    src, con = pair(world)
    alice = world.client("alice")
    alice.request("DELETE", f"/v1/workflows/{con}/sources/rts")
    alice.request(
        "POST", f"/v1/workflows/{con}/sources", json={"workflow_id": src, "alias": "rts", "access": "write"}
    )
    alice.request("POST", f"/v1/workflows/{src}/writers", json={"workflow_id": con})
    sid = str(alice.open_session(con, kind="execution", kb_access="read-write")["session_id"])
    sub = world.sse("bob")  # a reader of the source
    alice.request(
        "POST", f"/v1/sessions/{sid}/notes", json={"alias": "rts", "path": "d/x.md", "content": "SECRET-BODY"}
    )
    got = sub.until(lambda e: e["type"] == "note.written")
    assert (
        got[-1]["workflow_id"] == src
        and got[-1]["relpath"] == "notes/d/x.md"
        and got[-1]["by_workflow"] == con
    )
    assert "SECRET-BODY" not in "".join(sub.all_frames)


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_command_writing_notes_under_the_sandbox_gives_note_written(world: World) -> None:
    src, con = pair(world)
    alice = world.client("alice")
    alice.request("DELETE", f"/v1/workflows/{con}/sources/rts")
    alice.request(
        "POST", f"/v1/workflows/{con}/sources", json={"workflow_id": src, "alias": "rts", "access": "write"}
    )
    alice.request("POST", f"/v1/workflows/{src}/writers", json={"workflow_id": con})
    r = world.kb.cli(
        "session", "open", con, "--kind", "execution", "--kb-access", "read-write", "--as", "alice", "--json"
    )
    assert r.code == 0, r.err
    sid = r.json()["session_id"]
    sub = world.sse("bob")
    r = world.kb.cli("exec", sid, "--", "sh", "-c", 'echo body-text > "$WORKFLOW_KB_RTS/notes/by-shell.md"')
    assert r.code == 0, r.err
    got = sub.until(lambda e: e["type"] == "note.written")
    assert (got[-1]["workflow_id"], got[-1]["relpath"], got[-1]["by_workflow"]) == (
        src,
        "notes/by-shell.md",
        con,
    )


def test_a_reader_removed_from_the_audience_stops_receiving_its_events_replays_included(world: World) -> None:
    src, _ = pair(world)
    other, _ = pair(world)
    start = world.mark()
    bob = world.sse("bob")  # live
    first = open_api(world, "alice", src)
    assert bob.until(lambda e: e["type"] == "session.opened")[-1]["session_id"] == first
    # alice removes bob from the source's readers by hand (no event of its own without the watcher)
    path = world.kb.workflows / src
    world.kb.edit(path, access={"owners": ["alice"], "editors": ["carol"], "readers": []})
    hidden = open_api(world, "alice", src)
    seen = open_api(world, "alice", other)
    got = bob.until(lambda e: e.get("session_id") == seen)
    assert hidden not in {e.get("session_id") for e in got}, got
    # A replay from before the first event: the source's events are now hidden, both of them.
    replay = world.sse("bob", last_id=start, follow=False).rest()
    ids = {e.get("session_id") for e in replay}
    assert seen in ids and first not in ids and hidden not in ids, replay
    # The owner still sees both; an outsider never saw any.
    owner = {e.get("session_id") for e in world.sse("alice", last_id=start, follow=False).rest()}
    assert {first, hidden, seen} <= owner
    outsider = {e.get("session_id") for e in world.sse("dave", last_id=start, follow=False).rest()}
    assert not {first, hidden, seen} & outsider


def test_last_event_id_resumes_with_exactly_the_missed_events_in_order(world: World) -> None:
    _, con = pair(world)
    sub = world.sse("ops")
    open_api(world, "alice", con)
    seen = sub.until(lambda e: e["type"] == "session.opened")[-1]["id"]
    sub.close()
    missed = [open_api(world, "alice", con) for _ in range(3)]
    r = world.kb.cli("session", "open", con, "--kind", "builder", "--as", "alice", "--json")
    missed.append(r.json()["session_id"])
    missed.append(open_api(world, "alice", con))
    # follow=false: the replay ends after the last event; header and query give the same answer.
    by_header = world.sse("ops", last_id=seen, follow=False).rest()
    by_query = world.sse("ops", since=seen, follow=False).rest()
    assert by_header == by_query
    assert [e["session_id"] for e in by_header] == missed
    seqs = [parse_id(e["id"]) for e in by_header]
    first = parse_id(seen)
    assert first is not None
    assert [s[1] for s in seqs if s] == list(range(first[1] + 1, first[1] + 1 + len(missed)))
    # The header wins over ?since=.
    wins = world.sse("ops", last_id=by_header[2]["id"], since=seen, follow=False).rest()
    assert [e["session_id"] for e in wins] == missed[3:]
    # Following from the id: the same events, then live ones.
    live = world.sse("ops", last_id=seen)
    assert [e["session_id"] for e in live.until(lambda e: e.get("session_id") == missed[-1])] == missed
    after = open_api(world, "alice", con)
    assert live.until(lambda e: e["type"] == "session.opened")[-1]["session_id"] == after


def test_an_id_of_another_epoch_resyncs_and_a_malformed_one_is_refused(world: World) -> None:
    sub = world.sse("bob", last_id="0badc0de-5", follow=False)
    got = sub.rest()
    assert [e["type"] for e in got] == ["resync"] and got[0]["reason"] == "unknown-epoch"
    assert parse_id(got[0]["id"]) is not None and not got[0]["id"].startswith("0badc0de-")
    bad = Sse(world.daemon.sock, world.tokens["bob"], last_id="not-an-id")
    assert bad.status == 400
    err = bad.error()
    assert err["code"] == "invalid-input" and err["message"].startswith(
        "Last-Event-ID must be an event id"
    ), err
    bad.close()
    nobody = Sse(world.daemon.sock, "kbd_nope")
    assert nobody.status == 401 and nobody.error()["code"] == "unauthenticated"
    nobody.close()


def test_a_slow_subscriber_whose_queue_overflows_gets_resync_then_continues(world: World) -> None:
    from concurrent.futures import ThreadPoolExecutor

    wid = pair(world)[0]
    slow = world.sse("ops")
    assert slow.frame() == ": kbd events"
    fast = world.sse("ops")
    # Another process appends a burst (as CLI processes do): far more than the
    # queue (1024) plus the socket's buffers hold while `slow` does not read.
    n = 8000
    with EventLog(world.kb.root / "state", sync_interval=0) as log, ThreadPoolExecutor(2) as pool:
        before = parse_id(log.last_id)
        assert before is not None
        epoch, seq0 = before
        # `slow` has overflowed once the daemon has pushed more than its queue plus
        # what the socket and the transport buffer hold (< 300 KB, at 100+ bytes an
        # event: < 3,000 events). `fast`, skimmed without parsing from before the
        # burst, shows how far the daemon has pushed; `slow` is read from the moment
        # it has overflowed, while the burst may still be written. A subscriber whose
        # writes make no progress for WRITE_STALL_TIMEOUT is closed, so neither may
        # wait for the whole burst: on a loaded host it takes longer than that.
        # (`fast` may overflow too: it waits for any id at or past the target.)
        overflowed = (epoch, seq0 + QUEUE_SIZE + 3500)
        skimmed = pool.submit(fast.skim_past, overflowed, 120)
        burst = pool.submit(log.append_many, [("workflow.changed", wid, {})] * n)
        skimmed.result(timeout=150)
        end = seq0 + n

        def reached_end(e: dict[str, Any]) -> bool:
            p = parse_id(e["id"])
            return p is not None and p[0] == epoch and p[1] >= end

        got = slow.until(reached_end, timeout=120)
        events = burst.result(timeout=120)
    assert parse_id(events[0].id) == (epoch, seq0 + 1), "the burst's ids follow the log's last one"
    assert got[-1]["id"] == events[-1].id
    kinds = [e["type"] for e in got]
    assert "resync" in kinds, "the slow subscriber's queue never overflowed"
    resync = got[kinds.index("resync")]
    assert resync["reason"] == "overflow"
    after = [parse_id(e["id"]) for e in got[kinds.index("resync") + 1 :]]
    seqs = [s[1] for s in after if s]
    assert seqs == sorted(set(seqs)), "after the resync: in order, no repeats"
    assert len(got) < n, "an overflowed queue is dropped, not delivered late"
    # It continues live.
    sid = open_api(world, "alice", wid)
    assert slow.until(lambda e: e["type"] == "session.opened")[-1]["session_id"] == sid


# -- kbd events -------------------------------------------------------------------------------


def test_kbd_events_json_since_prints_exactly_the_sse_data(world: World) -> None:
    _, con = pair(world)
    start = world.mark()
    for _ in range(3):
        open_api(world, "alice", con)
    sse = world.sse("ops", since=start, follow=False)
    sse.rest()
    data = [f.split("\ndata: ", 1)[1] for f in sse.all_frames if not f.startswith(":")]
    env = {"KBD_TOKEN": world.tokens["ops"], "KBD_SOCKET": str(world.daemon.sock)}
    r = world.kb.cli("events", "--json", "--since", start, env=env)
    assert r.code == 0, r.err
    assert r.out.splitlines() == data and len(data) >= 3
    text = world.kb.cli("events", "--since", start, env=env)
    assert text.code == 0 and len(text.out.splitlines()) == len(data)
    assert all(" session.opened session_id=" in line for line in text.out.splitlines())


def test_kbd_events_follow_prints_new_events_and_stops_on_sigterm(world: World) -> None:
    import select
    import signal
    import subprocess
    import sys

    _, con = pair(world)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    env.update(KBD_TOKEN=world.tokens["alice"], KBD_SOCKET=str(world.daemon.sock))
    proc = subprocess.Popen([sys.executable, "-m", "kbd", "--root", str(world.kb.root), "events", "--follow", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        while True:  # until the follower is connected and prints what happens
            open_api(world, "alice", con)
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                event = json.loads(proc.stdout.readline())
                assert event["type"] == "session.opened" and event["workflow_id"] == con, event
                break
            assert time.monotonic() < deadline, "kbd events --follow printed nothing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        assert proc.stderr is not None and proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_kbd_events_without_a_daemon_is_69_with_a_hint(kb: KbRoot) -> None:
    r = kb.cli("events")
    assert r.code == 69, (r.code, r.err)
    assert r.err.startswith("error[unavailable]: no kbd daemon is reachable at ")
    assert "hint: start one with `kbd serve`" in r.err


# -- restart ------------------------------------------------------------------------------------


def test_restart_resyncs_and_client_events_resume_across_it(kb: KbRoot, tmp_path: Path) -> None:
    kb.workflow("w", access={"owners": ["alice"]})
    tokens = issue_tokens(kb.root, ["alice", "ops"])
    daemon = start(kb.root, home=tmp_path / "home")
    try:
        client = Client(daemon.sock, token=tokens["alice"])
        got: list[dict[str, Any]] = []

        def follow() -> None:
            after_resync = False
            for e in client.events():
                got.append(e)
                after_resync = after_resync or e["type"] == "resync"
                if after_resync and e["type"] == "session.opened":
                    return

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        opened: list[str] = []

        def connected() -> bool:  # each session opened is an event the follower sees once connected
            if got:
                return True
            opened.append(client.open_session("w", kind="builder")["session_id"])
            return False

        wait_for(connected, TIMEOUT, "the follower to be connected (to see a session.opened)")
        daemon.stop()
        # While no daemon runs, the CLI still appends to the shared log.
        r = kb.cli("session", "open", "w", "--kind", "builder", "--as", "alice", "--json")
        assert r.code == 0, r.err
        offline = r.json()["session_id"]
        daemon = start(kb.root, home=tmp_path / "home")
        client2 = Client(daemon.sock, token=tokens["alice"])
        later = client2.open_session("w", kind="builder")["session_id"]
        follower.join(TIMEOUT)
        assert not follower.is_alive()
        types = [(e["type"], e.get("session_id", e.get("reason"))) for e in got]
        assert types[-3:] == [
            ("session.opened", offline),
            ("resync", "restart"),
            ("session.opened", later),
        ], types
        ids = [e["id"] for e in got]
        assert len(set(ids)) == len(ids), "nothing delivered twice across the reconnect"
        assert opened
        client.close()
        client2.close()
        daemon.stop()
    finally:
        if daemon.proc.poll() is None:
            daemon.kill()


# -- the client library ---------------------------------------------------------------------------


def test_client_sessions_env_and_typed_errors(world: World) -> None:
    src, con = pair(world)
    with Client(world.daemon.sock, token=world.tokens["alice"]) as c:
        assert c.whoami()["id"] == "alice"
        plan = c.open_session(con, kind="execution", kb_access="read")
        sid = plan["session_id"]
        assert c.show_session(sid)["generation"] == plan["generation"]
        env = c.env(sid)
        assert env["WORKFLOW_KB_RTS"] == str((world.kb.workflows / src).resolve() / "knowledgebase")
        assert env["WORKFLOW_KB_ACCESS"] == "read"
        assert c.close_session(sid)["closed"] == [sid]
        with pytest.raises(SessionClosed) as closed:
            c.show_session(sid)
        assert closed.value.exit_code == 77 and closed.value.http_status == 410
        with pytest.raises(NotFound) as missing:
            c.open_session("no-such-workflow", kind="builder")
        assert missing.value.code == "workflow-not-found" and missing.value.exit_code == 66
        with pytest.raises(InvalidInput):
            list(c.events(since="garbage", follow=False))
    with Client(world.daemon.sock, token="kbd_wrong") as bad, pytest.raises(Unauthenticated) as unauth:
        bad.whoami()
    assert unauth.value.exit_code == 77 and "unknown token" in unauth.value.message
    with Client(world.daemon.sock.parent / "nothing.sock") as gone, pytest.raises(Unavailable) as unreachable:
        gone.whoami()
    assert unreachable.value.exit_code == 69 and "kbd serve" in unreachable.value.hint


def test_a_principal_disabled_mid_stream_gets_nothing_more(kb: KbRoot, tmp_path: Path) -> None:
    import yaml

    kb.workflow("w", access={"owners": ["alice"], "readers": ["bob"]})
    tokens = issue_tokens(kb.root, ["alice", "bob"])
    with (
        serving(kb.root, home=tmp_path / "home") as daemon,
        Client(daemon.sock, token=tokens["alice"]) as alice,
    ):
        bob = Sse(daemon.sock, tokens["bob"])
        try:
            sid = alice.open_session("w", kind="builder")["session_id"]
            assert bob.until(lambda e: e.get("session_id") == sid)
            path = kb.root / "principals.yaml"
            doc = yaml.safe_load(path.read_text())
            for entry in doc["principals"]:
                if entry["id"] == "bob":
                    entry["disabled"] = True
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            hidden = alice.open_session("w", kind="builder")["session_id"]
            rest = bob.rest()
            assert hidden not in {e.get("session_id") for e in rest} and bob.ended, rest
        finally:
            bob.close()
