"""Append-only audit log: one JSON object a line in ``state/audit.log``.

The stdlib json module is used on purpose: this runs on ``kbd exec``'s path,
where importing orjson costs more than it saves.

Each event is one ``write()`` on an ``O_APPEND`` descriptor followed by fsync:
concurrent appenders (CLI processes and the daemon) never interleave lines.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbd.fs.atomic import ensure_private_dir

if TYPE_CHECKING:
    from datetime import datetime

AUDIT_NAME = "audit.log"

# Called with each record this process appends, once it is on disk: the daemon
# counts note writes and gate refusals for its metrics (docs/daemon.md "Metrics").
_observers: list[Callable[[dict[str, Any]], None]] = []


def observe(fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call ``fn`` with every record appended from now on; returns the undo.
    ``fn`` must be quick and must not raise (a raise is dropped: an observer
    never fails the write it observes)."""
    _observers.append(fn)
    return lambda: _observers.remove(fn)


def append(state_dir: Path, event: str, **fields: Any) -> None:
    ensure_private_dir(state_dir)
    record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
    # A refused name may hold a lone surrogate (an undecodable argv byte, JSON
    # "\ud800"): backslashreplace writes it as a JSON \udcff escape, still one valid line.
    line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
        "utf-8", "backslashreplace"
    )
    fd = os.open(
        state_dir / AUDIT_NAME,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o640,
    )
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    for fn in tuple(_observers):
        with contextlib.suppress(Exception):  # see observe(): the record is written
            fn(record)


def parse_line(line: bytes) -> dict[str, Any] | None:
    """One record, or None for a torn or foreign line (not a JSON object with an
    ``event``): a crash mid-write or a hand edit must not hide every other record."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


def scan(state_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Every readable record, in order, and how many lines were skipped as torn."""
    try:
        with open(state_dir / AUDIT_NAME, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return [], 0
    records, torn = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        record = parse_line(line)
        if record is None:
            torn += 1
        else:
            records.append(record)
    return records, torn


def read(state_dir: Path) -> list[dict[str, Any]]:
    """Every readable record, in order (torn lines skipped; see :func:`scan`)."""
    return scan(state_dir)[0]


class Tail:
    """Reads records appended to the log since the last call (``kbd audit --follow``).

    Only complete lines are parsed: a line still being written is kept until its
    newline arrives. A log that shrank (rotated or truncated) is read again from
    its start.
    """

    def __init__(self, state_dir: Path, *, offset: int = 0) -> None:
        self.path = state_dir / AUDIT_NAME
        self.offset = offset
        self.pending = b""
        self.torn = 0

    def poll(self, *, max_bytes: int | None = None) -> list[dict[str, Any]]:
        """The complete records appended since the last call (reading at most
        ``max_bytes`` more of the file, when given)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        try:
            if os.fstat(fd).st_size < self.offset:
                self.offset, self.pending = 0, b""
            os.lseek(fd, self.offset, os.SEEK_SET)
            chunks = []
            left = max_bytes
            while left is None or left > 0:
                chunk = os.read(fd, 1 << 16 if left is None else min(left, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left = None if left is None else left - len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        self.offset += len(data)
        *lines, self.pending = (self.pending + data).split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            record = parse_line(line)
            if record is None:
                self.torn += 1
            else:
                out.append(record)
        return out


# -- selecting records (pure) ------------------------------------------------------------

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``7d``,
    ``1w``) or an ISO 8601 time (``2026-12-01T14:00:00Z``; without a zone it
    is UTC, as the log's own timestamps are). ValueError names what is allowed."""
    from datetime import UTC, datetime, timedelta  # not on kbd exec's path

    now = now or datetime.now(UTC)
    if m := _DURATION.fullmatch(text.strip()):
        try:
            return now - timedelta(seconds=int(m.group(1)) * _UNIT[m.group(2)])
        except OverflowError:  # beyond what a date can hold: bad input, not a bug in kbd
            raise ValueError(f"{text!r} reaches back before year 1; give a shorter duration") from None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (a number and one of s, m, h, d, w: 10m) "
            "nor an ISO 8601 time (2026-12-01T14:00:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def record_time(record: dict[str, Any]) -> datetime | None:
    from datetime import UTC, datetime

    ts = record.get("ts")
    if not isinstance(ts, str):
        return None
    try:
        when = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


#: The fields a record names a workflow in (as consumer, source or target).
WORKFLOW_FIELDS = ("workflow_id", "source", "consumer")


class Selection:
    """Which records ``kbd audit`` shows: at or after ``since``, touching
    workflow ``workflow`` (as consumer, source or target, or through one of its
    sessions, which are learnt from their ``session_opened`` records), done by
    ``actor``, of an event matching one of ``events`` (shell patterns: ``note_*``)."""

    def __init__(
        self, *, since: datetime | None = None, workflow: str | None = None, actor: str | None = None,
        events: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.since = since
        self.workflow = workflow
        self.actor = actor
        self.events = events
        self._sessions: set[str] = set()

    def wants(self, record: dict[str, Any]) -> bool:
        if self.workflow is not None and not self._touches(record):
            return False
        if self.actor is not None and record.get("actor") != self.actor:
            return False
        if self.events and not any(fnmatch.fnmatchcase(str(record.get("event")), p) for p in self.events):
            return False
        if self.since is not None:
            when = record_time(record)
            return when is not None and when >= self.since
        return True

    def _touches(self, record: dict[str, Any]) -> bool:
        session = record.get("session")
        if any(record.get(k) == self.workflow for k in WORKFLOW_FIELDS):
            if record.get("event") == "session_opened" and isinstance(session, str):
                self._sessions.add(session)
            return True
        return isinstance(session, str) and session in self._sessions


def format_value(value: Any) -> str:
    """A field value for people: text as one escaped line (quoted when it holds
    spaces, quotes or ``=``), everything else as compact JSON — never a Python repr."""
    from kbd.core.identifiers import one_line

    if isinstance(value, str):
        text = one_line(value, limit=10_000)
        return json.dumps(text, ensure_ascii=False) if not text or any(c in text for c in ' "=') else text
    # ASCII-escaped: a nested string may hold U+2028 or U+0085, which break lines.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def format_record(record: dict[str, Any]) -> str:
    """``TS EVENT key=value …``; fields without a value (None, empty lists and
    objects) are left out rather than printed as ``None`` or ``{}``."""
    rest = " ".join(
        f"{k}={format_value(v)}"
        for k, v in record.items()
        if k not in ("ts", "event") and v is not None and v != {} and v != []
    )
    head = f"{format_value(record.get('ts', '?'))} {format_value(record.get('event', '?'))}"
    return f"{head} {rest}" if rest else head
