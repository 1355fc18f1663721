"""`kbd serve --socket PATH` leaves other people's folders alone (docs/api.md "Socket and authentication";
docs/api.md "Socket and authentication"): a folder kbd creates is 0750 with the socket group, an existing
folder keeps its mode (a 1777 /tmp-like folder too), a folder writable by
others without the sticky bit is refused, and the socket is 0660 with group
``kbd`` when that group exists, else the daemon's own group. The REAL daemon."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from tests.helpers import KbRoot
from tests.integration.daemon import serving


def socket_gid() -> int:
    try:
        return grp.getgrnam("kbd").gr_gid
    except KeyError:
        return os.getegid()  # the daemon runs as this test's user


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def folder(path: Path, perm: int) -> Path:
    path.mkdir()
    os.chmod(path, perm)  # chmod: independent of the umask
    return path


@pytest.mark.parametrize("perm", [0o755, 0o700, 0o1777, 0o3775])
def test_an_existing_folder_keeps_its_mode(kb: KbRoot, tmp_path: Path, perm: int) -> None:
    d = folder(tmp_path / "sockets", perm)
    before = os.lstat(d)
    sock = d / "kbd.sock"
    with serving(kb.root, sock=sock):
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == socket_gid()
        assert mode(d) == perm, f"kbd changed {perm:04o} to {mode(d):04o}"
    after = os.lstat(d)
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)


def test_folders_kbd_creates_are_0750_with_the_socket_group(kb: KbRoot, tmp_path: Path) -> None:
    old = os.umask(0o022)  # the daemon inherits it; the created folders must not
    try:
        sock = tmp_path / "new" / "run" / "kbd.sock"
        with serving(kb.root, sock=sock):
            for d in (tmp_path / "new", tmp_path / "new" / "run"):
                st = os.lstat(d)
                assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == socket_gid(), (d, oct(st.st_mode))
            assert mode(sock) == 0o660 and os.lstat(sock).st_gid == socket_gid()
    finally:
        os.umask(old)
    assert not (tmp_path / "new" / "run" / "kbd.sock").exists()


@pytest.mark.parametrize(("layout", "perm"), [("sockets", 0o777), ("sockets", 0o773), ("open/sub", 0o777)])
def test_a_folder_others_may_write_without_the_sticky_bit_is_refused(
    kb: KbRoot, tmp_path: Path, layout: str, perm: int
) -> None:
    top = folder(tmp_path / layout.split("/")[0], perm)
    sock = tmp_path / layout / "kbd.sock"
    r = kb.cli("serve", "--socket", str(sock))
    assert r.code == 65, (r.code, r.err)
    assert r.err.startswith("error[unsafe-socket-folder]: "), r.err
    assert "writable by others" in r.err and "sticky" in r.err and f"{perm:04o}" in r.err, r.err
    assert "hint:" in r.err and "Traceback" not in r.err
    assert mode(top) == perm, "the refused folder was changed"
    assert sorted(p.name for p in top.iterdir()) == [], "something was created in the refused folder"
