"""A real, throwaway host user for tests of what a non-root caller gets through the daemon
(docs/multi-user.md): created and removed by the ``user`` fixture, never left on the host."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import KbRoot
from tests.integration import daemon


@dataclass
class User:
    name: str
    uid: int
    gid: int
    group: str
    group_gid: int


@contextlib.contextmanager
def throwaway_user(prefix: str = "kbd") -> Iterator[User]:
    """A real non-root user (``<prefix>u…``) with a supplementary group (``<prefix>t…``),
    removed afterwards (tests and bench/cli.py alike)."""
    tag = uuid.uuid4().hex[:8]
    name, group = f"{prefix}u{tag}", f"{prefix}t{tag}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "-G", group, name], check=True)
        try:
            pw = pwd.getpwnam(name)
            yield User(name, pw.pw_uid, pw.pw_gid, group, grp.getgrnam(group).gr_gid)
        finally:
            subprocess.run(["userdel", name], check=True)
    finally:
        subprocess.run(["groupdel", group], check=False)


@pytest.fixture
def user() -> Iterator[User]:
    """A real non-root user with a supplementary group, removed afterwards."""
    with throwaway_user() as u:
        yield u


@contextlib.contextmanager
def serving_for(kb: KbRoot, base: Path, u: User) -> Iterator[daemon.Daemon]:
    """The daemon on a socket the user's group may use (the operator's choice;
    docs/multi-user.md names group kbd, which this test must not create host-wide)."""
    with daemon.serving(kb.root, sock=base / "run" / "kbd.sock") as served:
        os.chown(served.sock.parent, -1, u.group_gid)
        os.chown(served.sock, -1, u.group_gid)
        yield served


def as_user(u: User, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    # The caller's umask and open-file limit differ from the daemon's, so the
    # test sees whose the command gets.
    shell = 'umask 027; ulimit -n 777; exec "$@"'
    return subprocess.run(
        ["setpriv", "--reuid", str(u.uid), "--regid", str(u.gid), "--init-groups", "sh", "-c", shell, "sh", *argv],
        capture_output=True, env=env, timeout=60, check=False, cwd="/",
    )  # fmt: skip
