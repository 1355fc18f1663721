"""Reading and saving workflow.json under its lock (DESIGN §2, §7).

:func:`update` is the only way kbd changes a manifest: take the manifest's
lock, re-read it, compare the expected version, compute the new document (the
caller's function may raise to refuse: nothing is written), then replace the
file atomically. Every field kbd does not own is carried over unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbd.errors import ManifestUnreadable, VersionConflict
from kbd.fsio import read_regular_nofollow, write_atomic
from kbd.locks import held
from kbd.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest, render
from kbd.registry import MANIFEST


def read(folder: Path) -> Manifest:
    """Read and parse ``<folder>/workflow.json`` strictly (no symlink, bounded)."""
    try:
        data, _ = read_regular_nofollow(folder / MANIFEST, limit=MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ManifestUnreadable(f"workflow.json cannot be read: {exc.strerror or exc}") from exc
    return parse_manifest(data)


def update(
    folder: Path,
    change: Callable[[Manifest], dict[str, Any]],
    *,
    state_dir: Path,
    timeout: float,
    expected_version: str | None = None,
) -> Manifest:
    """Apply ``change`` to the manifest atomically and return the saved manifest.

    Raises VersionConflict when ``expected_version`` is given and stale, Busy on
    lock timeout, and whatever ``change`` raises; in every error case the file
    is byte-identical to before.
    """
    with held(state_dir, "manifest", str(folder), timeout=timeout, what=f"workflow.json of {folder.name}"):
        current = read(folder)
        if expected_version is not None and expected_version != current.version:
            raise VersionConflict(
                f"workflow.json is at version {current.version}, not the expected {expected_version}"
            )
        doc = change(current)
        if doc == current.raw:
            return current  # nothing to change: keep the file and its formatting
        data = render(doc)
        saved = parse_manifest(data)  # never write what we could not read back
        write_atomic(folder / MANIFEST, data)
        return saved
