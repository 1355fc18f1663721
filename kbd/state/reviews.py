"""Review decisions on contributed notes (docs/notes.md "Reviewed contributions"), in kbd's state.

``<state>/reviews.sqlite`` holds one row per (source workflow, relpath relative
to the KB root, ``sha256:`` digest of the note's bytes): a decision is about
exactly those bytes, so an edit after approval makes the note unreviewed
again (its new digest has no row). Rejected notes are kept here whole (bytes
and original relpath) before they leave ``notes/``: never deleted outright,
restorable (:func:`kbd.service.reviews.restore_rejected`).

SQLite in WAL mode (shared by CLI processes and the daemon, like the session
store); every change is one short transaction. Errors become the tree's
(:func:`kbd.state.sqlite.from_sqlite`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kbd.fs.atomic import ensure_private_dir
from kbd.state.sqlite import from_sqlite

DB_NAME = "reviews.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS reviews (
    source TEXT NOT NULL,
    relpath TEXT NOT NULL,
    digest TEXT NOT NULL,
    status TEXT NOT NULL,
    reviewed_by TEXT NOT NULL,
    reviewed_at REAL NOT NULL,
    PRIMARY KEY (source, relpath, digest)
);
CREATE TABLE IF NOT EXISTS contributions (
    source TEXT NOT NULL,
    relpath TEXT NOT NULL,
    digest TEXT NOT NULL,
    by_workflow TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (source, relpath, digest)
);
CREATE TABLE IF NOT EXISTS rejected (
    id INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    relpath TEXT NOT NULL,
    digest TEXT NOT NULL,
    data BLOB NOT NULL,
    rejected_by TEXT NOT NULL,
    rejected_at REAL NOT NULL,
    restored_at REAL
);
"""


@dataclass(frozen=True)
class Rejected:
    """A rejected note as kept: enough to put it back byte for byte."""

    id: int
    source: str
    relpath: str
    digest: str
    data: bytes
    rejected_by: str
    rejected_at: float
    restored_at: float | None


@contextmanager
def _db(state_dir: Path) -> Iterator[sqlite3.Connection]:
    """A connection for one short transaction (committed on success)."""
    ensure_private_dir(state_dir)
    try:
        con = sqlite3.connect(state_dir / DB_NAME, timeout=10.0)
    except sqlite3.DatabaseError as exc:
        raise from_sqlite(exc, what="the review store") from None
    try:
        with con:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(SCHEMA)
            yield con
    except sqlite3.DatabaseError as exc:
        raise from_sqlite(exc, what="the review store") from None
    finally:
        con.close()


def decisions(state_dir: Path, source: str) -> dict[tuple[str, str], str]:
    """Every decision on ``source``'s notes: (relpath, digest) → status. A
    missing store has none (nothing was ever reviewed)."""
    if not (state_dir / DB_NAME).exists():
        return {}
    with _db(state_dir) as con:
        rows = con.execute(
            "SELECT relpath, digest, status FROM reviews WHERE source = ?", (source,)
        ).fetchall()
    return {(str(r[0]), str(r[1])): str(r[2]) for r in rows}


def lookup(
    state_dir: Path, keys: set[tuple[str, str, str]]
) -> dict[tuple[str, str, str], tuple[str | None, str | None]]:
    """For (source, relpath, digest) keys: (decision or None, the workflow a
    shell command contributed exactly these bytes from, or None). Keys with
    neither are left out; a missing store has nothing."""
    if not keys or not (state_dir / DB_NAME).exists():
        return {}
    out: dict[tuple[str, str, str], tuple[str | None, str | None]] = {}
    with _db(state_dir) as con:
        for key in keys:
            row = con.execute(
                "SELECT status FROM reviews WHERE source = ? AND relpath = ? AND digest = ?", key
            ).fetchone()
            by = con.execute(
                "SELECT by_workflow FROM contributions WHERE source = ? AND relpath = ? AND digest = ?", key
            ).fetchone()
            if row is not None or by is not None:
                out[key] = (None if row is None else str(row[0]), None if by is None else str(by[0]))
    return out


def contributed(state_dir: Path, source: str) -> dict[tuple[str, str], tuple[str, float]]:
    """Bytes shell commands of other workflows wrote into ``source``'s notes/:
    (relpath, digest) → (contributing workflow, when kbd saw them, Unix time)."""
    if not (state_dir / DB_NAME).exists():
        return {}
    with _db(state_dir) as con:
        rows = con.execute(
            "SELECT relpath, digest, by_workflow, at FROM contributions WHERE source = ?", (source,)
        ).fetchall()
    return {(str(r[0]), str(r[1])): (str(r[2]), float(r[3])) for r in rows}


def record_contributions(state_dir: Path, source: str, files: dict[str, str], *, by: str) -> None:
    """A command of workflow ``by`` left these (relpath → digest) in ``source``'s
    notes/: they are contributions (unreviewed) though they carry no provenance."""
    if not files:
        return
    with _db(state_dir) as con:
        con.executemany(
            "INSERT OR REPLACE INTO contributions VALUES (?, ?, ?, ?, ?)",
            [(source, rel, digest, by, time.time()) for rel, digest in files.items()],
        )


def record(state_dir: Path, source: str, relpath: str, digest: str, status: str, *, by: str) -> None:
    """Record ``status`` (approved or rejected) for exactly these bytes."""
    with _db(state_dir) as con:
        con.execute(
            "INSERT OR REPLACE INTO reviews VALUES (?, ?, ?, ?, ?, ?)",
            (source, relpath, digest, status, by, time.time()),
        )


def keep_rejected(state_dir: Path, source: str, relpath: str, digest: str, data: bytes, *, by: str) -> int:
    """Keep a rejected note's bytes (before it leaves ``notes/``); its id."""
    with _db(state_dir) as con:
        cur = con.execute(
            "INSERT INTO rejected (source, relpath, digest, data, rejected_by, rejected_at) VALUES (?, ?, ?, ?, ?, ?)",
            (source, relpath, digest, data, by, time.time()),
        )
        con.execute(
            "INSERT OR REPLACE INTO reviews VALUES (?, ?, ?, 'rejected', ?, ?)",
            (source, relpath, digest, by, time.time()),
        )
        return int(cur.lastrowid or 0)


def rejected(state_dir: Path, source: str, *, include_restored: bool = False) -> list[Rejected]:
    """``source``'s rejected notes, oldest first."""
    if not (state_dir / DB_NAME).exists():
        return []
    with _db(state_dir) as con:
        rows = con.execute(
            "SELECT id, source, relpath, digest, data, rejected_by, rejected_at, restored_at FROM rejected "
            "WHERE source = ? ORDER BY id",
            (source,),
        ).fetchall()
    out = [Rejected(int(r[0]), str(r[1]), str(r[2]), str(r[3]), bytes(r[4]), str(r[5]), float(r[6]),
                    None if r[7] is None else float(r[7])) for r in rows]  # fmt: skip
    return out if include_restored else [r for r in out if r.restored_at is None]


def mark_restored(state_dir: Path, rejected_id: int) -> None:
    """A kept note was put back (it stays kept: the record is history), and the
    rejection of its bytes is withdrawn with it: a restored note is unreviewed
    again, pending and out of search, until someone decides anew."""
    with _db(state_dir) as con:
        row = con.execute(
            "SELECT source, relpath, digest FROM rejected WHERE id = ?", (rejected_id,)
        ).fetchone()
        con.execute("UPDATE rejected SET restored_at = ? WHERE id = ?", (time.time(), rejected_id))
        if row is not None:
            con.execute("DELETE FROM reviews WHERE source = ? AND relpath = ? AND digest = ? AND status = 'rejected'",
                        (row[0], row[1], row[2]))  # fmt: skip
