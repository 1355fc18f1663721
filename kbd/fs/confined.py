"""Race-free path resolution beneath pinned directory descriptors (docs/access.md "The path layer").

Every path kbd takes from someone else (a KB-relative path to browse, a note
name to write) is opened *beneath* a directory fd that kbd pinned itself, never
by joining strings and checking them lexically (``realpath`` + ``commonpath``
loses to symlink swaps and PATH_MAX-long chains).

Policy, stricter than the kernel's minimum and identical on both code paths:

* A relative path is validated before any syscall: non-empty, no NUL, not
  absolute, no ``..`` component, at most :data:`PATH_MAX` bytes and
  :data:`NAME_MAX` bytes per component. Names are taken literally: ``..%2f``
  and backslashes are ordinary characters, never decoded. A trailing ``/``
  names a folder (POSIX): ``a.md/`` is ENOTDIR, never the file ``a.md``.
  (What callers may *ask for* is narrower — no control characters, no
  backslashes: :func:`kbd.core.relpaths.request_parts`, applied by every entry point.
  This layer stays literal so kbd's own walks can still reach, and audit,
  whatever names a contributor's shell created.)
* Symbolic links are never followed inside a KB (``RESOLVE_NO_SYMLINKS``), nor
  magic links, nor mount crossings (``RESOLVE_NO_XDEV``): the files kbd serves
  and writes are exactly the files physically inside the pinned folder. (Shell
  commands in the sandbox see links resolved inside their own mount namespace,
  where only granted folders exist.)
* Primary path: ``openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS|
  RESOLVE_NO_XDEV)`` through ctypes, retried a bounded number of times on
  ``EAGAIN``. Fallback, only where openat2 does not exist (ENOSYS at import):
  an ``O_NOFOLLOW`` walk one component at a time with a mount check. A lookup
  openat2 refused is never retried with the walk.
* After opening, ``fstat`` verifies the type (and for reads size and link
  count) of what was actually opened. Every fd is ``O_CLOEXEC``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kbd.core.relpaths import NAME_MAX as NAME_MAX
from kbd.core.relpaths import PATH_MAX as PATH_MAX
from kbd.core.relpaths import names_folder as names_folder
from kbd.core.relpaths import split_relative as split_relative
from kbd.errors import (
    NO_SPACE_ERRNOS,
    Busy,
    InvalidPath,
    KbdError,
    PathNotFound,
    PathRefused,
    PermissionDenied,
    from_oserror,
)
from kbd.fs.atomic import write_atomic_at
from kbd.fs.libc import AT_EMPTY_PATH, AT_FDCWD, SYS_OPENAT2, libc, mount_info

EAGAIN_RETRIES = 16

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


# syscall(2) typed once for openat2 (its own function object: ``libc.syscall``
# stays untyped for other callers), and each open_how built once as immutable
# bytes: wrapping every argument and building the struct per call was a third
# of a pin's time, and a policy lookup pins about 28 folders.
_openat2_call = libc["syscall"]
_openat2_call.restype = ctypes.c_long
_openat2_call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
_HOWS: dict[tuple[int, int, int], bytes] = {}  # kbd uses a handful of combinations
_MAX_HOWS = 64


def _raw_openat2(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
    key = (flags, mode, resolve)
    how = _HOWS.get(key)
    if how is None:
        how = bytes(_OpenHow(flags, mode, resolve))
        if len(_HOWS) < _MAX_HOWS:
            _HOWS[key] = how
    return int(_openat2_call(SYS_OPENAT2, dirfd, path, how, len(how)))


def _probe_openat2() -> bool:
    fd = _raw_openat2(AT_FDCWD, b"/", os.O_PATH | os.O_CLOEXEC, 0, 0)
    if fd >= 0:
        os.close(fd)
        return True
    return ctypes.get_errno() != errno.ENOSYS


HAVE_OPENAT2 = _probe_openat2()


def _refusal(err: int, rel: str) -> KbdError:
    """errno → the error a caller sees. Never includes a host path."""
    shown = rel if len(rel) <= 200 else rel[:200] + "…"
    if err == errno.ENOENT:
        return PathNotFound(f"{shown!r} does not exist in the knowledge base")
    if err == errno.ENOTDIR:
        if names_folder(rel):
            return PathNotFound(
                f"{shown!r} ends with '/', so it names a folder, but it (or a component) is not a folder",
                hint="drop the trailing '/' to name a file",
            )
        return PathNotFound(f"a component of {shown!r} is not a folder")
    if err == errno.ELOOP:
        return PathRefused(
            f"{shown!r} goes through a symbolic link; kbd never follows links inside a KB", why="symlink"
        )
    if err == errno.EXDEV:
        return PathRefused(
            f"{shown!r} leaves the knowledge base (a link, '..' or another mount)", why="escape"
        )
    if err in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{shown!r} is not accessible", hint="the file's permissions deny kbd")
    if err == errno.EISDIR:
        return PathRefused(f"{shown!r} is a folder", why="not_file")
    if err == errno.ENAMETOOLONG:
        return InvalidPath(f"{shown!r} is too long")
    if err == errno.EAGAIN:
        return Busy(f"{shown!r} kept changing while it was looked up; retry")
    if err in NO_SPACE_ERRNOS:  # a full disk is not a refusal of the path
        return from_oserror(OSError(err, os.strerror(err)), what=f"write {shown!r}")
    return PathRefused(f"{shown!r} cannot be opened ({os.strerror(err)})", why="os_error")


def _openat2(dirfd: int, parts: list[str], flags: int, mode: int, *, resolve: int = STRICT) -> int:
    return _openat2_rel(dirfd, "/".join(parts), flags, mode, resolve=resolve)


def _openat2_rel(dirfd: int, rel: str, flags: int, mode: int = 0, *, resolve: int = STRICT) -> int:
    """``openat2`` of the relative path ``rel`` ("" is ``dirfd`` itself), retried
    while the kernel answers EAGAIN (a rename raced the walk) or EINTR."""
    path = os.fsencode(rel or ".")
    for _ in range(EAGAIN_RETRIES):
        fd = _raw_openat2(dirfd, path, flags | os.O_CLOEXEC, mode, resolve)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, os.strerror(err))
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))


def _mnt(fd: int) -> tuple[int, int | None]:
    info = mount_info("", dir_fd=fd, flags=AT_EMPTY_PATH)
    return info.dev, info.mnt_id


def _open_nofollow(name: str, flags: int, mode: int, dirfd: int) -> int:
    """``openat`` with ``O_NOFOLLOW``; a link answers ELOOP (as RESOLVE_NO_SYMLINKS
    does), even where O_DIRECTORY would have said ENOTDIR."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)
    except NotADirectoryError:
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP)) from None
        raise


def _walk(dirfd: int, parts: list[str], flags: int, mode: int, *, same_mount: bool = True) -> int:
    """Fallback: one component at a time, never following a link (nor, with
    ``same_mount``, leaving the mount).

    Only the final fd's mount is compared: once a walk enters another mount,
    everything beneath is on that mount or a deeper one (a bind mount is always
    a new mount ID), so it can never come back to the base mount.
    """
    base = _mnt(dirfd) if same_mount else None
    cur = os.dup(dirfd)
    try:
        for comp in parts[:-1]:
            nxt = _open_nofollow(comp, os.O_RDONLY | os.O_DIRECTORY, 0, cur)
            os.close(cur)
            cur = nxt
        fd = _open_nofollow(parts[-1] if parts else ".", flags, mode, cur)
    finally:
        os.close(cur)
    try:
        # O_PATH|O_NOFOLLOW opens a final symlink itself instead of failing:
        # refuse it exactly as RESOLVE_NO_SYMLINKS does.
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        if base is not None and _mnt(fd) != base:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_folders(
    parent: int, names: Sequence[str], *, mode: int, owner: tuple[int, int] | None = None
) -> int:
    """Open each folder of ``names`` in turn beneath ``parent`` (each strictly
    beneath the last, never through a link), creating what is missing; a folder
    created gets ``owner`` (uid, gid) and then exactly ``mode`` (mkdir's mode
    passes through the caller's umask). Returns the last folder's fd (a dup of
    ``parent`` for no names)."""
    cur = os.dup(parent)
    try:
        for name in names:
            try:
                nxt = open_beneath(cur, name, os.O_RDONLY | os.O_DIRECTORY)
            except PathNotFound:
                try:
                    os.mkdir(name, mode & 0o777, dir_fd=cur)
                    created = True
                except FileExistsError:
                    created = False  # made meanwhile by someone else: theirs, as it is
                nxt = open_beneath(cur, name, os.O_RDONLY | os.O_DIRECTORY)
                if created:
                    if owner is not None:
                        os.fchown(nxt, *owner)
                    os.fchmod(nxt, mode)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def open_beneath(
    dirfd: int, rel: str, flags: int = os.O_RDONLY, mode: int = 0, *, use_openat2: bool | None = None
) -> int:
    """Open ``rel`` strictly beneath ``dirfd`` (see module policy). Returns an fd.

    Raises InvalidPath / PathNotFound / PathRefused / PermissionDenied / Busy.
    ``O_NONBLOCK`` is added (except to ``O_PATH``), so opening a FIFO planted at the name never
    hangs (it has no effect on regular files and folders).
    ``use_openat2`` exists for the differential tests; callers leave it None.
    """
    parts = split_relative(rel, allow_empty=True)
    if parts and names_folder(rel):
        flags |= os.O_DIRECTORY  # split_relative dropped the trailing '/': keep what it meant
    if not flags & os.O_PATH:  # openat2 refuses O_PATH with any other open flag
        flags |= os.O_NONBLOCK
    primary = HAVE_OPENAT2 if use_openat2 is None else use_openat2
    try:
        return _openat2(dirfd, parts, flags, mode) if primary else _walk(dirfd, parts, flags, mode)
    except OSError as exc:
        raise _refusal(exc.errno or errno.EIO, rel) from None


@dataclass
class Pinned:
    """An open directory fd with the identity it had when pinned."""

    fd: int
    dev: int
    ino: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The process's "/" pinned once (the root does not move under a running kbd);
# lookups start from a dup of it instead of opening "/" every time.
_ROOT_FD: int | None = None


def _root_fd() -> int:
    global _ROOT_FD
    if _ROOT_FD is None:
        _ROOT_FD = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return _ROOT_FD


def pin_dir(path: Path, *, expect: tuple[int, int] | None = None, path_only: bool = False) -> Pinned:
    """Pin the directory at absolute ``path`` without following any symlink on the way.

    Walks from ``/`` with ``RESOLVE_NO_SYMLINKS`` (mount crossings are allowed:
    kbd roots often live on another filesystem than ``/``). When ``expect``
    (st_dev, st_ino) is given, the pinned folder must be that same folder, so a
    folder swapped between resolution and use is refused.

    ``path_only``: an ``O_PATH`` pin, for looking only (fstat, statx and opens
    beneath it; never listing or reading the folder itself). The walk and its
    refusals are the same; such an open makes no inotify event, so the
    daemon's per-lookup probes of watched folders never wake its watcher.
    """
    if not path.is_absolute():
        raise InvalidPath("internal: pin_dir needs an absolute path")
    flags = (os.O_PATH if path_only else os.O_RDONLY) | os.O_DIRECTORY
    try:
        if HAVE_OPENAT2:
            # A Path is normalised (no "." or empty components), so its text
            # past the leading "/" is the components joined: no split per pin.
            rel = str(path).lstrip("/")
            fd = _openat2_rel(_root_fd(), rel, flags, resolve=RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        else:
            parts = [c for c in str(path).split("/") if c not in ("", ".")]
            fd = _walk(_root_fd(), parts, flags, 0, same_mount=False)
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            raise Busy("a folder kept changing while it was looked up; retry") from None
        raise _folder_refusal(exc.errno or errno.EIO) from None
    st = os.fstat(fd)
    if expect is not None and (st.st_dev, st.st_ino) != expect:
        os.close(fd)
        raise PathRefused(
            "the folder changed since it was resolved (swapped or replaced); retry", why="swapped"
        )
    return Pinned(fd, st.st_dev, st.st_ino)


def _folder_refusal(err: int) -> KbdError:
    if err in (errno.ELOOP, errno.EXDEV):
        return PathRefused("a folder on the way is a symbolic link", why="symlink")
    if err in (errno.ENOENT, errno.ENOTDIR):
        return PathNotFound("the folder does not exist")
    return PathRefused(f"the folder cannot be opened ({os.strerror(err)})", why="os_error")


def read_file(dirfd: int, rel: str, *, limit: int, use_openat2: bool | None = None) -> bytes:
    """Read a regular, singly-linked file beneath ``dirfd``, at most ``limit`` bytes.

    The file is first opened ``O_PATH`` and checked with fstat, so a FIFO, socket
    or device is refused without ever being opened for reading (no hang, no
    driver side effect); the same inode is then reopened through /proc/self/fd.
    """
    return read_file_stat(dirfd, rel, limit=limit, use_openat2=use_openat2)[0]


def _open_regular(
    dirfd: int, rel: str, *, limit: int, allow_hardlinks: bool, use_openat2: bool | None = None
) -> tuple[int, os.stat_result]:
    """A readable fd of the regular file ``rel`` beneath ``dirfd``: opened ``O_PATH``
    and checked with fstat first (a FIFO or device is never opened), then the
    same inode reopened through /proc/self/fd and checked again."""
    split_relative(rel)  # an empty path is an error here, not "the folder itself"
    pfd = open_beneath(dirfd, rel, os.O_PATH, use_openat2=use_openat2)
    try:
        st = os.fstat(pfd)
        _check_regular(st, rel, limit, allow_hardlinks)
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            raise _refusal(exc.errno or errno.EIO, rel) from None
    finally:
        os.close(pfd)
    try:
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise PathRefused(f"{rel!r} changed while it was opened", why="swapped")
        _check_regular(st2, rel, limit, allow_hardlinks)
    except BaseException:
        os.close(fd)
        raise
    return fd, st2


def read_file_stat(
    dirfd: int, rel: str, *, limit: int, allow_hardlinks: bool = False, use_openat2: bool | None = None
) -> tuple[bytes, os.stat_result]:
    """:func:`read_file`, also returning the fstat of what was read."""
    fd, st = _open_regular(dirfd, rel, limit=limit, allow_hardlinks=allow_hardlinks, use_openat2=use_openat2)
    try:
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, 1 << 16):
            total += len(chunk)
            if total > limit:
                raise PathRefused(f"{rel!r} is larger than {limit} bytes", why="too_large")
            chunks.append(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def read_file_head(dirfd: int, rel: str, *, size: int = 1024) -> bytes:
    """The first ``size`` bytes of a regular, singly-linked file beneath ``dirfd``."""
    fd, _ = _open_regular(dirfd, rel, limit=1 << 62, allow_hardlinks=False)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _check_regular(st: os.stat_result, rel: str, limit: int, allow_hardlinks: bool) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise PathRefused(f"{rel!r} is a folder; list it instead", why="not_file")
    if not stat.S_ISREG(st.st_mode):
        raise PathRefused(f"{rel!r} is not a regular file (FIFO, socket or device)", why="special_file")
    if st.st_nlink > 1 and not allow_hardlinks:
        raise PathRefused(
            f"{rel!r} has {st.st_nlink} hard links; kbd serves only singly-linked files", why="hardlinked"
        )
    if st.st_size > limit:
        raise PathRefused(f"{rel!r} is larger than {limit} bytes", why="too_large")


_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def list_dir(
    dirfd: int, rel: str, *, after: str | None = None, limit: int | None = None
) -> list[dict[str, str]]:
    """Names and types in the folder ``rel`` beneath ``dirfd`` (``""`` = the folder
    itself), in name order: those after ``after``, at most ``limit`` (only these
    are stat'ed). Entries are lstat'ed relative to the opened folder: nothing is followed."""
    fd = open_beneath(dirfd, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out: list[dict[str, str]] = []
        for name in sorted(os.listdir(fd)):
            if after is not None and name <= after:
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                kind = _TYPES.get(stat.S_IFMT(st.st_mode), "other")
            except FileNotFoundError:
                continue
            out.append({"name": name, "type": kind})
        return out
    finally:
        os.close(fd)


def replace_file(
    dirfd: int, rel: str, data: bytes, *, mode: int = 0o644, owner: tuple[int, int] | None = None
) -> None:
    """Atomically create or replace the regular file ``rel`` beneath ``dirfd``.

    The final name is never opened: a temp file is created ``O_EXCL|O_NOFOLLOW``
    in the (strictly resolved) parent folder, fsynced and renamed over the name,
    then the folder is fsynced. An existing destination that is not a regular
    file (folder, link, FIFO, device) is refused; a hardlinked one is replaced,
    never written through. The new file has exactly ``mode`` (masked to
    read/write bits; umask-independent): an existing file's mode is never
    carried over, so a planted set-id or executable bit does not survive.
    ``owner`` (uid, gid; root only) is set on the temp file before the rename.
    """
    parts = split_relative(rel)
    if names_folder(rel):
        raise InvalidPath(f"{rel[:200]!r} ends with '/': name a file, not a folder")
    parent = "/".join(parts[:-1])
    name = parts[-1]
    pfd = open_beneath(dirfd, parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = _TYPES.get(stat.S_IFMT(st.st_mode), "special file")
            raise PathRefused(
                f"{rel!r} exists and is a {kind}; only regular files are replaced", why="not_file"
            )
        try:
            write_atomic_at(pfd, name, data, mode=mode, keep_owner=False, keep_mode=False, owner=owner)
        except OSError as exc:
            raise _refusal(exc.errno or errno.EIO, rel) from None
    finally:
        os.close(pfd)


def link_below(root: Path, target: Path, *, folder: bool = False) -> str | None:
    """Why ``target`` (inside the grant ``root``) must not be used, or None: the
    file-system half of the path guard (:mod:`kbd.core.pathguard`).

    Its folder is pinned from ``/`` without following any link, then the name
    itself is checked with lstat: a link anywhere on the way is refused. A
    folder that does not exist yet is fine (a writer creates it; nothing below a
    missing folder can be a link), unless something else stands in its place.
    With ``folder`` (the path ended with ``/``), the target must be a folder.
    """
    if target == Path("/"):
        return None
    parent = target.parent
    missing: list[str] = [target.name]
    while True:
        try:
            pinned = pin_dir(parent)
            break
        except PathNotFound as exc:
            if parent == root or parent == Path("/") or root not in parent.parents:
                return exc.message
            missing.insert(0, parent.name)
            parent = parent.parent
        except KbdError as exc:
            return exc.message
    with pinned:
        try:
            st = os.stat(missing[0], dir_fd=pinned.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
    if stat.S_ISLNK(st.st_mode):
        return "the path is a symbolic link; kbd never follows links inside grants"
    if len(missing) > 1 and not stat.S_ISDIR(st.st_mode):
        return "a component of the path is not a folder"
    if folder and not stat.S_ISDIR(st.st_mode):
        return "the path ends with '/' but names a file, not a folder"
    return None
