"""The pure part of note history (kbd/core/history.py): versions, version
strings, retention (per note, and a source's budget across its notes), the
expiry of deleted notes, diffs."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.history import (
    ABSENT,
    DAY,
    Entry,
    Held,
    expired,
    held_totals,
    note_relpath,
    over_budget,
    parse_version,
    retained,
    unified_diff,
    version_of,
)
from kbd.errors import InvalidInput, InvalidPath


def test_a_version_is_the_sha256_of_the_bytes() -> None:
    assert version_of(b"x\n") == "sha256:" + hashlib.sha256(b"x\n").hexdigest()


@pytest.mark.parametrize(
    ("raw", "want"),
    [("sha256:" + "a" * 64, "sha256:" + "a" * 64), ('"sha256:' + "0" * 64 + '"', "sha256:" + "0" * 64),
     ("none", ABSENT), (' "none" ', ABSENT)],
)  # fmt: skip
def test_accepted_version_strings(raw: str, want: str) -> None:
    assert parse_version(raw, field="f", allow_absent=True) == want


@pytest.mark.parametrize(
    "raw", ["", "sha256:", "sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha1:" + "a" * 40, "a" * 64, "W/x"]
)
def test_refused_version_strings_name_the_field(raw: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_version(raw, field="--version", allow_absent=True)
    assert err.value.message.startswith("--version must be `sha256:`")


def test_none_only_where_absence_is_meaningful() -> None:
    with pytest.raises(InvalidInput):
        parse_version("none", field="--version")


@pytest.mark.parametrize("rel", ["notes/x.md", "notes/a/b.md", "notes//x.md"])
def test_note_paths(rel: str) -> None:
    assert note_relpath(rel).startswith("notes/")


@pytest.mark.parametrize("rel", ["notes", "context/x.md", "x.md", "/notes/x.md", "notes/../x.md"])
def test_paths_that_are_not_notes(rel: str) -> None:
    with pytest.raises(InvalidPath):
        note_relpath(rel)


def entry(n: int, size: int, version: str | None = None) -> Entry:
    return Entry(version or f"sha256:{n:064x}", None, float(n), size, "write")


@given(
    sizes=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), min_size=1, max_size=30),
    max_versions=st.integers(1, 10),
    max_bytes=st.integers(1, 3000),
)
def test_retention_keeps_a_newest_suffix_within_the_caps(
    sizes: list[tuple[int, int]], max_versions: int, max_bytes: int
) -> None:
    # Versions repeat (a restore, a revert): a repeated version's bytes count once.
    entries = [entry(i, size, f"sha256:{v:064x}") for i, (v, size) in enumerate(sizes)]
    kept = retained(entries, max_versions=max_versions, max_bytes=max_bytes)
    assert kept and kept == entries[len(entries) - len(kept) :]  # the newest ones, in order
    assert len(kept) <= max_versions
    distinct = {e.version: e.size for e in kept}
    assert len(kept) == 1 or sum(distinct.values()) <= max_bytes
    if len(kept) < len(entries):  # one more would have broken a cap
        more = entries[len(entries) - len(kept) - 1 :]
        grown = {e.version: e.size for e in more}
        assert len(more) > max_versions or sum(grown.values()) > max_bytes


def test_the_diff_is_unified_and_marks_a_missing_final_newline() -> None:
    text = unified_diff(b"a\nb\n", b"a\nc", old_label="old", new_label="new")
    assert text.splitlines()[:2] == ["--- old", "+++ new"]
    assert "-b\n+c\n\\ No newline at end of file\n" in text
    assert unified_diff(b"same\n", b"same\n", old_label="o", new_label="n") == ""


# -- a source's budget, across its notes ------------------------------------------------

NOTES = ("notes/a.md", "notes/b.md", "notes/c.md")


@st.composite
def source_histories(draw: st.DrawFn) -> tuple[list[Held], frozenset[str]]:
    """A source's kept versions in the order they were recorded (versions
    repeat within a note: a revert), and which of its notes are still there."""
    picks = draw(st.lists(st.tuples(st.sampled_from(NOTES), st.integers(0, 3), st.integers(0, 900)),
                          min_size=1, max_size=40))  # fmt: skip
    sizes: dict[tuple[str, int], int] = {}
    held = []
    for seq, (rel, v, size) in enumerate(picks):
        size = sizes.setdefault((rel, v), size)  # one version has one size
        held.append(Held(seq, rel, f"sha256:{v:064x}", size))
    return held, frozenset(draw(st.sets(st.sampled_from(NOTES))))


def annotated(held: list[Held]) -> list[Held]:
    """The oracle of what the store reads from its index: a source's whole
    history, oldest first, each entry with ``newest`` and ``copies`` as that
    whole history makes them."""
    ordered = sorted(held, key=lambda h: h.seq)
    newest = {h.relpath: h.seq for h in ordered}
    copies = Counter((h.relpath, h.version) for h in ordered)
    return [
        replace(h, newest=h.seq == newest[h.relpath], copies=copies[(h.relpath, h.version)]) for h in ordered
    ]


def budget(
    held: list[Held], max_versions: int, max_bytes: int, present: Callable[[str], bool], window: int = 10_000
) -> list[Held]:
    """over_budget as a store runs it: the oldest entries a window at a time,
    each window annotated against the history as it is then."""
    dropped: list[Held] = []
    after = -1
    while True:
        left = [h for h in held if h.seq not in {d.seq for d in dropped}]
        versions, size = held_totals(left)
        rows = [h for h in annotated(left) if h.seq > after][:window]
        if (versions <= max_versions and size <= max_bytes) or not rows:
            return dropped
        dropped += over_budget(rows, versions=versions, size=size, max_versions=max_versions,
                               max_bytes=max_bytes, present=present)  # fmt: skip
        after = rows[-1].seq


@given(history=source_histories(), max_versions=st.integers(1, 30), max_bytes=st.integers(0, 4000))
def test_the_budget_drops_the_oldest_first_across_notes_never_a_live_notes_newest(
    history: tuple[list[Held], frozenset[str]], max_versions: int, max_bytes: int
) -> None:
    held, live = history
    asked: list[str] = []

    def present(rel: str) -> bool:
        asked.append(rel)
        return rel in live

    dropped = budget(held, max_versions, max_bytes, present)
    newest = {h.relpath: h for h in held}
    protected = {h.seq for rel, h in newest.items() if rel in live}
    gone = {h.seq for h in dropped}
    kept = [h for h in held if h.seq not in gone]
    assert not gone & protected  # the current state of a live note is never forgotten
    assert len(asked) == len(set(asked))  # each note asked about at most once
    evictable = [h.seq for h in held if h.seq not in protected]
    assert [h.seq for h in dropped] == evictable[: len(dropped)]  # oldest first, whichever note
    count, size = held_totals(kept)
    if len(dropped) < len(evictable):  # stopped early: within both caps
        assert count <= max_versions and size <= max_bytes
    if dropped:  # one fewer dropped would have broken a cap
        before = held_totals([h for h in held if h.seq not in gone or h.seq == dropped[-1].seq])
        assert before[0] > max_versions or before[1] > max_bytes
    for rel in NOTES:  # what each note keeps is a newest suffix of its log
        log = [h.seq for h in held if h.relpath == rel]
        own = [h.seq for h in kept if h.relpath == rel]
        assert own == log[len(log) - len(own) :]


@given(history=source_histories(), max_versions=st.integers(1, 30), max_bytes=st.integers(0, 4000),
       window=st.integers(1, 8))  # fmt: skip
def test_a_window_at_a_time_drops_what_the_whole_history_at_once_drops(
    history: tuple[list[Held], frozenset[str]], max_versions: int, max_bytes: int, window: int
) -> None:
    held, live = history
    whole = [h.seq for h in budget(held, max_versions, max_bytes, lambda rel: rel in live)]
    assert [h.seq for h in budget(held, max_versions, max_bytes, lambda rel: rel in live, window)] == whole


def test_the_budget_counts_a_version_once_per_note() -> None:
    v = "sha256:" + "1" * 64
    held = [Held(1, "notes/a.md", v, 100), Held(2, "notes/b.md", v, 100), Held(3, "notes/a.md", v, 100)]
    assert held_totals(held) == (3, 200)  # a's blob once, b's (its own folder) once
    assert [(h.newest, h.copies) for h in annotated(held)] == [(False, 2), (True, 1), (True, 2)]


def test_within_budget_nothing_is_dropped_and_nobody_is_asked() -> None:
    held = annotated([Held(n, f"notes/{n}.md", f"sha256:{n:064x}", 10) for n in range(5)])

    def present(rel: str) -> bool:
        raise AssertionError(rel)

    assert over_budget(held, versions=5, size=50, max_versions=5, max_bytes=50, present=present) == []


def test_a_deleted_notes_newest_goes_in_its_turn_a_live_ones_stays_even_over_budget() -> None:
    held = [
        Held(1, "notes/gone.md", "sha256:" + "a" * 64, 500),
        Held(2, "notes/live.md", "sha256:" + "b" * 64, 900),
    ]
    dropped = budget(held, 10, 100, lambda rel: rel == "notes/live.md")
    assert [h.seq for h in dropped] == [1]  # live.md alone is still over: kept all the same


def test_deleted_notes_expire_after_the_days_set() -> None:
    now = 1_000 * DAY
    since = {"notes/old.md": now - 30 * DAY, "notes/new.md": now - 29 * DAY, "notes/now.md": now}
    assert expired(since, now=now, deleted_days=30) == ["notes/old.md"]
    assert expired(since, now=now, deleted_days=0) == ["notes/new.md", "notes/now.md", "notes/old.md"]
