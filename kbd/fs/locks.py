"""Cross-process locks under ``state/locks`` (filelock: flock on Linux).

A crashed holder's lock is released by the kernel with its file descriptor, so
no stale lock survives a SIGKILL. A timeout is an error (exit 75), never a
reason to go ahead without the lock. A lock taken with ``who`` also records its
holder beside it (``.holder``), so a waiter that gives up can say whom it
waited for: :func:`held` is the one lock and :func:`_busy` the one translation
of a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import filelock

from kbd.errors import Busy
from kbd.fs.atomic import ensure_private_dir

#: filelock's own retry interval, for locks held briefly.
DEFAULT_POLL = 0.05


def lock_path(state_dir: Path, kind: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return state_dir / "locks" / f"{kind}-{digest}.lock"


def _holder_path(lock: Path) -> Path:
    return lock.with_suffix(".holder")


def _record_holder(lock: Path, who: Mapping[str, str]) -> None:
    # Best effort: the lock itself is the mutex; this only helps a waiter explain.
    with contextlib.suppress(OSError):
        _holder_path(lock).write_text(
            json.dumps({**who, "since": time.time(), "pid": os.getpid(), "host": socket.gethostname()})
        )


def _holder(lock: Path) -> str:
    """The holder recorded beside ``lock``, as a waiter may be told it: only its
    workflow and since when. Its session, pid and host stay in the holder file
    for operators, not in an answer another consumer can read."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        info = json.loads(_holder_path(lock).read_text())
        since = time.strftime("%H:%M:%SZ", time.gmtime(float(info["since"])))
        return f"workflow {info['workflow']} (since {since})"
    return "another workflow"


def _busy(what: str, timeout: float, *, lock: Path, recorded: bool) -> Busy:
    """A timeout on the lock of ``what``, as the caller sees it."""
    if recorded:
        return Busy(
            f"{what} is being written by {_holder(lock)}; waited {timeout:g}s",
            hint="retry when that command finishes; locks.timeout_seconds in kbd.yaml sets the wait",
        )
    return Busy(f"{what} is locked by another kbd process (waited {timeout:g}s)")


@contextmanager
def held(
    state_dir: Path,
    kind: str,
    key: str,
    *,
    timeout: float,
    what: str,
    who: Mapping[str, str] | None = None,
    poll: float = DEFAULT_POLL,
) -> Iterator[None]:
    """Hold the lock for (kind, key); raise Busy naming ``what`` on timeout.

    With ``who`` (how the holder names itself, e.g. ``{"workflow": ...}``), the
    holder is recorded while the lock is held and a waiter's Busy names its
    workflow. ``poll`` is how often a waiter retries."""
    path = lock_path(state_dir, kind, key)
    ensure_private_dir(path.parent)
    lock = filelock.FileLock(str(path), timeout=timeout, mode=0o640)
    try:
        lock.acquire(poll_interval=poll)
    except filelock.Timeout:
        raise _busy(what, timeout, lock=path, recorded=who is not None) from None
    try:
        if who is not None:
            _record_holder(path, who)
        yield
    finally:
        lock.release()
