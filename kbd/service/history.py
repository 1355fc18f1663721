"""Note history operations (docs/notes.md "Note history"): ``kbd notes
log|show|diff|restore SOURCE_WF RELPATH``.

RELPATH is relative to the source's KB root (``notes/x.md``), as for ``kbd
read``. Reading a note's history is for whoever may see the source workflow
(its audience, admins, services; an outsider gets the same not-found as for a
missing workflow); restoring is for the source's owners and admins, is
audited, goes through the same confined, mutexed, gated write as every note
(:mod:`kbd.fs.notes`), and is itself a new version. The versions live in
kbd's state (:mod:`kbd.state.history`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path

from kbd.core import audience
from kbd.core.events import EventRefused
from kbd.core.history import ABSENT, Entry, note_relpath, parse_version, unified_diff, version_of
from kbd.core.layout import KB_DIR
from kbd.core.lookup import Found
from kbd.core.principals import Principal
from kbd.core.records import Record, key
from kbd.errors import (
    KbdError,
    NotFound,
    PathNotFound,
    PermissionDenied,
    SourceUnavailable,
    from_oserror,
)
from kbd.fs.confined import pin_dir, read_file_stat
from kbd.fs.notes import in_kb, note_adds, notes_lock, open_notes, replace_note
from kbd.service import ContentRecord
from kbd.service.root import Root
from kbd.state.history import HistoryStore, Who, store_for
from kbd.state.notes_quota import check_quota

#: The largest current note read to name its version (a shell command may leave big files).
MAX_CURRENT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class NoteLog(Record):
    workflow_id: str
    relpath: str
    current: str | None  # the note's version on disk now; None: absent (or unreadable as a note)
    versions: tuple[Entry, ...]  # newest first, as ``git log``


@dataclass(frozen=True)
class NoteVersion(ContentRecord):
    """One version of a note: its bytes are written as UTF-8 text or base64 (``encoding`` says which)."""

    workflow_id: str
    relpath: str
    version: str
    data: bytes


@dataclass(frozen=True)
class NoteDiff(Record):
    workflow_id: str
    relpath: str
    # None: the note had no earlier version (the diff adds every line)
    old: str | None = field(metadata=key(name="from"))
    new: str = field(metadata=key(name="to"))
    diff: str


@dataclass(frozen=True)
class NoteRestored(Record):
    workflow_id: str
    relpath: str
    version: str  # the version restored, now the note's current one
    previous: str | None  # what it replaced (None: the note was absent and is recreated)
    bytes: int


# -- helpers ------------------------------------------------------------------------------


def _visible(host: Root, wid: str, actor: Principal) -> Found:
    """``wid`` as ``actor`` may see it (the audience rule of ``kbd read``; an
    outsider gets the not-found a missing workflow gets)."""
    found = host.workflow(wid)
    audience.require_inspectable(actor, found.manifest, wid)
    return found


def _kb(host: Root, found: Found) -> tuple[Path, tuple[int, int]]:
    probe = host.probe_kb(found.folder.path, notes=True)
    if probe.problem is not None or probe.identity is None:
        reason = probe.problem.reason if probe.problem is not None else "kb_missing"
        message = probe.problem.message if probe.problem is not None else "no knowledge base"
        raise SourceUnavailable(f"{found.manifest.id!r}: {message}", reason=reason)
    return found.folder.path / KB_DIR, probe.identity


def _current(host: Root, found: Found, relpath: str) -> bytes | None:
    """The note's bytes on disk now, read through the confined path layer; None when absent."""
    kb_path, identity = _kb(host, found)
    with pin_dir(kb_path, expect=identity) as kb:
        try:
            return read_file_stat(kb.fd, relpath, limit=MAX_CURRENT_BYTES, allow_hardlinks=True)[0]
        except PathNotFound:
            return None


def _entry(log: list[Entry], version: str, wid: str, relpath: str) -> Entry:
    for e in reversed(log):
        if e.version == version:
            return e
    raise NotFound(
        f"version {version} of {relpath!r} in {wid!r} is not in its history",
        hint=f"`kbd notes log {wid} {relpath}` lists the versions kept",
    )


def _bytes(store: HistoryStore, wid: str, relpath: str, version: str) -> bytes:
    data = store.blob(wid, relpath, version)
    if data is None:
        raise NotFound(f"the bytes of version {version} of {relpath!r} in {wid!r} are no longer kept")
    return data


def _newest(log: list[Entry], wid: str, relpath: str) -> Entry:
    if not log:
        raise NotFound(
            f"{relpath!r} in {wid!r} has no recorded history",
            hint="versions are recorded from the first write kbd performs or sees",
        )
    return log[-1]


# -- the operations ------------------------------------------------------------------------


def log(host: Root, wid: str, relpath: str, *, actor: Principal) -> NoteLog:
    """Every kept version of the note, and its version on disk now."""
    found = _visible(host, wid, actor)
    rel = note_relpath(relpath)
    entries = store_for(host.config).entries(wid, rel)
    try:
        data = _current(host, found, rel)
    except SourceUnavailable:
        raise
    except KbdError:
        data = None  # not a regular note now (a link, a folder …): its history still shows
    return NoteLog(wid, rel, None if data is None else version_of(data), tuple(reversed(entries)))


def show(host: Root, wid: str, relpath: str, *, actor: Principal, version: str | None = None) -> NoteVersion:
    """The bytes of one kept version (default: the newest)."""
    wanted = None if version is None else parse_version(version, field="--version")  # before any lookup
    _visible(host, wid, actor)
    rel = note_relpath(relpath)
    store = store_for(host.config)
    entries = store.entries(wid, rel)
    v = _newest(entries, wid, rel).version if wanted is None else _entry(entries, wanted, wid, rel).version
    return NoteVersion(wid, rel, v, _bytes(store, wid, rel, v))


def diff(
    host: Root, wid: str, relpath: str, *, actor: Principal, version: str | None = None,
    against: str | None = None,
) -> NoteDiff:  # fmt: skip
    """The unified diff from ``against`` (default: the version before
    ``version`` in the log) to ``version`` (default: the newest)."""
    # Version strings are decoded before any lookup: the same answer whatever workflow is named.
    wanted = None if version is None else parse_version(version, field="--version")
    base = None if against is None else parse_version(against, field="--against")
    _visible(host, wid, actor)
    rel = note_relpath(relpath)
    store = store_for(host.config)
    entries = store.entries(wid, rel)
    new = _newest(entries, wid, rel) if wanted is None else _entry(entries, wanted, wid, rel)
    if base is not None:
        old: str | None = _entry(entries, base, wid, rel).version
    else:
        old = new.previous
    old_bytes = b"" if old is None else _bytes(store, wid, rel, old)
    text = unified_diff(old_bytes, _bytes(store, wid, rel, new.version), old_label=f"{rel}@{old or ABSENT}",
                        new_label=f"{rel}@{new.version}")  # fmt: skip
    return NoteDiff(wid, rel, old, new.version, text)


@dataclass(frozen=True)
class PreparedRestore:
    """A restore that passed every check but the write (see :func:`prepare_restore`)."""

    host: Root
    actor: Principal
    workflow_id: str
    relpath: str  # notes/...
    version: str
    data: bytes
    kb_path: Path
    kb_identity: tuple[int, int]


def restore(
    host: Root, wid: str, relpath: str, *, actor: Principal, version: str | None = None
) -> NoteRestored:
    """Make a kept version (default: the one before the newest) the note's
    content again, through the confined write: beneath ``notes/``, gated,
    under the notes mutex, within the quota. A note now absent is recreated.
    The source's owners and admins only (77; 66 for who may not see it).
    Audited (``note_restored``, or ``note_restore_refused``); a new version."""
    return commit_restore(prepare_restore(host, wid, relpath, actor=actor, version=version))


def _refused(host: Root, err: KbdError, actor: Principal, wid: str, relpath: str) -> KbdError:
    host.audit_refusal("note_restore_refused", err, actor=actor, source=wid, path=relpath[:200])
    return err


def prepare_restore(
    host: Root, wid: str, relpath: str, *, actor: Principal, version: str | None = None
) -> PreparedRestore:
    """Everything but the write, which waits for no lock (the daemon runs it
    under its state lock): who may, which version, its bytes, the gate, the KB."""
    from kbd.core import injection
    from kbd.fs import datafiles

    try:
        wanted = None if version is None else parse_version(version, field="--version")  # before any lookup
        found = _visible(host, wid, actor)
        if not audience.can_grant_writers(actor, found.manifest):
            raise PermissionDenied(
                f"{actor.id!r} may not restore notes of {wid!r}: only its owners or an admin may",
                hint="ask an owner of the source workflow",
            )
        rel = note_relpath(relpath)
        store = store_for(host.config)
        entries = store.entries(wid, rel)
        if wanted is None:
            if len(entries) < 2:
                raise NotFound(f"{rel!r} in {wid!r} has no earlier version to restore",
                               hint=f"`kbd notes log {wid} {rel}` lists the versions kept")  # fmt: skip
            target = entries[-2].version
        else:
            target = _entry(entries, wanted, wid, rel).version
        data = _bytes(store, wid, rel, target)
        # The same gate as every note write (a version a command left may be one it flagged).
        injection.check(data.decode("utf-8", "replace"), ruleset=datafiles.injection_rules())
        kb_path, identity = _kb(host, found)
    except KbdError as err:
        raise _refused(host, err, actor, wid, relpath) from None
    return PreparedRestore(host, actor, wid, rel, target, data, kb_path, identity)


def commit_restore(r: PreparedRestore) -> NoteRestored:
    """Write the restored bytes under the notes mutex (waits up to the lock
    timeout; the daemon runs it outside its state lock), record the version
    (and the bytes it replaced, when never recorded), audit, emit."""
    host, config, store = r.host, r.host.config, store_for(r.host.config)
    parts = tuple(r.relpath.split("/")[1:])
    try:
        with (
            pin_dir(r.kb_path, expect=r.kb_identity) as kb,
            open_notes(kb.fd) as notes_fd,
            notes_lock(
                config.state_dir, notes_fd, timeout=config.lock_timeout, who={"workflow": r.workflow_id}
            ),
        ):
            try:
                old: bytes | None = read_file_stat(notes_fd, "/".join(parts), limit=MAX_CURRENT_BYTES,
                                                   allow_hardlinks=True)[0]  # fmt: skip
            except PathNotFound:
                old = None
            adds = note_adds(notes_fd, parts, len(r.data))
            check_quota(
                config.state_dir, config.notes_quota, kb.fd, notes_fd, source=r.workflow_id, adds=adds
            )
            replace_note(notes_fd, parts, r.data, shared=config.sandbox.grant_group is not None)
            store.record(r.workflow_id, r.relpath, r.data, how="restore", who=Who(r.actor.id, None, None),
                         found=old, present=functools.partial(in_kb, kb.fd))  # fmt: skip
    except KbdError as err:
        raise _refused(host, err, r.actor, r.workflow_id, r.relpath) from None
    except OSError as exc:
        failed = from_oserror(exc, what=f"restore {r.relpath!r}")
        raise _refused(host, failed, r.actor, r.workflow_id, r.relpath) from None
    previous = None if old is None else version_of(old)
    host.audit("note_restored", source=r.workflow_id, path=r.relpath, version=r.version, previous=previous,
               actor=r.actor.id)  # fmt: skip
    with contextlib.suppress(EventRefused):
        host.events.emit(
            "note.written", workflow_id=r.workflow_id, relpath=r.relpath, by_workflow=r.workflow_id
        )
    return NoteRestored(r.workflow_id, r.relpath, r.version, previous, len(r.data))
