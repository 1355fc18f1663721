"""Reading and listing an attached KB as its consumer sees it (DESIGN §6 Browsing).

Split in two steps for the daemon: :func:`attachment` needs the registry (under
its state lock); :func:`read_file` and :func:`list_dir` then touch only the
files (outside it: the index reader may retry). :func:`read` and :func:`ls` do
both for the CLI.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from kbd import browse
from kbd.core.principals import Principal
from kbd.core.resolve import Attachment
from kbd.service import JsonObject
from kbd.service.root import Root

# The page bounds, for interfaces that explain them.
DEFAULT_LS_LIMIT = browse.DEFAULT_LS_LIMIT
MAX_LS_LIMIT = browse.MAX_LS_LIMIT


@dataclass(frozen=True)
class FileRead:
    workflow_id: str
    alias: str
    path: str
    data: bytes

    def to_json(self) -> JsonObject:
        """``kbd read --json`` and ``GET …/file``: UTF-8 text as is, anything else
        base64 (never altered: ``encoding`` says which)."""
        try:
            encoding, content = "utf-8", self.data.decode()
        except UnicodeDecodeError:
            encoding, content = "base64", base64.b64encode(self.data).decode()
        return {"workflow_id": self.workflow_id, "alias": self.alias, "path": self.path, "size": len(self.data),
                "encoding": encoding, "content": content}  # fmt: skip


@dataclass(frozen=True)
class Listing:
    """One page of a folder, in name order; ``next`` is the ``after`` of the
    following page, or None when this page ends the folder."""

    workflow_id: str
    alias: str
    path: str
    entries: tuple[JsonObject, ...]
    truncated: bool
    next: str | None

    def to_json(self) -> JsonObject:
        """``kbd ls --json`` and ``GET …/dir``."""
        return {"workflow_id": self.workflow_id, "alias": self.alias, "path": self.path,
                "entries": list(self.entries), "truncated": self.truncated, "next": self.next}  # fmt: skip


def attachment(host: Root, wid: str, alias: str, *, actor: Principal) -> Attachment:
    """The available attachment ``alias`` of ``wid`` as ``actor`` may see it now."""
    return browse.attachment(host, wid, alias, actor)


def read_file(att: Attachment, wid: str, alias: str, relpath: str) -> FileRead:
    return FileRead(wid, alias, relpath, browse.read_attached(att, relpath))


def list_dir(
    att: Attachment, wid: str, alias: str, reldir: str, *, limit: int | None = None, after: str | None = None
) -> Listing:
    page = browse.ls_page_attached(att, reldir, limit=limit, after=after)
    return Listing(wid, alias, reldir, tuple(page["entries"]), page["truncated"], page["next"])


def read(host: Root, wid: str, alias: str, relpath: str, *, actor: Principal) -> FileRead:
    return read_file(attachment(host, wid, alias, actor=actor), wid, alias, relpath)


def ls(
    host: Root, wid: str, alias: str, reldir: str, *, actor: Principal, limit: int | None = None,
    after: str | None = None,
) -> Listing:  # fmt: skip
    return list_dir(attachment(host, wid, alias, actor=actor), wid, alias, reldir, limit=limit, after=after)
