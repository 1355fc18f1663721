"""Independently authorized folder grants (``folder_access`` in workflow.json).

A folder grant is not KB-derived: it survives a KB detach, and kb_access does
not narrow it. Its path must lie under one of the operator-approved
``folder_roots`` of kbd.yaml; it is opened beneath that root through the path
layer (no links, no ``..``, no other mount), so a grant can never be steered
outside the approved roots. Entries are parsed leniently and reported with a
reason, like attachments.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

from kbd.core.identifiers import alias_problem
from kbd.core.plan import FolderStatus
from kbd.core.strict import kind_of
from kbd.errors import KbdError
from kbd.fs.confined import open_beneath, pin_dir

ACCESS = ("read_only", "read_write")
KEYS = ("alias", "path", "access")
MAX_FOLDERS = 20


def _bad(alias: Any, access: Any, reason: str, message: str) -> FolderStatus:
    return FolderStatus(
        alias=alias if isinstance(alias, str) and alias_problem(alias) is None else "",
        access=access if access in ACCESS else "read_only",
        available=False,
        reason=reason,
        message=message,
        path=None,
    )


def resolve_folders(raw: Any, *, roots: tuple[Path, ...]) -> list[FolderStatus]:
    """Resolve a manifest's ``folder_access`` value now. Never raises for a bad entry."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        return [_bad(None, None, "invalid_entry", f"folder_access must be a list, got {kind_of(raw)}")]
    out: list[FolderStatus] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if i >= MAX_FOLDERS:
            out.append(_bad(None, None, "invalid_entry", f"more than {MAX_FOLDERS} folder grants"))
            continue
        out.append(_resolve_one(item, roots=roots, seen=seen))
    return out


def _resolve_one(item: Any, *, roots: tuple[Path, ...], seen: set[str]) -> FolderStatus:
    if not isinstance(item, dict):
        return _bad(None, None, "invalid_entry", f"entry must be an object, got {kind_of(item)}")
    alias, path, access = item.get("alias"), item.get("path"), item.get("access", "read_only")
    unknown = sorted(set(item) - set(KEYS))
    if unknown:
        return _bad(alias, access, "invalid_entry", f"unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    if (problem := alias_problem(alias)) is not None or not isinstance(alias, str):
        return _bad(alias, access, "invalid_entry", f"alias {problem}")
    if alias in seen:
        return _bad(None, access, "invalid_entry", f"alias {alias!r} is used twice")
    seen.add(alias)
    if access not in ACCESS:
        return _bad(alias, access, "invalid_entry", f"access {access!r}; allowed: {', '.join(ACCESS)}")
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return _bad(alias, access, "invalid_entry", "path must be an absolute path")
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        return _bad(alias, access, "invalid_entry", "path must not contain '..'")
    for root in roots:
        try:
            rel = pure.relative_to(PurePosixPath(root))
        except ValueError:
            continue
        try:
            with pin_dir(root) as pinned:
                fd = open_beneath(pinned.fd, str(rel), os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
        except KbdError as exc:
            return _bad(alias, access, "folder_unavailable", exc.message)
        canonical = root / rel if str(rel) != "." else root
        return FolderStatus(
            alias=alias, access=access, available=True, reason=None, message=None, path=canonical
        )
    return _bad(
        alias,
        access,
        "folder_not_approved",
        "the path is not under an operator-approved folder root (kbd.yaml folder_roots)",
    )
