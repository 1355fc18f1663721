"""The one translation of ``sqlite3`` errors into the tree, for every SQLite
file under ``state/``: the sessions (:mod:`kbd.state.sessions`), the note
history, the reviews and the search index."""

from __future__ import annotations

import sqlite3

from kbd.errors import Busy, KbdError, NoSpace, StateCorrupt


def from_sqlite(exc: Exception, *, what: str = "the session store") -> KbdError:
    """The tree's error for a ``sqlite3`` error: a full disk is NoSpace; any
    other ``OperationalError`` (a lock held past the timeout, above all) is Busy;
    any other database error means the file is damaged: StateCorrupt (its text
    is not chained: SQLite's message may name the host path)."""
    if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL:
        return NoSpace(f"{what} cannot grow: {exc}")
    if isinstance(exc, sqlite3.OperationalError):
        return Busy(f"{what} is busy: {exc}")
    return StateCorrupt(f"{what} is unreadable: {exc}")
