"""Kernel plumbing through ctypes: statx (mount identity). No policy here.

Python 3.11 has no ``os.statx``; kbd needs ``stx_mnt_id`` and
``STATX_ATTR_MOUNT_ROOT`` to notice a KB folder that is a bind mount of someone
else's KB on the same filesystem (``st_dev`` alone cannot tell).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
STATX_BASIC_STATS = 0x7FF
STATX_MNT_ID = 0x1000
STATX_ATTR_MOUNT_ROOT = 0x2000

# The already-loaded libc (find_library would run ldconfig: slow on every start),
# loaded once for every parent-side module (kbd/sandbox/landlock_helper.py runs
# standalone inside the sandbox and loads its own). ``syscall`` returns a long.
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
_statx = getattr(libc, "statx", None)
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    _statx.restype = ctypes.c_int


@dataclass(frozen=True)
class MountInfo:
    mode: int
    dev: int
    ino: int
    mnt_id: int | None
    mount_root: bool | None


def mount_info(path: str | os.PathLike[str], *, dir_fd: int | None = None, flags: int = 0) -> MountInfo:
    """Identity and mount of ``path`` without following a final symlink.

    Falls back to ``lstat`` (mnt_id and mount_root unknown) where statx or
    STATX_MNT_ID is unavailable. Raises OSError like ``os.lstat``.
    """
    if _statx is not None:
        buf = ctypes.create_string_buffer(256)
        rc = _statx(
            AT_FDCWD if dir_fd is None else dir_fd,
            os.fsencode(path),
            AT_SYMLINK_NOFOLLOW | flags,
            STATX_BASIC_STATS | STATX_MNT_ID,
            buf,
        )
        if rc == 0:
            raw = buf.raw
            mask = int.from_bytes(raw[0:4], "little")
            attrs = int.from_bytes(raw[8:16], "little")
            attrs_mask = int.from_bytes(raw[56:64], "little")
            ino = int.from_bytes(raw[32:40], "little")
            dev = os.makedev(int.from_bytes(raw[136:140], "little"), int.from_bytes(raw[140:144], "little"))
            mnt = int.from_bytes(raw[144:152], "little") if mask & STATX_MNT_ID else None
            root = bool(attrs & STATX_ATTR_MOUNT_ROOT) if attrs_mask & STATX_ATTR_MOUNT_ROOT else None
            mode = int.from_bytes(raw[28:30], "little")
            return MountInfo(mode=mode, dev=dev, ino=ino, mnt_id=mnt, mount_root=root)
        err = ctypes.get_errno()
        if err != errno.ENOSYS:  # no statx: fall through to lstat
            raise OSError(err, os.strerror(err), os.fspath(path))
    st = os.fstat(dir_fd) if flags & AT_EMPTY_PATH and dir_fd is not None else os.lstat(path, dir_fd=dir_fd)
    return MountInfo(mode=st.st_mode, dev=st.st_dev, ino=st.st_ino, mnt_id=None, mount_root=None)
