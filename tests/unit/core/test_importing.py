"""The pure rules of `kbd import` (docs/search.md "Importing markdown"): title, container, slug and
target derivation, and what an import does with each document."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kbd.core import importing as imp
from kbd.core.relpaths import NAME_MAX, split_relative

# Any text, including separators, dots, controls, combining marks and wide characters.
ANY_TEXT = st.text(min_size=0, max_size=300)
NAME = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"),
    min_size=1,
    max_size=40,
).filter(lambda s: s not in (".", ".."))
# A title as people write one in a heading: no '#', no line break.
TITLE = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Zl", "Zp"), blacklist_characters="#\n\r"),
    min_size=1,
    max_size=80,
).filter(lambda s: any(ch.isalnum() for ch in unicodedata.normalize("NFKC", s)))
BODY_LINE = st.text(alphabet="abc xyz-*_`~0123456789.", max_size=30)


@given(ANY_TEXT)
def test_a_slug_is_one_plain_name_or_nothing(text: str) -> None:
    s = imp.slug(text)
    if s == "":
        return
    assert "/" not in s and "\\" not in s and s not in (".", "..") and "\x00" not in s
    assert len(s.encode()) <= imp.MAX_SLUG_BYTES
    assert not s.startswith(("-", "_", "."))
    assert all(ch.isalnum() or ch in "-_" or unicodedata.category(ch).startswith("M") for ch in s)
    assert split_relative(s) == [s]
    assert imp.slug(s) == s  # stable: a slug names itself


@given(ANY_TEXT, ANY_TEXT)
def test_every_target_is_one_file_in_one_folder_of_context(container: str, title: str) -> None:
    try:
        path = imp.target_of(container, title)
    except imp.Skip as skip:
        assert "no letter or digit" in skip.reason
        return
    parts = split_relative(path)
    assert path == "/".join(parts)  # nothing dropped: no '.', no '//'
    assert len(parts) == 3 and parts[0] == "context" and parts[2].endswith(".md")
    assert all(len(p.encode()) <= NAME_MAX for p in parts)


@pytest.mark.parametrize(
    ("container", "title", "expected"),
    [
        ("ENG", "Onboarding", "context/eng/onboarding.md"),
        ("LEAD", "Manager 1:1", "context/lead/manager-1-1.md"),
        ("ENG", "a/b", "context/eng/a-b.md"),
        ("ENG", "../../etc/passwd", "context/eng/etc-passwd.md"),
        ("ENG", "Ünïcödé Straße", "context/eng/ünïcödé-straße.md"),
    ],
)
def test_targets(container: str, title: str, expected: str) -> None:
    assert imp.target_of(container, title) == expected


@pytest.mark.parametrize("container", ["..", ".", "", "---", "//"])
def test_a_container_without_letters_is_refused(container: str) -> None:
    with pytest.raises(imp.Skip, match="container folder name"):
        imp.target_of(container, "Title")


@given(st.lists(NAME, min_size=1, max_size=5), NAME)
def test_the_container_is_the_immediate_parent_folder(parts: list[str], folder: str) -> None:
    assert imp.container_of(parts, folder) == (parts[-2] if len(parts) > 1 else folder)


@given(TITLE, st.lists(BODY_LINE, max_size=6))
@settings(max_examples=200)
def test_the_first_h1_is_the_title_and_leaves_the_body(title: str, lines: list[str]) -> None:
    body = "\n".join(lines)
    doc = imp.derive("ENG/x.md", f"# {title}\n{body}".encode(), folder="docs")
    assert doc.title == " ".join(title.split())
    assert doc.container == "ENG" and doc.imported_from == "ENG/x.md"
    text = doc.data.decode()
    _, stored = imp.split_frontmatter(text)
    assert stored.strip("\n") == body.strip("\n")  # the H1 line is gone, the rest kept
    assert imp.imported_from(doc.data) == "ENG/x.md"
    # What was written is what the next import of the same file finds: unchanged.
    assert imp.outcome(doc, doc.data, update=False) == ("unchanged", None)
    assert imp.derive("ENG/x.md", f"# {title}\n{body}".encode(), folder="docs") == doc


@example(fm="null", h1="0")
@example(fm="NULL", h1="0")
@given(TITLE, TITLE)
def test_a_frontmatter_title_overrides_the_h1(fm: str, h1: str) -> None:
    quoted = '"' + fm.replace("\\", "\\\\").replace('"', '\\"') + '"'
    doc = imp.derive("D/x.md", f"---\ntitle: {quoted}\nlabels: [a]\n---\n# {h1}\nbody\n".encode(), folder="f")
    assert doc.title == " ".join(fm.split())
    lines, body = imp.split_frontmatter(doc.data.decode())
    assert lines is not None and "labels: [a]" in lines
    assert sum(1 for line in lines if line.startswith("title:")) == 1
    assert f"# {h1}" in body  # not the title: kept


def test_an_h1_inside_fenced_code_is_not_the_title() -> None:
    doc = imp.derive("A/x.md", b"```sh\n# not this\n```\n# Real\ntext\n", folder="f")
    assert doc.title == "Real" and b"# not this" in doc.data


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"just text\n", "no title"),
        (b"## Second level only\n", "no title"),
        (b"# Bad \xff\n", "not UTF-8"),
        (b"# Nul\x00\n", "NUL"),
        (b"# \xe2\x80\xae evil\n", r"U\+202E"),
        (b"#     \n", "no title"),
        (b"x" * (imp.MAX_DOC_BYTES + 1), "larger than"),
    ],
)
def test_documents_without_a_usable_title_or_text_are_skipped(data: bytes, reason: str) -> None:
    with pytest.raises(imp.Skip, match=reason):
        imp.derive("A/x.md", data, folder="f")


@pytest.mark.parametrize("file", ["../x.md", "/etc/x.md", "A/../../x.md", "A/\x1bx.md", ""])
def test_bad_document_names_are_skipped(file: str) -> None:
    with pytest.raises(imp.Skip, match="bad file name"):
        imp.derive(file, b"# T\n", folder="f")


def test_outcomes() -> None:
    doc = imp.derive("ENG/x.md", b"# T\nv1\n", folder="f")
    newer = imp.derive("ENG/x.md", b"# T\nv2\n", folder="f")
    assert imp.outcome(doc, None, update=False) == ("created", None)
    assert imp.outcome(newer, doc.data, update=False) == ("skipped", "changed (use --update)")
    assert imp.outcome(newer, doc.data, update=True) == ("updated", None)
    # A file at the target that this file's import did not write is never replaced.
    for other in (b"hand-written\n", imp.derive("ENG/y.md", b"# T\n", folder="f").data):
        what, reason = imp.outcome(newer, other, update=True)
        assert what == "skipped" and reason is not None and "not an import of ENG/x.md" in reason


@pytest.mark.parametrize(("value", "title"), [("null", "H"), ("~", "H"), ("NULL", "H"), ('"null"', "null"),
                                              ("'Null'", "Null"), ("0", "0")])  # fmt: skip
def test_only_an_unquoted_null_is_no_title(value: str, title: str) -> None:
    doc = imp.derive("D/x.md", f"---\ntitle: {value}\n---\n# H\nbody\n".encode(), folder="f")
    assert doc.title == title


def test_a_name_that_is_not_utf8_is_shown_escaped() -> None:
    """``os.listdir`` gives an undecodable byte as a lone surrogate; a JSON
    ``\\ud800`` is one too: each is reported escaped, never passed on raw."""
    listed = "ENG/b\udcffd\udcc3.md"  # os.fsdecode(b"ENG/b\xffd\xc3.md")
    assert imp.undecodable(listed) and imp.undecodable("a\ud800b")
    assert imp.shown(listed) == "ENG/b\\xffd\\xc3.md" and imp.shown("a\ud800b") == "a\\ud800b"
    assert not imp.undecodable("Café ✓.md") and imp.shown("Café ✓.md") == "Café ✓.md"
    assert imp.shown(listed).encode("utf-8") == b"ENG/b\\xffd\\xc3.md"
