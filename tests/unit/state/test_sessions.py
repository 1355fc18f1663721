"""The session store (kbd.state.sessions) on real SQLite files: every sqlite3 error,
wherever it arises, reaches callers as the tree's error (one translator)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from kbd.errors import Busy, StateCorrupt
from kbd.state.sessions import SessionRow, SessionStore, new_session_id


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


def test_racing_lookups_that_built_the_same_plan_record_one_generation(tmp_path: Path) -> None:
    """Lookups in several processes (here: connections on threads) that read the
    same row and built the same new plan bump the generation once, not once each."""
    first = row()
    SessionStore(tmp_path, timeout=5).insert(first)
    stores = [SessionStore(tmp_path, timeout=5) for _ in range(8)]
    start = threading.Barrier(len(stores))
    got: list[int] = []

    def record(store: SessionStore) -> None:
        start.wait(timeout=10)
        got.append(store.record_generation(first.id, new_digest="plan-b"))

    threads = [threading.Thread(target=record, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [1] * len(stores)
    assert (stores[0].get(first.id).generation, stores[0].get(first.id).digest) == (1, "plan-b")


def test_a_generation_names_exactly_one_plan(tmp_path: Path) -> None:
    """A lookup whose plan differs from the one recorded since it read its row
    gets a generation of its own, never the other plan's number; going back to an
    earlier plan is a new generation too. A command recorded under generation g
    therefore always ran with the grants g names."""
    first = row()
    mine, theirs = SessionStore(tmp_path, timeout=1), SessionStore(tmp_path, timeout=1)
    mine.insert(first)
    assert theirs.record_generation(first.id, new_digest="plan-b") == 1
    # Read before that record (digest ""), looked up, built another plan:
    assert mine.record_generation(first.id, new_digest="plan-c") == 2
    assert mine.record_generation(first.id, new_digest="plan-c") == 2
    assert theirs.record_generation(first.id, new_digest="plan-b") == 3
    now = mine.get(first.id)
    assert (now.generation, now.digest) == (3, "plan-b")
