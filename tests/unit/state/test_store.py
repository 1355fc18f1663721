"""The session store (kbd.state.store) on real SQLite files: every sqlite3 error,
wherever it arises, reaches callers as the tree's error (one translator)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kbd.errors import Busy, StateCorrupt
from kbd.state.store import SessionRow, SessionStore, new_session_id


def row(sid: str | None = None) -> SessionRow:
    return SessionRow(id=sid or new_session_id(), workflow_id="con", kind="execution", kb_access="read",
                      item_kb_write=False, parent=None, opened_by="alice", opened_at=1.0, closed_at=None,
                      generation=0, digest="")  # fmt: skip


def test_a_held_write_lock_is_busy_and_changes_nothing(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, timeout=0.05)
    holder = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Busy, match="the session store is busy"):
            store.insert(row())
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert store.rows(include_closed=True) == []
    kept = row()
    store.insert(kept)
    assert store.get(kept.id) == kept


def test_an_error_inside_a_transaction_rolls_it_back(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, timeout=1)
    first = row()
    store.insert(first)
    with pytest.raises(StateCorrupt), store.transaction() as db:
        db.execute("UPDATE sessions SET kind = 'builder' WHERE id = ?", (first.id,))
        db.execute("INSERT INTO sessions (id) VALUES (?)", (first.id,))  # NOT NULL and UNIQUE
    assert store.get(first.id).kind == "execution"


def test_a_damaged_file_is_state_corrupt_when_opened(tmp_path: Path) -> None:
    (tmp_path / "sessions.db").write_bytes(b"garbage, not a database" * 100)
    with pytest.raises(StateCorrupt, match="the session store is unreadable"):
        SessionStore(tmp_path, timeout=1)
