"""Change-feed events, the pure half (kbd/core/events.py; docs/daemon.md).

- The allow-list is docs/daemon.md's list, type for type and field for field.
- Nothing off it gets in: an unknown type, a missing or extra field (``text``,
  ``content`` …), or a value its validator refuses is EventRefused; and a
  stored line that breaks the list (a hand edit) is not read back.
- Every accepted event survives the stored line unchanged, on one line.
- Resuming decisions: malformed / other epoch / future ids give Resync; a
  replay is contiguous or it is Resync (``too-old``, ``gap``).
- The fsync batcher calls its sync once per burst, within the interval.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core import events as ev
from kbd.core.events import EventRefused, Replay, Resync, make_event, parse_line, resume_from
from kbd.state.events import _Syncer

# docs/daemon.md "The change feed", copied by hand so a change on either side is seen.
DESIGN_TYPES = {
    "workflow.changed": {"workflow_id"},
    "sources.changed": {"workflow_id"},
    "writers.changed": {"workflow_id"},
    "session.opened": {"session_id", "workflow_id"},
    "session.closed": {"session_id", "workflow_id"},
    "session.plan_changed": {"session_id", "generation"},
    "command.stale": {"session_id", "pid", "generation"},
    "command.terminated": {"session_id", "pid", "generation"},
    "note.written": {"workflow_id", "relpath", "by_workflow"},
    # docs/access.md "Access requests": the source is the event's workflow; the consumer must be visible too.
    "request.opened": {"workflow_id", "consumer", "request_id"},
    "request.decided": {"workflow_id", "consumer", "request_id"},
    "resync": {"reason"},  # docs/daemon.md "The change feed": resync carries a reason token
}
EPOCH = "0badc0de"
GOOD_FIELDS: dict[str, dict[str, Any]] = {
    "workflow.changed": {},
    "sources.changed": {},
    "writers.changed": {},
    "session.opened": {"session_id": "s_0123456789abcdef0123"},
    "session.closed": {"session_id": "s_0123456789abcdef0123"},
    "session.plan_changed": {"session_id": "s_1", "generation": 3},
    "command.stale": {"session_id": "s_1", "pid": 4242, "generation": 2},
    "command.terminated": {"session_id": "s_1", "pid": 4242, "generation": 2},
    "note.written": {"relpath": "notes/design/x.md", "by_workflow": "wf_con"},
    "request.opened": {"consumer": "wf_con", "request_id": 1},
    "request.decided": {"consumer": "wf_con", "request_id": 7},
    "resync": {"reason": "restart"},
}


def _event(event_type: str, *, seq: int = 1, workflow_id: str | None = "wf_a", **fields: Any) -> ev.Event:
    wf = None if event_type == "resync" else workflow_id
    return make_event(
        event_type, epoch=EPOCH, seq=seq, ns=1_764_000_000_123_456_789, workflow_id=wf, fields=fields
    )


def test_the_allow_list_is_designs() -> None:
    assert {t: set(f) for t, f in ev.EVENT_FIELDS.items()} == DESIGN_TYPES
    assert set(GOOD_FIELDS) == set(DESIGN_TYPES)


@pytest.mark.parametrize("event_type", sorted(DESIGN_TYPES))
def test_each_type_round_trips_through_its_stored_line(event_type: str) -> None:
    event = _event(event_type, **GOOD_FIELDS[event_type])
    line = event.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_line(line.rstrip(b"\n")) == event
    public = event.public()
    assert set(public) == {"id", "type", "at"} | DESIGN_TYPES[event_type]
    assert public["id"] == f"{EPOCH}-1" and public["at"] == "2025-11-24T16:00:00.123Z"
    stored = json.loads(line)
    assert stored["_wf"] == (None if event_type == "resync" else "wf_a")
    assert "_wf" not in public


@pytest.mark.parametrize(
    ("event_type", "workflow_id", "fields", "says"),
    [
        ("file.read", "wf_a", {}, "unknown event type 'file.read'"),
        ("workflow.changed", "wf_a", {"content": "secret"}, "field 'content' is not allowed (fields: none)"),
        ("note.written", "wf_a", {"relpath": "notes/a", "by_workflow": "c", "text": "x"}, "field 'text'"),
        ("note.written", "wf_a", {"relpath": "notes/a"}, "field 'by_workflow' is missing"),
        ("note.written", "wf_a", {"relpath": "../x", "by_workflow": "c"}, "relpath must be a relative path"),
        (
            "note.written",
            "wf_a",
            {"relpath": "/etc/passwd", "by_workflow": "c"},
            "relpath must be a relative",
        ),
        ("note.written", "wf_a", {"relpath": "notes//a", "by_workflow": "c"}, "relpath must be a relative"),
        ("note.written", "wf_a", {"relpath": "notes/a\nb", "by_workflow": "c"}, "control characters"),
        ("note.written", "wf_a", {"relpath": "n/" + "a" * 4094, "by_workflow": "c"}, "at most 4095 bytes"),
        ("note.written", "wf_a", {"relpath": "notes/\udcff", "by_workflow": "c"}, "valid UTF-8"),
        ("note.written", "wf_a", {"relpath": 7, "by_workflow": "c"}, "relpath must be a non-empty string"),
        ("note.written", "wf_a", {"relpath": "n", "by_workflow": "a b"}, "by_workflow must not contain"),
        (
            "command.stale",
            "wf_a",
            {"session_id": "s", "pid": True, "generation": 1},
            "pid must be an integer",
        ),
        ("command.stale", "wf_a", {"session_id": "s", "pid": 0, "generation": 1}, "pid must be between 1"),
        ("command.stale", "wf_a", {"session_id": "s", "pid": 1, "generation": "1"}, "generation must be an"),
        ("session.opened", "wf_a", {"session_id": ""}, "session_id must not be empty"),
        ("session.plan_changed", "wf_a", {"session_id": "s", "generation": -1}, "between 0"),
        ("resync", None, {"reason": "Lost events, see file X"}, "reason must be a short token"),
        ("resync", None, {"reason": "r" * 65}, "reason must be a short token"),
        ("resync", "wf_a", {"reason": "restart"}, "pass workflow_id=None"),
        ("workflow.changed", None, {}, "workflow_id must be a string"),
        ("workflow.changed", "a/b", {}, "workflow_id must not contain '/'"),
    ],
)
def test_off_the_list_is_refused(
    event_type: str, workflow_id: str | None, fields: dict[str, Any], says: str
) -> None:
    with pytest.raises(EventRefused) as exc:
        ev.check_event(event_type, workflow_id, fields)
    assert says in str(exc.value)


values = st.one_of(
    st.text(max_size=80), st.integers(-(2**70), 2**70), st.booleans(), st.none(), st.binary(max_size=8)
)


@given(st.sampled_from(sorted(DESIGN_TYPES)), st.dictionaries(st.text(max_size=12), values, max_size=4))
def test_whatever_is_accepted_is_content_free_and_round_trips(
    event_type: str, fields: dict[str, Any]
) -> None:
    wf = None if event_type == "resync" else "wf_a"
    try:
        event = make_event(event_type, epoch=EPOCH, seq=9, ns=0, workflow_id=wf, fields=fields)
    except EventRefused:
        return
    assert set(fields) <= DESIGN_TYPES[event_type]
    for value in fields.values():  # IDs, numbers, tokens, path names: bounded, one line
        assert isinstance(value, int) or (len(value.encode()) <= 4095 and "\n" not in value)
    assert parse_line(event.line()) == event


@pytest.mark.parametrize(
    "line",
    [
        b'{"id":"0badc0de-1","type":"workflow.changed","at":"2025-11-24T16:00:00.123Z","workflow_id":"w","_wf":"w","body":"x"}',
        b'{"id":"0badc0de-1","type":"workflow.changed","at":"2025-11-24T16:00:00.123Z","workflow_id":"w","_wf":"v"}',
        b'{"id":"0badc0de-1","type":"workflow.changed","at":"yesterday","workflow_id":"w","_wf":"w"}',
        b'{"id":"0badc0de-01","type":"workflow.changed","at":"2025-11-24T16:00:00.123Z","workflow_id":"w","_wf":"w"}',
        b'{"id":"0badc0de-1","type":"file.read","at":"2025-11-24T16:00:00.123Z","_wf":"w"}',
        b'{"id":"0badc0de-1","type":"workflow.changed","at":"2025-11-24T16:00:00.123Z","workflow_id":"w","_wf"',
        b'["not", "an", "object"]',
        b'{"_epoch":"0badc0de","_base":0}',
        b"\xff\xfe",
        b"",
    ],
)
def test_a_line_off_the_list_is_not_read_back(line: bytes) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize(
    ("last_id", "expect"),
    [
        ("0badc0de-5", 6),
        ("0badc0de-0", 1),
        ("0badc0de-9", 10),
        ("0badc0de-10", Resync("future")),
        ("deadbeef-5", Resync("unknown-epoch")),
        ("0badc0de-05", Resync("malformed-id")),
        ("0BADC0DE-5", Resync("malformed-id")),
        ("0badc0de-", Resync("malformed-id")),
        ("0badc0de-5 ", Resync("malformed-id")),
        ("0badc0de--5", Resync("malformed-id")),
        ("0badc0de-99999999999999999999", Resync("malformed-id")),
        ("", Resync("malformed-id")),
        ("garbage", Resync("malformed-id")),
    ],
)
def test_resume_decisions(last_id: str, expect: int | Resync) -> None:
    assert resume_from(last_id, epoch=EPOCH, last_seq=9) == expect


def test_a_replay_is_contiguous_or_it_is_a_resync() -> None:
    run = [_event("workflow.changed", seq=s) for s in (3, 4, 5, 6)]
    assert ev.contiguous_from(run, 4, 6) == Replay(tuple(run[1:]))
    assert ev.contiguous_from(run, 3, 6) == Replay(tuple(run))
    assert ev.contiguous_from(run, 7, 6) == Replay(())
    assert ev.contiguous_from(run, 2, 6) == Resync("too-old")
    assert ev.contiguous_from([], 2, 6) == Resync("too-old")
    assert ev.contiguous_from([run[0], run[2], run[3]], 3, 6) == Resync("gap")
    assert ev.contiguous_from([run[0], run[2], run[3]], 4, 6) == Resync("gap")
    assert ev.contiguous_from(run[:3], 3, 6) == Resync("gap")  # the newest is missing


def test_header_lines() -> None:
    assert ev.parse_header(ev.header_line(EPOCH, 41).rstrip(b"\n")) == (EPOCH, 41)
    for bad in (b'{"_epoch":"xyz","_base":0}', b'{"_epoch":"0badc0de","_base":-1}', b'{"_epoch":"0badc0de"}'):
        assert ev.parse_header(bad) is None


def test_fsync_batching_is_bounded(tmp_path: Path) -> None:
    """A burst of writes costs one sync, made within the interval (plus
    scheduling slack), and a later write is synced again."""
    calls: list[float] = []
    synced = threading.Event()

    def sync() -> None:
        calls.append(time.monotonic())
        synced.set()

    syncer = _Syncer(0.1, sync)
    try:
        start = time.monotonic()
        for _ in range(100):
            syncer.mark()
        assert synced.wait(5)
        assert len(calls) == 1 and 0.09 <= calls[0] - start < 2.0
        synced.clear()
        syncer.mark()
        assert synced.wait(5) and len(calls) == 2
    finally:
        syncer.stop()


def test_sse_frames_and_the_per_subscriber_resync() -> None:
    event = _event("note.written", seq=7, relpath="notes/ü x.md", by_workflow="wf_con")
    frame = event.sse().decode()
    assert frame.startswith(f"id: {EPOCH}-7\nevent: note.written\ndata: {{")
    assert frame.endswith("\n\n") and frame.count("\n") == 4
    assert json.loads(frame.split("data: ", 1)[1]) == event.public()
    resync = ev.resync_event(f"{EPOCH}-7", "overflow", ns=0)
    assert resync.public() == {
        "id": f"{EPOCH}-7",
        "type": "resync",
        "at": "1970-01-01T00:00:00.000Z",
        "reason": "overflow",
    }
    assert {event, resync} and hash(event) == hash(event.id)
    with pytest.raises(EventRefused, match="needs a log id"):
        ev.resync_event("", "overflow", ns=0)
    with pytest.raises(EventRefused, match="reason must be a short token"):
        ev.resync_event(f"{EPOCH}-7", "queue overflowed", ns=0)


def test_what_a_stream_takes_and_when_it_is_refused() -> None:
    """docs/daemon.md "The change feed": a backlog beyond one chunk is a replay; a uid's
    streams, its share of the replays and all replays are each capped, and a
    stream with no replay is refused only by its uid's stream cap."""
    assert not ev.is_replay(0) and not ev.is_replay(ev.CHUNK) and ev.is_replay(ev.CHUNK + 1)
    caps = ev.StreamCaps(streams_per_uid=3, replays=4, replays_per_uid=2)
    # The figures of docs/daemon.md "The change feed": a uid holds at most a quarter of the replays, as of the connections.
    assert ev.StreamCaps(streams_per_uid=64, replays=16, replays_per_uid=4) == ev.STREAM_CAPS

    def refusal(uid_streams: int, replay: bool, replays: int, uid_replays: int) -> str | None:
        got = ev.stream_refusal(
            caps, uid_streams=uid_streams, replay=replay, replays=replays, uid_replays=uid_replays
        )
        return None if got is None else got.message

    assert refusal(2, True, 3, 1) is None
    assert refusal(3, False, 0, 0) == "this client already has 3 event streams open"
    assert refusal(3, True, 0, 0) == "this client already has 3 event streams open"
    assert refusal(2, True, 1, 2) == "2 replays from this client are already in progress"
    assert refusal(2, True, 4, 1) == "4 replays in progress already"
    # Without a replay, the replay caps do not apply.
    assert refusal(2, False, 4, 2) is None
    full = ev.stream_refusal(caps, uid_streams=0, replay=True, replays=4, uid_replays=0)
    assert full is not None and "Retry-After" in full.hint
