"""``others_cannot_use`` (kbd/fs/systemlayout.py): can a user who is neither the
owner nor in the group reach, read and run a file, where it really lies?"""

from __future__ import annotations

import os
from pathlib import Path

from kbd.fs.systemlayout import others_cannot_use


def test_a_file_every_user_may_read_and_run(traversable: Path) -> None:
    prog = traversable / "python3"
    prog.write_text("#!/bin/sh\n")
    os.chmod(prog, 0o755)  # noqa: S103
    assert others_cannot_use(prog, run=True) is None
    os.chmod(prog, 0o744)
    assert others_cannot_use(prog, run=False) is None
    assert others_cannot_use(prog, run=True) == f"{prog}: other users cannot run it (mode 0744)"


def test_a_closed_folder_above_it_is_named_even_through_a_link(traversable: Path) -> None:
    closed = traversable / "root-home"
    closed.mkdir(mode=0o700)
    prog = closed / "python3.11"
    prog.write_text("#!/bin/sh\n")
    os.chmod(prog, 0o755)  # noqa: S103
    link = traversable / "venv-python"
    link.symlink_to(prog)  # a venv's bin/python is a link to the interpreter it was made from
    problem = others_cannot_use(link, run=True)
    assert problem == f"{prog}: other users cannot reach it: {closed} is mode 0700 (no o+x)"
