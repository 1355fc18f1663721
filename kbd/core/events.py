"""Change-feed events (docs/daemon.md): the allow-list, ids, the stored line. Pure.

An event is a content-free notice that something changed: ``{"id", "type",
"at", ...}`` with exactly the fields its type lists in :data:`EVENT_FIELDS`,
each checked by a validator that admits IDs, numbers, a short reason token or a
path name, never free text. That allow-list is the guarantee that no event (in
the log, a replay or a stream) can carry file content: anything else is refused
when it is appended and skipped when it is read back.

Ids are ``"<epoch>-<seq>"``: ``epoch`` is 8 hex digits drawn when an event log
is created, ``seq`` counts from 1 within it. Two ids of one epoch compare by
``seq``; an id of another epoch says nothing about order, which is why a
subscriber presenting one gets :class:`Resync`.

The stored line adds ``_wf``: the workflow an event is about, which decides who
may see it (``note.written``: the source; ``session.*`` and ``command.*``: the
session's workflow; ``resync``: none, everyone sees it). It is stripped from
what subscribers receive (:meth:`Event.public`).

Serving subscribers: what counts as a replay and when one more stream is
refused (:class:`StreamCaps`, :func:`stream_refusal`; docs/daemon.md "The change feed").
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kbd.core.identifiers import id_problem

if TYPE_CHECKING:  # the type only
    from kbd.core.manifest import Manifest

FieldValue = str | int

#: type -> its fields, in the order they are shown. ``workflow_id`` among them
#: is the event's own ``workflow_id`` argument; the others are keyword fields.
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "workflow.changed": ("workflow_id",),
    "sources.changed": ("workflow_id",),
    "writers.changed": ("workflow_id",),
    "session.opened": ("session_id", "workflow_id"),
    "session.closed": ("session_id", "workflow_id"),
    "session.plan_changed": ("session_id", "generation"),
    "command.stale": ("session_id", "pid", "generation"),
    "command.terminated": ("session_id", "pid", "generation"),
    "note.written": ("workflow_id", "relpath", "by_workflow"),
    # Access requests (docs/access.md "Access requests"): workflow_id is the source; both it and
    # the consumer must be visible to a subscriber (kbd.service.changefeed).
    "request.opened": ("workflow_id", "consumer", "request_id"),
    "request.decided": ("workflow_id", "consumer", "request_id"),
    "resync": ("reason",),
}
#: The one type that concerns no workflow: continuity was lost, everyone reloads.
RESYNC = "resync"

_REASON = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
MAX_RELPATH_BYTES = 4095
# At most 18 digits, so that every id the pattern admits (the API's schema says the same:
# kbd.daemon.routes.EVENT_ID) is one kbd can hold; a million events a second would take
# 31,000 years to reach it.
MAX_SEQ = 10**18 - 1
_EPOCH = re.compile(r"[0-9a-f]{8}")
_ID = re.compile(r"([0-9a-f]{8})-(0|[1-9][0-9]{0,17})")
_AT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z")


class EventRefused(ValueError):
    """An event outside the allow-list: an unknown type, a missing or extra
    field, or a value its validator refuses. A bug in the producer, never
    user input, so not a :class:`kbd.errors.KbdError`."""


def _id_value(value: object) -> str | None:
    return id_problem(value)


def _count(value: object, *, low: int) -> str | None:
    if type(value) is not int:  # bool is an int subclass, and never a pid
        return f"must be an integer, got {type(value).__name__}"
    if not low <= value <= MAX_SEQ:
        return f"must be between {low} and {MAX_SEQ}, got {value}"
    return None


def _reason(value: object) -> str | None:
    if not isinstance(value, str) or not _REASON.fullmatch(value):
        return "must be a short token (a-z, 0-9, '_', '.', '-'; at most 64, starting with a letter)"
    return None


def _relpath(value: object) -> str | None:
    """A path name beneath a knowledge base: relative, plain, bounded. Never
    content: a name is what the audit log already records."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "must be valid UTF-8"
    if size > MAX_RELPATH_BYTES:
        return f"must be at most {MAX_RELPATH_BYTES} bytes, got {size}"
    if value.startswith("/") or any(part in ("", ".", "..") for part in value.split("/")):
        return "must be a relative path without empty, '.' or '..' parts"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        return "must not contain control characters"
    return None


_VALIDATORS: dict[str, Callable[[object], str | None]] = {
    "workflow_id": _id_value,
    "session_id": _id_value,
    "by_workflow": _id_value,
    "consumer": _id_value,
    "request_id": lambda v: _count(v, low=1),
    "generation": lambda v: _count(v, low=0),
    "pid": lambda v: _count(v, low=1),
    "relpath": _relpath,
    "reason": _reason,
}


def check_event(event_type: str, workflow_id: str | None, fields: Mapping[str, object]) -> None:
    """Raise EventRefused unless (type, workflow, fields) is on the allow-list."""
    wanted = EVENT_FIELDS.get(event_type)
    if wanted is None:
        raise EventRefused(f"unknown event type {event_type!r}; known: {', '.join(EVENT_FIELDS)}")
    if event_type == RESYNC:
        if workflow_id is not None:
            raise EventRefused("resync concerns every workflow: pass workflow_id=None")
    elif (problem := id_problem(workflow_id)) is not None:
        raise EventRefused(f"{event_type}: workflow_id {problem}")
    keyword = tuple(f for f in wanted if f != "workflow_id")
    for name in fields:
        if name not in keyword:
            allowed = ", ".join(keyword) or "none"
            raise EventRefused(f"{event_type}: field {name!r} is not allowed (fields: {allowed})")
    for name in keyword:
        if name not in fields:
            raise EventRefused(f"{event_type}: field {name!r} is missing")
        if (problem := _VALIDATORS[name](fields[name])) is not None:
            raise EventRefused(f"{event_type}: {name} {problem}")


# -- ids --------------------------------------------------------------------------------------------


def format_id(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq}"


def parse_id(text: object) -> tuple[str, int] | None:
    """(epoch, seq) of a well-formed id, else None. ``<epoch>-0`` is well formed:
    "nothing seen yet of this epoch"."""
    if not isinstance(text, str) or (m := _ID.fullmatch(text)) is None:
        return None
    seq = int(m.group(2))
    return (m.group(1), seq) if seq <= MAX_SEQ else None


def is_epoch(text: object) -> bool:
    return isinstance(text, str) and _EPOCH.fullmatch(text) is not None


def format_at(ns: int) -> str:
    """UTC, millisecond precision: ``2026-12-01T16:49:11.123Z``."""
    secs, rest = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{rest // 1_000_000:03d}Z"


# -- events ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    at: str
    workflow_id: str | None  # who may see it (stored as ``_wf``); None for resync
    fields: Mapping[str, FieldValue] = field(default_factory=dict)

    @property
    def seq(self) -> int:
        parsed = parse_id(self.id)
        assert parsed is not None  # built by make_event or parse_line, both check the id
        return parsed[1]

    def public(self) -> dict[str, Any]:
        """What a subscriber receives: ``{"id", "type", "at", <the type's fields>}``."""
        out: dict[str, Any] = {"id": self.id, "type": self.type, "at": self.at}
        for name in EVENT_FIELDS[self.type]:
            out[name] = self.workflow_id if name == "workflow_id" else self.fields[name]
        return out

    def __hash__(self) -> int:  # ``fields`` is a dict; an id names one event
        return hash(self.id)

    def sse(self) -> bytes:
        """One Server-Sent Events frame: ``id:``, ``event:`` and one ``data:``
        line (JSON never holds a raw newline, and no field may hold a control
        character), ended by a blank line."""
        data = json.dumps(self.public(), ensure_ascii=False, separators=(",", ":"))
        return f"id: {self.id}\nevent: {self.type}\ndata: {data}\n\n".encode()

    def line(self) -> bytes:
        """The stored JSON line (public fields plus ``_wf``), newline-terminated."""
        record = {**self.public(), "_wf": self.workflow_id}
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def make_event(
    event_type: str, *, epoch: str, seq: int, ns: int, workflow_id: str | None, fields: Mapping[str, object]
) -> Event:
    """A checked event (raises EventRefused; see :func:`check_event`)."""
    check_event(event_type, workflow_id, fields)
    if not is_epoch(epoch) or not 1 <= seq <= MAX_SEQ:
        raise EventRefused(f"bad id parts: epoch {epoch!r}, seq {seq}")
    values = {k: v for k, v in fields.items() if isinstance(v, str | int)}
    return Event(format_id(epoch, seq), event_type, format_at(ns), workflow_id, values)


def resync_event(last_id: str, reason: str, *, ns: int) -> Event:
    """The ``resync`` one subscriber gets when :meth:`since` answers Resync or
    its queue overflowed: not appended to the log (no one else lost anything),
    and carrying the log's current ``last_id``, so a subscriber that reloads
    its state and reconnects with it as ``Last-Event-ID`` misses nothing."""
    if parse_id(last_id) is None:
        raise EventRefused(f"resync_event needs a log id, got {last_id!r}")
    check_event(RESYNC, None, {"reason": reason})
    return Event(last_id, RESYNC, format_at(ns), None, {"reason": reason})


def parse_line(line: bytes) -> Event | None:
    """The event a stored line holds, or None for a torn, foreign or header line,
    or one that breaks the allow-list (a hand edit cannot smuggle content into
    a replay)."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        return None
    if not isinstance(record, dict):
        return None
    event_type, event_id, at = record.pop("type", None), record.pop("id", None), record.pop("at", None)
    workflow_id = record.pop("_wf", None)
    if not isinstance(event_type, str) or event_type not in EVENT_FIELDS or parse_id(event_id) is None:
        return None
    if (
        not isinstance(at, str)
        or not _AT.fullmatch(at)
        or (workflow_id is not None and type(workflow_id) is not str)
    ):
        return None
    if "workflow_id" in EVENT_FIELDS[event_type] and record.pop("workflow_id", None) != workflow_id:
        return None
    try:
        check_event(event_type, workflow_id, record)
    except EventRefused:
        return None
    assert isinstance(event_id, str)
    return Event(event_id, event_type, at, workflow_id, record)


# -- the header line of each log file ----------------------------------------------------------------


def header_line(epoch: str, base: int) -> bytes:
    """First line of a log file: its epoch, and ``base``, the last seq issued
    before the file was started (0 for a new epoch)."""
    return (json.dumps({"_epoch": epoch, "_base": base}, separators=(",", ":")) + "\n").encode("ascii")


def parse_header(line: bytes) -> tuple[str, int] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or set(record) != {"_epoch", "_base"}:
        return None
    epoch, base = record["_epoch"], record["_base"]
    if not is_epoch(epoch) or type(base) is not int or not 0 <= base <= MAX_SEQ:
        return None
    return epoch, base


# -- resuming -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """The events after the subscriber's last id, in order (maybe none)."""

    events: tuple[Event, ...]


@dataclass(frozen=True)
class Resync:
    """Continuity cannot be guaranteed: the subscriber must reload state.
    ``reason``: ``malformed-id``, ``unknown-epoch``, ``future``, ``too-old``, ``gap``."""

    reason: str


def resume_from(last_id: str, *, epoch: str, last_seq: int) -> int | Resync:
    """The first seq a subscriber that saw ``last_id`` still needs, or Resync
    when ``last_id`` cannot be placed in this log (malformed, another epoch,
    beyond what this log has issued). Whether that seq is still held is for the
    caller to check (``too-old``)."""
    parsed = parse_id(last_id)
    if parsed is None:
        return Resync("malformed-id")
    their_epoch, seq = parsed
    if their_epoch != epoch:
        return Resync("unknown-epoch")
    if seq > last_seq:
        return Resync("future")
    return seq + 1


def contiguous_from(events: list[Event], first: int, last: int) -> Replay | Resync:
    """``events`` (in log order, possibly starting earlier) reduced to seqs
    ``first..last``, or Resync when one is missing: ``too-old`` when the log no
    longer reaches back to ``first``, ``gap`` when one in between was lost."""
    if first > last:
        return Replay(())
    wanted = [e for e in events if first <= e.seq <= last]
    if not wanted or wanted[0].seq != first:
        reaches_back = bool(events) and events[0].seq < first
        return Resync("gap" if reaches_back else "too-old")
    for expect, event in enumerate(wanted, start=first):
        if event.seq != expect:
            return Resync("gap")
    if wanted[-1].seq != last:
        return Resync("gap")
    return Replay(tuple(wanted))


# -- serving subscribers ------------------------------------------------------------------------------

#: Events a subscriber is sent in one go (one visibility decision, one write).
#: A backlog of at most this many costs one chunk: it is no replay.
CHUNK = 256


@dataclass(frozen=True)
class StreamCaps:
    """How much of the change feed the daemon serves at once (docs/daemon.md "The change feed"): ``GET
    /v1/events`` streams per peer uid, and replays (a
    backlog of more than :data:`CHUNK` events, sent before the live ones) in
    all and per peer uid. A replay is bounded by the daemon's in-memory ring
    (an older ``since`` gets ``resync``), so the caps bound what replays cost
    at once: at most ``replays`` times the ring's events being decided and sent."""

    streams_per_uid: int = 64
    replays: int = 16
    replays_per_uid: int = 4


STREAM_CAPS = StreamCaps()


def is_replay(backlog: int) -> bool:
    """Does a stream whose backlog holds ``backlog`` events take a replay slot?"""
    return backlog > CHUNK


@dataclass(frozen=True)
class StreamRefusal:
    """Why a stream is refused, and what the subscriber can do about it."""

    message: str
    hint: str


def stream_refusal(
    caps: StreamCaps, *, uid_streams: int, replay: bool, replays: int, uid_replays: int
) -> StreamRefusal | None:
    """Why one more stream from a peer uid that has ``uid_streams`` open (and
    ``uid_replays`` of the ``replays`` in progress) is refused, or None to admit
    it. ``replay``: the new stream starts with a replay."""
    if uid_streams >= caps.streams_per_uid:
        return StreamRefusal(
            f"this client already has {caps.streams_per_uid} event streams open",
            "close the event streams you no longer read, then retry",
        )
    wait = "retry after the Retry-After delay, or reload and follow live (no Last-Event-ID)"
    if replay and uid_replays >= caps.replays_per_uid:
        return StreamRefusal(f"{caps.replays_per_uid} replays from this client are already in progress", wait)
    if replay and replays >= caps.replays:
        return StreamRefusal(f"{caps.replays} replays in progress already", wait)
    return None


# -- manifest changes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestFacts:
    """What the change feed compares between two states of one workflow's
    manifest: its bytes (``version``), where it lives, its attachment entries
    and its write grants. Built from a parsed manifest (:func:`manifest_facts`)
    whoever changed the file (kbd, a builder's editor, a restore from backup),
    so the same change always gives the same events."""

    version: str
    folder: str | None
    sources: tuple[tuple[str, str, str, str | None], ...]
    sources_problem: str | None
    writers: tuple[str, ...]


def manifest_facts(m: Manifest, *, folder: str | None = None) -> ManifestFacts:
    return ManifestFacts(
        version=m.version,
        folder=folder,
        sources=tuple((e.alias, e.workflow_id, e.access, e.problem) for e in m.entries),
        sources_problem=m.sources_problem,
        writers=tuple(m.access.allowed_kb_writers),
    )


def manifest_change_types(old: ManifestFacts | None, new: ManifestFacts | None) -> tuple[str, ...]:
    """The event types one manifest change gives, in the order they are
    emitted: ``workflow.changed`` for any difference (added, changed, moved,
    removed), then ``sources.changed`` when the attachment entries differ and
    ``writers.changed`` when ``allowed_kb_writers`` does. A missing side counts
    as a manifest without sources or writers; a folder of None (not known)
    never counts as a move."""
    if old == new:
        return ()
    out = ["workflow.changed"]
    before = (old.sources, old.sources_problem) if old else ((), None)
    after = (new.sources, new.sources_problem) if new else ((), None)
    if before != after:
        out.append("sources.changed")
    if (old.writers if old else ()) != (new.writers if new else ()):
        out.append("writers.changed")
    same_bytes = len(out) == 1 and old is not None and new is not None and old.version == new.version
    # Same bytes: only the folder may differ, and an unknown folder is no move.
    if same_bytes and (
        old is None or new is None or None in (old.folder, new.folder) or old.folder == new.folder
    ):
        return ()
    return tuple(out)
