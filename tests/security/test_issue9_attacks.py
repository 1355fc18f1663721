"""Attacks on the issue 9 fixes as merged (an adversarial review): each test
failed on the merged branch before the fix beside it. Real CLI, real daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import KbRoot

NOBODY = 65534


@pytest.mark.parametrize("via_link", [False, True])
def test_serve_refuses_a_socket_folder_another_user_owns(kb: KbRoot, tmp_path: Path, via_link: bool) -> None:
    """Item 11: a folder owned by someone else (mode 0755, so no "writable by
    others" bit) lets its owner rename kbd's socket away and put their own in its
    place, then collect the bearer tokens clients send. Reached directly or
    through a symlink (the merged check stat()ed the lexical path only)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    folder = theirs
    if via_link:
        folder = tmp_path / "link"
        folder.symlink_to(theirs)
    r = kb.cli("serve", "--socket", str(folder / "kbd.sock"))
    assert r.code == 65, (r.code, r.out, r.err)
    assert r.err.startswith("error[unsafe-socket-folder]: "), r.err
    assert f"uid {NOBODY}" in r.err and "Traceback" not in r.err, r.err
    assert list(theirs.iterdir()) == [], "kbd created its socket in a folder another user owns"
