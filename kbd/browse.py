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

from kbd.errors import KbdError, NotFound, PermissionDenied
from kbd.names import NOTE_SUFFIXES, request_parts
from kbd.notes import provenance_of, read_index
from kbd.ops import Host
from kbd.principals import Principal
from kbd.resolve import Attachment
from kbd.safepath import list_dir, names_folder, pin_dir, read_file, read_file_head

MAX_READ_BYTES = 2 * 1024 * 1024


class SourceUnavailable(KbdError):
    """The alias is attached but not available right now; ``reason`` says why."""

    code = "source-unavailable"
    exit_code = 69
    http_status = 409
    default_hint = "`kbd sources list WF` shows every attachment with its reason"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        if reason == "audience_denied":
            self.exit_code, self.http_status = PermissionDenied.exit_code, PermissionDenied.http_status
        elif reason == "not_found":
            self.exit_code, self.http_status = NotFound.exit_code, NotFound.http_status


def attachment(host: Host, wid: str, alias: str, actor: Principal) -> Attachment:
    """The current, available attachment ``alias`` of ``wid`` as ``actor`` may see it."""
    _, attachments = host.sources(wid, actor)
    for att in attachments:
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


def read(host: Host, wid: str, alias: str, relpath: str, actor: Principal) -> bytes:
    """The bytes of a regular, singly-linked file inside the source's KB (≤ 2 MiB)."""
    return read_attached(attachment(host, wid, alias, actor), relpath)


def read_attached(att: Attachment, relpath: str) -> bytes:
    """:func:`read` for an attachment just resolved; needs no registry (the daemon
    calls it outside its state lock: the index reader may retry). ``relpath``
    follows :func:`kbd.names.request_parts` (raises InvalidPath)."""
    parts = request_parts(relpath)
    assert att.path is not None
    with pin_dir(att.path, expect=att.kb_identity) as kb:
        if parts == ["notes", "_index.json"] and not names_folder(relpath):
            # Never mistake a read failure for an empty KB: retried, then an error.
            return read_index(kb.fd, limit=MAX_READ_BYTES)
        return read_file(kb.fd, relpath, limit=MAX_READ_BYTES)


def ls(host: Host, wid: str, alias: str, reldir: str, actor: Principal) -> list[dict[str, Any]]:
    """Names and types in a folder of the source's KB; links are listed, never followed."""
    return ls_attached(attachment(host, wid, alias, actor), reldir)


def ls_attached(att: Attachment, reldir: str) -> list[dict[str, Any]]:
    """:func:`ls` for an attachment just resolved; needs no registry. ``reldir``
    follows :func:`kbd.names.request_parts` (raises InvalidPath)."""
    request_parts(reldir, allow_empty=True)
    assert att.path is not None
    with pin_dir(att.path, expect=att.kb_identity) as kb:
        entries: list[dict[str, Any]] = list(list_dir(kb.fd, reldir))
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
