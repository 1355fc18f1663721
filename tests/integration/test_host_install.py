"""`kbd exec` by kbd as a host installs it (``pip install`` without -e into a
venv, see tests/integration/hostinstall.py) against this checkout's own `kbd`:
through the real daemon and in-process, commands and refusals answer byte for
byte alike (exit code, stdout, stderr). The development venv's editable install
puts this whole folder on the path; the installed thin client runs from its
own copy, with the console script pip wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import IN_PROCESS_ENV, KbRoot
from tests.integration import daemon, hostinstall

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_landlock(abi=2), pytest.mark.timeout(600)]

THIS_CHECKOUT = [sys.executable, "-m", "kbd"]


@dataclass
class Host:
    kbd: Path
    kb: KbRoot
    daemon: daemon.Daemon
    sid: str

    def run(self, command: list[str], *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        r = subprocess.run(
            [*command, "--root", str(self.kb.root), *args],
            env={**daemon.clean_env(), **(env or {})},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return r.returncode, r.stdout, r.stderr

    def both(self, *args: str, env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
        """``kbd ARGS`` by the installed console script, then by this checkout."""
        return [self.run([str(self.kbd)], *args, env=env), self.run(THIS_CHECKOUT, *args, env=env)]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """The installed `kbd`, and a root with a read session of ``con`` (opened
    by alice through the installed CLI) served by the real daemon, which
    authenticates this uid as the admin ``ops``."""
    kbd = hostinstall.install(tmp_path_factory.mktemp("host") / "venv")
    kb = KbRoot.create(tmp_path_factory.mktemp("hostroot") / "root")
    kb.workflow("con", access={"owners": ["alice"]})
    opened = subprocess.run(
        [str(kbd), "--root", str(kb.root), "session", "open", "con", "--kind", "execution",
         "--as", "alice", "--json"],
        env=daemon.clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert opened.returncode == 0, opened.stderr
    sid = opened.stdout.split('"session_id"', 1)[1].split('"')[1]
    daemon.map_uid(kb.root, "ops", os.getuid())
    with daemon.serving(kb.root) as served:
        yield Host(kbd, kb, served, sid)


@pytest.mark.parametrize("path", ["brokered", "in_process"])
def test_the_installed_kbd_execs_as_this_checkout_does(host: Host, path: str) -> None:
    env = {"KBD_SOCKET": str(host.daemon.sock)} if path == "brokered" else dict(IN_PROCESS_ENV)
    script = 'echo "out:$KBD_SESSION"; echo err >&2; exit 3'
    installed, checkout = host.both("exec", host.sid, "--", "sh", "-c", script, env=env)
    assert installed == (3, f"out:{host.sid}\n", "err\n"), installed
    assert installed == checkout


@pytest.mark.parametrize(
    "args",
    [
        ["exec", "s_00000000000000000000", "--", "true"],  # 66, from the daemon
        ["exec", "{sid}", "--bogus", "--", "true"],  # 2, the grammar
        ["exec", "{sid}", "--as", "alice", "--", "true"],  # 77: this uid authenticates as ops
        ["exec", "--help"],  # click's help
    ],
    ids=["unknown-session", "usage", "as-mismatch", "help"],
)
def test_the_installed_kbd_refuses_as_this_checkout_does(host: Host, args: list[str]) -> None:
    argv = [a.replace("{sid}", host.sid) for a in args]
    installed, checkout = host.both(*argv, env={"KBD_SOCKET": str(host.daemon.sock)})
    assert installed[0] in (0, 2, 66, 77), installed
    assert installed == checkout
