"""Markdown import, the pure half (docs/search.md "Importing markdown"): from one document's name and text to
its title,
its container, the file kbd writes and where, and what an import does with it.

* **Container** = the file's immediate parent folder name (a file directly in
  the imported folder takes that folder's own name).
* **Title** = a ``title:`` key in leading ``---`` frontmatter, else the first
  ATX ``# H1`` outside fenced code (that line is stripped from the body).
  Neither: the document is skipped with a reason.
* **Target** = ``context/<slug(container)>/<slug(title)>.md``. A slug keeps
  Unicode letters and digits (lower-cased), ``-`` and ``_``; every other run of
  characters becomes one ``-``; never empty, ``.``/``..`` or longer than
  :data:`MAX_SLUG_BYTES`. So no title or container can name another folder:
  ``a/b`` is ``a-b``, ``..`` has no letters and is refused.
* **Stored text** = frontmatter ``title`` and ``imported_from``
  (``<container>/<file name>``: stable whichever folder above it was
  imported), the original frontmatter's other lines verbatim, then the body.
  Deterministic, so a second import of the same files finds every one
  unchanged; ``imported_from`` tells kbd's own import of this file apart from
  a file someone wrote by hand (or another file's import) at the same name,
  which an import never replaces, even with ``--update``.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

from kbd.core.relpaths import NAME_MAX, name_problem, split_relative
from kbd.errors import InvalidPath

#: The largest document an import reads (and the daemon accepts), as for a note.
MAX_DOC_BYTES = 1024 * 1024
#: A title longer than this is refused (it is a heading, not a paragraph).
MAX_TITLE_CHARS = 300
#: Slugs are cut to this many UTF-8 bytes (whole characters), leaving room in NAME_MAX for ".md".
MAX_SLUG_BYTES = 120
MARKDOWN_SUFFIXES = (".md", ".markdown")
#: How far down a file its frontmatter may close.
MAX_FRONTMATTER_LINES = 200

Outcome = Literal["created", "updated", "unchanged", "skipped"]

_H1 = re.compile(r"^ {0,3}#[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*)[ \t]*:(.*)$")
_OWN_KEYS = ("title", "imported_from")


class Skip(Exception):
    """A document the import reports as skipped, with the reason it gives."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_markdown(name: str) -> bool:
    return name.lower().endswith(MARKDOWN_SUFFIXES) and not name.startswith(".")


def undecodable(name: str) -> bool:
    """A name whose bytes are not UTF-8 (``os.listdir`` hands them over as lone
    surrogates): it can be neither imported nor printed as it is."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def shown(name: str) -> str:
    """``name`` as it can be reported: a byte that is not UTF-8 (``os.listdir``'s
    surrogate escape) written ``\\xNN``, any other lone surrogate (a JSON
    escape) ``\\uNNNN``."""
    if not undecodable(name):
        return name
    out = []
    for ch in name:
        n = ord(ch)
        if 0xDC80 <= n <= 0xDCFF:
            out.append(f"\\x{n - 0xDC00:02x}")
        elif 0xD800 <= n <= 0xDFFF:
            out.append(f"\\u{n:04x}")
        else:
            out.append(ch)
    return "".join(out)


# -- names ----------------------------------------------------------------------------


def slug(text: str) -> str:
    """A safe file or folder name for ``text`` ("" when it has no letter or digit)."""
    out: list[str] = []
    for ch in unicodedata.normalize("NFKC", text):
        if ch.isalnum() or ch == "_":
            out.append(ch.lower())
        elif out and out[-1] != "-":
            out.append("-")
    s = "".join(out).strip("-_")
    if len(s.encode("utf-8")) > MAX_SLUG_BYTES:
        cut = s.encode("utf-8")[:MAX_SLUG_BYTES].decode("utf-8", "ignore")
        s = cut.rstrip("-_")
    # lower() of some characters yields combining marks; NFC keeps one spelling per name.
    s = unicodedata.normalize("NFC", s)
    if not any(ch.isalnum() for ch in s):
        return ""
    return s


def doc_parts(file: str) -> list[str]:
    """The components of a document's name relative to the imported folder
    (raises InvalidPath: relative, no ``..``, no control characters)."""
    parts = split_relative(file)
    for p in parts:
        if (problem := name_problem(p)) is not None:
            raise InvalidPath(f"{p[:80]!r} {problem}")
    return parts


def container_of(parts: list[str], folder: str) -> str:
    """The file's immediate parent folder name; ``folder`` (the imported folder's
    own name) for a file directly in it."""
    return parts[-2] if len(parts) > 1 else folder


def target_of(container: str, title: str) -> str:
    """``context/<container slug>/<title slug>.md`` (raises Skip when either has
    no letter or digit)."""
    c = slug(container)
    if not c:
        raise Skip(f"the container folder name {container[:80]!r} has no letter or digit to name a folder")
    t = slug(title)
    if not t:
        raise Skip(f"the title {title[:80]!r} has no letter or digit to name a file")
    name = f"{t}.md"
    assert len(name.encode("utf-8")) <= NAME_MAX and "/" not in c + name
    return f"context/{c}/{name}"


# -- text ------------------------------------------------------------------------------


def decode(data: bytes) -> str:
    """A document's text: at most MAX_DOC_BYTES of UTF-8 without NUL (raises Skip)."""
    if len(data) > MAX_DOC_BYTES:
        raise Skip(f"larger than {MAX_DOC_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Skip("not UTF-8 text") from None
    if "\x00" in text:
        raise Skip("contains a NUL character (not text)")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def split_frontmatter(text: str) -> tuple[list[str] | None, str]:
    """(the lines of a leading ``---`` block, or None; the text after it)."""
    if not text.startswith("---\n"):
        return None, text
    lines = text.split("\n")
    for i in range(1, min(len(lines), MAX_FRONTMATTER_LINES + 1)):
        if lines[i].rstrip() in ("---", "..."):
            return lines[1:i], "\n".join(lines[i + 1 :])
    return None, text


def _unquote(value: str) -> str:
    v = value.strip()
    if len(v) >= 2 and v[0] == v[-1] == '"':
        try:
            out = json.loads(v)
        except ValueError:
            return v[1:-1]
        return out if isinstance(out, str) else v
    if len(v) >= 2 and v[0] == v[-1] == "'":
        return v[1:-1].replace("''", "'")
    return v.split(" #", 1)[0].strip()


def frontmatter_title(lines: list[str]) -> str | None:
    """The top-level ``title:`` value, when it is one line of text."""
    for line in lines:
        m = _KEY.match(line)
        if m and m.group(1) == "title":
            # Only an UNQUOTED null or block marker is no title: "null" in quotes
            # is the word (hypothesis found a document titled "null").
            raw = m.group(2).split(" #", 1)[0].strip()
            return (
                None
                if raw in ("", "|", ">", "|-", ">-", "~", "null", "Null", "NULL")
                else _unquote(m.group(2))
            )
    return None


def take_h1(body: str) -> tuple[str | None, str]:
    """(the first ATX ``# H1`` outside fenced code, the body without that line)."""
    lines = body.split("\n")
    fence: str | None = None
    for i, line in enumerate(lines):
        f = _FENCE.match(line)
        if f:
            mark = f.group(1)
            if fence is None:
                fence = mark[0] * 3
            elif mark.startswith(fence):
                fence = None
            continue
        if fence is None:
            m = _H1.match(line)
            if m and m.group(1).strip():
                return m.group(1).strip(), "\n".join(lines[:i] + lines[i + 1 :])
    return None, body


def clean_title(raw: str) -> str:
    """One line of text: blanks collapsed; control, format and separator
    characters refused (raises Skip)."""
    title = " ".join(raw.split())
    if not title:
        raise Skip("the title is empty")
    if len(title) > MAX_TITLE_CHARS:
        raise Skip(f"the title is longer than {MAX_TITLE_CHARS} characters")
    for ch in title:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            raise Skip(f"the title contains the control or format character U+{ord(ch):04X}")
    return title


def _kept(lines: list[str]) -> list[str]:
    """The original frontmatter without the keys kbd writes itself (and their
    indented continuation lines)."""
    out: list[str] = []
    dropping = False
    for line in lines:
        m = _KEY.match(line)
        if m:
            dropping = m.group(1) in _OWN_KEYS
        elif line[:1] not in (" ", "\t"):
            dropping = False
        if not dropping:
            out.append(line)
    return out


@dataclass(frozen=True)
class Doc:
    """One document as the import would store it."""

    file: str  # as named by the importer, relative to the imported folder
    title: str
    container: str
    path: str  # relative to the workflow's KB root: context/<c>/<t>.md
    imported_from: str  # <container>/<file name>
    data: bytes  # what is written


def render(title: str, imported_from: str, kept: list[str], body: str) -> bytes:
    head = [f"title: {json.dumps(title, ensure_ascii=False)}",
            f"imported_from: {json.dumps(imported_from, ensure_ascii=False)}", *kept]  # fmt: skip
    text = body.lstrip("\n")
    if text and not text.endswith("\n"):
        text += "\n"
    return ("---\n" + "\n".join(head) + "\n---\n" + ("\n" + text if text else "")).encode("utf-8")


def derive(file: str, data: bytes, *, folder: str) -> Doc:
    """Everything an import needs about one document (raises Skip with the reason)."""
    try:
        parts = doc_parts(file)
    except InvalidPath as exc:
        raise Skip(f"bad file name: {exc.message}") from None
    if not is_markdown(parts[-1]):
        raise Skip("not a Markdown file (.md or .markdown)")
    text = decode(data)
    lines, rest = split_frontmatter(text)
    raw = frontmatter_title(lines) if lines is not None else None
    body = rest
    if raw is None:
        raw, body = take_h1(rest)
    if raw is None:
        raise Skip("no title: neither a 'title:' frontmatter key nor a '# H1' heading")
    title = clean_title(raw)
    container = container_of(parts, folder)
    path = target_of(container, title)
    imported_from = f"{container}/{parts[-1]}"
    return Doc(
        file, title, container, path, imported_from, render(title, imported_from, _kept(lines or []), body)
    )


def imported_from(stored: bytes) -> str | None:
    """The ``imported_from`` a stored file names in its frontmatter, if any."""
    try:
        text = stored.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines, _ = split_frontmatter(text)
    for line in lines or []:
        m = _KEY.match(line)
        if m and m.group(1) == "imported_from":
            return _unquote(m.group(2))
    return None


def outcome(doc: Doc, existing: bytes | None, *, update: bool) -> tuple[Outcome, str | None]:
    """What an import does with ``doc`` when its target holds ``existing``
    (None: no file there): the outcome and, when skipped, why."""
    if existing is None:
        return "created", None
    if existing == doc.data:
        return "unchanged", None
    if imported_from(existing) != doc.imported_from:
        return "skipped", (
            f"{doc.path} already exists and is not an import of {doc.imported_from}; "
            "kbd never replaces it (rename the title, or move that file)"
        )
    if not update:
        return "skipped", "changed (use --update)"
    return "updated", None
