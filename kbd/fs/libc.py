"""Kernel plumbing through ctypes: the one loaded libc, the syscall and prctl
numbers kbd uses, and statx (mount identity). No policy here.

Every parent-side module that calls into libc takes :data:`libc` and the named
numbers from here. Errors are compared with the ``errno`` module's names. The
one exception is :mod:`kbd.sandbox.landlock_helper`, which runs standalone
inside the sandbox (no kbd imports) and so carries its own copies; a unit test
keeps them equal to these.

Python 3.11 has no ``os.statx``; kbd needs ``stx_mnt_id`` and
``STATX_ATTR_MOUNT_ROOT`` to notice a KB folder that is a bind mount of someone
else's KB on the same filesystem (``st_dev`` alone cannot tell).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
STATX_BASIC_STATS = 0x7FF
STATX_MNT_ID = 0x1000
STATX_ATTR_MOUNT_ROOT = 0x2000

# Syscall numbers. These four are the same on every Linux architecture (the
# unified table, since 5.x); capset differs between x86_64 and the generic table
# (aarch64, riscv64, ...).
SYS_OPENAT2 = 437
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
SYS_CAPSET_X86_64 = 126
SYS_CAPSET_GENERIC = 91
# (setgroups, setfsuid, setfsgid) per machine: x86_64's own table, and the
# generic one. Called raw, each changes the calling thread only (glibc's
# setgroups wrapper changes every thread of the process).
SYS_FS_CREDENTIALS = {"x86_64": (116, 122, 123), "aarch64": (159, 151, 152), "riscv64": (159, 151, 152)}
LANDLOCK_CREATE_RULESET_VERSION = 1  # landlock_create_ruleset flag: return the ABI version

# prctl options (linux/prctl.h) and their arguments.
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# The already-loaded libc (find_library would run ldconfig: slow on every start),
# loaded once for every parent-side module (kbd/sandbox/landlock_helper.py runs
# standalone inside the sandbox and loads its own). ``syscall`` returns a long.
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
_statx = getattr(libc, "statx", None)
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    _statx.restype = ctypes.c_int


class MountInfo(NamedTuple):  # a tuple: built ~28 times per policy lookup
    mode: int
    dev: int
    ino: int
    mnt_id: int | None
    mount_root: bool | None


# struct statx (linux/stat.h), little-endian: stx_mask u32 @0, stx_attributes u64 @8,
# stx_mode u16 @28, stx_ino u64 @32, stx_attributes_mask u64 @56; stx_dev_major,
# stx_dev_minor u32 @136 and @140, stx_mnt_id u64 @144. One unpack for all of
# them (a policy lookup makes about 28 of these calls).
_STATX_FIELDS = struct.Struct("<I4xQ12xH2xQ16xQ72xIIQ")
_STATX_SIZE = 256  # sizeof(struct statx): the kernel writes all of it


def mount_info(
    path: str | bytes | os.PathLike[str], *, dir_fd: int | None = None, flags: int = 0
) -> MountInfo:
    """Identity and mount of ``path`` without following a final symlink.

    Falls back to ``lstat`` (mnt_id and mount_root unknown) where statx or
    STATX_MNT_ID is unavailable. Raises OSError like ``os.lstat``.
    """
    if _statx is not None:
        buf = ctypes.create_string_buffer(_STATX_SIZE)
        name = path if isinstance(path, bytes) else os.fsencode(path)
        rc = _statx(AT_FDCWD if dir_fd is None else dir_fd, name, AT_SYMLINK_NOFOLLOW | flags,
                    STATX_BASIC_STATS | STATX_MNT_ID, buf)  # fmt: skip
        if rc == 0:
            mask, attrs, mode, ino, attrs_mask, dev_major, dev_minor, mnt_id = _STATX_FIELDS.unpack_from(buf)
            return MountInfo(
                mode,
                os.makedev(dev_major, dev_minor),
                ino,
                mnt_id if mask & STATX_MNT_ID else None,
                bool(attrs & STATX_ATTR_MOUNT_ROOT) if attrs_mask & STATX_ATTR_MOUNT_ROOT else None,
            )
        err = ctypes.get_errno()
        if err != errno.ENOSYS:  # no statx: fall through to lstat
            raise OSError(err, os.strerror(err), os.fsdecode(path))
    st = os.fstat(dir_fd) if flags & AT_EMPTY_PATH and dir_fd is not None else os.lstat(path, dir_fd=dir_fd)
    return MountInfo(mode=st.st_mode, dev=st.st_dev, ino=st.st_ino, mnt_id=None, mount_root=None)


RENAME_NOREPLACE = 1


def rename_noreplace(src_dirfd: int, src: str, dst_dirfd: int, dst: str) -> None:
    """``renameat2(..., RENAME_NOREPLACE)``: move ``src`` to ``dst`` only if no
    ``dst`` exists (a plain rename replaces an empty folder). Raises OSError
    (``FileExistsError`` when ``dst`` is taken)."""
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(src_dirfd, os.fsencode(src), dst_dirfd, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


T = TypeVar("T")


def as_filesystem_user(uid: int, gid: int, groups: Sequence[int], fn: Callable[[], T]) -> T:
    """``fn()`` run in a short-lived thread of its own whose file-system
    credentials are ``uid``, ``gid`` and ``groups`` (needs root): every path it
    opens is checked as that user's would be, while the process's other threads
    keep theirs (a thread ``fn`` starts inherits the user's). The thread puts
    its credentials back before it ends (and ends with ``fn``). Raises what
    ``fn`` raises, or OSError when the credentials cannot be taken (never
    running ``fn`` then)."""
    import threading  # not on the exec path

    numbers = SYS_FS_CREDENTIALS.get(os.uname().machine)
    if numbers is None:
        raise OSError(errno.ENOSYS, f"per-thread credentials are not known on {os.uname().machine}")
    outcome: list[tuple[bool, object]] = []

    def body() -> None:
        try:
            outcome.append((True, _as_user(numbers, uid, gid, groups, fn)))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=body, name="kbd-as-user")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def _as_user(
    numbers: tuple[int, int, int], uid: int, gid: int, groups: Sequence[int], fn: Callable[[], T]
) -> T:
    setgroups, setfsuid, setfsgid = numbers
    euid, egid, before = os.geteuid(), os.getegid(), os.getgroups()

    def set_groups(gids: Sequence[int]) -> None:
        if libc.syscall(setgroups, len(gids), (ctypes.c_uint * len(gids))(*gids)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setgroups: {os.strerror(err)}")

    try:
        set_groups(groups)
        # setfsgid and setfsuid answer the previous id, never an error: asking
        # again with -1 (no change) tells whether the change was made.
        libc.syscall(setfsgid, gid)
        libc.syscall(setfsuid, uid)
        if (libc.syscall(setfsgid, -1), libc.syscall(setfsuid, -1)) != (gid, uid):
            raise OSError(errno.EPERM, f"cannot take the file-system credentials of uid {uid}")
        return fn()
    finally:
        libc.syscall(setfsuid, euid)
        libc.syscall(setfsgid, egid)
        set_groups(before)
