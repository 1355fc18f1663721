"""Cross-process locks under ``state/locks`` (filelock: flock on Linux).

A crashed holder's lock is released by the kernel with its file descriptor, so
no stale lock survives a SIGKILL. A timeout is an error (exit 75), never a
reason to go ahead without the lock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

from kbd.errors import Busy
from kbd.fs.atomic import ensure_private_dir


def lock_path(state_dir: Path, kind: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return state_dir / "locks" / f"{kind}-{digest}.lock"


@contextmanager
def held(state_dir: Path, kind: str, key: str, *, timeout: float, what: str) -> Iterator[None]:
    """Hold the lock for (kind, key); raise Busy naming ``what`` on timeout."""
    path = lock_path(state_dir, kind, key)
    ensure_private_dir(path.parent)
    lock = filelock.FileLock(str(path), timeout=timeout, mode=0o640)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise Busy(f"{what} is locked by another kbd process (waited {timeout:g}s)") from exc
    try:
        yield
    finally:
        lock.release()
