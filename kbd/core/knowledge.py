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


def match_expression(query: str) -> str:
    """``query`` as an FTS5 expression: every word quoted (so no word is an
    operator and no input is a syntax error), all required. UsageError when
    nothing searchable is left."""
    if len(query) > MAX_QUERY_CHARS:
        raise UsageError(f"the query is {len(query)} characters; at most {MAX_QUERY_CHARS} are allowed")
    terms = _TERM.findall(query)
    if not terms:
        raise UsageError(
            f"the query {query[:80]!r} has no word to search for (letters or digits)",
            hint='kbd search SID "retry policy"',
        )
    if len(terms) > MAX_QUERY_TERMS:
        raise UsageError(f"the query has {len(terms)} words; at most {MAX_QUERY_TERMS} are allowed")
    return " ".join('"' + t.replace('"', '""') + '"' for t in terms)


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
