"""The system default root (docs/cli.md "Global options", docs/multi-user.md): without --root and
$KBD_ROOT, a caller who has no root of their own uses /var/lib/kbd when it exists.

The tests never touch the host's /var/lib/kbd: each command runs in a private
mount namespace (bubblewrap, as root) where a temporary folder is mounted at
/var/lib/kbd (or nothing is, on an empty /var/lib).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CliResult, KbRoot

pytestmark = pytest.mark.requires_bwrap

REPO = Path(__file__).resolve().parents[2]


def kbd_with_system_root(system: Path | None, home: Path, *args: str) -> CliResult:
    """`kbd ARGS` without --root/KBD_ROOT/XDG_DATA_HOME, HOME=``home``, in a mount
    namespace whose /var/lib holds only ``system`` at /var/lib/kbd (or nothing)."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    mounts = ["--dev-bind", "/", "/", "--tmpfs", "/var/lib"]
    if system is not None:
        mounts += ["--bind", str(system), "/var/lib/kbd"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KBD_", "XDG_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [bwrap, *mounts, "--", sys.executable, "-m", "kbd", *args],
        capture_output=True, env=env, cwd=home, timeout=60, check=False,
    )  # fmt: skip
    return CliResult(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


@pytest.fixture
def system(tmp_path: Path) -> KbRoot:
    kb = KbRoot.create(tmp_path / "system")
    kb.workflow("sys-wf", access={"owners": ["alice"]})
    return kb


def listed(r: CliResult) -> list[str]:
    assert r.code == 0, r.err
    return [w["id"] for w in r.json()["workflows"]]


def test_a_caller_without_a_root_of_their_own_uses_the_system_root(tmp_path: Path, system: KbRoot) -> None:
    home = tmp_path / "home"
    home.mkdir()
    r = kbd_with_system_root(system.root, home, "workflows", "list", "--as", "alice", "--json")
    assert listed(r) == ["sys-wf"]
    assert not (home / ".local").exists()


def test_the_callers_own_root_wins_over_the_system_root(tmp_path: Path, system: KbRoot) -> None:
    home = tmp_path / "home"
    own = KbRoot.create(home / ".local" / "share" / "kbd")
    own.workflow("own-wf", access={"owners": ["alice"]})
    r = kbd_with_system_root(system.root, home, "workflows", "list", "--as", "alice", "--json")
    assert listed(r) == ["own-wf"]


def test_without_a_system_root_the_missing_own_root_is_the_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    r = kbd_with_system_root(None, home, "workflows", "list", "--as", "alice")
    assert r.code == 65, r.err
    assert f"kbd root {home / '.local' / 'share' / 'kbd'} does not exist" in r.err


def test_init_never_falls_back_to_the_system_root(tmp_path: Path) -> None:
    """An empty /var/lib/kbd (as systemd's StateDirectory= leaves it) is not
    initialised by a bare `kbd init`: that creates the caller's own root."""
    home = tmp_path / "home"
    home.mkdir()
    empty = tmp_path / "empty-state"
    empty.mkdir()
    r = kbd_with_system_root(empty, home, "init", "--host", "h", "--json")
    assert r.code == 0, r.err
    assert r.json()["root"] == str(home / ".local" / "share" / "kbd")
    assert list(empty.iterdir()) == []
    named = kbd_with_system_root(empty, home, "--root", "/var/lib/kbd", "init", "--host", "h", "--json")
    assert named.code == 0, named.err
    assert (empty / "kbd.yaml").is_file()
