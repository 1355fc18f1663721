"""The full-text search index (docs/search.md "Search"), in kbd's state: never in a source's folder.

``<state>/search/kb-<dev>-<ino>.sqlite``, one file per KB folder identity:
one row per indexed file (keyed by its relpath beneath the KB), with the
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
from kbd.state.sqlite import from_sqlite

SEARCH_DIR = "search"
# 2: provenance read to the block's real end (rows of 1 may hold a wrong contributor).
# 3: titles from the frontmatter's title: first (rows of 2 show imported documents by file name).
SCHEMA_VERSION = 3
SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    id INTEGER PRIMARY KEY,
    relpath TEXT NOT NULL UNIQUE,
    ino INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    racy INTEGER NOT NULL,
    title TEXT NOT NULL,
    contributed_by TEXT,
    digest TEXT NOT NULL,
    gated INTEGER NOT NULL
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
    id: int
    relpath: str
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    title: str
    contributed_by: str | None
    digest: str
    gated: bool
    score: float


class SearchIndex:
    """The index: one SQLite file per KB (``kb-<dev>-<ino>.sqlite``), so BM25's
    corpus statistics — and so a hit's score — come only from that KB, which
    the session may read whole; nothing about another KB leaks into a score.
    One connection per thread and KB (WAL: readers never wait for a writer)."""

    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / SEARCH_DIR
        self._local = threading.local()
        self._guard = threading.Lock()
        # Bumped by drop(): every thread's cached connections are reopened.
        self._generation = 0

    def path_of(self, kb: str) -> Path:
        dev, sep, ino = kb.partition(":")
        if not (sep and dev.isdigit() and ino.isdigit()):
            raise ValueError(f"internal: a KB key is st_dev:st_ino, not {kb!r}")
        return self.folder / f"kb-{dev}-{ino}.sqlite"

    def _connect(self, path: Path) -> sqlite3.Connection:
        ensure_private_dir(self.folder, 0o700)
        con = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
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

    def _cache(self) -> dict[str, sqlite3.Connection]:
        cache: dict[str, sqlite3.Connection] | None = getattr(self._local, "cons", None)
        if cache is None or getattr(self._local, "generation", None) != self._generation:
            for con in (cache or {}).values():
                con.close()
            cache = self._local.cons = {}
            self._local.generation = self._generation
        return cache

    def connection(self, kb: str) -> sqlite3.Connection:
        cache = self._cache()
        con = cache.get(kb)
        if con is None:
            path = self.path_of(kb)
            try:
                con = self._connect(path)
            except sqlite3.DatabaseError:
                # Damaged, truncated or foreign: a cache is rebuilt, never an error.
                self.drop(kb)
                try:
                    con = self._connect(path)
                except sqlite3.DatabaseError as exc:
                    raise from_sqlite(exc, what="the search index") from None
                cache = self._cache()
            cache[kb] = con
        return con

    def drop(self, kb: str | None = None) -> None:
        """Delete one KB's index files, or every one (the next use rebuilds them)."""
        with self._guard:
            self._generation += 1
            for con in self._cache().values():
                con.close()
            self._local.cons = {}
            names = [self.path_of(kb).name] if kb is not None else [
                p.name for p in self.folder.glob("kb-*.sqlite")] if self.folder.is_dir() else []  # fmt: skip
            for name in names:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.folder / (name + suffix)).unlink()

    @contextlib.contextmanager
    def _use(self, kb: str) -> Iterator[sqlite3.Connection]:
        """A connection; a corruption found while using it drops that KB's index
        (the next refresh rebuilds it) and is reported as Busy: retry."""
        con = self.connection(kb)
        try:
            yield con
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(sqlite3.Error):
                con.rollback()
            if not isinstance(exc, sqlite3.OperationalError):
                self.drop(kb)
            raise from_sqlite(exc, what="the search index") from None

    def signatures(self, kb: str) -> dict[str, Signature]:
        with self._use(kb) as con:
            rows = con.execute("SELECT relpath, id, ino, size, mtime_ns, ctime_ns, racy FROM docs").fetchall()
        return {
            str(r[0]): Signature(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), bool(r[6]))
            for r in rows
        }

    def apply(self, kb: str, docs: Sequence[Doc], gone: Sequence[int]) -> None:
        """Replace ``docs`` and delete the ids ``gone`` of KB ``kb``, in one transaction."""
        if not docs and not gone:
            return
        with self._use(kb) as con, con:
            for doc_id in gone:
                con.execute("DELETE FROM docs WHERE id = ?", (doc_id,))
                con.execute("DELETE FROM fts WHERE rowid = ?", (doc_id,))
            for d in docs:
                old = con.execute("SELECT id FROM docs WHERE relpath = ?", (d.relpath,)).fetchone()
                if old is not None:
                    con.execute("DELETE FROM fts WHERE rowid = ?", (old[0],))
                    con.execute("DELETE FROM docs WHERE id = ?", (old[0],))
                cur = con.execute(
                    "INSERT INTO docs (relpath, ino, size, mtime_ns, ctime_ns, racy, title, contributed_by, "
                    "digest, gated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (d.relpath, d.ino, d.size, d.mtime_ns, d.ctime_ns, int(d.racy), d.title, d.contributed_by,
                     d.digest, int(d.gated)),
                )  # fmt: skip
                con.execute(
                    "INSERT INTO fts (rowid, title, body) VALUES (?, ?, ?)", (cur.lastrowid, d.title, d.body)
                )

    def query(self, match: str, kb: str, *, limit: int) -> list[Row]:
        """The best ``limit`` matches of the FTS5 expression ``match`` in KB
        ``kb`` (BM25 with title words weighing 4 body words, then the most
        recently modified), without snippets (:meth:`snippet`: computing one
        for every match before the sort would cost ten times the ranking)."""
        with self._use(kb) as con:
            ranked = con.execute(
                "SELECT rowid, bm25(fts, 4.0, 1.0) AS score FROM fts WHERE fts MATCH ? ORDER BY score LIMIT ?",
                (match, limit),
            ).fetchall()
            if not ranked:
                return []
            score = {int(r[0]): float(r[1]) for r in ranked}
            rows = con.execute(
                "SELECT id, relpath, ino, size, mtime_ns, ctime_ns, title, contributed_by, digest, gated FROM docs "
                "WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps(list(score)),),
            ).fetchall()
        out = [Row(kb, int(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), str(r[6]),
                   None if r[7] is None else str(r[7]), str(r[8]), bool(r[9]), score[int(r[0])]) for r in rows]  # fmt: skip
        out.sort(key=lambda row: (row.score, -row.mtime_ns, row.relpath))
        return out

    def snippet(self, match: str, kb: str, doc_id: int) -> str:
        """The body's best window around the words of ``match`` (one row: cheap)."""
        with self._use(kb) as con:
            row = con.execute(
                "SELECT snippet(fts, 1, '', '', '…', 16) FROM fts WHERE fts MATCH ? AND rowid = ?",
                (match, doc_id),
            ).fetchone()
        return "" if row is None else str(row[0] or "")
