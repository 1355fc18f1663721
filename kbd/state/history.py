"""Note history storage (issue 13 item 3): per (source workflow, note path) a
log of versions and the content-addressed blobs it names, in kbd's state
(``state/history/``), never under a source's folder.

One folder per note, named by a digest of (source, relpath) so no
caller-chosen name becomes a path here: ``log.json`` (the entries, oldest
first, replaced atomically) and ``blobs/<hex>`` (each version's bytes, written
once, atomically). Every read-modify-write of a log holds that note's history
lock, so a confined write (under the notes mutex) and a command's post-run
audit (after it) never lose each other's entries. Retention
(:class:`kbd.core.config.NoteHistory`) trims the oldest entries and removes
the blobs no kept entry names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.history import PREFIX, Entry, is_version, retained, version_of
from kbd.errors import StateCorrupt
from kbd.fs.atomic import ensure_private_dir, write_atomic
from kbd.fs.locks import held

if TYPE_CHECKING:
    from kbd.core.config import Config, NoteHistory

HISTORY_DIR = "history"
LOG_NAME = "log.json"
BLOBS = "blobs"


@dataclass(frozen=True)
class Who:
    """Who made a version: the principal, the session, its workflow."""

    principal: str | None = None
    session: str | None = None
    workflow: str | None = None


class HistoryStore:
    """The version store of one root's state folder."""

    def __init__(self, state_dir: Path, caps: NoteHistory, *, lock_timeout: float) -> None:
        self.state_dir = state_dir
        self.caps = caps
        self.lock_timeout = lock_timeout

    def _key(self, source: str, relpath: str) -> str:
        return hashlib.sha256(f"{source}\x00{relpath}".encode()).hexdigest()

    def _folder(self, source: str, relpath: str) -> Path:
        key = self._key(source, relpath)
        return self.state_dir / HISTORY_DIR / key[:2] / key

    def entries(self, source: str, relpath: str) -> list[Entry]:
        """The log of ``relpath`` in ``source`` (oldest first; empty when none)."""
        path = self._folder(source, relpath) / LOG_NAME
        try:
            raw = json.loads(path.read_bytes())
            return [Entry.from_json(e) for e in raw["entries"]]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as exc:
            raise StateCorrupt(f"the history log of {relpath!r} in {source!r} is unreadable: {exc}") from None

    def head(self, source: str, relpath: str) -> str | None:
        log = self.entries(source, relpath)
        return log[-1].version if log else None

    def blob(self, source: str, relpath: str, version: str) -> bytes | None:
        """The bytes of ``version``, or None when the store does not hold them."""
        if not is_version(version):
            return None
        try:
            data = (self._folder(source, relpath) / BLOBS / version[len(PREFIX) :]).read_bytes()
        except FileNotFoundError:
            return None
        # A blob is named by its digest: one that does not match it is damage, never content.
        if version_of(data) != version:
            raise StateCorrupt(f"the stored bytes of {version} of {relpath!r} do not match their version")
        return data

    def record(
        self, source: str, relpath: str, data: bytes, *, how: str, who: Who, expected: str | None = None,
        if_new: bool = False, found: bytes | None = None,
    ) -> Entry | None:  # fmt: skip
        """Append a version of ``relpath`` (its bytes ``data``) to its log, then
        apply retention. ``if_new``: only when the log's newest version is not
        already this one (bytes found on disk that may have been recorded).
        ``found``: the bytes the write replaced, recorded first (how ``found``,
        nobody named) when the log does not end with them: one lock, one log
        save for both. Returns the entry written, or None when ``if_new``
        skipped it."""
        with held(self.state_dir, "history", self._key(source, relpath), timeout=self.lock_timeout,
                  what="the note's history"):  # fmt: skip
            log = self.entries(source, relpath)
            blobs = self._folder(source, relpath) / BLOBS
            ensure_private_dir(blobs)
            if found is not None and (not log or log[-1].version != version_of(found)):
                log.append(self._store(blobs, found, log, how="found", who=Who(), expected=None))
            if if_new and log and log[-1].version == version_of(data):
                return None
            entry = self._store(blobs, data, log, how=how, who=who, expected=expected)
            log.append(entry)
            self._save(source, relpath, log)
            return entry

    def _store(
        self, blobs: Path, data: bytes, log: list[Entry], *, how: str, who: Who, expected: str | None
    ) -> Entry:
        """Write ``data``'s blob (once: it is named by its digest) and make its entry."""
        version = version_of(data)
        name = version[len(PREFIX) :]
        if not (blobs / name).exists():
            write_atomic(blobs / name, data, mode=0o600, keep_owner=False, keep_mode=False)
        previous = log[-1].version if log else None
        return Entry(version, previous, time.time(), len(data), how, who.principal, who.session, who.workflow,
                     expected)  # fmt: skip

    def _save(self, source: str, relpath: str, log: list[Entry]) -> None:
        """Retention, then the log replaced atomically, then the blobs no kept entry names."""
        folder = self._folder(source, relpath)
        kept = retained(log, max_versions=self.caps.max_versions, max_bytes=self.caps.max_bytes)
        doc = {"source": source, "relpath": relpath, "entries": [e.to_json() for e in kept]}
        write_atomic(
            folder / LOG_NAME, json.dumps(doc).encode(), mode=0o600, keep_owner=False, keep_mode=False
        )
        if len(kept) < len(log):
            self._drop_unnamed(folder / BLOBS, {e.version[len(PREFIX) :] for e in kept})

    @staticmethod
    def _drop_unnamed(blobs: Path, named: set[str]) -> None:
        """Remove the blobs no kept entry names (after the log was saved: a crash
        in between leaves a blob too many, never an entry without its bytes)."""
        for name in os.listdir(blobs):
            if name not in named and not name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    (blobs / name).unlink()


def store_for(config: Config) -> HistoryStore:
    """The note history of the root ``config`` describes (its state folder, its retention setting)."""
    return HistoryStore(config.state_dir, config.note_history, lock_timeout=config.lock_timeout)
