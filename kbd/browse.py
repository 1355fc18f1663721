"""Consumer-scoped browsing of attached knowledge bases (seed: "consumer-scoped
browsing API"; DESIGN §6 Browsing). Shared by the CLI and the daemon's routes.

Every call re-resolves the consumer's attachments now: the caller must be able
to inspect the consumer, the alias must be attached and available at this
moment, and the KB folder is pinned and checked against the identity seen by
that resolution before anything beneath it is opened. Nothing outside the KB is
reachable (the path layer refuses ``..``, links, other mounts and special
files), and no message carries a host path.
"""

from __future__ import annotations

from typing import Any

from kbd.core.layout import INDEX_NAME, NOTES_DIR
from kbd.core.names import NOTE_SUFFIXES, request_parts
from kbd.core.principals import Principal
from kbd.core.resolve import Attachment
from kbd.errors import KbdError, NotFound, SourceUnavailable, UsageError
from kbd.fs.confined import list_dir, names_folder, pin_dir, read_file, read_file_head
from kbd.notes import provenance_of, read_index
from kbd.service import workflows
from kbd.service.root import Root

MAX_READ_BYTES = 2 * 1024 * 1024
# Listings are paged (issue 9 item 19: 100,000 files were 9.5 MB in one answer).
DEFAULT_LS_LIMIT = 1000
MAX_LS_LIMIT = 10_000


def attachment(host: Root, wid: str, alias: str, actor: Principal) -> Attachment:
    """The current, available attachment ``alias`` of ``wid`` as ``actor`` may see it."""
    for att in workflows.sources(host, wid, actor=actor).sources:
        if att.alias == alias:
            if not att.available or att.path is None:
                raise SourceUnavailable(
                    f"attachment {alias!r} of {wid!r} is unavailable: {att.reason}: {att.message}",
                    reason=att.reason or "invalid_entry",
                )
            return att
    raise NotFound(
        f"{wid!r} has no attachment with alias {alias!r}",
        hint=f"`kbd sources list {wid}` shows the attached aliases",
    )


def read(host: Root, wid: str, alias: str, relpath: str, actor: Principal) -> bytes:
    """The bytes of a regular, singly-linked file inside the source's KB (≤ 2 MiB)."""
    return read_attached(attachment(host, wid, alias, actor), relpath)


def read_attached(att: Attachment, relpath: str) -> bytes:
    """:func:`read` for an attachment just resolved; needs no registry (the daemon
    calls it outside its state lock: the index reader may retry). ``relpath``
    follows :func:`kbd.core.names.request_parts` (raises InvalidPath)."""
    parts = request_parts(relpath)
    assert att.path is not None
    with pin_dir(att.path, expect=att.kb_identity) as kb:
        if parts == [NOTES_DIR, INDEX_NAME] and not names_folder(relpath):
            # Never mistake a read failure for an empty KB: retried, then an error.
            return read_index(kb.fd, limit=MAX_READ_BYTES)
        return read_file(kb.fd, relpath, limit=MAX_READ_BYTES)


def check_limit(limit: int | None) -> int:
    """The page size asked for, or a clear UsageError."""
    if limit is None:
        return DEFAULT_LS_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LS_LIMIT:
        raise UsageError(f"limit (--limit) must be a whole number from 1 to {MAX_LS_LIMIT}, not {limit!r}")
    return limit


def ls_page(
    host: Root, wid: str, alias: str, reldir: str, actor: Principal, *, limit: int | None = None,
    after: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One page of :func:`ls`, in name order: at most ``limit`` entries (default
    DEFAULT_LS_LIMIT, at most MAX_LS_LIMIT) whose names sort after ``after``.
    ``{"entries", "truncated", "next"}``: ``next`` is the name to pass as
    ``after`` for the following page, or None when this page ends the folder."""
    return ls_page_attached(attachment(host, wid, alias, actor), reldir, limit=limit, after=after)


def ls_page_attached(
    att: Attachment, reldir: str, *, limit: int | None = None, after: str | None = None
) -> dict[str, Any]:
    """:func:`ls_page` for an attachment just resolved; needs no registry (the
    daemon lists outside its state lock)."""
    size = check_limit(limit)
    if after is not None and (not after or "/" in after or "\x00" in after):
        raise UsageError(f"after (--after) must be one entry name from a previous page, not {after!r}")
    entries = ls_attached(att, reldir, after=after, limit=size + 1)
    truncated = len(entries) > size
    entries = entries[:size]
    return {"entries": entries, "truncated": truncated, "next": entries[-1]["name"] if truncated else None}


def ls(
    host: Root, wid: str, alias: str, reldir: str, actor: Principal, *, after: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Names and types in a folder of the source's KB; links are listed, never followed."""
    return ls_attached(attachment(host, wid, alias, actor), reldir, after=after, limit=limit)


def ls_attached(
    att: Attachment, reldir: str, *, after: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """:func:`ls` for an attachment just resolved; needs no registry. ``reldir``
    follows :func:`kbd.core.names.request_parts` (raises InvalidPath)."""
    request_parts(reldir, allow_empty=True)
    assert att.path is not None
    with pin_dir(att.path, expect=att.kb_identity) as kb:
        entries: list[dict[str, Any]] = list(list_dir(kb.fd, reldir, after=after, limit=limit))
        # Contributed notes are told apart from the source's own by provenance.
        for e in entries:
            if e["type"] == "file" and e["name"].lower().endswith(NOTE_SUFFIXES):
                rel = f"{reldir.rstrip('/')}/{e['name']}" if reldir.strip("/") else e["name"]
                try:
                    head = read_file_head(kb.fd, rel)
                except KbdError:
                    head = b""
                e["contributed_by"] = provenance_of(head)
        return entries
