"""Name rules for every path a caller hands kbd, and for files kbd writes into a
source's notes/ (decision, docs/access.md "Names").

:func:`request_parts` is the one rule for every RELPATH kbd accepts — ``kbd
read``, ``kbd ls``, ``kbd check``, ``kbd notes write``, their API routes and the
library functions behind both: the path layer's rules
(:func:`kbd.fs.confined.split_relative`: relative, no ``..``, no NUL, length
limits) plus plain names: no C0/C1 control character or DEL (a name like
``evil\\nWORKFLOW_KB_X=…`` would forge lines in listings, agent context and
logs) and no backslash (a reader on another platform sees a separator, so
``..\\..\\x`` reads as a traversal).

:func:`note_parts` is the one rule for the name of a contributed note, used by
``kbd notes write`` and by ``kbd check --mode write`` below a source's
``notes/``, so the two always agree: the request rule, no trailing ``/``, never
``_index.json`` or a look-alike, never kbd's temp-file names, and a Markdown or
text suffix (the note carries provenance frontmatter).

``_index.json`` belongs to the source: contributors never write it. A name is
treated as the index when it equals ``_index.json`` after Unicode NFKC
normalisation and case folding, so ``_INDEX.json`` or a full-width
``U+FF3F index.json`` (full-width low line) cannot sneak past a case-insensitive reader or a normalising
filesystem. Characters that merely look alike without folding (dotless i, U+0131) make a
different name. Reads take names literally.
"""

from __future__ import annotations

import re
import unicodedata

from kbd.core.identifiers import char_name
from kbd.core.layout import INDEX_NAME as INDEX_NAME
from kbd.errors import InvalidInput, InvalidPath, PermissionDenied

# The kernel's limits, checked before any syscall so a refusal names the rule.
PATH_MAX = 4096
NAME_MAX = 255


def split_relative(rel: str, *, allow_empty: bool = False) -> list[str]:
    """Validate a caller-supplied relative path and split it into components.

    Raises InvalidPath naming the rule. ``.`` components and repeated slashes are
    dropped; ``..`` is refused outright (no lexical normalisation to argue about).
    """
    if not isinstance(rel, str):
        raise InvalidPath("path must be a string")
    if "\x00" in rel:
        raise InvalidPath("path contains a NUL byte")
    try:
        raw = rel.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPath("path is not valid Unicode (it contains a lone surrogate)") from None
    if len(raw) > PATH_MAX:
        raise InvalidPath(f"path is longer than {PATH_MAX} bytes")
    if rel.startswith("/"):
        raise InvalidPath("path must be relative to the knowledge base, not absolute")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    for p in parts:
        if p == "..":
            raise InvalidPath("path must not contain '..' components")
        if len(p.encode("utf-8")) > NAME_MAX:
            raise InvalidPath(f"a path component is longer than {NAME_MAX} bytes")
    if not parts and not allow_empty:
        raise InvalidPath("path is empty")
    return parts


def names_folder(rel: str) -> bool:
    """Does ``rel`` end with ``/`` (or ``/.``)? Then, as in POSIX, it names a
    folder: ``notes/a.md/`` is ENOTDIR when ``notes/a.md`` is a file, never the file."""
    raw = rel.split("/")
    return len(raw) > 1 and raw[-1] in ("", ".") and any(p not in ("", ".") for p in raw)


NOTE_SUFFIXES = (".md", ".markdown", ".txt")
TEMP_NAME = re.compile(r"^\.kbd-[0-9a-f]{16}\.tmp$")
_NOTE_HINT = "name a note beneath the source's notes/, e.g. notes/findings/latency.md"


def fold(name: str) -> str:
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def is_index_name(name: str) -> bool:
    """True when ``name`` (a single path component) folds to ``_index.json``."""
    return fold(name) == INDEX_NAME


def name_problem(name: str) -> str | None:
    """Why the path component ``name`` may not be asked for, or None."""
    for ch in name:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o <= 0x9F:
            return f"contains a control character ({char_name(ch)}); names may not hold C0/C1 controls or DEL"
        if ch == "\\":
            return "contains a backslash ('\\'), which other platforms read as a folder separator"
    return None


def _shown(rel: str) -> str:
    # repr escapes every control character, so the message stays one line.
    return repr(rel if len(rel) <= 200 else rel[:200] + "…")


def request_parts(rel: str, *, allow_empty: bool = False) -> list[str]:
    """The components of a caller-supplied relative path (see module docstring).

    Raises InvalidPath naming the rule; never touches the filesystem.
    """
    parts = split_relative(rel, allow_empty=allow_empty)
    for p in parts:
        if (problem := name_problem(p)) is not None:
            raise InvalidPath(f"path {_shown(rel)} {problem}")
    return parts


def note_parts(relpath: str) -> list[str]:
    """The components of a contributed note's path relative to ``notes/``.

    Raises InvalidPath / InvalidInput (a bad name) or PermissionDenied (the index
    or a look-alike). Pure: what exists on disk is the writer's business.
    """
    if names_folder(relpath):
        raise InvalidInput(f"{_shown(relpath)} ends with '/': name a file, not a folder", hint=_NOTE_HINT)
    try:
        parts = request_parts(relpath)
    except InvalidPath as exc:
        raise InvalidPath(exc.message, hint=_NOTE_HINT) from None
    for p in parts:
        if is_index_name(p):
            raise PermissionDenied(
                f"{_shown(relpath)} is (or folds to) _index.json; the index belongs to the source workflow",
                hint="write a note beside it; the source's own agents maintain the index",
            )
        if TEMP_NAME.match(p):
            raise InvalidInput(f"{_shown(relpath)} uses a name reserved for kbd's temporary files")
    if not parts[-1].lower().endswith(NOTE_SUFFIXES):
        raise InvalidInput(
            f"{_shown(relpath)}: contributed notes must be Markdown or text ({', '.join(NOTE_SUFFIXES)}) so "
            "they can carry provenance"
        )
    return parts


# One page of a folder listing (`kbd ls`, the API's dir route): the default and
# the most a caller may ask for.
DEFAULT_LS_LIMIT = 1000
MAX_LS_LIMIT = 10_000
