"""Note history, the pure part (docs/notes.md "Note history"): what a version
is, how a version string is checked, one log entry, which entries a
retention setting keeps, and the unified diff of two versions.

A version is ``sha256:<hex>`` of the note file's bytes as stored (provenance
frontmatter included), so anyone holding the bytes can compute it, and two
writers who wrote the same bytes wrote the same version. The storage (blobs
and logs in kbd's state) is :mod:`kbd.state.history`.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kbd.core.layout import NOTES_DIR
from kbd.core.records import Record
from kbd.core.relpaths import request_parts
from kbd.errors import InvalidInput, InvalidPath

PREFIX = "sha256:"
#: A version as a JSON Schema ``pattern`` spells it (results, the MCP tools' output schemas).
VERSION_PATTERN = "^sha256:[0-9a-f]{64}$"
#: ``--expected-version none`` / ``If-Match: "none"``: the note must not exist yet.
ABSENT = "none"
_HEX = frozenset("0123456789abcdef")


def version_of(data: bytes) -> str:
    """The version of ``data``: ``sha256:`` and 64 lower-case hex digits."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def is_version(text: str) -> bool:
    digest = text[len(PREFIX) :]
    return text.startswith(PREFIX) and len(digest) == 64 and all(c in _HEX for c in digest)


def parse_version(raw: str, *, field: str, allow_absent: bool = False) -> str:
    """``raw`` as a version (or :data:`ABSENT` when ``allow_absent``); raises
    InvalidInput naming ``field`` otherwise. Surrounding double quotes (an HTTP
    entity tag, ``If-Match: "sha256:…"``) are accepted and removed."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    if allow_absent and text == ABSENT:
        return ABSENT
    if is_version(text):
        return text
    allowed = (
        f"`sha256:` and 64 lower-case hex digits{' or `none` (must not exist yet)' if allow_absent else ''}"
    )
    raise InvalidInput(
        f"{field} must be {allowed}, not {raw[:80]!r}",
        hint="`kbd notes log SOURCE_WF RELPATH` lists a note's versions",
    )


def note_relpath(relpath: str) -> str:
    """A note's path relative to its KB root (``notes/x.md``), normalised; raises
    InvalidPath for anything that is not a file name beneath ``notes/``."""
    parts = request_parts(relpath)
    if len(parts) < 2 or parts[0] != NOTES_DIR:
        raise InvalidPath(
            f"RELPATH must name a note beneath notes/, relative to the source's KB root (notes/x.md), "
            f"not {relpath[:200]!r}"
        )
    return "/".join(parts)


@dataclass(frozen=True)
class Entry(Record):
    """One version in a note's log: what (version, previous, size), when, how,
    and who (principal, session, consumer workflow). ``how``: ``write`` (a
    confined write: ``kbd notes write``, the API), ``command`` (found by the
    post-command audit of a write plan), ``restore``, ``unreject``, or ``found``
    (bytes on disk before a write that were never recorded: written outside kbd). ``expected``: the version
    the writer said it started from (``--expected-version``/``If-Match``), None
    when it named none: a write whose ``previous`` is not what its writer read
    is a lost update, visible here."""

    version: str
    previous: str | None
    at: float
    size: int
    how: str
    principal: str | None = None
    session: str | None = None
    workflow: str | None = None
    expected: str | None = None

    @classmethod
    def from_log(cls, raw: Mapping[str, object]) -> Entry:
        """An entry as a note's log on disk holds it, read leniently: a value of the
        wrong type is left at its default (:meth:`from_json` is the strict reading)."""

        def opt(key: str) -> str | None:
            value = raw.get(key)
            return value if isinstance(value, str) else None

        at, size = raw.get("at"), raw.get("size")
        return cls(
            version=str(raw["version"]), previous=opt("previous"),
            at=float(at) if isinstance(at, int | float) else 0.0, size=int(size) if isinstance(size, int) else 0,
            how=str(raw.get("how", "write")), principal=opt("principal"), session=opt("session"),
            workflow=opt("workflow"), expected=opt("expected"),
        )  # fmt: skip


def retained(entries: Sequence[Entry], *, max_versions: int, max_bytes: int) -> list[Entry]:
    """The newest entries (oldest first, as given) a retention setting keeps: at
    most ``max_versions`` entries whose distinct versions add up to at most
    ``max_bytes``. The newest entry is always kept, whatever its size: the
    current state of a note is never forgotten."""
    kept: list[Entry] = []
    seen: set[str] = set()
    total = 0
    for e in reversed(entries):
        cost = 0 if e.version in seen else e.size
        if kept and (len(kept) >= max_versions or total + cost > max_bytes):
            break
        kept.append(e)
        seen.add(e.version)
        total += cost
    return kept[::-1]


@dataclass(frozen=True)
class Held:
    """One kept version as a source's history budget sees it: its place in
    the source's order of recording (``seq``, oldest lowest), its note, its
    version, the bytes its blob holds, whether it is its note's newest entry,
    and how many entries of the source name the same note and version (its
    blob goes with the last of them)."""

    seq: int
    relpath: str
    version: str
    size: int
    newest: bool = True
    copies: int = 1


def held_totals(held: Sequence[Held]) -> tuple[int, int]:
    """(versions, bytes) of a source's whole history: every entry counts as a
    version; a blob is stored once per (note, version), so its bytes count once."""
    return len(held), sum({(h.relpath, h.version): h.size for h in held}.values())


def over_budget(
    oldest: Sequence[Held], *, versions: int, size: int, max_versions: int, max_bytes: int,
    present: Callable[[str], bool],
) -> list[Held]:  # fmt: skip
    """The entries a source's history drops to fit ``max_versions`` and
    ``max_bytes`` across all its notes (docs/notes.md "Note history"): the oldest
    first, whichever note they belong to, except the newest entry of a note
    ``present`` says is still in ``notes/`` — the current state of a live note
    is never forgotten, even when those alone exceed the budget. A deleted
    note's entries, its newest included, go in their turn.

    ``oldest``: the source's oldest entries, oldest first (all of them, or
    the first of them: a store reads a window at a time, and asks again with
    the next window and the new totals while still over); ``versions`` and
    ``size``: the whole history's totals (:func:`held_totals`). ``present``
    is asked only about notes whose newest entry is reached, at most once
    each. Returns the dropped entries, oldest first; a note's entries always
    go oldest first, so what a note keeps stays a newest suffix."""
    left: dict[tuple[str, str], int] = {}
    asked: dict[str, bool] = {}
    dropped: list[Held] = []
    for h in oldest:
        if versions <= max_versions and size <= max_bytes:
            break
        if h.newest:
            if h.relpath not in asked:
                asked[h.relpath] = present(h.relpath)
            if asked[h.relpath]:
                continue
        dropped.append(h)
        versions -= 1
        key = (h.relpath, h.version)
        left[key] = left.get(key, h.copies) - 1
        if left[key] == 0:
            size -= h.size
    return dropped


#: Seconds in one of ``note_history.deleted_days``.
DAY = 86_400.0


def expired(missing_since: Mapping[str, float], *, now: float, deleted_days: int) -> list[str]:
    """The notes whose whole history is dropped: gone from ``notes/`` since
    (as kbd first found them gone) ``deleted_days`` or more ago."""
    cutoff = now - deleted_days * DAY
    return sorted(rel for rel, since in missing_since.items() if since <= cutoff)


def unified_diff(old: bytes, new: bytes, *, old_label: str, new_label: str) -> str:
    """The unified diff of two versions' text (undecodable bytes replaced)."""
    a = old.decode("utf-8", "replace").splitlines(keepends=True)
    b = new.decode("utf-8", "replace").splitlines(keepends=True)
    lines = difflib.unified_diff(a, b, fromfile=old_label, tofile=new_label)
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )
