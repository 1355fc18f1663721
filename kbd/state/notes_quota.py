"""The ``notes/`` quota across commands: the mark a shell command leaves in
``state/`` when it left a source's ``notes/`` over quota, and the check every
write and every later command makes under that ``notes/``'s mutex.

State, not the filesystem shell: the mark is kbd's own record (like the session
store), outliving the command that set it, and it is what turns one command's
verdict into the next writer's refusal until the source's owner cleans up.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.notes import NotesScan, quota_refusal
from kbd.fs.atomic import write_atomic
from kbd.fs.locks import lock_path
from kbd.fs.notes import notes_key, scan_notes

if TYPE_CHECKING:
    from kbd.core.config import NotesQuota


def _marker(state_dir: Path, key: str) -> Path:
    return lock_path(state_dir, "quota", key).with_suffix(".over")


def mark_over_quota(state_dir: Path, key: str, source: str, scan: NotesScan | None) -> None:
    """Remember that the ``notes/`` whose :func:`~kbd.fs.notes.notes_key` is
    ``key`` was left over quota (``scan``: what was counted), or forget it (None)."""
    path = _marker(state_dir, key)
    if scan is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    info = {"source": source, "entries": scan.entries, "bytes": scan.bytes, "since": time.time()}
    write_atomic(path, json.dumps(info).encode(), mode=0o640)


def check_quota(
    state_dir: Path,
    quota: NotesQuota,
    kb_fd: int,
    notes_fd: int,
    *,
    source: str,
    adds: tuple[int, int] = (0, 0),
) -> None:
    """Under the source's notes mutex: raise QuotaExceeded when ``notes/`` is over
    its quota, or would be after adding ``adds`` = (entries, bytes). The bounded
    walk is paid only by writes and by a command into a notes/ marked over quota."""
    key = notes_key(notes_fd)
    marked = _marker(state_dir, key).exists()
    if not marked and adds == (0, 0):
        return
    scan = scan_notes(kb_fd, quota=quota)
    if marked and not scan.over(quota):
        mark_over_quota(state_dir, key, source, None)  # back under: the source's owner cleaned up
        marked = False
    refusal = quota_refusal(scan, quota, source=source, marked=marked, adds=adds)
    if refusal is not None:
        raise refusal
