"""The broker's readers of the caller's /proc entry and its stdio checks
(kbd/daemon/broker.py), against this process's real values."""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path

import pytest

from kbd.daemon.broker import check_stdio, parse_limits, parse_umask
from kbd.errors import WireError


def test_limits_are_read_as_the_kernel_reports_them() -> None:
    limits = parse_limits(Path("/proc/self/limits").read_text())
    for res in (resource.RLIMIT_NOFILE, resource.RLIMIT_STACK, resource.RLIMIT_CORE, resource.RLIMIT_AS):
        assert limits[res] == resource.getrlimit(res)


def test_the_umask_is_read_from_status() -> None:
    old = os.umask(0o027)
    try:
        assert parse_umask(Path("/proc/self/status").read_text()) == 0o027
    finally:
        os.umask(old)


def test_stdio_must_be_three_descriptors_none_a_folder_or_o_path(tmp_path: Path) -> None:
    a, b = socket.socketpair()
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    (tmp_path / "f").touch()
    opath = os.open(tmp_path / "f", os.O_PATH)
    try:
        assert check_stdio([a.fileno(), b.fileno(), a.fileno()]) == (a.fileno(), b.fileno(), a.fileno())
        with pytest.raises(WireError, match="send exactly 3"):
            check_stdio([a.fileno(), b.fileno()])
        for bad in (folder, opath):
            with pytest.raises(WireError, match="folder or an O_PATH"):
                check_stdio([a.fileno(), bad, b.fileno()])
    finally:
        os.close(folder)
        os.close(opath)
        a.close()
        b.close()
