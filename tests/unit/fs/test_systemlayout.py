"""``others_cannot_use`` (kbd/fs/systemlayout.py): can a user who is neither the
owner nor in the group reach, read and run a file, where it really lies?"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.fs.systemlayout import others_cannot_use


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user may enter (pytest's own tmp folders are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kbd-install-", dir="/tmp"))
    os.chmod(path, 0o755)  # noqa: S103 - the case under test
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_a_file_every_user_may_read_and_run(open_dir: Path) -> None:
    prog = open_dir / "python3"
    prog.write_text("#!/bin/sh\n")
    os.chmod(prog, 0o755)  # noqa: S103
    assert others_cannot_use(prog, run=True) is None
    os.chmod(prog, 0o744)
    assert others_cannot_use(prog, run=False) is None
    assert others_cannot_use(prog, run=True) == f"{prog}: other users cannot run it (mode 0744)"


def test_a_closed_folder_above_it_is_named_even_through_a_link(open_dir: Path) -> None:
    closed = open_dir / "root-home"
    closed.mkdir(mode=0o700)
    prog = closed / "python3.11"
    prog.write_text("#!/bin/sh\n")
    os.chmod(prog, 0o755)  # noqa: S103
    link = open_dir / "venv-python"
    link.symlink_to(prog)  # a venv's bin/python is a link to the interpreter it was made from
    problem = others_cannot_use(link, run=True)
    assert problem == f"{prog}: other users cannot reach it: {closed} is mode 0700 (no o+x)"
