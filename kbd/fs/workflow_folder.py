"""A new workflow folder, made by kbd for its builder (``kbd workflows create``).

The folder is built complete under a temporary name beside its final place and
renamed into place with ``RENAME_NOREPLACE``: a half-made workflow folder never
appears, and an existing one is never replaced. Every step works beneath the
pinned ``workflows/`` folder, never following a link; owners and modes are set
through each new entry's own descriptor.

Layout (docs/multi-user.md "The permission model"), with a grant group::

    <WF>/                      owner:grant 2750
      workflow.json            owner:grant 0640
      knowledgebase/           owner:grant 2750
        context/               owner:grant 2750
        notes/                 owner:grant 2770   (granted sandboxed commands write here)
          _index.json          owner:grant 0640

Without one, the group is the owner's primary group and every folder is 0750.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kbd.core.layout import INDEX_NAME, KB_DIR, MANIFEST, NOTES_DIR
from kbd.errors import WorkflowExists, from_oserror
from kbd.fs.atomic import write_atomic_at
from kbd.fs.confined import pin_dir
from kbd.fs.libc import rename_noreplace

EMPTY_INDEX = b"{}\n"


@dataclass(frozen=True)
class Ownership:
    """Who a new workflow folder belongs to: ``uid``, ``gid`` and whether
    ``gid`` is the host's grant group (then folders are setgid and notes/ is
    group-writable)."""

    uid: int
    gid: int
    grant: bool

    def mode(self, folder: str) -> int:
        if not self.grant:
            return 0o750
        return 0o2770 if folder == NOTES_DIR else 0o2750


def _own(fd: int, who: Ownership, mode: int) -> None:
    if os.geteuid() == 0:
        os.fchown(fd, who.uid, who.gid)
    # After the chown (which clears setgid on some filesystems): exactly ``mode``.
    os.fchmod(fd, mode)


def _subfolder(parent: int, name: str, who: Ownership) -> int:
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    _own(fd, who, who.mode(name))
    return fd


def _fill(top: int, manifest: bytes, who: Ownership) -> None:
    owner = (who.uid, who.gid) if os.geteuid() == 0 else None
    kb = _subfolder(top, KB_DIR, who)
    try:
        os.close(_subfolder(kb, "context", who))
        notes = _subfolder(kb, NOTES_DIR, who)
        try:
            write_atomic_at(notes, INDEX_NAME, EMPTY_INDEX, mode=0o640, keep_owner=False, keep_mode=False,
                            owner=owner)  # fmt: skip
        finally:
            os.close(notes)
    finally:
        os.close(kb)
    write_atomic_at(top, MANIFEST, manifest, mode=0o640, keep_owner=False, keep_mode=False, owner=owner)


def create(workflows: Path, name: str, manifest: bytes, who: Ownership) -> Path:
    """Create ``workflows/<name>`` holding ``manifest``; WorkflowExists if
    anything is at that name already (nothing is changed then)."""
    with pin_dir(workflows) as pinned:
        parent = pinned.fd
        if _exists(parent, name):
            raise WorkflowExists(f"a folder named {name!r} already exists under the workflows folder")
        tmp = f".kbd-new-{os.urandom(8).hex()}"
        try:
            os.mkdir(tmp, 0o700, dir_fd=parent)
            top = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                _fill(top, manifest, who)
                _own(top, who, who.mode(name))
                os.fsync(top)
            finally:
                os.close(top)
            rename_noreplace(parent, tmp, parent, name)
            os.fsync(parent)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp, dir_fd=parent)
            if isinstance(exc, FileExistsError) or (
                isinstance(exc, OSError) and exc.errno == errno.ENOTEMPTY
            ):
                raise WorkflowExists(
                    f"a folder named {name!r} already exists under the workflows folder"
                ) from None
            if isinstance(exc, OSError):
                raise from_oserror(exc, what=f"create workflow folder {name!r}") from None
            raise
    return workflows / name


def _exists(parent: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
