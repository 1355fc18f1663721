"""Folder grants opened for real: the probe half of :mod:`kbd.core.folders`.

A valid grant is opened beneath its operator-approved root through the path
layer (no links, no ``..``, no other mount), so a grant can never be steered
outside the approved roots; one that cannot be opened now is unavailable, with
the path layer's reason.
"""

from __future__ import annotations

import os
from pathlib import Path

from kbd.core.folders import FolderRequest, FolderStatus, check_folders
from kbd.errors import KbdError
from kbd.fs.confined import open_beneath, pin_dir


def resolve_folders(raw: object, *, roots: tuple[Path, ...]) -> list[FolderStatus]:
    """Resolve a manifest's ``folder_access`` value now. Never raises for a bad entry."""
    return [c if isinstance(c, FolderStatus) else probe(c) for c in check_folders(raw, roots=roots)]


def probe(request: FolderRequest) -> FolderStatus:
    """``request`` as it stands now: available when its folder opens beneath its root."""
    try:
        with pin_dir(request.root) as pinned:
            fd = open_beneath(pinned.fd, str(request.rel), os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
    except KbdError as exc:
        return request.unavailable(exc.message)
    return request.available()
