"""Search and review rules (docs/search.md, docs/notes.md "Reviewed contributions"). Pure.

What a note's provenance says (:func:`provenance_fields`), its title
(:func:`title_of`), its review status and trust label (:func:`review_of`,
:func:`trust_of`), how a free-text query becomes an FTS5 expression that
cannot be a syntax error (:func:`match_expression`), and where review
RELPATHs (relative to the KB root, ``notes/x.md``) may point
(:func:`review_parts`). The index is :mod:`kbd.state.search_index`, the
review store :mod:`kbd.state.reviews`, the operations :mod:`kbd.service.search`
and :mod:`kbd.service.reviews`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Literal

from kbd.core.importing import Skip, clean_title, frontmatter_title
from kbd.core.layout import CONTEXT_DIR, NOTES_DIR
from kbd.core.relpaths import names_folder, note_parts, request_parts
from kbd.errors import InvalidInput, PermissionDenied, UsageError

Review = Literal["own", "unreviewed", "approved"]
Trust = Literal["own", "source", "contributed-unreviewed", "contributed-approved"]

MAX_QUERY_CHARS = 500
MAX_QUERY_TERMS = 32
DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# A word of a query: letters, digits and underscores in any script (FTS5's
# unicode61 tokenizer splits on everything else, so nothing is lost).
_TERM = re.compile(r"\w+", re.UNICODE)


def digest(data: bytes) -> str:
    """A note's version: ``sha256:<hex>`` of its bytes as stored (docs/notes.md "Note history")."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _frontmatter(text: str) -> tuple[list[str], str]:
    """The ``---`` block's lines and the body after it (no block: [], text).

    The block ends where :func:`kbd.core.notes.with_provenance` ends it: at a
    line that is exactly ``---``. A contributor's lines come first in it and
    kbd's stamp last, so a reader that stopped earlier (at a line merely
    starting with ``---``, or after so many lines) would miss the stamp and
    take a contribution for the source's own note."""
    if not text.startswith("---\n"):
        return [], text
    end = text.find("\n---\n", 3)
    if end == -1:
        if not text.endswith("\n---"):
            return [], text
        end = len(text) - 4
    return text[4:end].split("\n"), text[end + 5 :]


def provenance_fields(text: str) -> dict[str, str]:
    """The provenance keys kbd stamps (``contributed_by_workflow``, ``…_session``,
    ``contributed_at``) as the note's frontmatter holds them; others ignored."""
    out: dict[str, str] = {}
    for line in _frontmatter(text)[0]:
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("contributed_by_workflow", "contributed_by_session", "contributed_at"):
            out[key] = value.strip()
    return {k: v for k, v in out.items() if v}


def title_of(text: str, name: str) -> str:
    """The frontmatter's one-line ``title:`` (where ``kbd import`` keeps a
    document's H1), else the first ``# H1`` of the body, else the file name."""
    lines, body = _frontmatter(text)
    if (declared := frontmatter_title(lines)) is not None:
        try:
            return clean_title(declared)[:200]
        except Skip:
            pass  # not one line of text: the next candidate names it
    for line in body.split("\n"):
        if line.startswith("# ") and line[2:].strip():
            return line[2:].strip()[:200]
    return name


def body_of(text: str) -> str:
    """What is searched: the text without its frontmatter block."""
    return _frontmatter(text)[1]


def contributor(source_wf: str, contributed_by: str | None) -> str | None:
    """The contributing workflow, or None when the note is the source's own
    (no provenance, or provenance naming the source itself)."""
    return contributed_by if contributed_by and contributed_by != source_wf else None


def review_of(source_wf: str, contributed_by: str | None, stored: str | None) -> Review:
    """A note's review status: its source's own, or a contribution approved for
    exactly these bytes (``stored`` is the decision recorded for its digest)."""
    if contributor(source_wf, contributed_by) is None:
        return "own"
    return "approved" if stored == "approved" else "unreviewed"


def trust_of(review: Review, *, own_kb: bool) -> Trust:
    """The label a hit carries: where it comes from and whether anyone vouched."""
    if review == "unreviewed":
        return "contributed-unreviewed"
    if review == "approved":
        return "contributed-approved"
    return "own" if own_kb else "source"


#: The query language (docs/search.md "Queries"), said where people look (--help, the MCP tool).
QUERY_HELP = (
    'every word must appear; "a phrase" in quotes; a OR b for either; word* for a prefix; '
    "-word (or NOT word) to exclude"
)
#: A token of a query: a quoted phrase (an unbalanced quote runs to the end), or a run without blanks.
_TOKEN = re.compile(r'"([^"]*)"?|(\S+)')


@dataclass(frozen=True)
class _Term:
    words: tuple[str, ...]  # one word, or a phrase
    prefix: bool = False

    def fts(self) -> str:
        return '"' + " ".join(self.words) + '"' + ("*" if self.prefix else "")


def _groups(query: str) -> list[tuple[list[_Term], list[_Term]]]:
    """The query's OR groups, each (the terms it needs, the terms it excludes)."""
    groups: list[tuple[list[_Term], list[_Term]]] = [([], [])]
    negate = False
    for m in _TOKEN.finditer(query):
        phrase, bare = m.group(1), m.group(2)
        if bare == "OR":
            if groups[-1][0] or groups[-1][1]:
                groups.append(([], []))
            continue
        if bare == "NOT":
            negate = True
            continue
        text = phrase if phrase is not None else bare
        if phrase is None and text.startswith("-") and len(text) > 1:
            negate, text = True, text[1:]
        words = tuple(_TERM.findall(text))
        if words:
            prefix = phrase is None and text.endswith("*") and _TERM.fullmatch(words[-1]) is not None
            groups[-1][1 if negate else 0].append(_Term(words, prefix))
        negate = False
    return [g for g in groups if g[0] or g[1]]


def match_expression(query: str) -> str:
    """``query`` in the query language (:data:`QUERY_HELP`) as an FTS5
    expression: every word quoted (no word is an operator, no input a syntax
    error), groups parenthesised. UsageError when nothing searchable is left,
    or a group only excludes."""
    if len(query) > MAX_QUERY_CHARS:
        raise UsageError(f"the query is {len(query)} characters; at most {MAX_QUERY_CHARS} are allowed")
    groups = _groups(query)
    if not groups:
        raise UsageError(
            f"the query {query[:80]!r} has no word to search for (letters or digits)",
            hint='kbd search SID "retry policy"',
        )
    words = sum(len(t.words) for need, out in groups for t in [*need, *out])
    if words > MAX_QUERY_TERMS:
        raise UsageError(f"the query has {words} words; at most {MAX_QUERY_TERMS} are allowed")
    if any(not need for need, _ in groups):
        raise UsageError(
            f"the query {query[:80]!r} only excludes words: name at least one word to find",
            hint='e.g. "retry -backoff"',
        )
    return " OR ".join(
        "(" + " ".join(t.fts() for t in need) + "".join(f" NOT {t.fts()}" for t in out) + ")"
        for need, out in groups
    )


_HEADING_MARK = re.compile(r"(?:^|(?<=\s))#{1,6}\s+")


def plain_snippet(snippet: str) -> str:
    """A snippet on one line, without Markdown's heading marks (``# Title`` reads ``Title``)."""
    return _HEADING_MARK.sub("", " ".join(snippet.split()))


def query_hint(query: str) -> str | None:
    """What to try when ``query`` found nothing: with several required words and no OR,
    that every one of them must appear (and how to ask for either)."""
    groups = _groups(query)
    if len(groups) == 1 and len(groups[0][0]) > 1:
        need = groups[0][0]
        return (f"no text holds all of {len(need)} words; "
                f"{' OR '.join(' '.join(t.words) for t in need[:3])} finds any of them ({QUERY_HELP})")  # fmt: skip
    return None


def check_limit(limit: int | None) -> int:
    """The number of hits asked for, or a UsageError naming the field."""
    if limit is None:
        return DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise UsageError(f"limit (--limit) must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}")
    return limit


def review_parts(relpath: str) -> list[str]:
    """A review RELPATH (relative to the KB root: ``notes/x.md``) as components,
    or InvalidInput/InvalidPath: it must name a note ``kbd notes write`` could
    have written (beneath ``notes/``, a note suffix, never ``_index.json``)."""
    parts = request_parts(relpath)
    if len(parts) < 2 or parts[0] != NOTES_DIR:
        raise InvalidInput(
            f"RELPATH {relpath[:200]!r} must name a note beneath notes/ (relative to the KB root)",
            hint="e.g. notes/finding.md; `kbd notes pending SOURCE_WF` lists them",
        )
    return [NOTES_DIR, *note_parts("/".join(parts[1:]))]


#: A note write's RELPATH spelled the old way, relative to notes/ (accepted for one release: docs/notes.md "Paths").
DEPRECATED_NOTE_PATH = (
    "RELPATH {given!r} is relative to notes/, which is deprecated: name it from the KB root, as {meant!r} "
    "(as kbd read, search hits and the audit name it)"
)


def write_parts(relpath: str) -> tuple[list[str], str | None]:
    """A note write's RELPATH (relative to the source's KB root: ``notes/x.md``)
    as components beneath ``notes/``, and a deprecation warning when it was
    spelled relative to ``notes/`` (``x.md``: the same file, for one release).
    ``notes/x.md`` never nests; a path into ``context/`` or naming ``notes/``
    itself is refused, never read as a folder beneath ``notes/`` (docs/notes.md "Paths")."""
    if names_folder(relpath):
        return note_parts(relpath), None  # refused, naming the folder
    parts = request_parts(relpath)
    if parts[0] == NOTES_DIR:
        if len(parts) == 1:
            raise InvalidInput(f"RELPATH {relpath[:200]!r} names notes/ itself: name a note beneath it",
                               hint="e.g. notes/finding.md")  # fmt: skip
        return note_parts("/".join(parts[1:])), None
    if parts[0] == CONTEXT_DIR:
        raise PermissionDenied(
            f"RELPATH {relpath[:200]!r} is in context/, which only the source workflow writes",
            hint="contributed notes go beneath notes/, e.g. notes/finding.md",
        )
    found = note_parts(relpath)
    meant = "/".join([NOTES_DIR, *found])
    return found, DEPRECATED_NOTE_PATH.format(given=relpath[:200], meant=meant[:210])
