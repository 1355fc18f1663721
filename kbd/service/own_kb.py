"""A workflow's managers edit its own KB (docs/knowledge-page.md "Panels"): one
file of ``context/`` or ``notes/``, created or replaced whole, checked against
the version the editor read.

``notes/`` goes through the note write path itself (:func:`kbd.service.notes.commit`:
the injection gate, the notes mutex, the quota, an atomic replace, a history
version ``edit``, the audit record and ``note.written``). ``context/`` is the
workflow's reference text, written as ``kbd import`` writes it: under the KB's
import lock, atomically, owned like ``context/``. Neither ever writes the KB
root, ``notes/_index.json`` or a name the note rules refuse; a refusal changes
nothing and is audited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kbd.core import audience
from kbd.core import knowledge as rules
from kbd.core.history import ABSENT, VERSION_PATTERN, parse_version, version_of
from kbd.core.layout import CONTEXT_DIR, NOTES_DIR
from kbd.core.notes import note_text
from kbd.core.principals import Principal, actor_fields
from kbd.core.records import Record, key
from kbd.core.relpaths import request_parts
from kbd.errors import (
    InvalidInput,
    InvalidPath,
    KbdError,
    NoteVersionConflict,
    PermissionDenied,
    from_oserror,
)
from kbd.fs import importing as disk
from kbd.fs.confined import names_folder, pin_dir
from kbd.fs.locks import held
from kbd.service import notes
from kbd.service.browse import own_kb
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

#: The largest file the editor writes (a note's limit, for context/ too).
MAX_EDIT_BYTES = notes.MAX_NOTE_BYTES


@dataclass(frozen=True)
class KbFileWritten(Record):
    workflow_id: str
    path: str  # from the KB root: context/… or notes/…
    bytes: int
    version: str = field(metadata=key(schema={"pattern": VERSION_PATTERN}))  # of the bytes written


@dataclass(frozen=True)
class PreparedEdit:
    """An edit that passed every check but the ones made under its folder's
    lock (the version, the quota, the gate): see :func:`prepare_own`."""

    host: Root
    wid: str
    actor: Principal
    kb_path: Path
    kb_identity: tuple[int, int] | None
    folder: str  # CONTEXT_DIR or NOTES_DIR
    inner: tuple[str, ...]  # the components beneath it
    data: bytes
    text: str
    expected: str | None

    @property
    def relpath(self) -> str:
        return "/".join((self.folder, *self.inner))


def write_own(
    sessions: RootSessions, wid: str, relpath: str, data: bytes, *, actor: Principal, expected: str | None
) -> KbFileWritten:
    """Create or replace ``relpath`` (``context/…`` or ``notes/…``) in ``wid``'s
    own KB: :func:`prepare_own` then :func:`commit_own` (the CLI on the root)."""
    return commit_own(prepare_own(sessions, wid, relpath, data, actor=actor, expected=expected))


def prepare_own(
    sessions: RootSessions, wid: str, relpath: str, data: bytes, *, actor: Principal, expected: str | None
) -> PreparedEdit:
    """Who may, where, what: ``expected`` is the version the editor read
    (``sha256:…``), ``none`` for a file that must not exist yet, or None (no
    check). Owners, editors and admins only (an outsider is told the workflow
    does not exist). Needs the registry (the daemon holds its state lock); waits
    for no file lock. Every refusal is audited."""
    host = sessions.host
    try:
        if expected is not None:
            expected = parse_version(expected, field="the expected version", allow_absent=True)
        att = own_kb(host, wid, actor=actor)  # inspectable, and the KB checked as an attached one is
        if not audience.can_manage_sources(actor, host.workflow(wid).manifest):
            raise PermissionDenied(
                f"principal {actor.id!r} may not edit {wid!r}'s knowledge base",
                hint="its owners and editors may (and admins)",
            )
        if len(data) > MAX_EDIT_BYTES:
            raise InvalidInput(f"the file is {len(data)} bytes; at most {MAX_EDIT_BYTES} are written")
        parts = request_parts(relpath)
        if parts[0] not in (CONTEXT_DIR, NOTES_DIR) or len(parts) < 2:
            raise PermissionDenied(
                f"{relpath[:200]!r} is not beneath context/ or notes/: only their files are edited here",
                hint="e.g. context/overview.md or notes/finding.md",
            )
        if names_folder(relpath):
            raise InvalidPath(f"{relpath[:200]!r} ends with '/': name a file, not a folder")
        # One name rule for both folders: the notes' (no _index.json or look-alike, no control
        # characters); and no hidden name, which listings, search and import pass over.
        inner, _ = rules.write_parts("/".join((NOTES_DIR, *parts[1:])))
        if any(p.startswith(".") for p in inner):
            raise InvalidPath(f"{relpath[:200]!r} names a hidden file or folder (a name starting with '.')",
                              hint="name it without the leading '.'")  # fmt: skip
        if parts[0] == CONTEXT_DIR and len(inner) > 2:
            raise InvalidInput(f"{relpath[:200]!r} is nested deeper than context/<folder>/<file>",
                               hint="context/ holds files and one level of folders, as kbd import makes them")  # fmt: skip
        text = note_text(data)
    except KbdError as err:
        _refused(host, wid, relpath, err, actor)
        raise
    assert att.path is not None
    return PreparedEdit(
        host, wid, actor, att.path, att.kb_identity, parts[0], tuple(inner), data, text, expected
    )


def commit_own(edit: PreparedEdit) -> KbFileWritten:
    """Write a prepared edit: ``notes/`` through the note write path (its gate,
    mutex, quota, history), ``context/`` under the KB's import lock. May wait
    for that lock up to the lock timeout (the daemon calls it outside its state lock)."""
    if edit.folder == NOTES_DIR:
        note = notes.PreparedNote(
            edit.host,
            "",
            edit.wid,
            ".",
            edit.relpath,
            edit.wid,
            edit.kb_path,
            edit.kb_identity,
            edit.inner,
            edit.data,
            actor_fields(edit.actor),
            edit.text,
            edit.expected,
            edit.actor.id,
            "edit",
        )
        done = notes.commit(note)
        return KbFileWritten(edit.wid, done.path, done.bytes, done.version)
    return _write_context(edit)


def _write_context(edit: PreparedEdit) -> KbFileWritten:
    """``context/<inner>`` written as ``kbd import`` writes a document (one
    folder level at most), under the KB's import lock, the version checked under it."""
    host, wid, rel, data = edit.host, edit.wid, edit.relpath, edit.data
    config = host.config
    try:
        with pin_dir(edit.kb_path, expect=edit.kb_identity) as kb:
            lock = held(config.state_dir, "import", disk.kb_key(kb.fd), timeout=config.lock_timeout,
                        what=f"the knowledge base of {wid!r}", who={"workflow": wid})  # fmt: skip
            container, name = edit.inner if len(edit.inner) == 2 else ("", edit.inner[0])
            with lock:
                # The version first, creating nothing: a refused save leaves the KB as it was.
                with disk.open_context(kb.fd, create=False) as seen:
                    current = None
                    if seen is not None:
                        current = disk.existing(seen, container, name)
                now = ABSENT if current is None else version_of(current)
                if edit.expected is not None and now != edit.expected:
                    raise NoteVersionConflict(f"{rel} in {wid!r} is at version {now}, not {edit.expected}",
                                              current=now)  # fmt: skip
                _put_context(kb.fd, container, name, data)
    except OSError as exc:  # a full disk is NoSpace (75), a denied folder PermissionDenied
        err = from_oserror(exc, what=f"write {rel!r}")
        _refused(host, wid, rel, err, edit.actor)
        raise err from None
    except KbdError as err:
        _refused(host, wid, rel, err, edit.actor)
        raise
    host.audit("kb_file_written", workflow_id=wid, path=rel, bytes=len(data), **actor_fields(edit.actor))
    return KbFileWritten(wid, rel, len(data), version_of(data))


def _put_context(kb_fd: int, container: str, name: str, data: bytes) -> None:
    """Write ``context/[<container>/]<name>`` as ``kbd import`` writes a document
    (``context/`` made when missing); the caller holds the import lock."""
    with disk.open_context(kb_fd, create=True) as ctx:
        assert ctx is not None
        disk.write_doc(ctx, container, name, data)


def _refused(host: Root, wid: str, relpath: str, err: KbdError, actor: Principal) -> None:
    host.audit("kb_file_refused", workflow_id=wid, path=relpath[:200], code=err.code, reason=err.message[:300],
               **actor_fields(actor))  # fmt: skip
