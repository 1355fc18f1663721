"""A bounded walk of the notes-like files (``.md``, ``.markdown``, ``.txt``)
beneath a pinned KB, for the search index and the review queue.

Every folder is opened beneath the KB's fd through the confined-path layer
(no ``..``, no link, no other mount); entries are lstat'ed relative to their
opened folder, so nothing is followed; only regular, singly-linked files of
at most ``max_bytes`` are reported (a link, FIFO, socket or device is never
opened: it is skipped by its lstat). The walk stops at ``max_files`` reported
files and ``MAX_SCAN_DEPTH`` levels. What is then *read* is read with
:func:`kbd.fs.confined.read_file_stat`, which checks the opened inode again.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import NamedTuple

from kbd.core.notes import MAX_SCAN_DEPTH
from kbd.core.relpaths import NOTE_SUFFIXES, TEMP_NAME
from kbd.errors import KbdError
from kbd.fs.confined import open_beneath


class Seen(NamedTuple):
    """A file as the walk saw it (its lstat signature)."""

    rel: str  # relative to the KB root
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def walk_notes(
    kb_fd: int, top: str = "", *, max_files: int, max_bytes: int, folders: list[str] | None = None
) -> Iterator[Seen]:
    """Notes-like regular files beneath ``top`` ("" = the KB itself), in no set
    order; each folder opened is appended to ``folders`` when given."""
    stack = [(top, 0)]
    found = 0
    while stack:
        rel, depth = stack.pop()
        try:
            fd = open_beneath(kb_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        except KbdError:
            continue  # gone, a link, another mount: nothing below it is ours to read
        if folders is not None:
            folders.append(rel)
        try:
            # lstat'ed while the folder is open: a DirEntry of an fd stats relative to it.
            entries = _entries(fd)
        finally:
            os.close(fd)
        for name, st in entries:
            child = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                if depth < MAX_SCAN_DEPTH:
                    stack.append((child, depth + 1))
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or st.st_size > max_bytes:
                continue
            if not name.lower().endswith(NOTE_SUFFIXES) or TEMP_NAME.match(name):
                continue
            yield Seen(child, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            found += 1
            if found >= max_files:
                return


def _entries(fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each entry of the open folder ``fd``; vanished ones skipped."""
    out: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:
                    continue
    except OSError:
        pass
    return out
