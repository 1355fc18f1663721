"""The post-command audit of a write plan clears set-id bits a command left in
a source's notes/ (docs/multi-user.md "The permission model": a setgid file there would hand the grant group to
whoever runs it outside). The seccomp filter refuses to set them; this is the
second layer, proven here on real files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kbd.core.config import NotesQuota
from kbd.fs.notes import scan_notes
from kbd.service.command_notes import CommandChanges, strip_setid


def test_setid_bits_are_cleared_through_the_file_never_through_a_link(tmp_path: Path) -> None:
    kb = tmp_path / "kb"
    (kb / "notes" / "sub").mkdir(parents=True)
    (kb / "notes" / "sub").chmod(
        0o2770
    )  # a folder's inherited setgid stays: it is how notes/ keeps its group
    tool = kb / "notes" / "sub" / "tool"
    tool.write_bytes(b"#!/bin/sh\n")
    tool.chmod(0o6755)
    plain = kb / "notes" / "plain.md"
    plain.write_text("x\n")
    outside = tmp_path / "outside"
    outside.write_text("y\n")
    outside.chmod(0o2755)
    (kb / "notes" / "link").symlink_to(outside)
    st = kb.stat()
    fd = os.open(kb, os.O_RDONLY | os.O_DIRECTORY)
    try:
        scan = scan_notes(fd, quota=NotesQuota(), since_ns=0)
    finally:
        os.close(fd)
    changes = CommandChanges("src", "src-wf", kb, (st.st_dev, st.st_ino), scan)
    assert strip_setid(changes) == ["notes/sub/tool"]
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755
    assert stat.S_IMODE(plain.stat().st_mode) == 0o644 & ~_umask()
    assert stat.S_IMODE(outside.stat().st_mode) == 0o2755  # never followed
    assert stat.S_IMODE((kb / "notes" / "sub").stat().st_mode) == 0o2770


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
