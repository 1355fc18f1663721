"""Folder grants opened for real: the probe half of :mod:`kbd.core.folders`.

A valid grant is opened beneath its operator-approved root through the path
layer (no links, no ``..``, no other mount), so a grant can never be steered
outside the approved roots; one that cannot be opened now is unavailable.

On a host of many users (docs/sessions.md "Folder grants") the daemon runs as
root, and a probe made as root would tell a user whether a path exists inside
another user's private folder under an approved root. So a session whose
principal has a uid has its grants opened *as that user* (uid, primary group
and supplementary groups, through :func:`kbd.fs.libc.as_filesystem_user`),
and every failure, a missing folder and one that is not theirs alike, gives
the one same reason and message.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from kbd.core.folders import FolderRequest, FolderStatus, check_folders
from kbd.errors import KbdError
from kbd.fs import libc
from kbd.fs.confined import open_beneath, pin_dir

#: Every probe failure's message: a missing folder and one the user may not
#: open must not be told apart.
UNAVAILABLE = (
    "the approved folder does not exist, or the session's user may not open it "
    "(no permission, not a folder, a link or another mount)"
)
#: The group of a uid with no passwd entry (``nogroup``): it gets no group's access.
NO_GROUP = 65534


@dataclass(frozen=True)
class User:
    """The file-system identity folder grants are opened as."""

    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def of(cls, uid: int) -> User:
        """``uid`` with its primary and supplementary groups from the user
        database (no passwd entry: no group at all)."""
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return cls(uid, NO_GROUP, ())
        return cls(uid, pw.pw_gid, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)))


def resolve_folders(raw: object, *, roots: tuple[Path, ...], as_uid: int | None = None) -> list[FolderStatus]:
    """Resolve a manifest's ``folder_access`` value now, opening each valid
    grant as the user ``as_uid`` when given (the process must be root), else
    with the process's own credentials. Never raises for a bad entry."""
    checked = check_folders(raw, roots=roots)
    requests = [c for c in checked if isinstance(c, FolderRequest)]
    if not requests:
        return [c for c in checked if isinstance(c, FolderStatus)]
    if as_uid is None:
        probed = [probe(r) for r in requests]
    else:
        user = User.of(as_uid)
        try:
            probed = libc.as_filesystem_user(
                user.uid, user.gid, user.groups, lambda: [probe(r) for r in requests]
            )
        except OSError:  # the credentials could not be taken: nothing is opened, nothing granted
            probed = [r.unavailable(UNAVAILABLE) for r in requests]
    answers = iter(probed)
    return [c if isinstance(c, FolderStatus) else next(answers) for c in checked]


def probe(request: FolderRequest) -> FolderStatus:
    """``request`` as it stands now: available when its folder opens beneath its root."""
    try:
        with pin_dir(request.root) as pinned:
            fd = open_beneath(pinned.fd, str(request.rel), os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
    except (KbdError, OSError):
        return request.unavailable(UNAVAILABLE)
    return request.available()
