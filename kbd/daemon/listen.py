"""The daemon's listening socket: made by kbd (0660, group ``kbd`` when it
exists; a folder it creates is 0750; an unsafe folder on the way is refused),
or taken from systemd socket activation (``LISTEN_FDS``) or ``--fd``."""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct
from pathlib import Path

from kbd.daemon.limits import BACKLOG
from kbd.errors import Unavailable, UnsafeSocketFolder

SD_LISTEN_FDS_START = 3
SOCKET_GROUP = "kbd"


def socket_gid() -> int:
    """Group ``kbd`` if it exists, else the daemon's own group (docs/api.md "Socket and authentication")."""
    try:
        return grp.getgrnam(SOCKET_GROUP).gr_gid
    except KeyError:
        return os.getegid()


def unsafe_folder(mode: int) -> bool:
    """Writable by others without the sticky bit: anyone could replace the socket."""
    return bool(mode & stat.S_IWOTH) and not mode & stat.S_ISVTX


def foreign_owner(uid: int, *, me: int) -> bool:
    """A folder's owner may rename or replace any entry in it (sticky bit or not):
    only root and the daemon's own user may own a folder above the socket."""
    return uid not in (0, me)


def _check_ancestors(folder: Path) -> None:
    """Refuse a socket whose folder (or a folder above it) others may rename or
    replace entries in. The folders checked are the real ones: a symlinked
    component is resolved, so a link to someone else's folder is seen as that
    folder (its owner could swap the socket for their own and collect tokens)."""
    me = os.geteuid()
    # A link on the way is as good as a folder to its owner: they may retarget it
    # between this check and the bind (in a sticky folder too: it is theirs).
    for f in (folder, *folder.parents):
        try:
            lst = os.lstat(f)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(lst.st_mode) and foreign_owner(lst.st_uid, me=me):
            raise UnsafeSocketFolder(
                f"{f} on the socket's path is a link owned by uid {lst.st_uid}, neither root nor the daemon's "
                f"uid {me}: its owner could point it elsewhere"
            )
    real = Path(os.path.realpath(folder))
    for f in (real, *real.parents):
        try:
            st = os.stat(f)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeSocketFolder(f"socket folder {f} is not a folder")
        if foreign_owner(st.st_uid, me=me):
            raise UnsafeSocketFolder(
                f"socket folder {f} belongs to uid {st.st_uid}, neither root nor the daemon's uid {me}: its "
                "owner could replace the socket"
            )
        if unsafe_folder(st.st_mode):
            raise UnsafeSocketFolder(
                f"socket folder {f} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) without the "
                "sticky bit: anyone could replace the socket; kbd never changes the mode of a folder it did not "
                "create"
            )


def _make_folders(folder: Path, gid: int) -> None:
    """Create the missing folders above the socket, each 0750 with group ``gid``;
    existing folders are left exactly as they are."""
    missing: list[Path] = []
    for f in (folder, *folder.parents):
        if os.path.lexists(f):
            break
        missing.append(f)
    for f in reversed(missing):
        try:
            os.mkdir(f, 0o700)  # born private: no window where it is wider than 0750
        except FileExistsError:
            raise UnsafeSocketFolder(f"socket folder {f} appeared while kbd was creating it") from None
        os.chown(f, -1, gid)
        os.chmod(f, 0o750)  # noqa: S103 - the group traverses to reach the 0660 socket


def _holder(probe: socket.socket) -> str:
    """`` (pid N, uid U)`` of the process listening at the other end of
    ``probe`` (its credentials from when it bound), or nothing if unknown."""
    try:
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return ""
    pid, uid, _ = struct.unpack("3i", raw)
    return f" (pid {pid}, uid {uid})" if pid > 0 else ""


def bind_socket(path: Path) -> socket.socket:
    """Create the listening socket: 0660 with the socket group, in a folder that
    is safe; a folder kbd creates is 0750 with that group; stale socket replaced."""
    gid = socket_gid()
    _check_ancestors(path.parent)
    _make_folders(path.parent, gid)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise Unavailable(
                f"{path} exists and is not a socket; refusing to replace it",
                hint="move that file away, or serve another socket: kbd serve --socket PATH",
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise Unavailable(f"another kbd daemon{_holder(probe)} is already serving {path}", hint=(
                "stop it first (under systemd: systemctl stop kbd.socket kbd.service), or serve another "
                "socket: kbd serve --socket PATH, and point clients at it with KBD_SOCKET"))  # fmt: skip
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window where it is wider
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chown(path, -1, gid)
    os.chmod(path, 0o660)
    sock.listen(BACKLOG)
    return sock


def inherited_socket(fd: int | None) -> socket.socket | None:
    if (
        fd is None
        and os.environ.get("LISTEN_PID") == str(os.getpid())
        and os.environ.get("LISTEN_FDS") == "1"
    ):
        fd = SD_LISTEN_FDS_START
    if fd is None:
        return None
    return socket.socket(fileno=fd)
