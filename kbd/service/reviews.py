"""Reviewed contributions (docs/notes.md "Reviewed contributions": captured items stay unreviewed until
someone with authority reviews them): ``kbd notes pending SOURCE_WF``
and ``kbd notes review SOURCE_WF RELPATH --approve|--reject``.

A note in a source's ``notes/`` is *contributed* when its provenance
frontmatter names another workflow (``contributed_by_workflow``). It is
``unreviewed`` until the source's owner (or an admin) decides on exactly its
bytes (:mod:`kbd.state.reviews`, keyed by digest: an edit makes it unreviewed
again). Approval records the decision; rejection keeps the bytes and the
original relpath in kbd's state, then removes the file from ``notes/`` under
the source's notes mutex (the same one every writer holds), so nothing is
deleted outright and :func:`restore_rejected` can put it back.

Only the source's owners and admins may list or review (others 77, or 66
when they may not see the source); every review and every refusal is
audited. No change-feed event: docs/daemon.md's list has none for reviews.
"""

from __future__ import annotations

import functools
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from kbd.core import audience
from kbd.core import knowledge as rules
from kbd.core.history import parse_version
from kbd.core.layout import KB_DIR, NOTES_DIR
from kbd.core.notes import MAX_NOTE_BYTES, utc_stamp
from kbd.core.principals import Principal
from kbd.core.records import Record
from kbd.errors import (
    InvalidInput,
    KbdError,
    NoteVersionConflict,
    NotFound,
    PathRefused,
    PermissionDenied,
    SourceUnavailable,
    UsageError,
)
from kbd.fs import confined
from kbd.fs.kbwalk import walk_notes
from kbd.fs.notes import in_kb, notes_lock, open_notes, replace_note
from kbd.fs.registry import Found
from kbd.service.root import Root
from kbd.state import reviews as store
from kbd.state.history import Who, store_for

#: A file larger than any note kbd writes is no contribution kbd can vouch for.
MAX_REVIEW_BYTES = 2 * MAX_NOTE_BYTES
MAX_PENDING = 5000


@dataclass(frozen=True)
class PendingNote(Record):
    relpath: str  # relative to the KB root: notes/...
    contributed_by_workflow: str
    contributed_by_session: str | None
    contributed_at: str | None
    digest: str
    bytes: int


@dataclass(frozen=True)
class Pending(Record):
    workflow_id: str
    pending: tuple[PendingNote, ...]
    truncated: bool


@dataclass(frozen=True)
class Reviewed(Record):
    workflow_id: str
    relpath: str
    decision: str  # approved | rejected
    digest: str
    contributed_by_workflow: str
    contributed_at: str | None
    rejected_id: int | None  # the kept copy of a rejected note


def _reviewable(host: Root, source_wf: str, actor: Principal, *, action: str, relpath: str | None) -> Found:
    """The source, when ``actor`` is one of its owners or an admin; refusals audited."""
    try:
        found = host.workflow(source_wf)
        m = found.manifest
        audience.require_inspectable(actor, m, source_wf)
        if not audience.can_grant_writers(actor, m):
            raise PermissionDenied(
                f"{actor.id!r} may not review contributions to {source_wf!r}: only its owners or an admin may",
                hint="ask an owner of the source workflow to review them",
            )
    except KbdError as err:
        host.audit_refusal("note_review_refused", err, actor=actor, action=action, source=source_wf,
                           relpath=None if relpath is None else relpath[:200])  # fmt: skip
        raise
    return found


def _kb(host: Root, found: Found) -> tuple[Path, tuple[int, int]]:
    """The source's KB folder and the identity it has now (refused when it is
    missing, a link or another mount: the same rules as an attachment's)."""
    probe = host.probe_kb(found.folder.path)
    if probe.problem is not None or probe.identity is None:
        reason = probe.problem.reason if probe.problem is not None else "kb_missing"
        message = probe.problem.message if probe.problem is not None else "no knowledge base"
        raise SourceUnavailable(
            f"{found.manifest.id!r} has no usable knowledge base: {message}", reason=reason
        )
    return found.folder.path / KB_DIR, probe.identity


def pending(host: Root, source_wf: str, *, actor: Principal) -> Pending:
    """``source_wf``'s contributed notes no one has decided on (for these bytes)."""
    found = _reviewable(host, source_wf, actor, action="pending", relpath=None)
    path, identity = _kb(host, found)
    decided = store.decisions(host.config.state_dir, source_wf)
    by_command = store.contributed(host.config.state_dir, source_wf)
    out: list[PendingNote] = []
    truncated = False
    with confined.pin_dir(path, expect=identity) as kb:
        for seen in walk_notes(kb.fd, NOTES_DIR, max_files=MAX_PENDING + 1, max_bytes=MAX_REVIEW_BYTES):
            try:
                data, _ = confined.read_file_stat(kb.fd, seen.rel, limit=MAX_REVIEW_BYTES)
            except KbdError:
                continue  # changed into something kbd does not read since the walk
            prov = rules.provenance_fields(data.decode("utf-8", "replace"))
            digest = rules.digest(data)
            # What kbd saw a command write outranks what the bytes claim, its time too.
            saw = by_command.get((seen.rel, digest))
            by = rules.contributor(source_wf, saw[0] if saw else prov.get("contributed_by_workflow"))
            at = utc_stamp(saw[1]) if saw else prov.get("contributed_at")
            # Rejected bytes still in notes/ were written back after the
            # rejection took them out: pending again, not hidden by it.
            if by is None or decided.get((seen.rel, digest)) == "approved":
                continue
            if len(out) >= MAX_PENDING:
                truncated = True
                break
            out.append(PendingNote(seen.rel, by, prov.get("contributed_by_session"), at, digest, len(data)))
    out.sort(key=lambda p: (p.contributed_at or "", p.relpath))
    return Pending(source_wf, tuple(out), truncated)


def review(
    host: Root, source_wf: str, relpath: str, *, approve: bool, actor: Principal, expected: str | None = None
) -> Reviewed:
    """Approve the note's bytes the reviewer saw, or reject it: keep it in kbd's
    state and move it out of ``notes/``. RELPATH is relative to the KB root
    (``notes/x.md``). ``expected``: the version (digest) the reviewer saw
    (``kbd notes pending``), required to approve (docs/notes.md "Reviewed contributions": an approval names
    the bytes it approves); the decision is
    refused (75) when the note's bytes are no longer those."""
    action = "approve" if approve else "reject"
    # The version string is decoded before any lookup: the same answer whatever workflow is named.
    try:
        want = None if expected is None else parse_version(expected, field="--expected-version")
    except KbdError as err:
        host.audit_refusal("note_review_refused", err, actor=actor, action=action, source=source_wf,
                           relpath=relpath[:200])  # fmt: skip
        raise
    found = _reviewable(host, source_wf, actor, action=action, relpath=relpath)
    try:
        if approve and expected is None:
            raise UsageError(
                "--approve needs --expected-version V (over the API: expected_version), the version you "
                "reviewed: an approval names the bytes it approves",
                hint=f"`kbd notes pending {source_wf}` shows each note's version (sha256:<hex>); "
                "`kbd notes show` its bytes",
            )
        parts = rules.review_parts(relpath)
        path, identity = _kb(host, found)
        rel = "/".join(parts)
        result = _decide(host, source_wf, rel, path, identity, approve=approve, by=actor.id, expected=want)
    except KbdError as err:
        host.audit_refusal("note_review_refused", err, actor=actor, action=action, source=source_wf,
                           relpath=relpath[:200])  # fmt: skip
        raise
    host.audit("note_reviewed", actor=actor.id, source=source_wf, relpath=rel, decision=result.decision,
               digest=result.digest, contributed_by=result.contributed_by_workflow,
               rejected_id=result.rejected_id)  # fmt: skip
    return result


def _decide(
    host: Root, source_wf: str, rel: str, path: Path, identity: tuple[int, int], *, approve: bool, by: str,
    expected: str | None = None,
) -> Reviewed:  # fmt: skip
    config = host.config
    with (
        confined.pin_dir(path, expect=identity) as kb,
        open_notes(kb.fd) as notes_fd,
        # Held while deciding: no writer (kbd notes write, a granted command)
        # changes the note between the bytes read and the decision recorded.
        notes_lock(config.state_dir, notes_fd, timeout=config.lock_timeout, who={"workflow": f"review:{by}"}),
    ):
        data, st = confined.read_file_stat(kb.fd, rel, limit=MAX_REVIEW_BYTES)
        prov = rules.provenance_fields(data.decode("utf-8", "replace"))
        digest = rules.digest(data)
        if expected is not None and digest != expected:
            # The contributor changed the note since the reviewer read it: a
            # decision on bytes they never saw is refused, not recorded.
            raise NoteVersionConflict(
                f"{rel!r} in {source_wf!r} changed since version {expected}; it is now {digest}",
                current=digest, hint=f"`kbd notes pending {source_wf}` shows it again; review the new bytes",
            )  # fmt: skip
        key = (source_wf, rel, digest)
        shell_by = store.lookup(config.state_dir, {key}).get(key, (None, None))[1]
        contributed_by = rules.contributor(source_wf, shell_by or prov.get("contributed_by_workflow"))
        if contributed_by is None:
            raise InvalidInput(
                f"{rel!r} in {source_wf!r} is the source's own note (no contribution provenance); "
                "only contributed notes are reviewed"
            )
        if approve:
            store.record(config.state_dir, source_wf, rel, digest, "approved", by=by)
            return Reviewed(
                source_wf, rel, "approved", digest, contributed_by, prov.get("contributed_at"), None
            )
        kept = store.keep_rejected(config.state_dir, source_wf, rel, digest, data, by=by)
        _remove(kb.fd, rel, st)
        return Reviewed(source_wf, rel, "rejected", digest, contributed_by, prov.get("contributed_at"), kept)


def _remove(kb_fd: int, rel: str, seen: os.stat_result) -> None:
    """Unlink ``rel`` beneath the KB, only if it is still the file just read."""
    parent, _, name = rel.rpartition("/")
    pfd = confined.open_beneath(kb_fd, parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            raise PathRefused(f"{rel!r} changed while it was reviewed; review it again", why="swapped")
        os.unlink(name, dir_fd=pfd)
        os.fsync(pfd)
    finally:
        os.close(pfd)


@dataclass(frozen=True)
class Restored(Record):
    workflow_id: str
    relpath: str
    rejected_id: int
    digest: str


def restore_rejected(host: Root, source_wf: str, rejected_id: int, *, actor: Principal) -> Restored:
    """Put a rejected note back at its original relpath, byte for byte (owners
    and admins; refused when something now stands at that name). Its review
    decision is dropped with it: a restored note is unreviewed again. For a
    ``kbd notes restore``-like command (item 3 owns the CLI for it)."""
    found = _reviewable(host, source_wf, actor, action="restore", relpath=None)
    kept = next((r for r in store.rejected(host.config.state_dir, source_wf) if r.id == rejected_id), None)
    if kept is None:
        raise NotFound(f"{source_wf!r} has no rejected note {rejected_id}")
    path, identity = _kb(host, found)
    config = host.config
    parts = rules.review_parts(kept.relpath)
    with (
        confined.pin_dir(path, expect=identity) as kb,
        open_notes(kb.fd) as notes_fd,
        notes_lock(
            config.state_dir, notes_fd, timeout=config.lock_timeout, who={"workflow": f"review:{actor.id}"}
        ),
    ):
        try:
            os.close(confined.open_beneath(kb.fd, kept.relpath, os.O_PATH))
        except NotFound:
            pass
        else:
            raise PathRefused(f"{kept.relpath!r} exists again; move it away first", why="exists")
        replace_note(notes_fd, tuple(parts[1:]), kept.data, shared=config.sandbox.grant_group is not None)
        # A write kbd performs into notes/: a version in the note's history (docs/notes.md "Note history").
        store_for(config).record(source_wf, kept.relpath, kept.data, how="unreject",
                                 who=Who(actor.id, None, None), present=functools.partial(in_kb, kb.fd))  # fmt: skip
    store.mark_restored(config.state_dir, rejected_id)
    host.audit("note_restored", actor=actor.id, source=source_wf, relpath=kept.relpath, rejected_id=rejected_id,
               digest=kept.digest, at=time.time())  # fmt: skip
    return Restored(source_wf, kept.relpath, rejected_id, kept.digest)


@dataclass(frozen=True)
class RejectedNote(Record):
    """A rejected note kept for its source (its size, not its bytes)."""

    id: int
    relpath: str
    digest: str
    bytes: int
    rejected_by: str
    rejected_at: float

    @classmethod
    def of(cls, r: store.Rejected) -> RejectedNote:
        return cls(r.id, r.relpath, r.digest, len(r.data), r.rejected_by, r.rejected_at)


@dataclass(frozen=True)
class RejectedList(Record):
    workflow_id: str
    rejected: tuple[RejectedNote, ...]


def rejected_notes(host: Root, source_wf: str, *, actor: Principal) -> RejectedList:
    """The rejected notes kept for ``source_wf`` that were not restored (owners and admins)."""
    _reviewable(host, source_wf, actor, action="list rejected", relpath=None)
    return RejectedList(
        source_wf, tuple(RejectedNote.of(r) for r in store.rejected(host.config.state_dir, source_wf))
    )
