"""Sessions (docs/sessions.md): open (and copied children), show, environment, list, close,
revoke, path checks — and the lookup that rebuilds a session's plan.

A lookup (:meth:`RootSessions.plan`) is the only way to get a session's plan,
and it always rebuilds the plan from saved configuration (docs/sessions.md "Reconciliation and generation"):
every lookup re-reads the session row, verifies the
consumer's and every source's manifest and probes every attached KB's identity
on disk (docs/daemon.md: "every grant is verified at lookup"). Only the pure part —
resolving those answers into attachments, building the plan, its digest — is
remembered per session (:class:`_Memo`), and reused only when every answer is
the same as the one it was built from.

Every operation here takes a :class:`RootSessions` and an
:data:`kbd.core.principals.Actor`: a principal is authorized by its roles; a
:class:`kbd.core.principals.LocalOperator` (created only by the CLI entry
points) is the trusted operator of the root. Opening a session always needs a
principal. Every refusal is audited before the caller hears of it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kbd.core import audience, pathguard, policy
from kbd.core.folders import FolderStatus
from kbd.core.lookup import Found, KbProbe, Lookup, Unreadable
from kbd.core.pathguard import PathCheck
from kbd.core.plan import Plan, build_plan, plan_keys
from kbd.core.policy import KINDS, KindPolicy
from kbd.core.principals import Actor, LocalOperator, Principal, Principals, actor_fields
from kbd.core.records import Keys, Record
from kbd.errors import InvalidInput, KbdError, PermissionDenied, session_not_found
from kbd.fs import datafiles
from kbd.fs.confined import link_below
from kbd.fs.folders import resolve_folders
from kbd.fs.registry import Folder
from kbd.sandbox import trees
from kbd.service import JsonObject
from kbd.service.root import Root
from kbd.state.processes import ProcessRow, RunningCommands, process_keys
from kbd.state.sessions import SessionRow, SessionStore, new_session_id, require_open

_MODES = {"none": set(), "read": {"r"}, "write": {"w"}, "read-write": {"r", "w"}}
# Sessions whose last plan is remembered (least recently looked up forgotten
# first): a few KB each, and a host's open sessions are far fewer.
MEMO_SESSIONS = 1024


# -- the verified plan memo ---------------------------------------------------------


@dataclass(frozen=True)
class _Looked:
    """A registry lookup the resolver made, and its answer."""

    workflow_id: str
    answer: Lookup


@dataclass(frozen=True)
class _Probed:
    """A KB probe the resolver made, and its answer."""

    folder: Path
    notes: bool
    answer: KbProbe


def _same_lookup(now: Lookup, then: Lookup) -> bool:
    """The registry gives the same answer: for a folder, the very same Folder
    object (the registry replaces it, never changes it, when its manifest or
    place changes, and a memo holds it, so it cannot be recycled)."""
    if type(now) is not type(then):
        return False
    if isinstance(now, Found | Unreadable):
        assert isinstance(then, Found | Unreadable)
        return now.folder is then.folder
    return now == then


class _Recorder:
    """The root's view for the resolver, writing down every answer in order."""

    def __init__(self, host: Root) -> None:
        self.host = host
        self.asked: list[_Looked | _Probed] = []

    def find(self, workflow_id: str) -> Lookup:
        found = self.host.find(workflow_id)
        self.asked.append(_Looked(workflow_id, found))
        return found

    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe:
        probe = self.host.probe_kb(workflow_folder, notes=notes)
        self.asked.append(_Probed(workflow_folder, notes, probe))
        return probe


def _answers_hold(host: Root, asked: tuple[_Looked | _Probed, ...]) -> bool:
    """Ask the root every question again, now, in the same order: True when
    every answer is the same. Resolution is a pure function of its inputs and
    of these answers, and each question it asks depends only on the earlier
    answers, so the same answers mean the same attachments."""
    find, probe_kb = host.find, host.probe_kb  # bound once: ~40 questions per lookup
    for a in asked:
        if isinstance(a, _Looked):
            if not _same_lookup(find(a.workflow_id), a.answer):
                return False
        elif probe_kb(a.folder, notes=a.notes) != a.answer:
            return False
    return True


@dataclass(frozen=True, eq=False)
class _Memo:
    """A session's last plan and everything it was built from. ``plan`` is the
    session's plan at ``plan.generation``; ``bare`` the same before the session
    fields were set."""

    workflow_id: str
    kind: str
    kb_access: str
    item_kb_write: bool
    consumer: Folder
    policy: KindPolicy
    principals: Principals
    host_name: str
    asked: tuple[_Looked | _Probed, ...]
    folders: tuple[FolderStatus, ...]
    bare: Plan
    digest: str
    plan: Plan

    def built_from(self, row: SessionRow, consumer: Folder, policy: KindPolicy, host: Root) -> bool:
        """Everything but the disk answers (asked, folders) is what it was."""
        return (
            self.consumer is consumer
            and self.principals is host.principals
            and (self.policy is policy or self.policy == policy)
            and self.host_name == host.config.host
            and self.workflow_id == row.workflow_id
            and self.kind == row.kind
            and self.kb_access == row.kb_access
            and self.item_kb_write == row.item_kb_write
        )


class RootSessions:
    """The sessions of one root: their store, the records of the commands running
    in them, and the lookup that rebuilds a session's plan and decides who may
    use a session. Every session operation below takes one."""

    def __init__(self, host: Root) -> None:
        self.host = host
        datafiles.use_cache(host.config.state_dir)
        self.store = SessionStore(host.config.state_dir, timeout=host.config.lock_timeout)
        self.commands = RunningCommands(host.config.state_dir)
        self._folder_roots: tuple[tuple[Path, ...], tuple[Path, ...]] = ((), ())
        # Per session: the last plan and what it was built from (see _build).
        # Callers serialise lookups (the daemon's state lock); a memo is
        # replaced whole, never changed.
        self._memos: dict[str, _Memo] = {}

    def folder_roots(self) -> tuple[Path, ...]:
        """The operator-approved roots of the current config (a daemon re-reads
        kbd.yaml when it changes), canonicalised once per change."""
        configured = self.host.config.folder_roots
        if self._folder_roots[0] != configured:
            self._folder_roots = (configured, tuple(r.resolve() for r in configured))
        return self._folder_roots[1]

    # -- plans -------------------------------------------------------------
    def _build(self, row: SessionRow) -> Plan:
        """The session's plan from what is on disk now. Every lookup asks the
        registry and the KB probes again (manifests, KB identities, folder
        grants); when every answer, the manifests, principals, policy and the
        row are what the session's memo was built from, the memo's plan is the
        plan (nothing pure is recomputed), else it is rebuilt."""
        found = self.host.workflow(row.workflow_id)
        m = found.manifest
        policy = datafiles.consumer_kind(row.kind)
        memo = self._memos.pop(row.id, None)
        if memo is not None and not (
            memo.built_from(row, found.folder, policy, self.host) and _answers_hold(self.host, memo.asked)
        ):
            memo = None
        recorder = _Recorder(self.host)
        attachments = None if memo is not None else self.host.resolve(m, view=recorder)
        folders = tuple(resolve_folders(m.raw.get("folder_access"), roots=self.folder_roots(),
                                        as_uid=self.folder_uid(row)))  # fmt: skip
        if memo is None or folders != memo.folders:
            bare = build_plan(
                workflow_id=m.id,
                workflow_folder=found.folder.path,
                policy=policy,
                kb_access=row.kb_access,
                item_kb_write=row.item_kb_write,
                attachments=attachments if attachments is not None else self.host.resolve(m, view=recorder),
                folders=list(folders),
            )
            memo = _Memo(row.workflow_id, row.kind, row.kb_access, row.item_kb_write, found.folder, policy,
                         self.host.principals, self.host.config.host, tuple(recorder.asked), folders, bare,
                         bare.digest(), bare)  # fmt: skip
        generation = row.generation
        if memo.digest != row.digest:
            generation = self.store.record_generation(row.id, new_digest=memo.digest)
        plan = memo.plan
        if (plan.generation, plan.session_id, plan.parent, plan.opened_by) != (
            generation, row.id, row.parent, row.opened_by
        ):  # fmt: skip
            plan = memo.bare.with_generation(generation, session_id=row.id, parent=row.parent,
                                             opened_by=row.opened_by)  # fmt: skip
            memo = replace(memo, plan=plan)
        self._remember(row.id, memo)
        return plan

    def folder_uid(self, row: SessionRow) -> int | None:
        """Whom the session's folder grants are opened as: on a root served as
        root, the uid of the principal who opened the session (docs/sessions.md "Folder grants": a user learns
        nothing of folders she may not
        open; the session's, not each caller's, so the plan and its generation
        are one whoever looks it up); None: with the process's own credentials."""
        if os.geteuid() != 0:
            return None
        opener = self.host.principals.get(row.opened_by)
        return opener.uid if opener is not None and opener.uid else None

    def _remember(self, sid: str, memo: _Memo) -> None:
        self._memos[sid] = memo  # popped before: now the most recently used
        if len(self._memos) > MEMO_SESSIONS:
            del self._memos[next(iter(self._memos))]

    def rebuild(self, row: SessionRow) -> Plan:
        """The session's plan rebuilt from saved configuration now, recording a
        new generation when it changed; for the daemon's live state, which acts
        for nobody (no actor, nothing authorized or audited here)."""
        return self._build(row)

    def plan(self, sid: str, *, actor: Actor) -> Plan:
        """The session's current plan as ``actor`` may use it (a LocalOperator is
        the trusted CLI on the root). Closed sessions grant nothing."""
        row = self._usable(sid, actor, action="plan", need_open=True)
        return self._build(row)

    def may_use(self, row: SessionRow, principal: str) -> bool:
        """Whether ``principal`` may still use the session (enabled, and in a
        role :meth:`_authorize` accepts); for the daemon's live state, which
        ends the commands of a principal that lost it (nothing audited here)."""
        try:
            self._authorize(row, self.host.actor(principal))
        except KbdError:
            return False
        return True

    def _usable(self, sid: str, actor: Actor, *, action: str, need_open: bool = False) -> SessionRow:
        """The session ``sid`` if ``actor`` may use it for ``action`` (and it is
        open, with ``need_open``); every refusal is audited before it is raised."""
        try:
            row = self.store.get(sid)
            self._authorize(row, actor)
            if need_open:
                require_open(self.store, row)
        except KbdError as err:
            self.host.audit("session_refused", **actor_fields(actor), action=action, session=sid, code=err.code,
                            message=err.message[:300])  # fmt: skip
            raise
        return row

    def _authorize(self, row: SessionRow, actor: Actor) -> None:
        """Who may use a session (plan, notes, check, close, revoke, children):
        the trusted local operator (the CLI on the root), services,
        enabled admins, and the principal who opened it — while that principal
        may still open this kind of session. Anyone else gets the same answer as
        for a session that does not exist (a reader of the workflow must not
        borrow an owner's execution session)."""
        if isinstance(actor, LocalOperator) or actor.is_service or actor.enabled_admin:
            return
        if actor.id == row.opened_by:
            m = self.host.workflow(row.workflow_id).manifest
            if audience.may_use_session(
                actor, row.opened_by, m, readers_may_open=datafiles.consumer_kind(row.kind).readers_may_open
            ):
                return
            raise PermissionDenied(
                f"{actor.id!r} may no longer use session {row.id}: their role on {row.workflow_id!r} changed"
            )
        raise session_not_found(row.id)

    def _visible(self, rows: list[SessionRow], actor: Actor) -> list[SessionRow]:
        """The rows ``actor`` may use (others are left out, not refused)."""
        out = []
        for row in rows:
            try:
                self._authorize(row, actor)
            except KbdError:
                continue
            out.append(row)
        return out

    def _drop_scratch(self, sid: str) -> None:
        """Remove the Landlock-only backend's per-session scratch folder (its
        stand-in for a private /tmp, kbd.service.execute.private_tmp): on disk and bounded
        per file only, it must not outlive the session. ``rmtree`` works through
        folder descriptors on Linux, so links the command planted are removed,
        never followed."""
        import shutil  # not on the exec path

        path = self.host.config.state_dir / "tmp" / sid
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


# -- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunningCommand(Record):
    """A command still running in a session; ``stale`` when it started under an
    older plan generation than the current one (its grants since changed).

    Its JSON is written by hand (docs/architecture.md "Typed operations"): the process's keys, then ``stale``."""

    process: ProcessRow
    stale: bool

    def to_json(self) -> JsonObject:
        return {**self.process.to_json(), "stale": self.stale}

    @classmethod
    def from_json(cls, data: object, where: str = "") -> RunningCommand:
        k = _RUNNING.read(cls, data, where)
        return cls(ProcessRow.from_json(data, where or cls.__name__), k["stale"])

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _RUNNING.schema(cls, defs)


_RUNNING = Keys(lambda: {**process_keys(), "stale": bool})


@dataclass(frozen=True)
class SessionView(Record):
    """A session's plan, rebuilt from saved configuration now, and what runs in it.

    Its JSON is written by hand (docs/architecture.md "Typed operations"): the plan's keys, then ``running``."""

    plan: Plan
    running: tuple[RunningCommand, ...]

    def to_json(self) -> JsonObject:
        return {**self.plan.to_json(), "running": [r.to_json() for r in self.running]}

    @classmethod
    def from_json(cls, data: object, where: str = "") -> SessionView:
        k = _SESSION_VIEW.read(cls, data, where)
        return cls(Plan.from_json(data, where or cls.__name__), tuple(k["running"]))

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _SESSION_VIEW.schema(cls, defs)


_SESSION_VIEW = Keys(lambda: {**plan_keys(), "running": list[RunningCommand]},
                     omitted=("session_id", "parent", "opened_by"))  # fmt: skip


@dataclass(frozen=True)
class SessionList(Record):
    sessions: tuple[SessionRow, ...]


@dataclass(frozen=True)
class Closed(Record):
    session_id: str
    closed: tuple[str, ...]  # the session and its open children, as closed now


@dataclass(frozen=True)
class Revoked(Record):
    session_id: str
    generation: int
    terminated: tuple[int, ...]
    still_running: tuple[int, ...]


# -- operations --------------------------------------------------------------------


def open_session(
    sessions: RootSessions,
    wid: str,
    *,
    actor: Principal,
    kind: str | None,
    kb_access: str | None = None,
    item_kb_write: bool | None = None,
    parent: str | None = None,
) -> Plan:
    """Open a session of ``kind`` for ``wid`` (a copied child of ``parent`` when
    given); its plan. ``kb_access`` defaults to read; a child's ``kind`` and
    ``kb_access`` default to its parent's (a different kind, a wider access or
    an item write its parent did not ask for are refused)."""
    try:
        if kind is None:
            kind = _child_kind(sessions, parent)
        return _open(sessions, actor, wid, kind=kind, kb_access=kb_access, item_kb_write=item_kb_write,
                     parent=parent)  # fmt: skip
    except KbdError as err:
        _open_refused(sessions, err, actor=actor, wid=wid, kind=kind, kb_access=kb_access, parent=parent)
        raise


def open_child(
    sessions: RootSessions,
    parent: str,
    *,
    actor: Principal,
    kind: str | None = None,
    kb_access: str | None = None,
    item_kb_write: bool | None = None,
) -> Plan:
    """Open a copied child of ``parent``, in its parent's workflow (see
    :func:`open_session`). An empty ``kind`` is no kind: the parent's."""
    kind = kind or None
    try:
        row = sessions.store.get(parent)
        # Before anything the request asks: a parent the actor may not use is
        # answered as a missing one, whatever kind or access came with it.
        sessions._authorize(row, actor)
        wid = row.workflow_id
    except KbdError as err:
        _open_refused(sessions, err, actor=actor, wid=None, kind=kind, kb_access=kb_access, parent=parent)
        raise
    return open_session(sessions, wid, actor=actor, kind=kind, kb_access=kb_access, item_kb_write=item_kb_write,
                        parent=parent)  # fmt: skip


def _child_kind(sessions: RootSessions, parent: str | None) -> str:
    """The kind of a session opened without one: its parent's (only a child may omit it)."""
    if parent is None:
        raise InvalidInput(
            "kind is required unless a parent session is given", hint=f"kinds: {', '.join(KINDS)}"
        )
    return sessions.store.get(parent).kind


def _open_refused(
    sessions: RootSessions,
    err: KbdError,
    *,
    actor: Principal,
    wid: str | None,
    kind: str | None,
    kb_access: str | None,
    parent: str | None,
) -> None:
    # Every refusal is recorded (who, what, target, why) before the caller hears of it.
    sessions.host.audit("session_refused", **actor_fields(actor), action="open", workflow_id=wid, kind=kind,
                        kb_access=kb_access, parent=parent, code=err.code, message=err.message[:300])  # fmt: skip


def _open(
    sessions: RootSessions,
    actor: Principal,
    wid: str,
    *,
    kind: str,
    kb_access: str | None,
    item_kb_write: bool | None,
    parent: str | None,
) -> Plan:
    kind_policy = datafiles.consumer_kind(kind)
    store = sessions.store
    parent_row: SessionRow | None = None
    if parent is not None:
        parent_row = store.get(parent)
        sessions._authorize(parent_row, actor)
        require_open(store, parent_row)
        if parent_row.workflow_id != wid:
            raise InvalidInput(
                f"session {parent} belongs to {parent_row.workflow_id!r}, not {wid!r}",
                hint="a copied child session stays in its parent's workflow",
            )
    requested = kb_access if kb_access is not None else (parent_row.kb_access if parent_row else "read")
    if requested not in policy.KB_ACCESS:
        raise InvalidInput(f"kb_access {requested!r} is not allowed; allowed: {', '.join(policy.KB_ACCESS)}")
    if parent_row is not None and not _MODES[requested] <= _MODES[parent_row.kb_access]:
        raise PermissionDenied(
            f"a child session cannot widen kb_access from {parent_row.kb_access!r} to {requested!r}"
        )
    item = item_kb_write if item_kb_write is not None else bool(parent_row and parent_row.item_kb_write)
    if parent_row is not None:
        # A copied child re-resolves like its parent: same kind, and never a
        # KB write the parent's item did not ask for.
        if kind != parent_row.kind:
            raise PermissionDenied(f"a child session keeps its parent's kind ({parent_row.kind}), not {kind}")
        if item and not parent_row.item_kb_write:
            raise PermissionDenied("a child session cannot ask for KB write when its parent's item did not")
    found = sessions.host.workflow(wid)
    if not audience.can_open_session(actor, found.manifest, readers_may_open=kind_policy.readers_may_open):
        audience.require_inspectable(actor, found.manifest, wid)
        raise PermissionDenied(
            f"{actor.id!r} may not open {kind} sessions for {wid!r} (readers may open reviewer sessions only)"
        )
    row = SessionRow(
        id=new_session_id(),
        workflow_id=wid,
        kind=kind,
        kb_access=requested,
        item_kb_write=item,
        parent=parent,
        opened_by=actor.id,
        opened_at=time.time(),
        closed_at=None,
        generation=0,
        digest="",
    )
    # Audit first: if the log cannot be written, no session exists either.
    sessions.host.audit("session_opened", session=row.id, workflow_id=wid, kind=kind, kb_access=requested,
                        actor=actor.id, parent=parent)  # fmt: skip
    store.insert(row)
    sessions.host.events.emit("session.opened", workflow_id=wid, session_id=row.id)
    return sessions._build(row)


def running_commands(commands: RunningCommands, sid: str) -> list[ProcessRow]:
    """The commands of ``sid`` still running: the recorded process itself, or —
    when the recording ``kbd exec`` was killed — a tree its cgroup still holds
    (``alive`` False: its PID must not be signalled). What such a ``kbd exec``
    left behind once its tree is gone (the cgroup, the record) is dropped."""
    out = []
    for row in commands.of_session(sid):
        if row.alive or (row.cgroup is not None and trees.tree_left(row.cgroup)):
            out.append(row)
        elif row.cgroup is not None:
            trees.drop_tree(row.cgroup)
            commands.remove(sid, row.pid)
    return out


def end_command(commands: RunningCommands, row: ProcessRow, *, grace: float) -> bool:
    """End one running command's whole tree (:func:`kbd.sandbox.trees.end_tree`);
    the record of one whose ``kbd exec`` is gone is removed with it. True when
    nothing of it is left."""
    done = trees.end_tree(row.pgid, row.cgroup, alive=row.alive, grace=grace)
    if done and not row.alive:  # no kbd exec is left to remove its record
        commands.remove(row.session_id, row.pid)
    return done


def running(sessions: RootSessions, sid: str, plan: Plan) -> tuple[RunningCommand, ...]:
    return tuple(
        RunningCommand(p, p.generation < plan.generation) for p in running_commands(sessions.commands, sid)
    )


def show(sessions: RootSessions, sid: str, *, actor: Actor) -> SessionView:
    """The plan as ``actor`` may use it, and the commands running in the session.
    Closed sessions grant nothing (SessionClosed)."""
    plan = sessions.plan(sid, actor=actor)
    return SessionView(plan, running(sessions, sid, plan))


def list_sessions(
    sessions: RootSessions, *, actor: Actor, workflow_id: str | None = None, include_closed: bool = False
) -> SessionList:
    """The sessions ``actor`` may use (others are left out, not refused)."""
    rows = sessions.store.rows(workflow_id=workflow_id, include_closed=include_closed)
    return SessionList(tuple(sessions._visible(rows, actor)))


def close(sessions: RootSessions, sid: str, *, actor: Actor) -> Closed:
    """Close ``sid`` and its child sessions; what they left running ends now."""
    row = sessions._usable(sid, actor, action="close")
    closed = sessions.store.close(sid)
    # A closed session grants nothing: whatever its commands left running —
    # background trees included — ends now, without a grace period.
    ended = list(dict.fromkeys([sid, *closed]))
    commands = sessions.commands
    terminated = [
        p.pid for s in ended for p in running_commands(commands, s) if end_command(commands, p, grace=0)
    ]
    unrecorded = [name for s in ended for name in trees.kill_unrecorded(s)]
    for s in ended:
        sessions._drop_scratch(s)
    sessions.host.audit("session_closed", session=sid, closed=closed, terminated=terminated,
                        **({"terminated_unrecorded": unrecorded} if unrecorded else {}),
                        **actor_fields(actor))  # fmt: skip
    for s in closed:  # a copied child stays in its parent's workflow
        sessions.host.events.emit("session.closed", workflow_id=row.workflow_id, session_id=s)
    return Closed(sid, tuple(closed))


def revoke(sessions: RootSessions, sid: str, *, actor: Actor, immediate: bool = False) -> Revoked:
    """Commands running with grants the session no longer has — or every command
    of a closed session: reported, or terminated with ``immediate`` (or when
    kbd.yaml's ``revoke_immediately`` says so for every revoke). Termination is
    SIGTERM to the process group, kbd.yaml's ``revoke_grace`` seconds, then
    SIGKILL to the command's whole tree (its cgroup); only what was actually
    terminated is reported as such."""
    return carry_out(sessions, revocation(sessions, sid, actor=actor, immediate=immediate))


@dataclass(frozen=True)
class Revocation:
    """What :func:`revoke` will do: decided with the registry (the daemon holds
    its state lock), carried out without it (termination waits out a grace period)."""

    sid: str
    generation: int
    procs: tuple[ProcessRow, ...]
    immediate: bool
    actor: JsonObject


def revocation(sessions: RootSessions, sid: str, *, actor: Actor, immediate: bool = False) -> Revocation:
    immediate = immediate or sessions.host.config.revoke_immediately
    row = sessions._usable(sid, actor, action="revoke")
    closed = row.closed_at is not None or sessions.store.ancestors_closed(row)
    generation = row.generation if closed else sessions._build(row).generation
    procs = tuple(p for p in running_commands(sessions.commands, sid) if closed or p.generation < generation)
    return Revocation(sid, generation, procs, immediate, actor_fields(actor))


def carry_out(sessions: RootSessions, r: Revocation) -> Revoked:
    terminated: list[int] = []
    still: list[int] = []
    if r.immediate:
        for p in r.procs:
            if end_command(sessions.commands, p, grace=sessions.host.config.revoke_grace):
                terminated.append(p.pid)
            else:
                still.append(p.pid)
    else:
        still = [p.pid for p in r.procs]
    sessions.host.audit("session_revoke", session=r.sid, immediate=r.immediate, terminated=terminated,
                        still_running=still, **r.actor)  # fmt: skip
    return Revoked(r.sid, r.generation, tuple(terminated), tuple(still))


def check(sessions: RootSessions, sid: str, path: str, mode: str, *, actor: Actor) -> PathCheck:
    """May the session read/write ``path`` now? (For file tools outside the sandbox.)"""
    return check_path(sessions.plan(sid, actor=actor), path, mode)


def check_path(plan: Plan, path: str, mode: str) -> PathCheck:
    """May ``plan`` touch ``path`` for ``mode`` (read|write)? The grants decide
    (:func:`kbd.core.pathguard.decide`); a path they allow is allowed only when
    no symbolic link stands below the deciding grant (:func:`kbd.fs.confined.link_below`)."""
    verdict = pathguard.decide(plan, path, mode)
    if isinstance(verdict, PathCheck):
        return verdict
    link = link_below(verdict.grant.path, verdict.target, folder=verdict.folder)
    return verdict.allowed() if link is None else PathCheck(allowed=False, reason=link)


@dataclass(frozen=True)
class Environment(Record):
    """The variables a command of the session gets from its current plan.

    Its JSON is written by hand (docs/architecture.md "Typed operations"): its keys are the variables' names."""

    env: Mapping[str, str]

    def to_json(self) -> JsonObject:
        return dict(self.env)

    @classmethod
    def from_json(cls, data: object, where: str = "") -> Environment:
        return cls(_VARIABLES.read(cls, data, where))

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _VARIABLES.schema(cls, defs)


_VARIABLES = Keys(dict, others=str)


def environment(sessions: RootSessions, sid: str, *, actor: Actor) -> Environment:
    """The session's environment as ``actor`` may use it now (SessionClosed when closed)."""
    return Environment(sessions.plan(sid, actor=actor).env)
