"""A source's ``notes/`` on disk, beneath a pinned KB: its mutex, the bounded
walk, the confined replace of one note, and the index reader.

The mutex (:func:`notes_lock`) is a lock (:func:`kbd.fs.locks.held`) keyed by
the identity (``st_dev:st_ino``) of the canonical ``notes/`` folder, so it
survives a rename of the source workflow; it works across threads and
processes, is released by the kernel when a holder dies, and is also held by
``kbd exec`` for the whole command when a session may write into that
``notes/``. Readers never take it. Every path goes through the confined-path
layer (:mod:`kbd.fs.confined`): no ``..``, no link, no other mount.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.layout import INDEX_NAME
from kbd.core.layout import NOTES_DIR as NOTES
from kbd.core.notes import MAX_SCAN_DEPTH, Changed, NotesScan
from kbd.core.relpaths import TEMP_NAME
from kbd.errors import IndexUnreadable, KbdError, PathNotFound
from kbd.fs.confined import make_folders, open_beneath, read_file, replace_file
from kbd.fs.locks import held

if TYPE_CHECKING:
    from kbd.core.config import NotesQuota

#: Every written note, whatever mode the file it replaces had (never set-id or executable).
NOTE_MODE = 0o644
NOTE_FOLDER_MODE = 0o755
#: On a host with a grant group, a note kbd writes as root belongs to the
#: notes/ folder's owner and group (the source's builder, the grant group):
#: readable and writable by its owner outside and by granted commands inside.
SHARED_NOTE_MODE = 0o660
INDEX_RETRIES = 10
INDEX_RETRY_DELAY = 0.02
# A short poll keeps a writer's wait tail close to the holder's real hold time.
NOTES_LOCK_POLL = 0.005


# -- the folder and its mutex -------------------------------------------------------------


@contextlib.contextmanager
def open_notes(kb_fd: int) -> Iterator[int]:
    """The ``notes/`` folder beneath the pinned KB ``kb_fd``, open for the block."""
    fd = open_beneath(kb_fd, NOTES, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def notes_key(notes_fd: int) -> str:
    """The identity of the ``notes/`` open at ``notes_fd``: what its mutex and
    its quota mark are keyed by."""
    st = os.fstat(notes_fd)
    return f"{st.st_dev}:{st.st_ino}"


def notes_lock(
    state_dir: Path, notes_fd: int, *, timeout: float, who: Mapping[str, str]
) -> AbstractContextManager[None]:
    """Hold the mutex of the ``notes/`` folder open at ``notes_fd``.

    Raises Busy (exit 75) naming the current holder's workflow when ``timeout`` passes."""
    return held(state_dir, "notes", notes_key(notes_fd), timeout=timeout, what="the source's notes/", who=who,
                poll=NOTES_LOCK_POLL)  # fmt: skip


# -- the bounded walk -----------------------------------------------------------------------------


def _past_end(st: os.stat_result) -> int:
    """Disk space a file holds beyond its length rounded up to whole blocks:
    fallocate(FALLOC_FL_KEEP_SIZE) takes any amount without growing st_size (nor
    meeting RLIMIT_FSIZE), so a quota of lengths alone would not see it. A sparse
    file still counts its length."""
    block = max(st.st_blksize, 512)
    return max(0, st.st_blocks * 512 - -(-st.st_size // block) * block)


def scan_notes(kb_fd: int, *, quota: NotesQuota, since_ns: int | None = None) -> NotesScan:
    """Walk ``notes/`` beneath the pinned KB (nothing followed), within the caps."""
    out = NotesScan()
    stack = [(NOTES, 0)]
    while stack:
        rel, depth = stack.pop()
        try:
            fd = open_beneath(kb_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        except KbdError:
            continue
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    out.entries += 1
                    if out.entries > quota.max_files:
                        out.truncated = True
                        return out
                    child = f"{rel}/{entry.name}"
                    if entry.is_dir(follow_symlinks=False):
                        if depth >= MAX_SCAN_DEPTH:
                            out.truncated = out.too_deep = True
                        else:
                            stack.append((child, depth + 1))
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.bytes += st.st_size + _past_end(st)
                    # A change is a status-change time (which a writer cannot set back).
                    if since_ns is not None and st.st_ctime_ns >= since_ns:
                        out.changed.append(Changed(child, st.st_ino, st.st_ctime_ns))
        except OSError:
            continue
        finally:
            os.close(fd)
    return out


# -- one note ---------------------------------------------------------------------------------------


def in_kb(kb_fd: int, relpath: str) -> bool:
    """Whether ``relpath`` (relative to the pinned KB ``kb_fd``: ``notes/x.md``)
    names anything now — what the note history asks before it may forget a
    note's newest version (docs/notes.md "Note history"). Only a clear "no such
    name" is False: a name kbd cannot check (a link, a folder it may not
    enter) counts as present, so an unsure answer never costs a version."""
    try:
        os.close(open_beneath(kb_fd, relpath, os.O_PATH))
    except PathNotFound:
        return False
    except (KbdError, OSError):
        return True
    return True


def note_adds(notes_fd: int, parts: tuple[str, ...], size: int) -> tuple[int, int]:
    """(new entries, new bytes) that writing ``size`` bytes at ``parts`` adds to
    ``notes/``; nothing is created (a refused write leaves nothing behind)."""
    cur = os.dup(notes_fd)
    try:
        for i, comp in enumerate(parts[:-1]):
            try:
                nxt = open_beneath(cur, comp, os.O_RDONLY | os.O_DIRECTORY)
            except PathNotFound:
                return len(parts) - i, size  # this folder, those under it, and the note
            os.close(cur)
            cur = nxt
        try:
            old = os.stat(parts[-1], dir_fd=cur, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 1, size
        return 0, size - old
    finally:
        os.close(cur)


def _open_parent(notes_fd: int, parts: tuple[str, ...], shared: os.stat_result | None = None) -> int:
    """The folder that will hold the note, beneath ``notes/``; missing subfolders
    are created one component at a time (never through a link). ``shared``:
    notes/'s own status, whose owner, group and rwx/setgid bits a new folder
    gets (see :func:`replace_note`); else a folder kbd creates has one mode,
    like the note itself (a writer's umask of 077 made folders the source's own
    agents could not enter)."""
    if shared is None:
        return make_folders(notes_fd, parts[:-1], mode=NOTE_FOLDER_MODE)
    return make_folders(
        notes_fd, parts[:-1], mode=shared.st_mode & 0o2770, owner=(shared.st_uid, shared.st_gid)
    )


def _sweep_temp_files(dir_fd: int) -> None:
    """Remove temp files of writers that died mid-write (the caller holds the
    mutex, so none is in use)."""
    for name in os.listdir(dir_fd):
        if TEMP_NAME.match(name):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)


def replace_note(notes_fd: int, parts: tuple[str, ...], data: bytes, *, shared: bool = False) -> None:
    """Create or atomically replace the note at ``parts`` beneath ``notes/``
    (missing folders created), mode NOTE_MODE. The caller holds the mutex.
    ``shared`` (a host with a grant group, kbd running as root): the note gets
    notes/'s owner and group and SHARED_NOTE_MODE instead, set on the temp
    file's descriptor before the rename (never by path); a new subfolder gets
    notes/'s owner, group and mode."""
    st = os.fstat(notes_fd) if shared and os.geteuid() == 0 else None
    parent = _open_parent(notes_fd, parts, st)
    try:
        _sweep_temp_files(parent)
        if st is None:
            replace_file(parent, parts[-1], data, mode=NOTE_MODE)
        else:
            replace_file(parent, parts[-1], data, mode=SHARED_NOTE_MODE, owner=(st.st_uid, st.st_gid))
    finally:
        os.close(parent)


def remove_note(notes_fd: int, parts: tuple[str, ...]) -> bool:
    """Remove the regular file at ``parts`` beneath ``notes/`` (never through a
    link; a folder, link or special file at the name is refused with
    PathRefused); False when there is nothing there. The caller holds the
    mutex. The folder is synced, as after a write."""
    import stat

    from kbd.errors import PathRefused

    try:
        parent = open_beneath(notes_fd, "/".join(parts[:-1]), os.O_RDONLY | os.O_DIRECTORY)
    except PathNotFound:
        return False
    try:
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            shown = "/".join(parts)
            raise PathRefused(f"notes/{shown} is not a regular file; only notes are removed", why="not_file")
        os.unlink(parts[-1], dir_fd=parent)
        os.fsync(parent)
        return True
    finally:
        os.close(parent)


# -- the index ------------------------------------------------------------------------------------


def read_index(kb_fd: int, *, limit: int) -> bytes:
    """``notes/_index.json`` as valid JSON bytes. A transient parse failure (a
    writer mid-rewrite without atomic replacement) is retried briefly; then an
    error is raised — never an empty index."""
    import orjson  # only readers pay for it: kbd exec imports this module for its mutex

    last = ""
    for attempt in range(INDEX_RETRIES):
        data = read_file(kb_fd, f"{NOTES}/{INDEX_NAME}", limit=limit)
        try:
            if not data.strip():
                raise ValueError("the index file is empty")
            orjson.loads(data)
            return data
        except ValueError as exc:
            last = str(exc)
        if attempt + 1 < INDEX_RETRIES:
            time.sleep(INDEX_RETRY_DELAY)
    raise IndexUnreadable(f"notes/_index.json is not valid JSON after {INDEX_RETRIES} reads: {last}")
