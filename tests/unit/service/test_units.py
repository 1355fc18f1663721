"""kbd/service/units.py: a root service runs only what root alone can change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kbd.errors import PermissionDenied
from kbd.service.units import shipped, unsafe_for_root


@pytest.fixture
def program(tmp_path: Path) -> Path:
    folder = tmp_path / "opt" / "kbd" / "bin"
    folder.mkdir(parents=True)
    for p in (tmp_path / "opt", tmp_path / "opt" / "kbd", folder):
        p.chmod(0o755)
    exe = folder / "kbd"
    exe.write_text("#!/usr/bin/python3\n")
    exe.chmod(0o755)
    return exe


def test_a_root_owned_install_is_safe_and_each_way_out_is_named(program: Path, tmp_path: Path) -> None:
    assert unsafe_for_root(program) is None
    shipped(["kbd.service"], kbd_bin=program)  # and kbd units accepts it
    program.parent.chmod(0o775)
    assert "writable by its group or by others (mode 0775)" in str(unsafe_for_root(program))
    program.parent.chmod(0o755)
    os.chown(program, 65534, -1)
    assert unsafe_for_root(program) == f"{program} is owned by uid 65534, not root"
    with pytest.raises(PermissionDenied, match=r"runs .* as root, but .* owned by uid 65534"):
        shipped(["kbd.service"], kbd_bin=program)
    os.chown(program, 0, -1)
    # A link into a folder another user owns: where it leads counts.
    theirs = tmp_path / "home"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    real = theirs / "kbd"
    shutil.copy2(program, real)
    program.unlink()
    program.symlink_to(real)
    assert f"{theirs} is owned by uid 65534" in str(unsafe_for_root(program))


def test_the_interpreter_counts_too(program: Path, tmp_path: Path) -> None:
    python = tmp_path / "py"
    python.mkdir(mode=0o777)
    python.chmod(0o777)
    (python / "python3").write_text("")
    program.write_text(f"#!{python}/python3 -I\n")
    with pytest.raises(PermissionDenied, match=f"{python} is writable"):
        shipped(None, kbd_bin=program)
