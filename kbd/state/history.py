"""Note history storage (docs/notes.md "Note history"): per (source workflow, note
path) a log of versions and the content-addressed blobs it names, in kbd's
state (``state/history/``), never under a source's folder.

- ``index.sqlite`` holds every log: one row per version, numbered in the
  order they were recorded across the whole root (``seq``); each source's
  totals (kept by triggers in the transaction that changes a row, so a
  write within the budget reads no other row); and for each source the notes
  kbd found gone from its ``notes/`` (since when) and when it last looked.
  SQLite in WAL mode, shared by CLI processes and the daemon.
- One folder per note, named by a digest of (source, relpath) so no
  caller-chosen name becomes a path here, holds ``blobs/<hex>``: each
  version's bytes, written once, atomically.

Every change to a source's history holds that source's history lock, so a
confined write (under the notes mutex), a command's post-run audit (after it)
and a restore never lose each other's entries, and the source's budget is
decided over a history nobody else is changing. Retention
(:class:`kbd.core.config.NoteHistory`, decided by :mod:`kbd.core.history`)
runs on every record: the note's own caps, the expiry of deleted notes, then
the source's budget across all its notes. Rows go first (one transaction),
then the blobs no kept row names: a crash in between leaves a blob too many,
never an entry without its bytes.

A root whose history predates the index (one ``log.json`` per note folder)
is moved into it once, on first use, under a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbd.core.history import (
    PREFIX,
    Entry,
    Held,
    expired,
    is_version,
    over_budget,
    retained,
    version_of,
)
from kbd.errors import StateCorrupt
from kbd.fs.atomic import ensure_private_dir, write_atomic
from kbd.fs.locks import held
from kbd.state.sqlite import from_sqlite

if TYPE_CHECKING:
    from kbd.core.config import Config, NoteHistory

HISTORY_DIR = "history"
DB_NAME = "index.sqlite"
BLOBS = "blobs"
#: A note folder's log before the index held them (moved into it once).
LEGACY_LOG = "log.json"
#: How often, at most, a record checks every note of its source for deletion
#: (a note found gone by the budget is marked at once, whenever that is).
SWEEP_SECONDS = 3600.0
#: How many of a source's oldest entries its budget reads at a time.
BUDGET_WINDOW = 256
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    source TEXT NOT NULL,
    relpath TEXT NOT NULL,
    version TEXT NOT NULL,
    previous TEXT,
    at REAL NOT NULL,
    size INTEGER NOT NULL,
    how TEXT NOT NULL,
    principal TEXT,
    session TEXT,
    workflow TEXT,
    expected TEXT
);
CREATE INDEX IF NOT EXISTS entries_by_note ON entries (source, relpath, seq);
CREATE INDEX IF NOT EXISTS entries_by_version ON entries (source, relpath, version);
CREATE INDEX IF NOT EXISTS entries_by_age ON entries (source, seq);
-- Each source's totals as held_totals counts them (a blob's bytes once per note
-- and version), kept by the triggers in the very transaction that changes a row.
CREATE TABLE IF NOT EXISTS usage (
    source TEXT PRIMARY KEY,
    versions INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS entry_added AFTER INSERT ON entries BEGIN
    INSERT OR IGNORE INTO usage (source, versions, bytes) VALUES (NEW.source, 0, 0);
    UPDATE usage SET versions = versions + 1, bytes = bytes + CASE WHEN (
        SELECT COUNT(*) FROM entries WHERE source = NEW.source AND relpath = NEW.relpath AND version = NEW.version
    ) = 1 THEN NEW.size ELSE 0 END WHERE source = NEW.source;
END;
CREATE TRIGGER IF NOT EXISTS entry_removed AFTER DELETE ON entries BEGIN
    UPDATE usage SET versions = versions - 1, bytes = bytes - CASE WHEN NOT EXISTS (
        SELECT 1 FROM entries WHERE source = OLD.source AND relpath = OLD.relpath AND version = OLD.version
    ) THEN OLD.size ELSE 0 END WHERE source = OLD.source;
END;
CREATE TABLE IF NOT EXISTS missing (
    source TEXT NOT NULL,
    relpath TEXT NOT NULL,
    since REAL NOT NULL,
    PRIMARY KEY (source, relpath)
);
CREATE TABLE IF NOT EXISTS sweeps (
    source TEXT PRIMARY KEY,
    at REAL NOT NULL
);
"""
_INSERT = (
    "INSERT INTO entries (source, relpath, version, previous, at, size, how, principal, session, workflow, "
    "expected) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: One note's log, oldest first: seq, then an Entry's fields (see :func:`_entry`).
_LOG = (
    "SELECT seq, version, previous, at, size, how, principal, session, workflow, expected FROM entries "
    "WHERE source = ? AND relpath = ? ORDER BY seq"
)

#: Whether a note (relative to its KB root: ``notes/x.md``) is in its source's
#: ``notes/`` now (:func:`kbd.fs.notes.in_kb` over the pinned KB).
Present = Callable[[str], bool]


@dataclass(frozen=True)
class Who:
    """Who made a version: the principal, the session, its workflow."""

    principal: str | None = None
    session: str | None = None
    workflow: str | None = None


def _entry(row: tuple[Any, ...]) -> Entry:
    version, previous, at, size, how, principal, session, workflow, expected = row
    return Entry(str(version), _opt(previous), float(at), int(size), str(how), _opt(principal), _opt(session),
                 _opt(workflow), _opt(expected))  # fmt: skip


def _opt(value: object) -> str | None:
    return value if isinstance(value, str) else None


class HistoryStore:
    """The version store of one root's state folder. ``quota_caps``: the
    source budget (versions, bytes) as :meth:`NoteHistory.source_caps` gives
    it; ``clock``: the time entries are stamped with and deletions judged by."""

    def __init__(
        self, state_dir: Path, caps: NoteHistory, *, lock_timeout: float, source_caps: tuple[int, int],
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.state_dir = state_dir
        self.caps = caps
        self.source_caps = source_caps
        self.lock_timeout = lock_timeout
        self.clock = clock

    # -- where things are ----------------------------------------------------------------

    @property
    def root(self) -> Path:
        return self.state_dir / HISTORY_DIR

    def _key(self, source: str, relpath: str) -> str:
        return hashlib.sha256(f"{source}\x00{relpath}".encode()).hexdigest()

    def _folder(self, source: str, relpath: str) -> Path:
        key = self._key(source, relpath)
        return self.root / key[:2] / key

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection for one short transaction (committed on success); the
        schema made, and a root's older history moved in, on first use."""
        ensure_private_dir(self.root)
        try:
            con = sqlite3.connect(self.root / DB_NAME, timeout=max(self.lock_timeout, 1.0))
        except sqlite3.DatabaseError as exc:
            raise from_sqlite(exc, what="the note history") from None
        try:
            if con.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                self._create(con)
            with con:
                yield con
        except sqlite3.DatabaseError as exc:
            raise from_sqlite(exc, what="the note history") from None
        finally:
            con.close()

    def _create(self, con: sqlite3.Connection) -> None:
        with held(self.state_dir, "history", "schema", timeout=self.lock_timeout, what="the note history"):
            if con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                return  # another process made it meanwhile
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(SCHEMA)
            with con:  # the older logs' rows and the schema's version: one transaction
                moved = self._import_legacy(con)
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            for log in moved:
                with contextlib.suppress(FileNotFoundError):
                    log.unlink()

    def _import_legacy(self, con: sqlite3.Connection) -> list[Path]:
        """Every per-note ``log.json`` of an older root, as rows in the order
        their versions were made; the logs read (removed once committed). An
        unreadable log is left where it is, unused."""
        rows: list[tuple[float, int, str, str, Entry]] = []
        logs: list[Path] = []
        for log in sorted(self.root.glob(f"*/*/{LEGACY_LOG}")):
            try:
                doc = json.loads(log.read_bytes())
                source, relpath = str(doc["source"]), str(doc["relpath"])
                entries = [Entry.from_log(e) for e in doc["entries"]]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            logs.append(log)
            rows.extend((e.at, i, source, relpath, e) for i, e in enumerate(entries))
        rows.sort(key=lambda r: (r[0], r[1]))
        for _, _, source, relpath, e in rows:
            self._insert(con, source, relpath, e)
        return logs

    @staticmethod
    def _insert(con: sqlite3.Connection, source: str, relpath: str, e: Entry) -> None:
        con.execute(
            _INSERT,
            (source, relpath, e.version, e.previous, e.at, e.size, e.how, e.principal, e.session, e.workflow,
             e.expected),
        )  # fmt: skip

    # -- reading ---------------------------------------------------------------------------

    def entries(self, source: str, relpath: str) -> list[Entry]:
        """The log of ``relpath`` in ``source`` (oldest first; empty when none)."""
        with self._db() as con:
            rows = con.execute(_LOG, (source, relpath)).fetchall()
        return [_entry(r[1:]) for r in rows]

    def head(self, source: str, relpath: str) -> str | None:
        log = self.entries(source, relpath)
        return log[-1].version if log else None

    def usage(self, source: str) -> tuple[int, int]:
        """(versions, bytes) ``source``'s whole history keeps now."""
        with self._db() as con:
            return self._totals(con, source)

    def blob(self, source: str, relpath: str, version: str) -> bytes | None:
        """The bytes of ``version``, or None when the store does not hold them."""
        if not is_version(version):
            return None
        try:
            data = (self._folder(source, relpath) / BLOBS / version[len(PREFIX) :]).read_bytes()
        except FileNotFoundError:
            return None
        # A blob is named by its digest: one that does not match it is damage, never content.
        if version_of(data) != version:
            raise StateCorrupt(f"the stored bytes of {version} of {relpath!r} do not match their version")
        return data

    # -- recording -------------------------------------------------------------------------

    def record(
        self, source: str, relpath: str, data: bytes, *, how: str, who: Who, present: Present,
        expected: str | None = None, if_new: bool = False, found: bytes | None = None,
    ) -> Entry | None:  # fmt: skip
        """Append a version of ``relpath`` (its bytes ``data``) to its log, then
        apply retention: the note's caps, the expiry of the source's deleted
        notes and the source's budget (``present`` says which notes are still
        in ``notes/``; asked only when it matters). ``if_new``: only when the
        log's newest version is not already this one (bytes found on disk that
        may have been recorded). ``found``: the bytes the write replaced,
        recorded first (how ``found``, nobody named) when the log does not end
        with them: one lock, one transaction for both. Returns the entry
        written, or None when ``if_new`` skipped it."""
        with held(self.state_dir, "history-source", source, timeout=self.lock_timeout,
                  what="the source's note history"):  # fmt: skip
            log = self.entries(source, relpath)
            if if_new and log and log[-1].version == version_of(data):
                return None
            blobs = self._folder(source, relpath) / BLOBS
            ensure_private_dir(blobs)
            added: list[Entry] = []
            if found is not None and (not log or log[-1].version != version_of(found)):
                added.append(self._store(blobs, found, log, how="found", who=Who(), expected=None))
            entry = self._store(blobs, data, log + added, how=how, who=who, expected=expected)
            added.append(entry)
            touched = self._commit(source, relpath, added, present)
            self._drop_unnamed(source, touched)
            return entry

    def _store(
        self, blobs: Path, data: bytes, log: list[Entry], *, how: str, who: Who, expected: str | None
    ) -> Entry:
        """Write ``data``'s blob (once: it is named by its digest) and make its entry."""
        version = version_of(data)
        name = version[len(PREFIX) :]
        if not (blobs / name).exists():
            write_atomic(blobs / name, data, mode=0o600, keep_owner=False, keep_mode=False)
        previous = log[-1].version if log else None
        return Entry(version, previous, self.clock(), len(data), how, who.principal, who.session, who.workflow,
                     expected)  # fmt: skip

    def _commit(self, source: str, relpath: str, added: list[Entry], present: Present) -> set[str]:
        """One transaction: the new rows, then every retention rule. The notes
        that lost rows (their unnamed blobs are removed after the commit)."""
        now = self.clock()
        seen: dict[str, bool] = {relpath: True}  # just recorded: its bytes were in notes/ a moment ago

        def is_present(rel: str) -> bool:
            if rel not in seen:
                seen[rel] = present(rel)
            return seen[rel]

        touched: set[str] = set()
        with self._db() as con:
            for e in added:
                self._insert(con, source, relpath, e)
            # The note's own caps.
            rows = con.execute(_LOG, (source, relpath)).fetchall()
            log = [_entry(r[1:]) for r in rows]
            kept = retained(log, max_versions=self.caps.max_versions, max_bytes=self.caps.max_bytes)
            if len(kept) < len(log):
                gone = [r[0] for r in rows[: len(log) - len(kept)]]
                con.executemany("DELETE FROM entries WHERE seq = ?", [(s,) for s in gone])
                touched.add(relpath)
            # Deleted notes: found gone long enough ago, their whole history.
            swept = con.execute("SELECT at FROM sweeps WHERE source = ?", (source,)).fetchone()
            if swept is None or now - float(swept[0]) >= SWEEP_SECONDS or now < float(swept[0]):
                for (rel,) in con.execute("SELECT DISTINCT relpath FROM entries WHERE source = ?", (source,)):
                    is_present(str(rel))
                con.execute("INSERT OR REPLACE INTO sweeps (source, at) VALUES (?, ?)", (source, now))
            self._note_presence(con, source, seen, now)
            since = dict(
                con.execute("SELECT relpath, since FROM missing WHERE source = ?", (source,)).fetchall()
            )
            for rel in expired(since, now=now, deleted_days=self.caps.deleted_days):
                con.execute("DELETE FROM entries WHERE source = ? AND relpath = ?", (source, rel))
                con.execute("DELETE FROM missing WHERE source = ? AND relpath = ?", (source, rel))
                touched.add(rel)
            # The source's budget, across all its notes.
            dropped = self._fit_budget(con, source, is_present)
            if dropped:
                touched.update(h.relpath for h in dropped)
                self._note_presence(con, source, seen, now)
        return touched

    def _fit_budget(self, con: sqlite3.Connection, source: str, present: Present) -> list[Held]:
        """Drop the source's oldest entries until it is within its budget
        (:func:`~kbd.core.history.over_budget` decides), reading only its
        oldest entries, a window at a time, and only while it is over."""
        max_versions, max_bytes = self.source_caps
        dropped: list[Held] = []
        after = -1
        while True:
            versions, size = self._totals(con, source)
            if versions <= max_versions and size <= max_bytes:
                return dropped
            rows = con.execute(
                "SELECT seq, relpath, version, size FROM entries WHERE source = ? AND seq > ? ORDER BY seq LIMIT ?",
                (source, after, BUDGET_WINDOW),
            ).fetchall()
            if not rows:
                return dropped  # over, and nothing left it may drop: live notes' newest versions only
            window = self._annotate(con, source, rows)
            gone = over_budget(window, versions=versions, size=size, max_versions=max_versions,
                               max_bytes=max_bytes, present=present)  # fmt: skip
            con.executemany("DELETE FROM entries WHERE seq = ?", [(h.seq,) for h in gone])
            dropped += gone
            after = int(rows[-1][0])

    @staticmethod
    def _annotate(con: sqlite3.Connection, source: str, rows: list[tuple[Any, ...]]) -> list[Held]:
        """The rows as :class:`~kbd.core.history.Held`, with whether each is its
        note's newest entry and how many entries share its note and version."""
        newest: dict[str, int] = {}
        copies: dict[tuple[str, str], int] = {}
        out = []
        for seq, relpath, version, size in rows:
            if relpath not in newest:
                newest[relpath] = con.execute(
                    "SELECT MAX(seq) FROM entries WHERE source = ? AND relpath = ?", (source, relpath)
                ).fetchone()[0]
            if (relpath, version) not in copies:
                copies[(relpath, version)] = con.execute(
                    "SELECT COUNT(*) FROM entries WHERE source = ? AND relpath = ? AND version = ?",
                    (source, relpath, version),
                ).fetchone()[0]
            out.append(Held(int(seq), str(relpath), str(version), int(size), newest=seq == newest[relpath],
                            copies=int(copies[(relpath, version)])))  # fmt: skip
        return out

    @staticmethod
    def _totals(con: sqlite3.Connection, source: str) -> tuple[int, int]:
        """:func:`~kbd.core.history.held_totals` of ``source``, as the triggers keep them."""
        row = con.execute("SELECT versions, bytes FROM usage WHERE source = ?", (source,)).fetchone()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    @staticmethod
    def _note_presence(con: sqlite3.Connection, source: str, seen: dict[str, bool], now: float) -> None:
        """Remember since when each note checked is gone (kept from the first
        time it was found gone), and forget it for one that is back."""
        con.executemany(
            "DELETE FROM missing WHERE source = ? AND relpath = ?",
            [(source, rel) for rel, here in seen.items() if here],
        )
        con.executemany(
            "INSERT OR IGNORE INTO missing (source, relpath, since) VALUES (?, ?, ?)",
            [(source, rel, now) for rel, here in seen.items() if not here],
        )

    def _drop_unnamed(self, source: str, notes: set[str]) -> None:
        """After the commit: remove the blobs no kept row names, in the folders
        of ``notes``, and the folder of a note with no row left."""
        if not notes:
            return
        with self._db() as con:
            named = {
                rel: {str(v)[len(PREFIX) :] for (v,) in con.execute(
                    "SELECT DISTINCT version FROM entries WHERE source = ? AND relpath = ?", (source, rel))}
                for rel in notes
            }  # fmt: skip
        for rel, names in named.items():
            folder = self._folder(source, rel)
            blobs = folder / BLOBS
            try:
                listed = os.listdir(blobs)
            except FileNotFoundError:
                continue
            for name in listed:
                if name not in names and not name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        (blobs / name).unlink()
            if not names:
                with contextlib.suppress(OSError):  # not empty (a temp file): kept, harmless
                    blobs.rmdir()
                    folder.rmdir()


def store_for(config: Config) -> HistoryStore:
    """The note history of the root ``config`` describes (its state folder, its retention settings)."""
    return HistoryStore(config.state_dir, config.note_history, lock_timeout=config.lock_timeout,
                        source_caps=config.note_history.source_caps(config.notes_quota))  # fmt: skip
