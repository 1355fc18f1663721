"""The pure rules of :mod:`kbd.core.knowledge`: note paths and the search query language.

One path convention (docs/notes.md "Paths"): a note write's RELPATH is
relative to the source's KB root and beneath ``notes/``, as ``kbd read``,
search hits, the audit and the change feed name it. For one release a RELPATH
relative to ``notes/`` still means the same file, with a warning; it never nests
(``notes/x.md`` is never ``notes/notes/x.md``), and nothing names ``context/``."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.knowledge import match_expression, plain_snippet, query_hint, write_parts
from kbd.core.relpaths import note_parts
from kbd.errors import InvalidInput, InvalidPath, KbdError, PermissionDenied, UsageError


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


# -- the search query language (docs/search.md "Queries") ---------------------------------------

BODIES = ["egress router budget", "latency p99 budget", "router only", "egress", "p99 latency"]


def _found(query: str) -> list[str]:
    """The bodies ``query`` matches in a real FTS5 table, as the index stores text."""
    import sqlite3

    con = sqlite3.connect(":memory:")
    con.execute("CREATE VIRTUAL TABLE t USING fts5(body)")
    con.executemany("INSERT INTO t VALUES (?)", [(b,) for b in BODIES])
    return sorted(r[0] for r in con.execute("SELECT body FROM t WHERE t MATCH ?", (match_expression(query),)))


@pytest.mark.parametrize(
    ("query", "bodies"),
    [
        ("router budget", ["egress router budget"]),  # every word
        ("egress OR router", ["egress", "egress router budget", "router only"]),
        ('"p99 budget"', ["latency p99 budget"]),  # a phrase: those words, in order
        ('"budget p99"', []),
        ("rout*", ["egress router budget", "router only"]),  # a prefix
        ("budget -latency", ["egress router budget"]),
        ("budget NOT egress", ["latency p99 budget"]),
        ("p99 OR router -budget", ["latency p99 budget", "p99 latency", "router only"]),  # NOT: its own group
        ('unbalanced "p99 latency', []),  # an unbalanced quote runs to the end: never a syntax error
        ("OR p99 OR", ["latency p99 budget", "p99 latency"]),  # a dangling OR is nothing
        ("or", []),  # lower-case or is a word
    ],
)
def test_the_query_language(query: str, bodies: list[str]) -> None:
    assert _found(query) == bodies


@pytest.mark.parametrize("query", ["-router", "NOT egress", "p99 OR -router", "", "!!", "   "])
def test_a_query_with_nothing_to_find_is_a_usage_error(query: str) -> None:
    with pytest.raises(UsageError):
        match_expression(query)


def test_no_hits_for_several_words_hints_at_or() -> None:
    hint = query_hint("latency p99 missing")
    assert hint is not None and "latency OR p99 OR missing" in hint and "a phrase" in hint
    assert query_hint("egress") is None and query_hint("a OR b") is None


@pytest.mark.parametrize(
    ("snippet", "plain"),
    [("# SFU egress Egress is 62%", "SFU egress Egress is 62%"), ("intro\n## Budget\nx", "intro Budget x"),
     ("C# code, issue #42", "C# code, issue #42")],
)  # fmt: skip
def test_snippets_lose_heading_marks_only(snippet: str, plain: str) -> None:
    assert plain_snippet(snippet) == plain
