"""The shipped systemd units, read as systemd reads them (for the tests here and
scripts/install-check.sh's twin checks): ``[Section]`` → directive → values."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNITS = ("kbd.socket", "kbd.service")
# Where the units put things on a real host; tests map each to a temporary folder.
INSTALL_PREFIX = "/opt/kbd"
STATE_ROOT = "/var/lib/kbd"
RUNTIME = "/run/kbd"


def directives(name: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of unit ``name`` (all sections), values in order."""
    out: dict[str, list[str]] = {}
    for raw in (SYSTEMD / name).read_text().splitlines():
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


def systemd_analyze() -> str:
    """The tool, or a failure saying how to get it: these checks never skip (CI
    installs the systemd package in .ci/run)."""
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing: apt-get install -y systemd"
    return tool
