"""Durable file I/O: atomic replacement of a file beneath a folder.

Atomic replacement (docs/notes.md "Concurrency"): a random temp name created with
``O_CREAT|O_EXCL|O_NOFOLLOW`` beside the target, write, fsync, ``rename`` over
the target, fsync the folder. The final name is never opened for writing, so a
symlink or hardlink planted there is replaced, not written through.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
#: Every file kbd writes is data (JSON, YAML, notes): read/write bits only. Never
#: set-uid, set-gid, sticky or executable, whatever the caller asks for and
#: whatever mode the file it replaces had (a planted 06755 must not survive a save
#: made by root).
DATA_MODE_MASK = 0o666


def write_atomic(
    path: Path, data: bytes, *, mode: int = 0o644, keep_owner: bool = True, keep_mode: bool = True
) -> None:
    """Replace ``path`` atomically with ``data``.

    The new file gets ``mode`` masked to :data:`DATA_MODE_MASK`, independent of
    the umask (set with fchmod). With ``keep_mode``, an existing regular file's
    read/write bits are carried over instead (still masked: never set-id,
    sticky or executable); with ``keep_owner``, when running as root, its owner
    too, so saving a user's manifest does not hand it to root. Raises OSError;
    on failure the target is untouched and the temp file removed.
    """
    dfd = os.open(path.parent, _DIR_FLAGS)
    try:
        write_atomic_at(dfd, path.name, data, mode=mode, keep_owner=keep_owner, keep_mode=keep_mode)
    finally:
        os.close(dfd)


def write_atomic_at(
    dfd: int,
    name: str,
    data: bytes,
    *,
    mode: int = 0o644,
    keep_owner: bool = True,
    keep_mode: bool = True,
    owner: tuple[int, int] | None = None,
) -> None:
    """Like :func:`write_atomic`, beneath an already pinned directory fd.
    ``owner`` (uid, gid), when given, is set on the temp file's descriptor
    before the rename (root only)."""
    if "/" in name or name in {"", ".", ".."} or "\x00" in name:
        raise ValueError(f"not a plain file name: {name!r}")
    uid = gid = -1
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            if keep_mode:
                mode = stat.S_IMODE(st.st_mode)
            if keep_owner and os.geteuid() == 0:
                uid, gid = st.st_uid, st.st_gid
    except FileNotFoundError:
        pass
    if owner is not None:
        uid, gid = owner
    mode &= DATA_MODE_MASK
    # A fixed-length temp name: a long (multi-byte) target name cannot push it past NAME_MAX.
    tmp = f".kbd-{os.urandom(8).hex()}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dfd,
    )
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if uid != -1:
                os.fchown(fd, uid, gid)
            # After the chown (which may clear mode bits) and never through the
            # umask: the file ends with exactly ``mode``.
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.fsync(dfd)


def ensure_private_dir(path: Path, mode: int = 0o750) -> None:
    """Create a kbd-owned folder (and parents) if missing."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
