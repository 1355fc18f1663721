"""Durable sessions (docs/sessions.md): the SQLite store under ``state/``; its errors
reach callers through :func:`kbd.state.sqlite.from_sqlite`. The lookup that
rebuilds a session's plan from saved configuration every time is
:mod:`kbd.service.sessions`; running commands are :mod:`kbd.state.processes`.

SQLite in WAL mode with ``synchronous=FULL`` is shared safely by CLI processes
and the daemon; every change is one short transaction. A session stores only
what was requested (workflow, kind, kb_access, item flag, parent) plus the
digest and ``generation`` of its last plan: grants are never stored, so nothing
stale can be served. ``generation`` increases (compare-and-swap on the digest)
exactly when a lookup yields different grants.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from kbd.core.records import JsonObject, Keys, Record
from kbd.errors import SessionClosed, session_not_found
from kbd.fs.atomic import ensure_private_dir
from kbd.state.sqlite import from_sqlite

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    workflow_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    kb_access TEXT NOT NULL,
    item_kb_write INTEGER NOT NULL,
    parent TEXT REFERENCES sessions(id),
    opened_by TEXT NOT NULL,
    opened_at REAL NOT NULL,
    closed_at REAL,
    generation INTEGER NOT NULL,
    digest TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_workflow ON sessions(workflow_id);
CREATE INDEX IF NOT EXISTS sessions_parent ON sessions(parent);
"""


SCHEMA_VERSION = 1
# What a query takes: SQLite's own value types. What it returns is untyped
# (``sqlite3`` rows are ``Any``): the one dynamic boundary here, read by _row.
SqlValue: TypeAlias = str | int | float | bytes | None


@contextmanager
def _translated() -> Iterator[None]:
    """The one place a ``sqlite3`` error becomes the tree's error (:func:`from_sqlite`)."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        raise from_sqlite(exc) from None


@dataclass(frozen=True)
class SessionRow(Record):
    """A stored session. Its JSON is written by hand (docs/architecture.md "Typed operations"): it says
    whether the session is closed, not when, and never its digest."""

    id: str
    workflow_id: str
    kind: str
    kb_access: str
    item_kb_write: bool
    parent: str | None
    opened_by: str
    opened_at: float
    closed_at: float | None
    generation: int
    digest: str

    def to_json(self) -> JsonObject:
        return {
            "session_id": self.id,
            "workflow_id": self.workflow_id,
            "kind": self.kind,
            "kb_access": self.kb_access,
            "item_kb_write": self.item_kb_write,
            "parent": self.parent,
            "opened_by": self.opened_by,
            "opened_at": self.opened_at,
            "closed": self.closed_at is not None,
            "generation": self.generation,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "") -> SessionRow:
        """The row ``data`` spells; what it does not say is unknown: a closed
        session's ``closed_at`` is its ``opened_at``, the digest is empty."""
        k = _SESSION_ROW.read(cls, data, where)
        return cls(k["session_id"], k["workflow_id"], k["kind"], k["kb_access"], k["item_kb_write"], k["parent"],
                   k["opened_by"], k["opened_at"], k["opened_at"] if k["closed"] else None, k["generation"], "")  # fmt: skip

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _SESSION_ROW.schema(cls, defs)


_SESSION_ROW = Keys(lambda: {"session_id": str, "workflow_id": str, "kind": str, "kb_access": str, "item_kb_write": bool,
                             "parent": str | None, "opened_by": str, "opened_at": float, "closed": bool,
                             "generation": int})  # fmt: skip


def new_session_id() -> str:
    return "s_" + os.urandom(10).hex()


class SessionStore:
    """The sessions database at ``<state>/sessions.db``."""

    def __init__(self, state_dir: Path, *, timeout: float) -> None:
        ensure_private_dir(state_dir)
        self.path = state_dir / "sessions.db"
        self.timeout = timeout
        with _translated():
            self._db = sqlite3.connect(
                self.path, timeout=timeout, isolation_level=None, check_same_thread=False
            )
            os.chmod(self.path, 0o640)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
        # One connection, shared by the daemon's threads: serialise its use.
        self._lock = threading.RLock()
        self._create_schema()

    def _create_schema(self) -> None:
        # A read first: an existing store needs no write lock at every start.
        if self._query("PRAGMA user_version")[0][0] == SCHEMA_VERSION:
            return
        with self.transaction() as db:
            for stmt in filter(None, (s.strip() for s in SCHEMA.split(";"))):
                db.execute(stmt)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``; a lock timeout is Busy (exit 75)."""
        with self._lock, _translated():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: Sequence[SqlValue] = ()) -> list[tuple[Any, ...]]:
        with self._lock, _translated():
            return self._db.execute(sql, args).fetchall()

    @staticmethod
    def _row(r: tuple[Any, ...]) -> SessionRow:
        return SessionRow(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7], r[8], r[9], r[10])

    _COLS = "id, workflow_id, kind, kb_access, item_kb_write, parent, opened_by, opened_at, closed_at, generation, digest"

    def insert(self, row: SessionRow) -> None:
        with self.transaction() as db:
            db.execute(
                f"INSERT INTO sessions ({self._COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",  # noqa: S608 - fixed columns
                (row.id, row.workflow_id, row.kind, row.kb_access, int(row.item_kb_write), row.parent,
                 row.opened_by, row.opened_at, row.closed_at, row.generation, row.digest),
            )  # fmt: skip

    def get(self, sid: str) -> SessionRow:
        rows = self._query(f"SELECT {self._COLS} FROM sessions WHERE id = ?", (sid,))  # noqa: S608
        r = rows[0] if rows else None
        if r is None:
            raise session_not_found(sid)
        return self._row(r)

    def rows(self, *, workflow_id: str | None = None, include_closed: bool = False) -> list[SessionRow]:
        q = f"SELECT {self._COLS} FROM sessions"  # noqa: S608
        clauses, args = [], []
        if workflow_id is not None:
            clauses.append("workflow_id = ?")
            args.append(workflow_id)
        if not include_closed:
            clauses.append("closed_at IS NULL")
        if clauses:
            q += " WHERE " + " AND ".join(clauses)
        return [self._row(r) for r in self._query(q + " ORDER BY opened_at", args)]

    def ancestors_closed(self, row: SessionRow) -> bool:
        seen = {row.id}
        cur = row
        while cur.parent is not None:
            if cur.parent in seen:
                return True  # a cycle cannot happen through kbd; treat as closed (fail closed)
            seen.add(cur.parent)
            cur = self.get(cur.parent)
            if cur.closed_at is not None:
                return True
        return False

    def record_generation(self, sid: str, *, new_digest: str) -> int:
        """Record ``new_digest`` as the session's plan; the generation that names it.

        The compare-and-swap is against the digest stored *now*, in the same
        transaction, never against the row the caller read before its lookup:
        lookups that raced from the same row to the same plan bump once, and a
        plan other than the one recorded meanwhile gets a generation of its own.
        So a generation always names exactly one set of grants (docs/sessions.md "Folder grants"), and a
        command started under another plan is always "older"."""
        with self.transaction() as db:
            r = db.execute("SELECT generation, digest FROM sessions WHERE id = ?", (sid,)).fetchone()
            if r is None:
                raise session_not_found(sid)
            generation, digest = int(r[0]), str(r[1])
            if digest != new_digest:
                generation += 1
                db.execute(
                    "UPDATE sessions SET generation = ?, digest = ? WHERE id = ?",
                    (generation, new_digest, sid),
                )
            return generation

    def close(self, sid: str) -> list[str]:
        """Close ``sid`` and every descendant still open; returns the closed IDs."""
        now = time.time()
        closed: list[str] = []
        with self.transaction() as db:
            todo = [sid]
            while todo:
                cur = todo.pop()
                r = db.execute("SELECT closed_at FROM sessions WHERE id = ?", (cur,)).fetchone()
                if r is None:
                    raise session_not_found(cur)
                if r[0] is None:
                    db.execute("UPDATE sessions SET closed_at = ? WHERE id = ?", (now, cur))
                    closed.append(cur)
                todo.extend(x[0] for x in db.execute("SELECT id FROM sessions WHERE parent = ?", (cur,)))
        return closed


def require_open(store: SessionStore, row: SessionRow) -> None:
    if row.closed_at is not None or store.ancestors_closed(row):
        raise SessionClosed(f"session {row.id} is closed; it grants nothing")
