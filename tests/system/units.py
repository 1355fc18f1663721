"""The shipped systemd units, read as systemd reads them (for the tests here and
scripts/install-check.sh's twin checks): ``[Section]`` → directive → values; and
installed as a host installs them (`kbd units install`)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
UNITS = ("kbd.socket", "kbd.service")
# The placeholders of kbd.service that `kbd units install` fills in: the
# executable (ExecStart) and the installed docs folder (Documentation=).
KBD_BIN = "{{KBD_BIN}}"
KBD_DOCS = "{{KBD_DOCS}}"
# Where the units put things on a real host; tests map each to a temporary folder.
STATE_ROOT = "/var/lib/kbd"
RUNTIME = "/run/kbd"


def directives(name: str, *, folder: Path = SYSTEMD) -> dict[str, list[str]]:
    """Every ``Key=value`` of unit ``name`` (all sections), values in order."""
    out: dict[str, list[str]] = {}
    for raw in (folder / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{name}: not a directive: {line!r}"
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def exec_start(service: dict[str, list[str]]) -> list[str]:
    (line,) = service["ExecStart"]
    return shlex.split(line)


def environment(service: dict[str, list[str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in service.get("Environment", []):
        for word in shlex.split(value):
            key, _, val = word.partition("=")
            env[key] = val
    return env


def rewrite(text: str, paths: dict[str, str]) -> str:
    """``text`` with each path prefix of ``paths`` replaced (longest first), only
    where the prefix is a whole path component."""
    for old in sorted(paths, key=len, reverse=True):
        text = re.sub(re.escape(old) + r"(?=/|\s|$)", paths[old], text)
    return text


def install_units(kbd_bin: str, dest: Path) -> subprocess.CompletedProcess[str]:
    """`kbd units install --kbd-bin KBD_BIN --dest DEST`: the units, sysusers.d
    and tmpfiles.d under DEST/etc."""
    argv = [sys.executable, "-m", "kbd", "units", "install", "--kbd-bin", kbd_bin, "--dest", str(dest)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def installed_units(dest: Path) -> Path:
    """Where install_units put the units."""
    return dest / "etc" / "systemd" / "system"


def systemd_analyze() -> str:
    """The tool, or a failure saying how to get it: these checks never skip (CI
    installs the systemd package in .ci/run)."""
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing: apt-get install -y systemd"
    return tool
