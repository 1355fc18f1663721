"""Committing a command's staged contributions (docs/notes.md "Staged contributions").

A command with a write grant wrote each source ``notes/`` through an overlay
whose upper layer is kbd's staging folder (:mod:`kbd.sandbox.staging`). When it
exits, :func:`commit` looks the session's plan up again and, unless a grant
shrank meanwhile (a revoke, a detach, a closed session, a principal who lost
the session: then *nothing* is committed), sends each changed path through the
one note write path (:mod:`kbd.service.notes`: names, gate, provenance,
mutex, quota, history version ``command``, review state) and each deleted one
through its removal. Each path is its own commit, holding the notes mutex only
for that file. A refused path is not applied; its bytes are kept for the
contributor in the consumer's own workflow folder (``.kbd-refused/``) and it
is reported (:class:`Report`) and audited.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.notes import MAX_NOTE_BYTES, MAX_SCAN_DEPTH, MAX_SCAN_FILES
from kbd.core.plan import Plan, grants_shrunk
from kbd.core.principals import Actor
from kbd.core.records import Keys, Record, key
from kbd.errors import KbdError
from kbd.fs.confined import make_folders, pin_dir, read_file_stat
from kbd.service import JsonObject
from kbd.service import notes as note_ops

if TYPE_CHECKING:
    from kbd.sandbox.staging import Area, Staging
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions

OPAQUE_XATTR = "trusted.overlay.opaque"
#: Where refused contributions are kept, inside the consumer's workflow folder.
REFUSED_DIR = ".kbd-refused"
#: At most this many bytes of refused contributions are kept per command.
MAX_KEPT_BYTES = 64 * 1024 * 1024
#: A placeholder body for a removal's checks (a removal writes no bytes).
_REMOVAL = b"(removed)\n"


@dataclass(frozen=True)
class Change:
    """One path the command changed in a staged ``notes/``: the staged file
    (read only when it is offered: :meth:`read`), or None for a removal;
    ``problem``: why it cannot even be offered to the write path (a special
    file, a folder made opaque, too large, too deep)."""

    relpath: str  # relative to notes/
    staged: Path | None
    problem: str | None = None
    size: int = 0

    def read(self) -> bytes:
        """The staged bytes (never through a link, never a FIFO: the walk saw
        a regular file, and nothing writes the layer once the command's tree
        is dead)."""
        fd = os.open(self.staged or "/dev/null", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            chunks, left = [], MAX_NOTE_BYTES + 1
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Contributions(Record):
    """A command's contributions: the notes committed (``notes/...`` relpaths, also by alias), those
    refused (alias, relpath, code, message) and where the refused bytes are kept."""

    committed: tuple[str, ...]
    refused: tuple[dict[str, str], ...]
    committed_by_alias: dict[str, list[str]]
    kept: str | None = field(default=None, metadata=key(omit_none=True))


@dataclass
class Report(Record):
    """What became of a command's contributions (docs/notes.md "Staged contributions"), filled in as they are
    committed. Its JSON is written by hand (docs/architecture.md "Typed operations"): it is the
    :class:`Contributions` it adds up to, under ``contributions``."""

    committed: list[tuple[str, str]] = field(default_factory=list)  # (alias, notes/... relpath)
    refused: list[dict[str, str]] = field(default_factory=list)  # alias, relpath, code, message
    kept: str | None = None  # where the refused bytes are, inside the consumer's folder

    def to_json(self) -> JsonObject:
        by_alias: dict[str, list[str]] = {}
        for alias, rel in self.committed:
            by_alias.setdefault(alias, []).append(rel)
        done = Contributions(tuple(rel for _, rel in self.committed), tuple(dict(r) for r in self.refused),
                             by_alias, self.kept)  # fmt: skip
        return {"contributions": done.to_json()}

    @classmethod
    def from_json(cls, data: object, where: str = "") -> Report:
        done: Contributions = _REPORT.read(cls, data, where)["contributions"]
        # Each committed relpath's alias: the one whose own list names it next.
        left = {alias: list(rels) for alias, rels in done.committed_by_alias.items()}
        committed = []
        for rel in done.committed:
            alias = next((a for a, rels in left.items() if rels and rels[0] == rel), "")
            if alias:
                left[alias].pop(0)
            committed.append((alias, rel))
        return cls(committed, list(done.refused), done.kept)

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _REPORT.schema(cls, defs)

    def lines(self) -> list[str]:
        """The stderr lines: one per refused path, and where its bytes are."""
        out = [
            f"contribution refused: {r['alias']}:{r['relpath']}: error[{r['code']}]: {r['message']}"
            for r in self.refused
        ]
        if self.refused and self.kept is not None:
            out.append(f"the refused contributions are kept in {self.kept}")
        return out


_REPORT = Keys(lambda: {"contributions": Contributions})


def changes(area: Area, *, budget: int = MAX_SCAN_FILES) -> Iterator[Change]:
    """The paths a command changed in one staged ``notes/``: a walk of the
    upper layer (kbd's own folder: no link is followed, nothing but regular
    files is read), at most ``budget`` entries and MAX_SCAN_DEPTH levels."""
    seen = 0

    def walk(folder: Path, rel: str, depth: int) -> Iterator[Change]:
        nonlocal seen
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            seen += 1
            if seen > budget:
                if seen == budget + 1:
                    yield Change(
                        f"{rel}{entry.name}",
                        None,
                        f"the command changed more than {budget} entries; the rest were not read",
                    )
                return
            name = f"{rel}{entry.name}"
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                yield Change(name, None)  # an overlay whiteout: the command removed the path
            elif stat.S_ISDIR(st.st_mode):
                if _opaque(entry.path):
                    yield Change(
                        name, None, "a folder was replaced as a whole; remove and write its notes one by one"
                    )
                elif depth < MAX_SCAN_DEPTH:
                    yield from walk(Path(entry.path), name + "/", depth + 1)
                else:
                    yield Change(
                        name, None, f"a folder deeper than {MAX_SCAN_DEPTH} levels is not contributed"
                    )
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > MAX_NOTE_BYTES:
                    yield Change(
                        name, None, f"the file is {st.st_size} bytes; at most {MAX_NOTE_BYTES} are allowed"
                    )
                    continue
                yield Change(name, Path(entry.path), size=st.st_size)
            else:
                yield Change(
                    name, None, "only regular files are contributed (no links, FIFOs, sockets or devices)"
                )

    yield from walk(area.upper, "", 0)


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _current(area: Area, relpath: str) -> bytes | None:
    """The real note's bytes now (None: absent or not a readable note)."""
    try:
        with pin_dir(area.kb_path, expect=area.kb_identity) as kb:
            return read_file_stat(kb.fd, f"notes/{relpath}", limit=MAX_NOTE_BYTES, allow_hardlinks=True)[0]
    except KbdError:
        return None


def _revoked(sessions: RootSessions, sid: str, started: Plan, actor: Actor) -> tuple[Plan | None, str | None]:
    """The session's plan now, or why nothing may be committed."""
    try:
        now = sessions.plan(sid, actor=actor)
    except KbdError as err:
        return None, f"the session no longer grants this command anything ({err.code}: {err.message})"
    if now.generation != started.generation and grants_shrunk(started, now):
        return (
            None,
            "the session's grants shrank while the command ran (a revoke, a detach or an audience change)",
        )
    return now, None


def commit(
    sessions: RootSessions, sid: str, started: Plan, staging: Staging, *, actor: Actor,
    lock: AbstractContextManager[object] | None = None,
) -> Report:  # fmt: skip
    """Commit ``staging``'s changes as ``actor`` in session ``sid`` (see the
    module docstring). ``started``: the plan the command ran under. ``lock``
    guards the daemon's shared root: held for the plan lookup and each path's
    checks, never across the injection gate, a notes mutex or a write (as the
    API's note route does). Each staged ``notes/`` offers at most its source's
    ``notes_quota.max_bytes`` of changed files: past that every path would be
    refused by the quota anyway, so the rest are refused unread."""
    host = sessions.host
    guard = lock if lock is not None else contextlib.nullcontext()
    report = Report()
    pending: list[tuple[Area, Change]] = [(area, ch) for area in staging.areas for ch in changes(area)]
    if not pending:
        return report
    with guard:
        now, why = _revoked(sessions, sid, started, actor)
    offered: dict[str, int] = {}
    budget = host.config.notes_quota.max_bytes
    for area, ch in pending:
        rel = f"notes/{ch.relpath}"
        if now is None or why is not None:
            _refuse(report, area, ch, "revoked", why or "revoked")
            continue
        if ch.problem is not None:
            _refuse(report, area, ch, "invalid-input", ch.problem)
            continue
        data: bytes | None = None
        if ch.staged is not None:
            offered[area.alias] = offered.get(area.alias, 0) + ch.size
            if offered[area.alias] > budget:
                _refuse(report, area, ch, "quota-exceeded",
                        f"the command's changes exceed the notes quota ({budget} bytes)")  # fmt: skip
                continue
            try:
                data = ch.read()
            except OSError as exc:
                _refuse(report, area, ch, "invalid-input", f"cannot read it ({exc.strerror or exc})")
                continue
            if data == _current(area, ch.relpath):
                continue  # copied up without a change (a chmod, a touch)
        try:
            with guard:
                note = note_ops.prepare(sessions, sid, area.alias, rel,
                                        data if data is not None else _REMOVAL, actor=actor, how="command",
                                        plan=now)  # fmt: skip
            if data is None:
                if note_ops.remove(note).removed:
                    report.committed.append((area.alias, rel))
            else:
                note_ops.commit(note)
                report.committed.append((area.alias, rel))
        except KbdError as err:
            _refuse(report, area, ch, err.code, err.message)
    if why is not None:
        host.audit("contributions_discarded", session=sid, workflow_id=started.workflow_id, reason=why[:300],
                   files=[r["relpath"] for r in report.refused][:200])  # fmt: skip
    if report.refused:
        report.kept = _keep(host, started, staging, report)
    return report


def _refuse(report: Report, area: Area, ch: Change, code: str, message: str) -> None:
    report.refused.append({"alias": area.alias, "relpath": f"notes/{ch.relpath}", "code": code,
                           "message": message[:300]})  # fmt: skip


def _keep(host: Root, plan: Plan, staging: Staging, report: Report) -> str | None:
    """Copy each refused file's bytes into the consumer's own workflow folder,
    ``.kbd-refused/<time>-<n>/<alias>/notes/...`` (owned like that folder), so
    the contributor has them; None when they could not be kept (audited)."""
    from kbd.fs.confined import replace_file

    areas = {a.alias: a for a in staging.areas}
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    kept = 0
    try:
        with pin_dir(plan.workflow_folder) as own:
            owner = os.fstat(own.fd)
            base = _kept_folders(own.fd, [REFUSED_DIR, stamp], owner)
            try:
                for r in report.refused:
                    area = areas[r["alias"]]
                    src = area.upper / r["relpath"].removeprefix("notes/")
                    try:
                        st = os.stat(src, follow_symlinks=False)
                    except OSError:
                        continue
                    if (
                        not stat.S_ISREG(st.st_mode)
                        or st.st_size > 4 * MAX_NOTE_BYTES
                        or kept + st.st_size > MAX_KEPT_BYTES
                    ):
                        continue
                    kept += st.st_size
                    data = src.read_bytes()
                    parts = [r["alias"], *r["relpath"].split("/")]
                    folder = _kept_folders(base, parts[:-1], owner)
                    try:
                        replace_file(folder, parts[-1], data, mode=0o640, owner=(owner.st_uid, owner.st_gid))
                    finally:
                        os.close(folder)
            finally:
                os.close(base)
    except (KbdError, OSError) as exc:
        host.audit("contributions_not_kept", workflow_id=plan.workflow_id, reason=str(exc)[:300])
        return None
    return str(plan.workflow_folder / REFUSED_DIR / stamp)


def _kept_folders(parent: int, names: list[str], owner: os.stat_result) -> int:
    """Open (creating, owned like ``owner``, its setgid bit kept) each folder of ``names`` beneath ``parent``."""
    mode = 0o2750 if owner.st_mode & stat.S_ISGID else 0o750
    return make_folders(parent, names, mode=mode, owner=(owner.st_uid, owner.st_gid))
