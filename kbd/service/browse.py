"""Reading and listing an attached KB as its consumer sees it (docs/cli.md "Browsing").

Every call re-resolves the consumer's attachments now: the caller must be able
to inspect the consumer, the alias must be attached and available at this
moment, and the KB folder is pinned and checked against the identity seen by
that resolution before anything beneath it is opened. Nothing outside the KB is
reachable (the path layer refuses ``..``, links, other mounts and special
files), and no message carries a host path.

Split in two steps for the daemon: :func:`attachment` needs the registry (under
its state lock); :func:`read_file` and :func:`list_dir` then touch only the
files (outside it: the index reader may retry). :func:`read` and :func:`ls` do
both for the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from kbd.core.layout import INDEX_NAME, NOTES_DIR
from kbd.core.notes import provenance_of
from kbd.core.principals import Principal
from kbd.core.records import JsonValue, Record, key
from kbd.core.relpaths import DEFAULT_LS_LIMIT, MAX_LS_LIMIT, NOTE_SUFFIXES, request_parts
from kbd.core.resolve import Attachment
from kbd.errors import KbdError, NotFound, SourceUnavailable, UsageError
from kbd.fs import confined
from kbd.fs.notes import read_index
from kbd.service import ContentRecord, JsonObject, workflows
from kbd.service.root import Root

MAX_READ_BYTES = 2 * 1024 * 1024
# Listings are paged (docs/cli.md "Browsing": 100,000 files were 9.5 MB in one answer).


#: An :class:`Entry`'s JSON Schema.
ENTRY_SCHEMA: JsonObject = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "type": {"type": "string"},
                   "contributed_by": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "type"],
}  # fmt: skip


class Entry(TypedDict):
    """One name in a listing; links are listed, never followed."""

    name: str
    type: str  # file, dir, symlink or other
    # Files with a note's suffix: the contributing workflow (None: the source's own).
    contributed_by: NotRequired[str | None]


@dataclass(frozen=True)
class FileRead(ContentRecord):
    """A file read from a KB (``kbd read --json`` and ``GET …/file``): its bytes
    are written as UTF-8 text or base64 (``encoding`` says which)."""

    workflow_id: str
    alias: str | None  # None: the workflow's own KB (as search hits say)
    path: str
    data: bytes


@dataclass(frozen=True)
class Listing(Record):
    """One page of a folder, in name order; ``next`` is the ``after`` of the
    following page, or None when this page ends the folder (``kbd ls --json`` and ``GET …/dir``)."""

    workflow_id: str
    alias: str | None  # None: the workflow's own KB
    path: str
    # Each an :class:`Entry` (a TypedDict: written as it is).
    entries: tuple[JsonValue, ...] = field(metadata=key(schema={"items": ENTRY_SCHEMA}))
    truncated: bool
    next: str | None


def attachment(host: Root, wid: str, alias: str, *, actor: Principal) -> Attachment:
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


def own_kb(host: Root, wid: str, *, actor: Principal) -> Attachment:
    """``wid``'s own KB, for an actor who may inspect ``wid`` (as the attached
    ones are: the same confinement, caps and refusals follow). Its folder must
    pass the very checks an attached KB passes (not a link, not another mount,
    present): a workflow's own ``knowledgebase`` symlinked to its private
    folders is refused here too, with the reason code."""
    found = workflows.inspectable(host, wid, actor=actor)
    probe = host.probe_kb(found.folder.path)
    if probe.problem is not None:
        raise SourceUnavailable(
            f"{wid!r}'s own knowledge base is unavailable: {probe.problem.reason}: {probe.problem.message}",
            reason=probe.problem.reason,
        )
    m = found.manifest
    return Attachment(alias="", workflow_id=m.id, label=m.label, access="read", available=True, reason=None,
                      message=None, write=None, path=found.folder.kb_path,
                      kb_identity=probe.identity)  # fmt: skip


def read_own(host: Root, wid: str, relpath: str, *, actor: Principal) -> FileRead:
    """A file of ``wid``'s own KB (``kbd read WF . RELPATH``)."""
    return read_file(own_kb(host, wid, actor=actor), wid, None, relpath)


def ls_own(
    host: Root, wid: str, reldir: str, *, actor: Principal, limit: int | None = None, after: str | None = None
) -> Listing:
    """One page of a folder of ``wid``'s own KB (``kbd ls WF . [RELDIR]``)."""
    return list_dir(own_kb(host, wid, actor=actor), wid, None, reldir, limit=limit, after=after)


def read_file(att: Attachment, wid: str, alias: str | None, relpath: str) -> FileRead:
    """A regular, singly-linked file inside the source's KB (≤ 2 MiB), for an
    attachment just resolved; needs no registry (the daemon calls it outside its
    state lock: the index reader may retry). ``relpath`` follows
    :func:`kbd.core.relpaths.request_parts` (raises InvalidPath)."""
    parts = request_parts(relpath)
    assert att.path is not None
    with confined.pin_dir(att.path, expect=att.kb_identity) as kb:
        if parts == [NOTES_DIR, INDEX_NAME] and not confined.names_folder(relpath):
            # Never mistake a read failure for an empty KB: retried, then an error.
            data = read_index(kb.fd, limit=MAX_READ_BYTES)
        else:
            data = confined.read_file(kb.fd, relpath, limit=MAX_READ_BYTES)
    return FileRead(wid, alias, relpath, data)


def _page_size(limit: int | None) -> int:
    """The page size asked for, or a clear UsageError."""
    if limit is None:
        return DEFAULT_LS_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LS_LIMIT:
        raise UsageError(f"limit (--limit) must be a whole number from 1 to {MAX_LS_LIMIT}, not {limit!r}")
    return limit


def list_dir(
    att: Attachment,
    wid: str,
    alias: str | None,
    reldir: str,
    *,
    limit: int | None = None,
    after: str | None = None,
) -> Listing:
    """One page of a folder of the source's KB, in name order, for an attachment
    just resolved; needs no registry (the daemon lists outside its state lock):
    at most ``limit`` entries (default DEFAULT_LS_LIMIT, at most MAX_LS_LIMIT)
    whose names sort after ``after``. ``reldir`` follows
    :func:`kbd.core.relpaths.request_parts` (raises InvalidPath)."""
    size = _page_size(limit)
    if after is not None and (not after or "/" in after or "\x00" in after):
        raise UsageError(f"after (--after) must be one entry name from a previous page, not {after!r}")
    entries = _entries(att, reldir, after=after, limit=size + 1)
    truncated = len(entries) > size
    entries = entries[:size]
    return Listing(wid, alias, reldir, tuple(entries), truncated, entries[-1]["name"] if truncated else None)


def _entries(att: Attachment, reldir: str, *, after: str | None, limit: int) -> list[Entry]:
    """Names and types in ``reldir``; contributed notes are told apart from the
    source's own by provenance."""
    request_parts(reldir, allow_empty=True)
    assert att.path is not None
    with confined.pin_dir(att.path, expect=att.kb_identity) as kb:
        entries: list[Entry] = []
        for found in confined.list_dir(kb.fd, reldir, after=after, limit=limit):
            e = Entry(name=found["name"], type=found["type"])
            if e["type"] == "file" and e["name"].lower().endswith(NOTE_SUFFIXES):
                rel = f"{reldir.rstrip('/')}/{e['name']}" if reldir.strip("/") else e["name"]
                try:
                    head = confined.read_file_head(kb.fd, rel)
                except KbdError:
                    head = b""
                e["contributed_by"] = provenance_of(head)
            entries.append(e)
        return entries


def read(host: Root, wid: str, alias: str, relpath: str, *, actor: Principal) -> FileRead:
    """Resolve and read (see :func:`attachment` and :func:`read_file`)."""
    return read_file(attachment(host, wid, alias, actor=actor), wid, alias, relpath)


def ls(
    host: Root, wid: str, alias: str, reldir: str, *, actor: Principal, limit: int | None = None,
    after: str | None = None,
) -> Listing:  # fmt: skip
    """Resolve and list one page (see :func:`attachment` and :func:`list_dir`)."""
    return list_dir(attachment(host, wid, alias, actor=actor), wid, alias, reldir, limit=limit, after=after)
