"""Access requests (docs/access.md "Access requests"), in kbd's state.

``<state>/requests.sqlite`` holds one row per request: who asked which source to admit which
consumer (``read``: its whole audience; ``write``: a writer grant), with a message, when it expires,
and how it was decided. At most one request per (source, consumer, kind) is open: a partial unique
index says so, so two requests made at once cannot both be stored. An open request whose time is up
is expired when it is next read or asked again.

SQLite in WAL mode (shared by CLI processes and the daemon, like the other stores); every change is
one short transaction. Errors become the tree's (:func:`kbd.state.sqlite.from_sqlite`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kbd.fs.atomic import ensure_private_dir
from kbd.state.sqlite import from_sqlite

DB_NAME = "requests.sqlite"
WHAT = "the access-request store"
SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    source TEXT NOT NULL,
    consumer TEXT NOT NULL,
    requested_by TEXT NOT NULL,
    message TEXT NOT NULL,
    opened_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL,
    decided_by TEXT,
    decided_at REAL,
    decision_message TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS requests_one_open ON requests(source, consumer, kind) WHERE state = 'pending';
"""
_COLS = ("id, kind, source, consumer, requested_by, message, opened_at, expires_at, state, decided_by, "
         "decided_at, decision_message")  # fmt: skip


@dataclass(frozen=True)
class RequestRow:
    id: int
    kind: str  # read | write
    source: str
    consumer: str
    requested_by: str
    message: str
    opened_at: float
    expires_at: float
    state: str  # pending | approved | declined | expired
    decided_by: str | None
    decided_at: float | None
    decision_message: str | None


class Duplicate(Exception):
    """An open request for the same (source, consumer, kind) exists: its row."""

    def __init__(self, row: RequestRow) -> None:
        super().__init__(row.id)
        self.row = row


@contextmanager
def _db(state_dir: Path) -> Iterator[sqlite3.Connection]:
    """A connection for one short transaction (committed on success), open requests past their
    time expired first."""
    ensure_private_dir(state_dir)
    try:
        con = sqlite3.connect(state_dir / DB_NAME, timeout=10.0)
    except sqlite3.DatabaseError as exc:
        raise from_sqlite(exc, what=WHAT) from None
    try:
        with con:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(SCHEMA)
            con.execute("UPDATE requests SET state = 'expired' WHERE state = 'pending' AND expires_at <= ?",
                        (time.time(),))  # fmt: skip
            yield con
    except sqlite3.DatabaseError as exc:
        raise from_sqlite(exc, what=WHAT) from None
    finally:
        con.close()


def _row(r: Any) -> RequestRow:
    """A stored row (``sqlite3`` rows are untyped: the one dynamic boundary here)."""
    return RequestRow(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), float(r[6]), float(r[7]),
                      str(r[8]), None if r[9] is None else str(r[9]), None if r[10] is None else float(r[10]),
                      None if r[11] is None else str(r[11]))  # fmt: skip


def open_request(state_dir: Path, *, kind: str, source: str, consumer: str, by: str, message: str,
                 expires_in: float) -> RequestRow:  # fmt: skip
    """Store a new pending request; :class:`Duplicate` when one is open for the same three."""
    now = time.time()
    with _db(state_dir) as con:
        found = con.execute(
            f"SELECT {_COLS} FROM requests WHERE source = ? AND consumer = ? AND kind = ? AND state = 'pending'",  # noqa: S608
            (source, consumer, kind),
        ).fetchone()
        if found is not None:
            raise Duplicate(_row(found))
        cur = con.execute(
            "INSERT INTO requests (kind, source, consumer, requested_by, message, opened_at, expires_at, state) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'pending')",
            (kind, source, consumer, by, message, now, now + expires_in),
        )
        rid = int(cur.lastrowid or 0)
        return _row(con.execute(f"SELECT {_COLS} FROM requests WHERE id = ?", (rid,)).fetchone())  # noqa: S608


def get(state_dir: Path, rid: int) -> RequestRow | None:
    if not (state_dir / DB_NAME).exists():
        return None
    with _db(state_dir) as con:
        found = con.execute(f"SELECT {_COLS} FROM requests WHERE id = ?", (rid,)).fetchone()  # noqa: S608
    return None if found is None else _row(found)


def every(state_dir: Path) -> list[RequestRow]:
    """Every request, newest first (the service decides who sees which)."""
    if not (state_dir / DB_NAME).exists():
        return []
    with _db(state_dir) as con:
        rows = con.execute(f"SELECT {_COLS} FROM requests ORDER BY id DESC").fetchall()  # noqa: S608
    return [_row(r) for r in rows]


def decide(state_dir: Path, rid: int, *, state: str, by: str, message: str) -> RequestRow | None:
    """Mark the pending request ``rid`` approved or declined; None when it is no longer pending
    (decided, expired) — then nothing changed."""
    with _db(state_dir) as con:
        cur = con.execute(
            "UPDATE requests SET state = ?, decided_by = ?, decided_at = ?, decision_message = ? "
            "WHERE id = ? AND state = 'pending'",
            (state, by, time.time(), message, rid),
        )
        if cur.rowcount != 1:
            return None
        return _row(con.execute(f"SELECT {_COLS} FROM requests WHERE id = ?", (rid,)).fetchone())  # noqa: S608
