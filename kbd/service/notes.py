"""Contributed notes: one write into an attached source's ``notes/`` (docs/notes.md "The write path"), the one
confined write entry point for ``kbd notes
write``, the API and any other writer.

It re-resolves the session's plan, requires a write grant for that source
*now*, confines the target beneath the source's ``notes/`` (no ``..``, no link,
no other mount, never ``_index.json`` or a look-alike, only regular files
replaced), refuses prompt-injection patterns, merges provenance frontmatter,
and replaces the file atomically while holding the source's notes mutex. Every
refusal is audited (``note_refused``), every write too (``note_written``).

Split in two steps for the daemon: :func:`prepare` needs the session's plan
(under its state lock); :func:`commit` runs the injection gate and waits for the
source's notes mutex (outside it). :func:`write` does both for the CLI.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core import notes as rules
from kbd.core.events import EventRefused
from kbd.core.history import ABSENT, VERSION_PATTERN, parse_version, version_of
from kbd.core.knowledge import write_parts
from kbd.core.layout import NOTES_DIR
from kbd.core.plan import Plan
from kbd.core.principals import Actor, actor_fields
from kbd.core.records import Record, key
from kbd.core.resolve import Attachment
from kbd.errors import KbdError, NoteVersionConflict, NotFound, PathNotFound, PermissionDenied, from_oserror
from kbd.fs.confined import pin_dir, read_file_stat
from kbd.fs.notes import in_kb, note_adds, notes_lock, open_notes, remove_note, replace_note
from kbd.state.history import Who, store_for
from kbd.state.notes_quota import check_quota

if TYPE_CHECKING:  # the types only: a note write never needs the registry to import
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions

#: The largest note, for interfaces that read one in.
MAX_NOTE_BYTES = rules.MAX_NOTE_BYTES
#: The largest existing note read for its version before a write. A shell
#: command may have left a bigger one: a writer that named a version is then
#: refused; one that did not writes as before, the replaced bytes unrecorded.
MAX_HISTORY_READ = 4 * MAX_NOTE_BYTES


@dataclass(frozen=True)
class NoteWritten(Record):
    workflow_id: str  # the source whose notes/ now holds the note
    alias: str
    path: str  # relative to the source's KB root: notes/...
    bytes: int
    # sha256:<hex> of the bytes written (docs/notes.md "Note history").
    version: str = field(metadata=key(schema={"pattern": VERSION_PATTERN}))
    # RELPATH was spelled relative to notes/ (accepted for one release): what to pass instead.
    warning: str | None = field(default=None, metadata=key(omit_none=True))


@dataclass(frozen=True)
class PreparedNote:
    """A note that passed every check except the gate and the write (see :func:`prepare`)."""

    host: Root
    sid: str
    consumer: str
    alias: str
    relpath: str
    source: str
    kb_path: Path
    kb_identity: tuple[int, int] | None
    parts: tuple[str, ...]
    data: bytes
    who: Mapping[str, object] = field(default_factory=dict)  # the actor, as audit records name it
    text: str = ""  # what the injection gate checks, in commit (never under a shared lock)
    # --expected-version / If-Match: a version, "none" (must not exist yet), or None (not asked).
    expected: str | None = None
    principal: str | None = None  # who, for the note's history
    how: str = (
        "write"  # the history's word for it: "command" for a staged shell write (docs/notes.md history)
    )
    # HTTP's ``If-Match: *``: the note must exist now, at any version; ``If-None-Match: *``:
    # it must not (docs/api.md "Malformed requests"). Both with ``expected``, as preconditions that must all hold.
    must_exist: bool = False
    must_not_exist: bool = False
    # A second version the note must be at (the API's body ``expected_version`` beside an
    # ``If-Match`` header): every precondition given must hold, so two that differ never do.
    also_expected: str | None = None
    warning: str | None = (
        None  # the deprecated RELPATH spelling, told with the answer (knowledge.write_parts)
    )

    def refuse(self, err: KbdError) -> KbdError:
        self.host.audit("note_refused", session=self.sid, workflow_id=self.consumer, alias=self.alias,
                        path=self.relpath[:200], code=err.code, reason=err.message[:300],
                        rule=getattr(err, "rule", None), **self.who)  # fmt: skip
        return err


def prepare(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor,
    expected: str | None = None, how: str = "write", plan: Plan | None = None, must_exist: bool = False,
    must_not_exist: bool = False, also_expected: str | None = None,
) -> PreparedNote:  # fmt: skip
    """Everything but the gate and the write: the session's plan now, the grant,
    the name, the size, the text, and the provenance-stamped content.
    ``expected`` (``--expected-version``): checked here for its form
    (InvalidInput) before anything else, against the note under the mutex in
    :func:`commit`. Needs the host's registry (the daemon calls it under its
    state lock); waits for no file lock and does no work proportional to the
    note beyond decoding it (the injection gate runs in :func:`commit`). Every
    refusal is audited. ``plan``: the session's plan as just looked up by the
    caller (a staged commit looks it up once for all of a command's files).
    ``must_exist``/``must_not_exist``: refuse (NoteVersionConflict) unless the
    note exists, at whatever version (``If-Match: *``), or does not
    (``If-None-Match: *``). ``also_expected``: one more version the note must be
    at, checked like ``expected`` (all preconditions must hold)."""
    host = sessions.host
    try:
        # A version string is decoded before the session is looked at: the
        # same answer whatever session it names (docs/api.md "Malformed requests").
        if expected is not None:
            expected = parse_version(
                expected, field="the expected version (--expected-version, If-Match)", allow_absent=True
            )
        if also_expected is not None:
            also_expected = parse_version(
                also_expected, field="the expected version (--expected-version, If-Match)", allow_absent=True
            )
        if plan is None:
            plan = sessions.plan(sid, actor=actor)
    except KbdError as err:
        host.audit("note_refused", session=sid, alias=alias, path=relpath[:200], code=err.code,
                   reason=err.message[:300], **actor_fields(actor))  # fmt: skip
        raise
    att = next((a for a in plan.sources if a.alias == alias), None)
    # The note's name from the KB root (docs/notes.md "Paths"), for every record of this write,
    # refusals included; a RELPATH that names no note is refused after the access checks, as it was.
    try:
        found, warning = write_parts(relpath)
        named, bad_name = "/".join((NOTES_DIR, *found)), None
    except KbdError as err:
        found, warning, named, bad_name = [], None, relpath, err
    draft = PreparedNote(
        host, sid, plan.workflow_id, alias, named, "", Path("/"), None, (), b"", actor_fields(actor)
    )
    if att is None:
        raise draft.refuse(
            NotFound(
                f"source {alias!r} is not attached to {plan.workflow_id!r}",
                hint="`kbd session show SID` lists the attached aliases",
            )
        )
    if not att.available or att.path is None or not plan.writes_source(alias):
        refusal = PermissionDenied(f"source {alias!r} {_unwritable(plan, att)}",
                                   hint="`kbd sources list WF` shows each attachment's write status")  # fmt: skip
        raise draft.refuse(refusal)
    if bad_name is not None:
        raise draft.refuse(bad_name)
    try:
        text = rules.note_text(data)
    except KbdError as err:
        raise draft.refuse(err) from None
    parts = tuple(found)
    final = rules.with_provenance(text, workflow_id=plan.workflow_id, session_id=sid).encode("utf-8")
    # As its audit records name it: a principal's ID, the local operator's user name.
    principal = str(actor_fields(actor)["actor"])
    return PreparedNote(host, sid, plan.workflow_id, alias, named, att.workflow_id, att.path, att.kb_identity,
                        parts, final, actor_fields(actor), text, expected, principal, how,
                        must_exist, must_not_exist, also_expected, warning)  # fmt: skip


def _unwritable(plan: Plan, att: Attachment) -> str:
    """Why the session may not write the source's notes/ now: the one reason that applies."""
    if not att.available:
        return f"is unavailable ({att.reason}" + (f": {att.message})" if att.message else ")")
    if att.access != "write":
        return "is attached read-only (access read): its consumer's owners can attach it with access write"
    if att.write is not None and not att.write.available:
        return f"is not writable: {att.write.reason}" + (
            f" ({att.write.message})" if att.write.message else ""
        )
    return (f"is not writable in this session: a {plan.kind!r} session with kb_access {plan.kb_access!r} "
            "does not write sources' notes/")  # fmt: skip


def _current(notes_fd: int, note: PreparedNote) -> bytes | None:
    """The note's bytes now (under the mutex), None when it does not exist. A
    name that cannot be read as a note (a link, a FIFO, a folder, too large) is
    the writer's refusal when it asked for a version; otherwise the write goes
    on as before (and refuses what is not a regular file itself)."""
    try:
        return read_file_stat(notes_fd, "/".join(note.parts), limit=MAX_HISTORY_READ, allow_hardlinks=True)[0]
    except PathNotFound:
        return None
    except KbdError:
        if (
            note.expected is not None
            or note.also_expected is not None
            or note.must_exist
            or note.must_not_exist
        ):
            raise
        return None


def _check_expected(note: PreparedNote, old: bytes | None) -> None:
    """Refuse (NoteVersionConflict, 75) when the note is not at the version its
    writer expected, or does not exist when it must."""
    if note.must_exist and old is None:
        raise NoteVersionConflict(
            f"notes/{'/'.join(note.parts)} in {note.source!r} does not exist (If-Match: * needs a current version)",
            current=ABSENT,
        )
    if note.must_not_exist and old is not None:
        current = version_of(old)
        raise NoteVersionConflict(
            f"notes/{'/'.join(note.parts)} in {note.source!r} exists, at version {current} (If-None-Match: *)",
            current=current,
        )
    current = ABSENT if old is None else version_of(old)
    for wanted in (note.expected, note.also_expected):
        if wanted is not None and current != wanted:
            raise NoteVersionConflict(
                f"notes/{'/'.join(note.parts)} in {note.source!r} is at version {current}, not {wanted}",
                current=current,
            )


def _record(note: PreparedNote, old: bytes | None, path: str, kb_fd: int) -> None:
    """After the rename, under the mutex: the bytes that were there first, when
    the history never saw them (written outside kbd, or before history), then
    the new version. The note is written whatever happens here: a history that
    cannot be recorded is audited, never a refused write after the fact."""
    host = note.host
    store = store_for(host.config)
    who = Who(note.principal, note.sid, note.consumer)
    expected = note.expected if note.expected is not None else note.also_expected  # both held: one is enough
    try:
        store.record(note.source, path, note.data, how=note.how, who=who, expected=expected, found=old,
                     present=functools.partial(in_kb, kb_fd))  # fmt: skip
    except (KbdError, OSError) as exc:
        host.audit("note_history_failed", source=note.source, path=path, reason=str(exc)[:300])


def commit(note: PreparedNote) -> NoteWritten:
    """Write a prepared note: run the injection gate (before any lock: it is
    linear in the note, but a lock shared with other writers must never wait
    on it), pin the KB (same identity as resolved), take the notes mutex (may
    wait up to the lock timeout), check the quota, replace the file atomically."""
    from kbd.core import injection
    from kbd.fs import datafiles

    host = note.host
    config = host.config
    try:
        injection.check(note.text, ruleset=datafiles.injection_rules())
    except KbdError as err:
        raise note.refuse(err) from None
    lock_wait, who = config.lock_timeout, {"workflow": note.consumer}
    try:
        with (
            pin_dir(note.kb_path, expect=note.kb_identity) as kb,
            open_notes(kb.fd) as notes_fd,
            notes_lock(config.state_dir, notes_fd, timeout=lock_wait, who=who),
        ):
            old = _current(notes_fd, note)
            _check_expected(note, old)  # under the mutex: no writer slips in between
            adds = note_adds(notes_fd, note.parts, len(note.data))
            check_quota(config.state_dir, config.notes_quota, kb.fd, notes_fd, source=note.source, adds=adds)
            replace_note(notes_fd, note.parts, note.data, shared=config.sandbox.grant_group is not None)
            _record(note, old, note.relpath, kb.fd)
    except KbdError as err:
        raise note.refuse(err) from None
    except OSError as exc:
        # A full disk is NoSpace (75), a denied folder PermissionDenied: never one for the other.
        raise note.refuse(from_oserror(exc, what=f"write {note.relpath!r}")) from None
    host.audit("note_written", session=note.sid, workflow_id=note.consumer, source=note.source, alias=note.alias,
               path=note.relpath, bytes=len(note.data), how=note.how, **note.who)  # fmt: skip
    with contextlib.suppress(EventRefused):  # a name the feed cannot carry is in the audit record only
        host.events.emit(
            "note.written", workflow_id=note.source, relpath=note.relpath, by_workflow=note.consumer
        )
    return NoteWritten(
        note.source, note.alias, note.relpath, len(note.data), version_of(note.data), note.warning
    )


def write(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor,
    expected: str | None = None,
) -> NoteWritten:  # fmt: skip
    """Write RELPATH (from the source's KB root, beneath notes/: docs/notes.md "Paths") atomically, with provenance.

    Raises (nothing written anywhere): SessionClosed, PermissionDenied (no write
    grant now, or the index), InvalidPath/InvalidInput (bad name, not UTF-8,
    too large, wrong kind of file), PathRefused (a link, a folder or a special
    file on the way or at the name), InjectionRefused, QuotaExceeded, Busy (lock
    timeout), NoSpace, NoteVersionConflict (``expected`` given and the note is
    at another version now). Every refusal is audited.
    """
    return commit(prepare(sessions, sid, alias, relpath, data, actor=actor, expected=expected))


@dataclass(frozen=True)
class NoteRemoved(Record):
    workflow_id: str
    alias: str
    path: str  # relative to the source's KB root: notes/...
    removed: bool  # False: nothing was there


def remove(note: PreparedNote) -> NoteRemoved:
    """Remove a prepared note's file (a staged command deleted it: docs/notes.md "Staged contributions"): the
    same plan, grant and name checks as a write
    (``prepare`` with any content), under the same mutex; only a regular file
    is removed. Its history stays (docs/notes.md history). Audited
    ``note_removed``, or ``note_refused``."""
    host = note.host
    config = host.config
    try:
        with (
            pin_dir(note.kb_path, expect=note.kb_identity) as kb,
            open_notes(kb.fd) as notes_fd,
            notes_lock(
                config.state_dir, notes_fd, timeout=config.lock_timeout, who={"workflow": note.consumer}
            ),
        ):
            removed = remove_note(notes_fd, note.parts)
    except KbdError as err:
        raise note.refuse(err) from None
    except OSError as exc:
        raise note.refuse(from_oserror(exc, what=f"remove {note.relpath!r}")) from None
    if removed:
        host.audit("note_removed", session=note.sid, workflow_id=note.consumer, source=note.source,
                   alias=note.alias, path=note.relpath, how=note.how, **note.who)  # fmt: skip
    return NoteRemoved(note.source, note.alias, note.relpath, removed)
