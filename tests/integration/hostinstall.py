"""kbd installed as a host installs it, for tests and bench/exec.py.

A host runs kbd from a venv it made and filled with pip, without ``-e``
(systemd/README.md: ``python3 -m venv /opt/kbd``, then ``pip install``): the
``kbd`` console script pip writes, the package and its data files copied into
site-packages, bytecode compiled at install. :func:`install` does exactly that
from this checkout in a fresh venv, upgrading the venv's own pip first: the pip
a Debian venv starts with (23.0) writes a console script that imports ``re``
(pip >= 25 does not), ≈5 ms of CPU on every brokered ``kbd exec``. The
third-party dependencies are not downloaded again: one .pth line appends the
running venv's site-packages. It is a plain path line, so the .pth files there
(the development venv's editable install among them) are not read, and
``import kbd`` finds the host venv's own copy (checked).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600.0  # pip builds the wheel in an isolated environment (setuptools from the index)


def install(where: Path) -> Path:
    """This checkout installed without -e into a fresh venv at ``where``; the
    path of its ``kbd`` console script."""
    base = str(getattr(sys, "_base_executable", sys.executable))  # the interpreter this venv was made from
    subprocess.run([base, "-m", "venv", str(where)], check=True, timeout=TIMEOUT)
    pip = [str(where / "bin" / "python"), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True, timeout=TIMEOUT)
    subprocess.run([*pip, "install", "--no-deps", str(REPO)], check=True, timeout=TIMEOUT)
    python = where / "bin" / "python"
    purelib = _ask(python, "import sysconfig; print(sysconfig.get_path('purelib'))")
    Path(purelib, "kbd-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    found = _ask(python, "import kbd; print(kbd.__file__)")
    assert found.startswith(purelib + "/"), f"the host venv imports kbd from {found}, not its own install"
    return where / "bin" / "kbd"


def pip_version(kbd: Path) -> str:
    """The version of the pip that wrote ``kbd`` (the venv's own)."""
    return _ask(kbd.parent / "python", "import pip; print(pip.__version__)")


def _ask(python: Path, code: str) -> str:
    # -P: not the current folder first (it may be this checkout).
    return subprocess.run(
        [str(python), "-P", "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()
