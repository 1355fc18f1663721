"""The pure rules of contributed notes (:mod:`kbd.core.notes`): a note's content,
its provenance, and the ``notes/`` quota verdict — with no file, lock or root.
The write itself is covered end to end in ``test_notes.py``."""

from __future__ import annotations

import pytest

from kbd.core.config import NotesQuota
from kbd.core.notes import (
    MAX_NOTE_BYTES,
    MAX_SCAN_DEPTH,
    NotesScan,
    note_text,
    provenance_of,
    quota_refusal,
    with_provenance,
)
from kbd.errors import InvalidInput

QUOTA = NotesQuota(max_files=10, max_bytes=1000)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"x" * (MAX_NOTE_BYTES + 1), f"at most {MAX_NOTE_BYTES}"),
        (b"ok \xff", "not UTF-8 text (byte 3)"),
        (b"a\x00b", "NUL byte"),
        (b" \n\t\n", "empty (or only whitespace)"),
    ],
)
def test_bad_note_content_is_invalid_input_saying_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(InvalidInput, match=r"^the note ") as info:
        note_text(data)
    assert says in info.value.message
    assert info.value.exit_code == 65


def test_note_content_at_the_limit_is_its_text() -> None:
    assert note_text("é".encode() * (MAX_NOTE_BYTES // 2)) == "é" * (MAX_NOTE_BYTES // 2)


def test_provenance_written_is_provenance_read() -> None:
    stamped = with_provenance("---\ntitle: t\ncontributed_by_workflow: forged\n---\nbody\n",
                              workflow_id="con", session_id="s1", now=0.0)  # fmt: skip
    assert stamped == (
        "---\ntitle: t\ncontributed_by_workflow: con\ncontributed_by_session: s1\n"
        "contributed_at: 1970-01-01T00:00:00Z\n---\nbody\n"
    )
    assert provenance_of(stamped.encode()) == "con"
    assert provenance_of(b"no frontmatter\ncontributed_by_workflow: x\n") is None


def test_a_notes_folder_within_its_quota_is_not_refused() -> None:
    scan = NotesScan(entries=9, bytes=900)
    assert not scan.over(QUOTA)
    assert quota_refusal(scan, QUOTA, source="src", marked=False, adds=(1, 100)) is None


@pytest.mark.parametrize(
    ("scan", "marked", "adds", "says"),
    [
        (NotesScan(entries=10, bytes=0), False, (1, 1), "holds 10 entries and 0 bytes; this write adds 1 entries"),
        (NotesScan(entries=1, bytes=1000), False, (0, 1), "holds 1 entries and 1000 bytes; this write adds 0"),
        (NotesScan(entries=11, bytes=0, truncated=True), False, (0, 0), "holds more than 11 entries"),
        (NotesScan(entries=3, bytes=0, truncated=True, too_deep=True), False, (0, 0),
         f"holds 3 entries and 0 bytes, nested deeper than {MAX_SCAN_DEPTH} folders (not counted)"),
        (NotesScan(entries=0, bytes=0), True, (0, 0), "holds 0 entries and 0 bytes and a command left it over quota"),
    ],
)  # fmt: skip
def test_a_notes_folder_over_its_quota_is_refused_saying_why(
    scan: NotesScan, marked: bool, adds: tuple[int, int], says: str
) -> None:
    err = quota_refusal(scan, QUOTA, source="src", marked=marked, adds=adds)
    assert err is not None
    assert err.message.startswith(
        "the notes/ of source 'src' would exceed its quota (10 entries, 1000 bytes): "
    )
    assert says in err.message
    assert (err.code, err.exit_code) == ("quota-exceeded", 65)
