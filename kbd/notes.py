"""Contributed notes: the one confined write entry point, the per-target mutex,
provenance, and the index reader (DESIGN §7; seed "Write access").

:func:`write_note` is used by ``kbd notes write``, the API and any other
writer. It re-resolves the session's plan, requires a write grant for that
source *now*, confines the target beneath the source's ``notes/`` (through the
path layer: no ``..``, no link, no other mount, never ``_index.json`` or a
look-alike, only regular files replaced), refuses prompt-injection patterns,
merges provenance frontmatter, and replaces the file atomically while holding
the source's notes mutex.

The mutex (:func:`notes_lock`) is a filelock keyed by the identity
(``st_dev:st_ino``) of the canonical ``notes/`` folder, so it survives a rename
of the source workflow; it works across threads and processes, is released by
the kernel when a holder dies, and is also held by ``kbd exec`` for the whole
command when a session may write into that ``notes/``. Readers never take it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from kbd.core.config import NotesQuota
from kbd.core.layout import INDEX_NAME
from kbd.core.layout import NOTES_DIR as NOTES
from kbd.core.names import NOTE_SUFFIXES as NOTE_SUFFIXES  # re-exported: readers import it from here
from kbd.core.names import TEMP_NAME, note_parts
from kbd.core.plan import Plan
from kbd.core.principals import Actor, actor_fields
from kbd.errors import (
    Busy,
    IndexUnreadable,
    InjectionRefused,
    InvalidInput,
    KbdError,
    NotFound,
    PathNotFound,
    PermissionDenied,
    QuotaExceeded,
    from_oserror,
)
from kbd.fs.confined import (
    open_beneath,
    pin_dir,
    read_file,
    read_file_stat,
    replace_file,
)

if TYPE_CHECKING:  # the types only: notes never needs the registry to import
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions

MAX_NOTE_BYTES = 1024 * 1024
#: Every written note, whatever mode the file it replaces had (never set-id or executable).
NOTE_MODE = 0o644
NOTE_FOLDER_MODE = 0o755
PROVENANCE_KEYS = ("contributed_by_workflow", "contributed_by_session", "contributed_at")
INDEX_RETRIES = 10
INDEX_RETRY_DELAY = 0.02
_TMP = TEMP_NAME


# -- the mutex ------------------------------------------------------------------------


def _holder_path(lock: Path) -> Path:
    return lock.with_suffix(".holder")


@contextlib.contextmanager
def notes_lock(state_dir: Path, notes_fd: int, *, timeout: float, who: dict[str, Any]) -> Iterator[None]:
    """Hold the mutex of the ``notes/`` folder open at ``notes_fd``.

    Raises Busy (exit 75) naming the current holder when ``timeout`` passes.
    """
    import filelock  # only writers pay for it

    from kbd.fs.locks import lock_path

    st = os.fstat(notes_fd)
    path = lock_path(state_dir, "notes", f"{st.st_dev}:{st.st_ino}")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    lock = filelock.FileLock(str(path), timeout=timeout, mode=0o640)
    try:
        # A short poll keeps the wait tail close to the holder's real hold time.
        lock.acquire(poll_interval=0.005)
    except filelock.Timeout:
        holder = "another workflow"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            info = json.loads(_holder_path(path).read_text())
            since = time.strftime("%H:%M:%SZ", time.gmtime(float(info["since"])))
            holder = f"workflow {info['workflow']} (since {since})"
        # Only the holder's workflow: its session, pid and host stay in the holder
        # file for operators, not in an answer another consumer can read.
        raise Busy(
            f"the source's notes/ is being written by {holder}; waited {timeout:g}s",
            hint="retry when that command finishes; locks.timeout_seconds in kbd.yaml sets the wait",
        ) from None
    try:
        with contextlib.suppress(OSError):
            _holder_path(path).write_text(
                json.dumps({**who, "since": time.time(), "pid": os.getpid(), "host": socket.gethostname()})
            )
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def command_locks(
    state_dir: Path, plan: Plan, *, timeout: float, who: dict[str, Any], host: Root | None = None
) -> Iterator[None]:
    """For ``kbd exec``: hold the mutex of every source ``notes/`` the plan may
    write, for the whole command, in a fixed order (no lock-order deadlocks).
    With ``host``, a ``notes/`` that an earlier command left over its quota
    refuses the command (QuotaExceeded, audited) until it is back under."""
    targets = []
    for att in plan.sources:
        if att.path is None or att.kb_identity is None:
            continue
        if plan.writes_source(att.alias):
            targets.append(att)
    with contextlib.ExitStack() as stack:
        fds = []
        for att in targets:
            assert att.path is not None
            kb = stack.enter_context(pin_dir(att.path, expect=att.kb_identity))
            fd = open_beneath(kb.fd, NOTES, os.O_RDONLY | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            st = os.fstat(fd)
            fds.append(((st.st_dev, st.st_ino), fd, kb.fd, att.workflow_id))
        for _, fd, kb_fd, source in sorted(fds):
            stack.enter_context(notes_lock(state_dir, fd, timeout=timeout, who=who))
            if host is not None:
                try:
                    check_quota(host, kb_fd, fd, source=source)
                except QuotaExceeded as err:
                    host.audit("command_refused", session=who.get("session"), workflow_id=plan.workflow_id,
                               source=source, code=err.code, reason=err.message[:300])  # fmt: skip
                    raise
        yield


# -- provenance --------------------------------------------------------------------------


def with_provenance(text: str, *, workflow_id: str, session_id: str, now: float | None = None) -> str:
    """``text`` with kbd's provenance frontmatter. An existing ``---`` block is
    merged (its other keys kept, in order); provenance keys a contributor wrote
    are replaced, never trusted."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    ours = [
        f"contributed_by_workflow: {workflow_id}",
        f"contributed_by_session: {session_id}",
        f"contributed_at: {stamp}",
    ]
    body = text
    kept: list[str] = []
    if text.startswith("---\n"):
        end = text.find("\n---\n", 3)
        if end == -1 and text.endswith("\n---"):
            end = len(text) - 4
        if end != -1:
            block = text[4:end]
            body = text[end + 5 :]
            # A contributor's own provenance keys (quoted or not) are dropped, never trusted.
            kept = [
                ln
                for ln in block.split("\n")
                if ln.split(":", 1)[0].strip().strip("\"'") not in PROVENANCE_KEYS
            ]
    return "---\n" + "\n".join([*kept, *ours]) + "\n---\n" + body


def provenance_of(head: bytes) -> str | None:
    """The contributing workflow named in a note's frontmatter, if any."""
    text = head.decode("utf-8", "replace")
    if not text.startswith("---\n"):
        return None
    end = text.find("\n---", 3)
    for line in text[4 : end if end != -1 else None].split("\n"):
        key, _, value = line.partition(":")
        if key.strip() == "contributed_by_workflow":
            return value.strip() or None
    return None


# -- the entry point ------------------------------------------------------------------------


def validate_target(relpath: str) -> list[str]:
    """The components of a note path relative to ``notes/``, or InvalidInput/PermissionDenied.
    The rule itself is :func:`kbd.core.names.note_parts` (shared with ``kbd check --mode write``)."""
    return note_parts(relpath)


def _open_parent(notes_fd: int, parts: list[str]) -> int:
    """The folder that will hold the note, beneath ``notes/``; missing subfolders
    are created one component at a time (never through a link)."""
    cur = os.dup(notes_fd)
    try:
        for comp in parts[:-1]:
            try:
                nxt = open_beneath(cur, comp, os.O_RDONLY | os.O_DIRECTORY)
            except PathNotFound:
                try:
                    os.mkdir(comp, NOTE_FOLDER_MODE, dir_fd=cur)
                    created = True
                except FileExistsError:
                    created = False
                nxt = open_beneath(cur, comp, os.O_RDONLY | os.O_DIRECTORY)
                if created:
                    # mkdir's mode passes through the writer's umask (077 made a
                    # folder the source's own agents could not enter); like the
                    # note itself, a folder kbd creates has one mode.
                    os.fchmod(nxt, NOTE_FOLDER_MODE)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def _adds(notes_fd: int, parts: tuple[str, ...], size: int) -> tuple[int, int]:
    """(new entries, new bytes) that writing ``size`` bytes at ``parts`` adds to
    ``notes/``; nothing is created (a refused write leaves nothing behind)."""
    cur = os.dup(notes_fd)
    try:
        for i, comp in enumerate(parts[:-1]):
            try:
                nxt = open_beneath(cur, comp, os.O_RDONLY | os.O_DIRECTORY)
            except PathNotFound:
                return len(parts) - i, size  # this folder, those under it, and the note
            os.close(cur)
            cur = nxt
        try:
            old = os.stat(parts[-1], dir_fd=cur, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 1, size
        return 0, size - old
    finally:
        os.close(cur)


def _sweep_temp_files(dir_fd: int) -> None:
    """Remove temp files of writers that died mid-write (we hold the mutex, so
    none is in use)."""
    for name in os.listdir(dir_fd):
        if _TMP.match(name):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)


@dataclass(frozen=True)
class PreparedNote:
    """A note that passed every check except the write itself (see :func:`prepare_note`)."""

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
    who: dict[str, Any] = field(default_factory=dict)  # the actor, as audit records name it
    text: str = ""  # what the injection gate checks, in commit_note (never under a shared lock)

    def refuse(self, err: KbdError) -> KbdError:
        self.host.audit("note_refused", session=self.sid, workflow_id=self.consumer, alias=self.alias,
                        path=self.relpath[:200], code=err.code, reason=err.message[:300],
                        rule=getattr(err, "rule", None), **self.who)  # fmt: skip
        return err


def prepare_note(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor
) -> PreparedNote:
    """Everything but the gate and the write: the session's plan now, the grant,
    the name, the size, the text, and the provenance-stamped content. Needs the
    host's registry (the daemon calls it under its state lock); waits for no file
    lock and does no work proportional to the note beyond decoding it (the
    injection gate runs in :func:`commit_note`). Every refusal is audited."""
    host = sessions.host
    try:
        plan: Plan = sessions.plan(sid, actor=actor)
    except KbdError as err:
        host.audit("note_refused", session=sid, alias=alias, path=relpath[:200], code=err.code,
                   reason=err.message[:300], **actor_fields(actor))  # fmt: skip
        raise
    att = next((a for a in plan.sources if a.alias == alias), None)
    draft = PreparedNote(
        host, sid, plan.workflow_id, alias, relpath, "", Path("/"), None, (), b"", actor_fields(actor)
    )
    if att is None:
        raise draft.refuse(
            NotFound(
                f"source {alias!r} is not attached to {plan.workflow_id!r}",
                hint="`kbd session show SID` lists the attached aliases",
            )
        )
    if not att.available or att.path is None or not plan.writes_source(alias):
        why = (
            f"is unavailable ({att.reason})" if not att.available
            else "has no write grant in this session now (attached read-only, not granted by the source's owner, "
            "or the session's kind or kb_access does not write)"
        )  # fmt: skip
        raise draft.refuse(
            PermissionDenied(
                f"source {alias!r} {why}", hint="`kbd sources list WF` shows each attachment's write status"
            )
        )
    try:
        parts = validate_target(relpath)
        if len(data) > MAX_NOTE_BYTES:
            raise InvalidInput(f"the note is {len(data)} bytes; at most {MAX_NOTE_BYTES} are allowed")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"the note is not UTF-8 text (byte {exc.start})") from None
        if "\x00" in text:
            raise InvalidInput("the note contains a NUL byte")
        if not text.strip():
            raise InvalidInput(
                "the note is empty (or only whitespace); nothing would be written but provenance",
                hint="pass the note's content with --file F or on stdin",
            )
    except KbdError as err:
        raise draft.refuse(err) from None
    final = with_provenance(text, workflow_id=plan.workflow_id, session_id=sid).encode("utf-8")
    return PreparedNote(host, sid, plan.workflow_id, alias, relpath, att.workflow_id, att.path, att.kb_identity,
                        tuple(parts), final, actor_fields(actor), text)  # fmt: skip


def commit_note(note: PreparedNote) -> dict[str, Any]:
    """Write a prepared note: run the injection gate (before any lock: it is
    linear in the note, but a lock shared with other writers must never wait
    on it), pin the KB (same identity as resolved), take the notes mutex (may
    wait up to the lock timeout), replace the file atomically."""
    from kbd.core import injection

    host = note.host
    who = {"workflow": note.consumer}
    try:
        injection.check(note.text)
    except KbdError as err:
        raise note.refuse(err) from None
    try:
        with pin_dir(note.kb_path, expect=note.kb_identity) as kb:
            notes_fd = open_beneath(kb.fd, NOTES, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with notes_lock(host.config.state_dir, notes_fd, timeout=host.config.lock_timeout, who=who):
                    adds = _adds(notes_fd, note.parts, len(note.data))
                    check_quota(host, kb.fd, notes_fd, source=note.source, adds=adds)
                    parent = _open_parent(notes_fd, list(note.parts))
                    try:
                        _sweep_temp_files(parent)
                        replace_file(parent, note.parts[-1], note.data, mode=NOTE_MODE)
                    finally:
                        os.close(parent)
            finally:
                os.close(notes_fd)
    except KbdError as err:
        raise note.refuse(err) from None
    except OSError as exc:
        # A full disk is NoSpace (75), a denied folder PermissionDenied: never one for the other.
        raise note.refuse(from_oserror(exc, what=f"write {note.relpath!r}")) from None
    path = "/".join(note.parts)
    host.audit("note_written", session=note.sid, workflow_id=note.consumer, source=note.source, alias=note.alias,
               path=path, bytes=len(note.data), **note.who)  # fmt: skip
    return {"workflow_id": note.source, "alias": note.alias, "path": "notes/" + path, "bytes": len(note.data)}


def write_note(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor
) -> dict[str, Any]:
    """Write one contributed note. Returns ``{workflow_id, alias, path, bytes}``.

    Raises (nothing written anywhere): SessionClosed, PermissionDenied (no write
    grant now, or the index), InvalidPath/InvalidInput (bad name, not UTF-8,
    too large, wrong kind of file), PathRefused (a link, a folder or a special
    file on the way or at the name), InjectionRefused, Busy (lock timeout).
    Every refusal is audited.
    """
    return commit_note(prepare_note(sessions, sid, alias, relpath, data, actor=actor))


# -- after a shell command, and the notes/ quota -------------------------------------------------


# Bounds of one post-command audit (issue 9 item 19: a contributed notes/ is
# attacker-shaped). The walk of each notes/ happens under its mutex, so it visits
# at most ``notes_quota.max_files + 1`` entries (kbd.yaml; at most
# config.MAX_QUOTA_FILES) and MAX_SCAN_DEPTH levels; then, after the mutex is
# released, at most MAX_SCAN_FILES changed files and MAX_AUDIT_READ_BYTES bytes
# in all are read for the injection gate. A capped audit says "truncated": true.
MAX_SCAN_FILES = 2000
MAX_SCAN_DEPTH = 16
MAX_AUDIT_READ_BYTES = 16 * 1024 * 1024


@dataclass
class NotesScan:
    """One walk of a ``notes/``: its size, and the regular files changed since a
    time, with the identity (inode, ctime) each had when seen."""

    entries: int = 0
    bytes: int = 0
    truncated: bool = False  # stopped at the entry or depth cap: the counts are lower bounds
    too_deep: bool = False  # folders below MAX_SCAN_DEPTH were not counted
    changed: list[tuple[str, int, int]] = field(default_factory=list)

    def over(self, quota: NotesQuota) -> bool:
        # A walk stopped early has seen more than max_files entries, or could not
        # count what lies deeper: either way the usage is not known to fit.
        return self.truncated or self.entries > quota.max_files or self.bytes > quota.max_bytes


def _past_end(st: os.stat_result) -> int:
    """Disk space a file holds beyond its length rounded up to whole blocks:
    fallocate(FALLOC_FL_KEEP_SIZE) takes any amount without growing st_size (nor
    meeting RLIMIT_FSIZE), so a quota of lengths alone would not see it. A sparse
    file still counts its length."""
    block = max(st.st_blksize, 512)
    return max(0, st.st_blocks * 512 - -(-st.st_size // block) * block)


def scan_notes(kb_fd: int, *, quota: NotesQuota, since_ns: int | None = None) -> NotesScan:
    """Walk ``notes/`` beneath the pinned KB (nothing followed), within the caps."""
    out = NotesScan()
    stack = [(NOTES, 0)]
    while stack:
        rel, depth = stack.pop()
        try:
            fd = open_beneath(kb_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        except KbdError:
            continue
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    out.entries += 1
                    if out.entries > quota.max_files:
                        out.truncated = True
                        return out
                    child = f"{rel}/{entry.name}"
                    if entry.is_dir(follow_symlinks=False):
                        if depth >= MAX_SCAN_DEPTH:
                            out.truncated = out.too_deep = True
                        else:
                            stack.append((child, depth + 1))
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.bytes += st.st_size + _past_end(st)
                    # A change is a status-change time (which a writer cannot set back).
                    if since_ns is not None and st.st_ctime_ns >= since_ns:
                        out.changed.append((child, st.st_ino, st.st_ctime_ns))
        except OSError:
            continue
        finally:
            os.close(fd)
    return out


@dataclass
class CommandChanges:
    """What :func:`scan_command_changes` saw in one source's notes/ under its mutex."""

    alias: str
    source: str
    kb_path: Path
    kb_identity: tuple[int, int] | None
    scan: NotesScan


def _notes_key(notes_fd: int) -> str:
    st = os.fstat(notes_fd)
    return f"{st.st_dev}:{st.st_ino}"


def scan_command_changes(host: Root, plan: Plan, *, since_ns: int) -> list[CommandChanges]:
    """After a write-plan command, its notes mutexes still held: which files in
    each contributed ``notes/`` changed while it ran (bounded walk, nothing read).
    Reading and gating them is :func:`audit_command_changes`, after release."""
    since = since_ns - 50_000_000  # the coarse-timestamp margin
    out = []
    for att in plan.sources:
        if att.path is None or not plan.writes_source(att.alias):
            continue
        try:
            with pin_dir(att.path, expect=att.kb_identity) as kb:
                notes_fd = open_beneath(kb.fd, NOTES, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    key = _notes_key(notes_fd)
                finally:
                    os.close(notes_fd)
                scan = scan_notes(kb.fd, quota=host.config.notes_quota, since_ns=since)
                # Under the mutex, so a later command's verdict is never overwritten by this one's.
                _mark_over_quota(
                    host, key, att.workflow_id, scan if scan.over(host.config.notes_quota) else None
                )
        except (KbdError, OSError):
            continue
        out.append(CommandChanges(att.alias, att.workflow_id, att.path, att.kb_identity, scan))
    return out


def audit_command_changes(host: Root, plan: Plan, sid: str, changes: list[CommandChanges]) -> None:
    """Audit (after the notes mutexes are released) the changed files found by
    :func:`scan_command_changes`, and which of them the injection gate would have
    refused. Files are only read, never changed: shell writes carry no enforced
    provenance (``kbd notes write`` is the path that stamps it), but the source's
    owner can see who changed what. A file changed again since the scan (another
    writer, after the mutex was released) is listed but not gated. A command
    that left a notes/ over its quota is recorded, and the next write to it is
    refused until it is back under (:func:`check_quota`)."""
    from kbd.core import injection

    budget = MAX_AUDIT_READ_BYTES
    for ch in changes:
        files = [rel for rel, _, _ in ch.scan.changed]
        flagged: dict[str, str] = {}
        truncated = ch.scan.truncated or len(files) > MAX_SCAN_FILES
        try:
            with pin_dir(ch.kb_path, expect=ch.kb_identity) as kb:
                for rel, ino, ctime in ch.scan.changed[:MAX_SCAN_FILES]:
                    if budget <= 0:
                        truncated = True
                        break
                    try:
                        data, st = read_file_stat(kb.fd, rel, limit=MAX_NOTE_BYTES, allow_hardlinks=True)
                    except KbdError:
                        continue
                    if (st.st_ino, st.st_ctime_ns) != (ino, ctime):
                        continue
                    budget -= len(data)
                    try:
                        injection.check(data.decode("utf-8", "replace"))
                    except InjectionRefused as exc:
                        flagged[rel] = exc.rule
        except KbdError:
            pass
        if files or truncated:
            host.audit("notes_changed_by_command", session=sid, workflow_id=plan.workflow_id, source=ch.source,
                       files=files[:200], flagged=flagged, truncated=truncated)  # fmt: skip
        if ch.scan.over(host.config.notes_quota):
            host.audit("notes_quota_exceeded", session=sid, workflow_id=plan.workflow_id, source=ch.source,
                       entries=ch.scan.entries, bytes=ch.scan.bytes, truncated=ch.scan.truncated,
                       max_files=host.config.notes_quota.max_files,
                       max_bytes=host.config.notes_quota.max_bytes)  # fmt: skip


def _marker(state_dir: Path, notes_key: str) -> Path:
    from kbd.fs.locks import lock_path

    return lock_path(state_dir, "quota", notes_key).with_suffix(".over")


def _mark_over_quota(host: Root, notes_key: str, source: str, scan: NotesScan | None) -> None:
    """Remember (in state/) that a notes/ was left over quota, or forget it."""
    path = _marker(host.config.state_dir, notes_key)
    if scan is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    from kbd.fs.atomic import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    info = {"source": source, "entries": scan.entries, "bytes": scan.bytes, "since": time.time()}
    write_atomic(path, json.dumps(info).encode(), mode=0o640)


def check_quota(
    host: Root, kb_fd: int, notes_fd: int, *, source: str, adds: tuple[int, int] = (0, 0)
) -> None:
    """Under the source's notes mutex: raise QuotaExceeded when ``notes/`` is over
    its quota, or would be after adding ``adds`` = (entries, bytes). The bounded
    walk is paid only by writes and by a command into a notes/ marked over quota."""
    quota = host.config.notes_quota
    key = _notes_key(notes_fd)
    marked = _marker(host.config.state_dir, key).exists()
    if not marked and adds == (0, 0):
        return
    scan = scan_notes(kb_fd, quota=quota)
    if marked and not scan.over(quota):
        _mark_over_quota(host, key, source, None)  # back under: the source's owner cleaned up
        marked = False
    entries, size = scan.entries + adds[0], scan.bytes + adds[1]
    if marked or scan.truncated or entries > quota.max_files or size > quota.max_bytes:
        counted = "more than " if scan.truncated and not scan.too_deep else ""
        raise QuotaExceeded(
            f"the notes/ of source {source!r} would exceed its quota ({quota.max_files} entries, "
            f"{quota.max_bytes} bytes): it holds {counted}{scan.entries} entries and {scan.bytes} bytes"
            + (f", nested deeper than {MAX_SCAN_DEPTH} folders (not counted)" if scan.too_deep else "")
            + (" and a command left it over quota" if marked else "")
            + (f"; this write adds {adds[0]} entries and {adds[1]} bytes" if adds != (0, 0) else "")
        )


# -- readers ------------------------------------------------------------------------------------


def read_index(kb_fd: int, *, limit: int) -> bytes:
    """``notes/_index.json`` as valid JSON bytes. A transient parse failure (a
    writer mid-rewrite without atomic replacement) is retried briefly; then an
    error is raised — never an empty index."""
    last = ""
    for attempt in range(INDEX_RETRIES):
        data = read_file(kb_fd, f"{NOTES}/{INDEX_NAME}", limit=limit)
        try:
            if not data.strip():
                raise ValueError("the index file is empty")
            orjson.loads(data)
            return data
        except ValueError as exc:
            last = str(exc)
        if attempt + 1 < INDEX_RETRIES:
            time.sleep(INDEX_RETRY_DELAY)
    raise IndexUnreadable(f"notes/_index.json is not valid JSON after {INDEX_RETRIES} reads: {last}")
