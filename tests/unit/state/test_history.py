"""The note history store (kbd/state/history.py) on a real state folder and a
real KB folder: a source's budget across its notes, the expiry of deleted
notes, blobs leaving with their last entry, and a root whose history predates
the index moved into it (docs/notes.md "Note history")."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.core.config import NoteHistory
from kbd.core.history import DAY, Entry, Held, held_totals, version_of
from kbd.fs.confined import pin_dir
from kbd.fs.notes import in_kb
from kbd.state.history import BLOBS, DB_NAME, HISTORY_DIR, LEGACY_LOG, HistoryStore, Present, Who


class Clock:
    """The store's time, moved by the test (deletions are judged in days)."""

    def __init__(self) -> None:
        self.now = 1_000 * DAY

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kb(tmp_path: Path) -> Iterator[tuple[Path, Present]]:
    """A KB with a notes/ folder, and the presence check records use (over its pinned fd)."""
    root = tmp_path / "kb"
    (root / "notes").mkdir(parents=True)
    with pin_dir(root) as pinned:
        yield root / "notes", functools.partial(in_kb, pinned.fd)


def store(tmp_path: Path, clock: Clock | None = None, *, versions: int = 100, size: int = 10_000,
          **caps: int) -> HistoryStore:  # fmt: skip
    return HistoryStore(tmp_path / "state", NoteHistory(**caps), lock_timeout=5, source_caps=(versions, size),
                        clock=clock or Clock())  # fmt: skip


def write(s: HistoryStore, notes: Path, present: Present, name: str, data: bytes, source: str = "src") -> str:
    """A note written into notes/, then recorded, as a confined write does."""
    (notes / name).write_bytes(data)
    entry = s.record(source, f"notes/{name}", data, how="write", who=Who("alice"), present=present)
    assert entry is not None
    return entry.version


def blobs(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "state" / HISTORY_DIR).rglob(f"{BLOBS}/*")}


def test_the_oldest_versions_go_first_across_the_sources_notes(
    tmp_path: Path, kb: tuple[Path, Present]
) -> None:
    notes, present = kb
    s = store(tmp_path, size=3_000)
    a0 = write(s, notes, present, "a.md", b"a" * 1000)
    b0 = write(s, notes, present, "b.md", b"b" * 1000)
    a1 = write(s, notes, present, "a.md", b"A" * 1000)
    assert s.usage("src") == (3, 3000)
    b1 = write(s, notes, present, "b.md", b"B" * 1000)  # over: a0, the oldest, goes
    assert [e.version for e in s.entries("src", "notes/a.md")] == [a1]
    assert [e.version for e in s.entries("src", "notes/b.md")] == [b0, b1]
    write(s, notes, present, "c.md", b"c" * 1000)  # then b0
    assert [e.version for e in s.entries("src", "notes/b.md")] == [b1]
    assert s.usage("src") == (3, 3000)
    assert blobs(tmp_path) == {v.removeprefix("sha256:") for v in (a1, b1, version_of(b"c" * 1000))}
    assert s.blob("src", "notes/a.md", a0) is None and s.blob("src", "notes/a.md", a1) == b"A" * 1000
    # Another source's history is its own budget.
    write(s, notes, present, "d.md", b"d" * 2000, source="other")
    assert s.usage("src") == (3, 3000) and s.usage("other") == (1, 2000)


def test_a_live_notes_newest_version_is_kept_whatever_the_budget(
    tmp_path: Path, kb: tuple[Path, Present]
) -> None:
    notes, present = kb
    s = store(tmp_path, versions=1, size=10)
    big = write(s, notes, present, "big.md", b"x" * 500)
    other = write(s, notes, present, "other.md", b"y" * 500)
    assert s.head("src", "notes/big.md") == big and s.head("src", "notes/other.md") == other
    assert s.usage("src") == (2, 1000)  # over both caps: nothing it may drop
    (notes / "big.md").unlink()
    write(s, notes, present, "third.md", b"z" * 5)  # big.md is gone: its history goes now
    assert s.entries("src", "notes/big.md") == []
    assert not s._folder("src", "notes/big.md").exists()  # its blobs and folder too


def test_a_deleted_notes_history_expires_the_days_set_after_kbd_found_it_gone(
    tmp_path: Path, kb: tuple[Path, Present]
) -> None:
    notes, present = kb
    clock = Clock()
    s = store(tmp_path, clock, deleted_days=2)
    write(s, notes, present, "gone.md", b"one\n")
    write(s, notes, present, "gone.md", b"two\n")
    (notes / "gone.md").unlink()
    clock.now += DAY  # the next record looks (its source was last looked at a day ago)
    write(s, notes, present, "live.md", b"live\n")
    assert len(s.entries("src", "notes/gone.md")) == 2  # found gone now: kept two more days
    clock.now += DAY
    write(s, notes, present, "live.md", b"live 2\n")
    assert len(s.entries("src", "notes/gone.md")) == 2
    clock.now += DAY
    write(s, notes, present, "live.md", b"live 3\n")
    assert s.entries("src", "notes/gone.md") == []
    assert len(s.entries("src", "notes/live.md")) == 3


def test_a_note_back_before_expiry_keeps_its_history(tmp_path: Path, kb: tuple[Path, Present]) -> None:
    notes, present = kb
    clock = Clock()
    s = store(tmp_path, clock, deleted_days=1)
    write(s, notes, present, "back.md", b"one\n")
    (notes / "back.md").unlink()
    clock.now += DAY
    write(s, notes, present, "other.md", b"x\n")  # back.md found gone
    write(s, notes, present, "back.md", b"two\n")  # and written again: no longer missing
    clock.now += 2 * DAY
    write(s, notes, present, "other.md", b"y\n")
    assert [e.version for e in s.entries("src", "notes/back.md")] == [
        version_of(b"one\n"),
        version_of(b"two\n"),
    ]


def test_a_root_whose_history_predates_the_index_is_moved_into_it(tmp_path: Path) -> None:
    """The per-note log.json an older kbd kept is read once, its blobs stay where they are."""
    s = store(tmp_path)
    folder = s._folder("src", "notes/x.md")
    (folder / BLOBS).mkdir(parents=True)
    old = [Entry(version_of(b"v1\n"), None, 10.0, 3, "write", "alice"),
           Entry(version_of(b"v2\n"), version_of(b"v1\n"), 20.0, 3, "command", None, "s1", "con")]  # fmt: skip
    for data in (b"v1\n", b"v2\n"):
        (folder / BLOBS / version_of(data).removeprefix("sha256:")).write_bytes(data)
    doc = {"source": "src", "relpath": "notes/x.md", "entries": [e.to_json() for e in old]}
    (folder / LEGACY_LOG).write_text(json.dumps(doc))
    (tmp_path / "state" / HISTORY_DIR / "zz" / "broken").mkdir(parents=True)
    (tmp_path / "state" / HISTORY_DIR / "zz" / "broken" / LEGACY_LOG).write_text("{not json")
    assert s.entries("src", "notes/x.md") == old
    assert not (folder / LEGACY_LOG).exists() and (tmp_path / "state" / HISTORY_DIR / DB_NAME).is_file()
    assert s.blob("src", "notes/x.md", old[0].version) == b"v1\n"
    assert store(tmp_path).entries("src", "notes/x.md") == old  # once: a second open imports nothing


def rows_totals(s: HistoryStore, source: str) -> tuple[int, int]:
    """The totals counted from the rows themselves (the store keeps its own by triggers)."""
    with s._db() as con:
        rows = con.execute(
            "SELECT seq, relpath, version, size FROM entries WHERE source = ?", (source,)
        ).fetchall()
    return held_totals([Held(int(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows])


def test_writes_reverts_and_deletions_keep_the_budget_and_its_totals_exact(
    tmp_path: Path, kb: tuple[Path, Present]
) -> None:
    """Many notes written (some back to an earlier version: one blob, several
    entries), deleted and written again under a small budget: after every
    write the source is within it, the kept totals are the rows' own, every
    kept entry has its blob and no blob is left without an entry."""
    notes, present = kb
    s = store(tmp_path, versions=12, size=2_000)
    rng = random.Random(7)  # noqa: S311 - a reproducible schedule, not a secret
    for step in range(120):
        name = f"n{rng.randrange(6)}.md"
        if rng.random() < 0.25 and (notes / name).exists():
            (notes / name).unlink()
            continue
        write(s, notes, present, name, (f"{name} v{rng.randrange(4)}\n" * rng.randrange(1, 60)).encode())
        assert s.usage("src") == rows_totals(s, "src"), step
        versions, size = s.usage("src")
        live = [p for p in notes.iterdir()]
        # Over only by what is protected: each live note's newest version.
        assert versions <= max(12, len(live)) and size <= 2_000 + sum(p.stat().st_size for p in live), step
        kept = {
            e.version.removeprefix("sha256:") for n in range(6) for e in s.entries("src", f"notes/n{n}.md")
        }
        assert blobs(tmp_path) == kept, step
