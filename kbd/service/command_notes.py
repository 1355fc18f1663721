"""What a shell command may do to the ``notes/`` it can write (``kbd exec`` with
a write plan): hold each such ``notes/``'s mutex for the whole command
(:func:`command_locks`, refusing a ``notes/`` a command left over quota), walk
them for changes while still held (:func:`scan_command_changes`), then read and
audit the changed files after release (:func:`audit_command_changes`).

An operation, not storage: it takes the root (its config and audit log) and the
session's plan, and applies the injection rules to what a command wrote. The
storage under it is :mod:`kbd.fs.notes` and :mod:`kbd.state.notes_quota`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.events import EventRefused
from kbd.core.notes import MAX_AUDIT_READ_BYTES, MAX_NOTE_BYTES, MAX_SCAN_FILES, NotesScan
from kbd.core.plan import Plan
from kbd.errors import InjectionRefused, KbdError, QuotaExceeded
from kbd.fs.confined import open_beneath, pin_dir, read_file_stat
from kbd.fs.notes import in_kb, notes_key, notes_lock, open_notes, scan_notes
from kbd.state.history import Who, store_for
from kbd.state.notes_quota import check_quota, mark_over_quota

if TYPE_CHECKING:  # the type only: kbd exec already holds the root
    from kbd.service.root import Root

#: The coarse-timestamp margin: a file changed just before the command started still counts.
CTIME_MARGIN_NS = 50_000_000


@contextlib.contextmanager
def command_locks(host: Root, plan: Plan, *, who: Mapping[str, str]) -> Iterator[None]:
    """Hold the mutex of every source ``notes/`` the plan may write, for the
    whole command, in a fixed order (no lock-order deadlocks). A ``notes/``
    that an earlier command left over its quota refuses the command
    (QuotaExceeded, audited ``command_refused``) until it is back under."""
    config = host.config
    targets = [
        att for att in plan.sources
        if att.path is not None and att.kb_identity is not None and plan.writes_source(att.alias)
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        fds = []
        for att in targets:
            assert att.path is not None
            kb = stack.enter_context(pin_dir(att.path, expect=att.kb_identity))
            fd = stack.enter_context(open_notes(kb.fd))
            st = os.fstat(fd)
            fds.append(((st.st_dev, st.st_ino), fd, kb.fd, att.workflow_id))
        for _, fd, kb_fd, source in sorted(fds):
            stack.enter_context(notes_lock(config.state_dir, fd, timeout=config.lock_timeout, who=who))
            try:
                check_quota(config.state_dir, config.notes_quota, kb_fd, fd, source=source)
            except QuotaExceeded as err:
                host.audit("command_refused", session=who.get("session"), workflow_id=plan.workflow_id,
                           source=source, code=err.code, reason=err.message[:300])  # fmt: skip
                raise
        yield


@dataclass
class CommandChanges:
    """What :func:`scan_command_changes` saw in one source's notes/ under its mutex."""

    alias: str
    source: str
    kb_path: Path
    kb_identity: tuple[int, int] | None
    scan: NotesScan


def scan_command_changes(host: Root, plan: Plan, *, since_ns: int) -> list[CommandChanges]:
    """After a write-plan command, its notes mutexes still held: which files in
    each contributed ``notes/`` changed while it ran (bounded walk, nothing read).
    Reading and gating them is :func:`audit_command_changes`, after release."""
    since = since_ns - CTIME_MARGIN_NS
    quota = host.config.notes_quota
    out = []
    for att in plan.sources:
        if att.path is None or not plan.writes_source(att.alias):
            continue
        try:
            with pin_dir(att.path, expect=att.kb_identity) as kb:
                with open_notes(kb.fd) as notes_fd:
                    key = notes_key(notes_fd)
                scan = scan_notes(kb.fd, quota=quota, since_ns=since)
                # Under the mutex, so a later command's verdict is never overwritten by this one's.
                mark_over_quota(
                    host.config.state_dir, key, att.workflow_id, scan if scan.over(quota) else None
                )
        except (KbdError, OSError):
            continue
        out.append(CommandChanges(att.alias, att.workflow_id, att.path, att.kb_identity, scan))
    return out


def _gate_changes(ch: CommandChanges, budget: int) -> tuple[dict[str, str], bool, int, dict[str, bytes]]:
    """Read (within ``budget`` bytes) the files of ``ch`` still as the scan saw
    them and run the injection gate: (flagged file → rule, budget ran out,
    budget left, the bytes read by file: what the note history records and
    whose digests the review state keys)."""
    from kbd.core import injection
    from kbd.fs import datafiles

    flagged: dict[str, str] = {}
    seen: dict[str, bytes] = {}
    out_of_budget = False
    try:
        with pin_dir(ch.kb_path, expect=ch.kb_identity) as kb:
            for rel, ino, ctime in ch.scan.changed[:MAX_SCAN_FILES]:
                if budget <= 0:
                    out_of_budget = True
                    break
                try:
                    data, st = read_file_stat(kb.fd, rel, limit=MAX_NOTE_BYTES, allow_hardlinks=True)
                except KbdError:
                    continue
                if (st.st_ino, st.st_ctime_ns) != (ino, ctime):
                    continue
                budget -= len(data)
                seen[rel] = data
                try:
                    injection.check(data.decode("utf-8", "replace"), ruleset=datafiles.injection_rules())
                except InjectionRefused as exc:
                    flagged[rel] = exc.rule
    except KbdError:
        pass
    return flagged, out_of_budget, budget, seen


#: What a contribution's digest is computed for when the gate did not read it
#: (over its per-file cap or its budget): files up to the search index's and the
#: review queue's cap, within this many bytes per command.
MAX_DIGEST_FILE_BYTES = 2 * MAX_NOTE_BYTES
MAX_DIGEST_BYTES = 4 * MAX_AUDIT_READ_BYTES


def _digests_unread(ch: CommandChanges, seen: Mapping[str, bytes]) -> dict[str, str]:
    """The ``sha256:`` digests of the changed files the gate did not read (too
    big for it, or past its budget), still as the scan saw them, hashed without
    keeping them: another workflow's bytes must be recorded as its contribution
    whatever their size, or search and the review queue would take a note kbd
    cannot vouch for for the source's own."""
    import hashlib
    import stat

    out: dict[str, str] = {}
    budget = MAX_DIGEST_BYTES
    try:
        with pin_dir(ch.kb_path, expect=ch.kb_identity) as kb:
            for rel, ino, ctime in ch.scan.changed[:MAX_SCAN_FILES]:
                if rel in seen:
                    continue
                if budget <= 0:
                    break
                try:
                    # O_NONBLOCK: a FIFO planted under the name never blocks the audit.
                    fd = open_beneath(kb.fd, rel, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
                except KbdError:
                    continue
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or (st.st_ino, st.st_ctime_ns) != (ino, ctime):
                        continue
                    if st.st_size > MAX_DIGEST_FILE_BYTES:
                        continue  # neither indexed nor queued for review: nothing to vouch for
                    h = hashlib.sha256()
                    while chunk := os.read(fd, 1 << 16):
                        h.update(chunk)
                        budget -= len(chunk)
                    out[rel] = "sha256:" + h.hexdigest()
                except OSError:
                    continue
                finally:
                    os.close(fd)
    except KbdError:
        pass
    return out


def _record_versions(host: Root, ch: CommandChanges, seen: dict[str, bytes], who: Who) -> None:
    """Each changed note the audit read, as a version (how: ``command``) unless
    its history already ends with these bytes. A file changed again since the
    scan was not read, so it is not recorded here: the next write records what
    it finds. A failure to record is audited; the command's result stands."""
    if not seen:
        return
    store = store_for(host.config)
    try:
        kb = pin_dir(ch.kb_path, expect=ch.kb_identity, path_only=True)
    except (KbdError, OSError) as exc:
        for rel in seen:
            host.audit("note_history_failed", source=ch.source, path=rel, reason=str(exc)[:300])
        return
    with kb:
        # The source's history budget asks which notes are still there (docs/notes.md "Note history").
        present = functools.partial(in_kb, kb.fd)
        for rel, data in seen.items():
            try:
                store.record(ch.source, rel, data, how="command", who=who, if_new=True, present=present)
            except (KbdError, OSError) as exc:
                host.audit("note_history_failed", source=ch.source, path=rel, reason=str(exc)[:300])


SETID = 0o6000


def strip_setid(ch: CommandChanges) -> list[str]:
    """Clear S_ISUID/S_ISGID on the changed regular files of ``ch`` (the
    seccomp filter already refuses to set them: this is the second layer, and
    covers a kernel path the filter does not see). A setgid file in a source's
    notes/ would hand the grant group, or its owner's group, to whoever runs it.
    Each file is opened beneath the pinned KB without following links and
    changed through that descriptor only, never by path. The names stripped."""
    stripped = []
    try:
        with pin_dir(ch.kb_path, expect=ch.kb_identity) as kb:
            for c in ch.scan.changed[:MAX_SCAN_FILES]:
                try:
                    fd = open_beneath(kb.fd, c.rel, os.O_RDONLY | os.O_NOCTTY)
                except KbdError:
                    continue
                try:
                    st = os.fstat(fd)
                    if st.st_mode & 0o170000 == 0o100000 and st.st_mode & SETID:
                        os.fchmod(fd, st.st_mode & 0o7777 & ~SETID)
                        stripped.append(c.rel)
                except OSError:
                    continue
                finally:
                    os.close(fd)
    except KbdError:
        pass
    return stripped


def audit_command_changes(
    host: Root, plan: Plan, sid: str, changes: list[CommandChanges], *, principal: str | None
) -> None:
    """Audit (after the notes mutexes are released) the changed files found by
    :func:`scan_command_changes`, and which of them the injection gate would have
    refused, and record each file it read as a version in the note's history
    (``principal``: who ran the command). Files are only read, never changed: shell writes carry no enforced
    provenance (``kbd notes write`` is the path that stamps it), but the source's
    owner can see who changed what. A file changed again since the scan (another
    writer, after the mutex was released) is listed but not gated. A command
    that left a notes/ over its quota is recorded, and the next write to it is
    refused until it is back under (:func:`kbd.state.notes_quota.check_quota`)."""
    quota = host.config.notes_quota
    budget = MAX_AUDIT_READ_BYTES
    for ch in changes:
        files = [c.rel for c in ch.scan.changed]
        flagged, out_of_budget, budget, seen = _gate_changes(ch, budget)
        _record_versions(host, ch, seen, Who(principal, sid, plan.workflow_id))
        if ch.source != plan.workflow_id:
            import hashlib

            digests = {rel: "sha256:" + hashlib.sha256(data).hexdigest() for rel, data in seen.items()}
            digests.update(_digests_unread(ch, seen))
            # Another workflow's bytes in the source's notes/: unreviewed until
            # its owner decides (docs/notes.md "Reviewed contributions"), provenance frontmatter or not.
            with contextlib.suppress(KbdError):
                from kbd.state.reviews import record_contributions

                record_contributions(host.config.state_dir, ch.source, digests, by=plan.workflow_id)
        truncated = ch.scan.truncated or len(files) > MAX_SCAN_FILES or out_of_budget
        # After the gate (which compares each file's ctime with the scan's).
        extra = {"setid_stripped": stripped[:200]} if (stripped := strip_setid(ch)) else {}
        if files or truncated:
            host.audit("notes_changed_by_command", session=sid, workflow_id=plan.workflow_id, source=ch.source,
                       files=files[:200], flagged=flagged, truncated=truncated, **extra)  # fmt: skip
        for rel in files[:200]:  # the same names the audit record lists
            # A name the feed's allow-list refuses (a control character: the
            # command chose it) is in the audit record, never in an event.
            with contextlib.suppress(EventRefused):
                host.events.emit(
                    "note.written", workflow_id=ch.source, relpath=rel, by_workflow=plan.workflow_id
                )
        if ch.scan.over(quota):
            host.audit("notes_quota_exceeded", session=sid, workflow_id=plan.workflow_id, source=ch.source,
                       entries=ch.scan.entries, bytes=ch.scan.bytes, truncated=ch.scan.truncated,
                       max_files=quota.max_files, max_bytes=quota.max_bytes)  # fmt: skip


def record_own_changes(host: Root, plan: Plan, sid: str, *, since_ns: int, principal: str | None) -> None:
    """Version what a command changed in the session's own KB's ``notes/``
    (docs/notes.md "Note history": a shell's edits there are versions too, ``how:
    command``). Not staged and not gated: the KB is the consumer's own. A
    bounded walk, then reads within the audit's byte budget; failures are
    audited, never the command's."""
    from kbd.core.layout import KB_DIR

    own_kb = plan.workflow_folder / KB_DIR
    try:
        with pin_dir(own_kb) as kb:
            identity = (kb.dev, kb.ino)
            scan = scan_notes(kb.fd, quota=host.config.notes_quota, since_ns=since_ns - CTIME_MARGIN_NS)
    except (KbdError, OSError):
        return
    if not scan.changed:
        return
    ch = CommandChanges(".", plan.workflow_id, own_kb, identity, scan)
    _, _, _, seen = _gate_changes(ch, MAX_AUDIT_READ_BYTES)
    _record_versions(host, ch, seen, Who(principal, sid, plan.workflow_id))
