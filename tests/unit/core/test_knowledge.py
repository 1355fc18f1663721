"""One path convention (docs/notes.md "Paths"): a note write's RELPATH is
relative to the source's KB root and beneath ``notes/``, as ``kbd read``,
search hits, the audit and the change feed name it. For one release a RELPATH
relative to ``notes/`` still means the same file, with a warning; it never nests
(``notes/x.md`` is never ``notes/notes/x.md``), and nothing names ``context/``."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.knowledge import write_parts
from kbd.core.relpaths import note_parts
from kbd.errors import InvalidInput, InvalidPath, KbdError, PermissionDenied


@pytest.mark.parametrize(
    ("relpath", "parts"),
    [("notes/x.md", ["x.md"]), ("notes/a/b.txt", ["a", "b.txt"]), ("notes/notes/x.md", ["notes", "x.md"])],
)
def test_a_path_from_the_kb_root_names_its_note_beneath_notes(relpath: str, parts: list[str]) -> None:
    assert write_parts(relpath) == (parts, None)


def test_a_path_relative_to_notes_means_the_same_note_and_says_it_is_deprecated() -> None:
    parts, warning = write_parts("a/x.md")
    assert parts == ["a", "x.md"]
    assert warning is not None and "'notes/a/x.md'" in warning and "deprecated" in warning


@pytest.mark.parametrize(
    ("relpath", "error", "says"),
    [
        ("context/a.md", PermissionDenied, "context/, which only the source workflow writes"),
        ("notes", InvalidInput, "names notes/ itself"),
        ("notes/", InvalidInput, "ends with '/'"),
        ("notes/_index.json", PermissionDenied, "_index.json"),
        ("_index.json", PermissionDenied, "_index.json"),
        ("notes/x.png", InvalidInput, "Markdown or text"),
        ("notes/../context/a.md", InvalidPath, "must not contain '..' components"),
        ("/notes/x.md", InvalidPath, "not absolute"),
    ],
)
def test_what_no_write_may_name_is_refused_saying_why(relpath: str, error: type[KbdError], says: str) -> None:
    with pytest.raises(error, match=re.escape(says)):
        write_parts(relpath)


names = st.text(alphabet="abcxyz-_0", min_size=1, max_size=6)


@given(folders=st.lists(names, max_size=3), stem=names, suffix=st.sampled_from([".md", ".txt"]))
def test_both_spellings_name_one_note_and_only_the_old_one_warns(
    folders: list[str], stem: str, suffix: str
) -> None:
    below = "/".join([*folders, stem + suffix])
    assert write_parts(f"notes/{below}") == (note_parts(below), None)
    if folders[:1] in (["notes"], ["context"]):
        return  # read from the KB root: notes/… is itself, context/… is refused
    parts, warning = write_parts(below)
    assert parts == note_parts(below) and warning is not None
