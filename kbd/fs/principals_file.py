"""Changing ``<root>/principals.yaml`` on disk: one edit at a time, under the
root's principals lock, by the line editor of :mod:`kbd.core.principals_edit`
(which keeps every comment, blank line, key order and quoting outside the
changed entry), written atomically with the file's mode and owner kept.

The caller decides the edit from the principals as they are under the lock, so
two concurrent edits never overwrite each other; the file is never rewritten
from a parsed document.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kbd.core.layout import PRINCIPALS_NAME, STATE_DIR
from kbd.core.principals import Principals, parse_principals
from kbd.core.principals_edit import Edit, Layout, apply_edit, parse_layout
from kbd.errors import InvalidConfig, RootError

#: The mode principals.yaml gets when kbd creates it; an existing file keeps its own.
MODE = 0o640


@dataclass(frozen=True)
class Current:
    """principals.yaml as it is under the lock: its layout and its principals."""

    layout: Layout
    principals: Principals


def _read(path: Path) -> str:
    """The file's text; it must be a regular file (a link would be replaced by
    the atomic write, silently changing the operator's layout)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise RootError(f"{PRINCIPALS_NAME} not found at {path}") from exc
    except OSError as exc:
        raise InvalidConfig(f"{PRINCIPALS_NAME} at {path} is unreadable: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise InvalidConfig(
            f"{path} is not a regular file (a symlink or special file); kbd edits only a regular "
            f"{PRINCIPALS_NAME}, so nothing was written",
            hint="edit the file it points to by hand, or replace the link with the file",
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise InvalidConfig(f"{PRINCIPALS_NAME} at {path} is unreadable: {exc.strerror}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfig(f"{PRINCIPALS_NAME} at {path} is not UTF-8: {exc}") from exc


def update(
    root: Path,
    decide: Callable[[Current], Edit | None],
    *,
    timeout: float,
    before_write: Callable[[Edit], None] = lambda _edit: None,
    dry_run: bool = False,
) -> Principals:
    """Apply the edit ``decide`` returns for the current file (None: nothing to
    change) and return the principals the file then holds (``dry_run``: would
    hold; nothing is written and ``before_write`` is not called).

    Under the root's principals lock: read, check the layout and the current
    principals (an invalid file is never edited), decide, render and check the
    edit, call ``before_write`` (the caller's audit record: if it cannot be
    written, nothing changes), then replace the file atomically. Any refusal
    leaves the file byte-identical."""
    from kbd.fs.atomic import write_atomic
    from kbd.fs.locks import held  # filelock: only for writers, never on the exec path

    path = root / PRINCIPALS_NAME
    # Keyed by the resolved path: every writer of this file takes the same lock.
    key = str(root.resolve() / PRINCIPALS_NAME)
    lock = contextlib.nullcontext() if dry_run else held(root / STATE_DIR, "principals", key, timeout=timeout,
                                                            what=PRINCIPALS_NAME)  # fmt: skip
    with lock:
        text = _read(path)
        layout = parse_layout(text, source=str(path))
        current = Current(layout, parse_principals({"principals": list(layout.entries)}, source=str(path)))
        edit = decide(current)
        if edit is None:
            return current.principals
        new_text, principals = apply_edit(layout, edit, source=str(path))
        if dry_run:
            return principals
        before_write(edit)
        write_atomic(path, new_text.encode("utf-8"), mode=MODE, keep_owner=True, keep_mode=True)
    return principals
