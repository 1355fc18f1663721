"""Contributed notes' rules (docs/notes.md "The write path"). Pure.

What a note may be called (:func:`kbd.core.knowledge.write_parts`), what it may contain
(:func:`note_text`), the provenance frontmatter kbd stamps on it
(:func:`with_provenance`) and reads back (:func:`provenance_of`), and the
``notes/`` quota verdict (:class:`NotesScan`, :func:`quota_refusal`). The
filesystem side is :mod:`kbd.fs.notes`; the operation is :mod:`kbd.service.notes`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kbd.errors import InvalidInput, QuotaExceeded

if TYPE_CHECKING:  # the type only: config loading stays out of the pure core
    from kbd.core.config import NotesQuota

MAX_NOTE_BYTES = 1024 * 1024
PROVENANCE_KEYS = ("contributed_by_workflow", "contributed_by_session", "contributed_at")

# Bounds of one post-command audit (docs/notes.md "Quota": a contributed notes/ is
# attacker-shaped). The walk of each notes/ happens under its mutex, so it visits
# at most ``notes_quota.max_files + 1`` entries (kbd.yaml; at most
# config.MAX_QUOTA_FILES) and MAX_SCAN_DEPTH levels; then, after the mutex is
# released, at most MAX_SCAN_FILES changed files and MAX_AUDIT_READ_BYTES bytes
# in all are read for the injection gate. A capped audit says "truncated": true.
MAX_SCAN_FILES = 2000
MAX_SCAN_DEPTH = 16
MAX_AUDIT_READ_BYTES = 16 * 1024 * 1024


# -- names and content ------------------------------------------------------------------------


def note_text(data: bytes) -> str:
    """``data`` as the text of a note, or InvalidInput saying what is wrong:
    at most MAX_NOTE_BYTES of UTF-8, no NUL, not only whitespace."""
    if len(data) > MAX_NOTE_BYTES:
        raise InvalidInput(f"the note is {len(data)} bytes; at most {MAX_NOTE_BYTES} are allowed")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"the note is not UTF-8 text (byte {exc.start})") from None
    if "\x00" in text:
        raise InvalidInput("the note contains a NUL byte")
    if not text.strip():
        raise InvalidInput(
            "the note is empty (or only whitespace); nothing would be written but provenance",
            hint="pass the note's content with --file F or on stdin",
        )
    return text


# -- provenance --------------------------------------------------------------------------


def utc_stamp(at: float | None = None) -> str:
    """A Unix time (now: None) as provenance spells it: ``2026-12-07T18:34:57Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def with_provenance(text: str, *, workflow_id: str, session_id: str, now: float | None = None) -> str:
    """``text`` with kbd's provenance frontmatter. An existing ``---`` block is
    merged (its other keys kept, in order); provenance keys a contributor wrote
    are replaced, never trusted."""
    stamp = utc_stamp(now)
    ours = [
        f"contributed_by_workflow: {workflow_id}",
        f"contributed_by_session: {session_id}",
        f"contributed_at: {stamp}",
    ]
    body = text
    kept: list[str] = []
    if text.startswith("---\n"):
        end = text.find("\n---\n", 3)
        if end == -1 and text.endswith("\n---"):
            end = len(text) - 4
        if end != -1:
            block = text[4:end]
            body = text[end + 5 :]
            # A contributor's own provenance keys (quoted or not) are dropped, never trusted.
            kept = [
                ln
                for ln in block.split("\n")
                if ln.split(":", 1)[0].strip().strip("\"'") not in PROVENANCE_KEYS
            ]
    return "---\n" + "\n".join([*kept, *ours]) + "\n---\n" + body


def provenance_of(head: bytes) -> str | None:
    """The contributing workflow named in a note's frontmatter, if any."""
    text = head.decode("utf-8", "replace")
    if not text.startswith("---\n"):
        return None
    # The block ends at a line that is exactly ``---``, as with_provenance ends
    # it (its stamp comes after the contributor's own lines).
    end = text.find("\n---\n", 3)
    if end == -1 and text.endswith("\n---"):
        end = len(text) - 4
    for line in text[4 : end if end != -1 else None].split("\n"):
        key, _, value = line.partition(":")
        if key.strip() == "contributed_by_workflow":
            return value.strip() or None
    return None


# -- the quota ------------------------------------------------------------------------------------


class Changed(NamedTuple):
    """A regular file a walk saw changed, with the identity it had then."""

    rel: str  # relative to the KB root: notes/...
    ino: int
    ctime_ns: int


@dataclass
class NotesScan:
    """One walk of a ``notes/``: its size, and the regular files changed since a
    time, with the identity (inode, ctime) each had when seen."""

    entries: int = 0
    bytes: int = 0
    truncated: bool = False  # stopped at the entry or depth cap: the counts are lower bounds
    too_deep: bool = False  # folders below MAX_SCAN_DEPTH were not counted
    changed: list[Changed] = field(default_factory=list)

    def over(self, quota: NotesQuota) -> bool:
        # A walk stopped early has seen more than max_files entries, or could not
        # count what lies deeper: either way the usage is not known to fit.
        return self.truncated or self.entries > quota.max_files or self.bytes > quota.max_bytes


def quota_refusal(
    scan: NotesScan, quota: NotesQuota, *, source: str, marked: bool, adds: tuple[int, int] = (0, 0)
) -> QuotaExceeded | None:
    """The refusal when ``notes/`` (as ``scan`` saw it) is over its quota, or
    would be after adding ``adds`` = (entries, bytes), or a command left it over
    quota (``marked``); None when the write or command may go ahead."""
    entries, size = scan.entries + adds[0], scan.bytes + adds[1]
    if not (marked or scan.truncated or entries > quota.max_files or size > quota.max_bytes):
        return None
    counted = "more than " if scan.truncated and not scan.too_deep else ""
    return QuotaExceeded(
        f"the notes/ of source {source!r} would exceed its quota ({quota.max_files} entries, "
        f"{quota.max_bytes} bytes): it holds {counted}{scan.entries} entries and {scan.bytes} bytes"
        + (f", nested deeper than {MAX_SCAN_DEPTH} folders (not counted)" if scan.too_deep else "")
        + (" and a command left it over quota" if marked else "")
        + (f"; this write adds {adds[0]} entries and {adds[1]} bytes" if adds != (0, 0) else "")
    )
