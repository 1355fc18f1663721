"""The full-text search index (DESIGN §11), in kbd's state: never in a source's folder.

``<state>/search/index.sqlite``: one row per indexed file (keyed by the KB
folder's identity ``st_dev:st_ino`` and the relpath beneath it), with the
lstat signature it had when read, its title, contributor, digest and whether
the injection gate refused its text; its words in an FTS5 table (BM25).

The index is a cache: it grants nothing. What a search may return is decided
by the session's plan at query time (:mod:`kbd.service.search`), and every hit
is re-opened through the confined layer and compared with the signature here
before it is shown. So a damaged or missing file is rebuilt, never an error:
any ``sqlite3.DatabaseError`` on opening drops the file and starts empty.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kbd.fs.atomic import ensure_private_dir
from kbd.state.store import from_sqlite

SEARCH_DIR = "search"
DB_NAME = "index.sqlite"
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    id INTEGER PRIMARY KEY,
    kb TEXT NOT NULL,
    relpath TEXT NOT NULL,
    ino INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    racy INTEGER NOT NULL,
    title TEXT NOT NULL,
    contributed_by TEXT,
    digest TEXT NOT NULL,
    gated INTEGER NOT NULL,
    UNIQUE (kb, relpath)
);
CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(title, body, tokenize = 'unicode61 remove_diacritics 2');
"""


@dataclass(frozen=True)
class Signature:
    id: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    racy: bool


@dataclass(frozen=True)
class Doc:
    """One file's entry, as read through the confined layer."""

    relpath: str
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    racy: bool  # changed too recently to trust its signature: read again at the next refresh
    title: str
    body: str
    contributed_by: str | None
    digest: str
    gated: bool


@dataclass(frozen=True)
class Row:
    """A match, before the plan and the file system have confirmed it."""

    kb: str
    relpath: str
    ino: int
    size: int
    mtime_ns: int
    title: str
    contributed_by: str | None
    digest: str
    gated: bool
    score: float
    snippet: str


class SearchIndex:
    """The index file, one connection per thread (WAL: readers never wait for a writer)."""

    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / SEARCH_DIR
        self.path = self.folder / DB_NAME
        self._local = threading.local()
        self._reset_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        ensure_private_dir(self.folder, 0o700)
        con = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")  # a cache: losing the last write costs a re-read
            version = con.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"unknown index version {version}")
            con.executescript(SCHEMA)
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            con.execute("SELECT count(*) FROM docs").fetchone()
            con.commit()
        except BaseException:
            con.close()
            raise
        return con

    def connection(self) -> sqlite3.Connection:
        con: sqlite3.Connection | None = getattr(self._local, "con", None)
        if con is None:
            try:
                con = self._connect()
            except sqlite3.DatabaseError:
                # Damaged, truncated or foreign: a cache is rebuilt, never an error.
                self.drop()
                try:
                    con = self._connect()
                except sqlite3.DatabaseError as exc:
                    raise from_sqlite(exc, what="the search index") from None
            self._local.con = con
        return con

    def drop(self) -> None:
        """Delete the index files (the next use rebuilds them)."""
        with self._reset_lock:
            con = getattr(self._local, "con", None)
            if con is not None:
                con.close()
                self._local.con = None
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / (DB_NAME + suffix)).unlink()

    @contextlib.contextmanager
    def _use(self) -> Iterator[sqlite3.Connection]:
        """A connection; a corruption found while using it drops the index (the
        caller's refresh rebuilds it) and is reported as Busy: retry."""
        con = self.connection()
        try:
            yield con
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(sqlite3.Error):
                con.rollback()
            if not isinstance(exc, sqlite3.OperationalError):
                self.drop()
            raise from_sqlite(exc, what="the search index") from None

    def signatures(self, kb: str) -> dict[str, Signature]:
        with self._use() as con:
            rows = con.execute(
                "SELECT relpath, id, ino, size, mtime_ns, ctime_ns, racy FROM docs WHERE kb = ?", (kb,)
            ).fetchall()
        return {
            str(r[0]): Signature(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), bool(r[6]))
            for r in rows
        }

    def apply(self, kb: str, docs: Sequence[Doc], gone: Sequence[int]) -> None:
        """Replace ``docs`` and delete the ids ``gone`` of KB ``kb``, in one transaction."""
        if not docs and not gone:
            return
        with self._use() as con, con:
            for doc_id in gone:
                con.execute("DELETE FROM docs WHERE id = ?", (doc_id,))
                con.execute("DELETE FROM fts WHERE rowid = ?", (doc_id,))
            for d in docs:
                old = con.execute(
                    "SELECT id FROM docs WHERE kb = ? AND relpath = ?", (kb, d.relpath)
                ).fetchone()
                if old is not None:
                    con.execute("DELETE FROM fts WHERE rowid = ?", (old[0],))
                    con.execute("DELETE FROM docs WHERE id = ?", (old[0],))
                cur = con.execute(
                    "INSERT INTO docs (kb, relpath, ino, size, mtime_ns, ctime_ns, racy, title, contributed_by, "
                    "digest, gated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (kb, d.relpath, d.ino, d.size, d.mtime_ns, d.ctime_ns, int(d.racy), d.title, d.contributed_by,
                     d.digest, int(d.gated)),
                )  # fmt: skip
                con.execute(
                    "INSERT INTO fts (rowid, title, body) VALUES (?, ?, ?)", (cur.lastrowid, d.title, d.body)
                )

    def query(self, match: str, kbs: Sequence[str], *, limit: int, offset: int = 0) -> list[Row]:
        """Matches of the FTS5 expression ``match`` in the KBs ``kbs``, best
        first (BM25, then the most recently modified)."""
        if not kbs:
            return []
        # BM25 with title words weighing 4 body words. The KB keys go in as one bound JSON array: the SQL text is constant.
        sql = (
            "SELECT d.kb, d.relpath, d.ino, d.size, d.mtime_ns, d.title, d.contributed_by, d.digest, d.gated, "
            "bm25(fts, 4.0, 1.0) AS score, snippet(fts, 1, '', '', '…', 16) FROM fts JOIN docs d ON d.id = fts.rowid "
            "WHERE fts MATCH ? AND d.kb IN (SELECT value FROM json_each(?)) "
            "ORDER BY score, d.mtime_ns DESC LIMIT ? OFFSET ?"
        )
        with self._use() as con:
            rows = con.execute(sql, (match, json.dumps(list(kbs)), limit, offset)).fetchall()
        return [Row(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), str(r[5]),
                    None if r[6] is None else str(r[6]), str(r[7]), bool(r[8]), float(r[9]), str(r[10] or ""))
                for r in rows]  # fmt: skip
