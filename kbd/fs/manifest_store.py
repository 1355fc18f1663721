"""Reading and saving workflow.json under its lock (docs/on-disk.md, docs/notes.md).

:func:`update` is the only way kbd changes a manifest: take the manifest's
lock, re-read it, compare the expected version, compute the new document (the
caller's function may raise to refuse: nothing is written), then replace the
file atomically. Every field kbd does not own is carried over unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbd.core.layout import MANIFEST
from kbd.core.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest, render
from kbd.errors import KbdError, ManifestUnreadable, VersionConflict
from kbd.fs.atomic import write_atomic_at
from kbd.fs.confined import pin_dir, read_file_stat
from kbd.fs.locks import held


def _read_at(dirfd: int) -> Manifest:
    try:
        data, _ = read_file_stat(dirfd, MANIFEST, limit=MAX_MANIFEST_BYTES, allow_hardlinks=True)
    except KbdError as exc:
        raise ManifestUnreadable(f"workflow.json cannot be read: {exc.message}") from exc
    return parse_manifest(data)


def read(folder: Path) -> Manifest:
    """Read and parse ``<folder>/workflow.json`` strictly through the path layer."""
    with pin_dir(folder) as pinned:
        return _read_at(pinned.fd)


def update(
    folder: Path,
    change: Callable[[Manifest], dict[str, Any]],
    *,
    state_dir: Path,
    timeout: float,
    expected_version: str | None = None,
    dry_run: bool = False,
) -> Manifest:
    """Apply ``change`` to the manifest atomically and return the saved manifest
    (``dry_run``: the manifest that would be saved; nothing is written).

    Raises VersionConflict when ``expected_version`` is given and stale, Busy on
    lock timeout, and whatever ``change`` raises; in every error case the file
    is byte-identical to before.
    """
    with contextlib.ExitStack() as stack:
        if not dry_run:  # a preview reads what is there and leaves no trace, not even a lock file
            stack.enter_context(
                held(
                    state_dir,
                    "manifest",
                    str(folder),
                    timeout=timeout,
                    what=f"workflow.json of {folder.name}",
                )
            )
        pinned = stack.enter_context(pin_dir(folder))
        # Read and replace through one pinned folder fd: a folder swapped for a
        # link between the two steps cannot redirect the write.
        current = _read_at(pinned.fd)
        if expected_version is not None and expected_version != current.version:
            raise VersionConflict(
                f"workflow.json is at version {current.version}, not the expected {expected_version}"
            )
        doc = change(current)
        if doc == current.raw:
            return current  # nothing to change: keep the file and its formatting
        data = render(doc)
        saved = parse_manifest(data)  # never write what we could not read back
        if not dry_run:
            write_atomic_at(pinned.fd, MANIFEST, data)
        return saved
