"""The pure part of note history (kbd/core/history.py): versions, version
strings, retention, diffs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.history import ABSENT, Entry, note_relpath, parse_version, retained, unified_diff, version_of
from kbd.errors import InvalidInput, InvalidPath

HEX = "0123456789abcdef"


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
