"""Session operations: open, look up (rebuild the plan), list, close, path checks.

Shared by the CLI, ``kbd exec`` and the daemon. A lookup is the only way to
get a plan for a session, and it always rebuilds the plan from saved
configuration (DESIGN §4 "Reconciliation").
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Any

from kbd.core import audience, policy
from kbd.core.plan import Plan, build_plan
from kbd.core.principals import Actor, LocalOperator, Principal, actor_fields
from kbd.core.relpaths import name_problem, note_parts
from kbd.errors import (
    InvalidInput,
    KbdError,
    PathNotFound,
    PermissionDenied,
    session_not_found,
)
from kbd.fs import datafiles
from kbd.fs.confined import names_folder, pin_dir
from kbd.fs.folders import resolve_folders
from kbd.service.root import Root
from kbd.state.store import ProcessRow, SessionRow, SessionStore, new_session_id, require_open

_MODES = {"none": set(), "read": {"r"}, "write": {"w"}, "read-write": {"r", "w"}}


class Sessions:
    def __init__(self, host: Root) -> None:
        self.host = host
        datafiles.use_cache(host.config.state_dir)
        self.store = SessionStore(host.config.state_dir, timeout=host.config.lock_timeout)
        self._folder_roots: tuple[tuple[Path, ...], tuple[Path, ...]] = ((), ())

    def folder_roots(self) -> tuple[Path, ...]:
        """The operator-approved roots of the current config (a daemon re-reads
        kbd.yaml when it changes), canonicalised once per change."""
        configured = self.host.config.folder_roots
        if self._folder_roots[0] != configured:
            self._folder_roots = (configured, tuple(r.resolve() for r in configured))
        return self._folder_roots[1]

    # -- plans -------------------------------------------------------------
    def _build(self, row: SessionRow) -> Plan:
        found = self.host.workflow(row.workflow_id)
        m = found.manifest
        plan = build_plan(
            workflow_id=m.id,
            workflow_folder=found.folder.path,
            policy=datafiles.consumer_kind(row.kind),
            kb_access=row.kb_access,
            item_kb_write=row.item_kb_write,
            attachments=self.host.resolve(m),
            folders=resolve_folders(m.raw.get("folder_access"), roots=self.folder_roots()),
        )
        digest = plan.digest()
        generation = row.generation
        if digest != row.digest:
            generation = self.store.record_generation(row.id, seen_digest=row.digest, new_digest=digest)
        return plan.with_generation(generation, session_id=row.id, parent=row.parent, opened_by=row.opened_by)

    def plan(self, sid: str, *, actor: Actor) -> Plan:
        """The session's current plan as ``actor`` may use it (a LocalOperator is
        the trusted CLI on the root). Closed sessions grant nothing."""
        row = self._usable(sid, actor, action="plan", need_open=True)
        return self._build(row)

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
            if audience.can_open_session(
                actor, m, readers_may_open=datafiles.consumer_kind(row.kind).readers_may_open
            ):
                return
            raise PermissionDenied(
                f"{actor.id!r} may no longer use session {row.id}: their role on {row.workflow_id!r} changed"
            )
        raise session_not_found(row.id)

    # -- lifecycle ---------------------------------------------------------
    def open(
        self,
        actor: Principal,
        wid: str,
        *,
        kind: str,
        kb_access: str | None = None,
        item_kb_write: bool | None = None,
        parent: str | None = None,
    ) -> Plan:
        try:
            return self._open(
                actor, wid, kind=kind, kb_access=kb_access, item_kb_write=item_kb_write, parent=parent
            )
        except KbdError as err:
            # Every refusal is recorded (who, what, target, why) before the caller hears of it.
            self.host.audit("session_refused", **actor_fields(actor), action="open", workflow_id=wid, kind=kind,
                            kb_access=kb_access, parent=parent, code=err.code, message=err.message[:300])  # fmt: skip
            raise

    def _open(
        self,
        actor: Principal,
        wid: str,
        *,
        kind: str,
        kb_access: str | None,
        item_kb_write: bool | None,
        parent: str | None,
    ) -> Plan:
        kind_policy = datafiles.consumer_kind(kind)
        parent_row: SessionRow | None = None
        if parent is not None:
            parent_row = self.store.get(parent)
            self._authorize(parent_row, actor)
            require_open(self.store, parent_row)
            if parent_row.workflow_id != wid:
                raise InvalidInput(
                    f"session {parent} belongs to {parent_row.workflow_id!r}, not {wid!r}",
                    hint="a copied child session stays in its parent's workflow",
                )
        requested = kb_access if kb_access is not None else (parent_row.kb_access if parent_row else "read")
        if requested not in policy.KB_ACCESS:
            raise InvalidInput(
                f"kb_access {requested!r} is not allowed; allowed: {', '.join(policy.KB_ACCESS)}"
            )
        if parent_row is not None and not _MODES[requested] <= _MODES[parent_row.kb_access]:
            raise PermissionDenied(
                f"a child session cannot widen kb_access from {parent_row.kb_access!r} to {requested!r}"
            )
        item = item_kb_write if item_kb_write is not None else bool(parent_row and parent_row.item_kb_write)
        if parent_row is not None:
            # A copied child re-resolves like its parent: same kind, and never a
            # KB write the parent's item did not ask for.
            if kind != parent_row.kind:
                raise PermissionDenied(
                    f"a child session keeps its parent's kind ({parent_row.kind}), not {kind}"
                )
            if item and not parent_row.item_kb_write:
                raise PermissionDenied(
                    "a child session cannot ask for KB write when its parent's item did not"
                )
        found = self.host.workflow(wid)
        if not audience.can_open_session(
            actor, found.manifest, readers_may_open=kind_policy.readers_may_open
        ):
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
        self.host.audit("session_opened", session=row.id, workflow_id=wid, kind=kind, kb_access=requested,
                        actor=actor.id, parent=parent)  # fmt: skip
        self.store.insert(row)
        return self._build(row)

    def close(self, sid: str, *, actor: Actor) -> list[str]:
        self._usable(sid, actor, action="close")
        closed = self.store.close(sid)
        # A closed session grants nothing: whatever its commands left running —
        # background trees included — ends now, without a grace period.
        ended = list(dict.fromkeys([sid, *closed]))
        terminated = [
            p.pid for s in ended for p in self.store.processes(s) if terminate_command(self.store, p, grace=0)
        ]
        unrecorded = [name for s in ended for name in kill_unrecorded(s)]
        for s in ended:
            self._drop_scratch(s)
        self.host.audit("session_closed", session=sid, closed=closed, terminated=terminated,
                        **({"terminated_unrecorded": unrecorded} if unrecorded else {}),
                        **actor_fields(actor))  # fmt: skip
        return closed

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

    def visible(
        self, *, actor: Actor, workflow_id: str | None = None, include_closed: bool = False
    ) -> list[SessionRow]:
        """The sessions ``actor`` may use (others are left out, not refused)."""
        out = []
        for row in self.store.rows(workflow_id=workflow_id, include_closed=include_closed):
            try:
                self._authorize(row, actor)
            except KbdError:
                continue
            out.append(row)
        return out

    def rows(
        self, *, actor: Actor, workflow_id: str | None = None, include_closed: bool = False
    ) -> list[dict[str, Any]]:
        return [
            r.to_json()
            for r in self.visible(actor=actor, workflow_id=workflow_id, include_closed=include_closed)
        ]

    # -- running processes -----------------------------------------------------

    def revoke(self, sid: str, *, immediate: bool, grace: float, actor: Actor) -> dict[str, Any]:
        """Report (and with ``immediate`` terminate) commands running under an
        older generation — or every command of a closed session. Termination is
        SIGTERM to the process group, ``grace`` seconds, then SIGKILL to the
        command's whole tree (its cgroup); only what was actually terminated is
        reported as such."""
        row = self._usable(sid, actor, action="revoke")
        closed = row.closed_at is not None or self.store.ancestors_closed(row)
        generation = row.generation if closed else self._build(row).generation
        procs = [p for p in self.store.processes(sid) if closed or p.generation < generation]
        terminated: list[int] = []
        still: list[int] = []
        if immediate:
            for p in procs:
                if terminate_command(self.store, p, grace=grace):
                    terminated.append(p.pid)
                else:
                    still.append(p.pid)
        else:
            still = [p.pid for p in procs]
        self.host.audit("session_revoke", session=sid, immediate=immediate, terminated=terminated,
                        still_running=still, **actor_fields(actor))  # fmt: skip
        return {"session_id": sid, "generation": generation, "terminated": terminated, "still_running": still}

    # -- path guard -----------------------------------------------------------
    def check(self, sid: str, path: str, mode: str, *, actor: Actor) -> dict[str, Any]:
        return check_path(self.plan(sid, actor=actor), path, mode)


def terminate_command(store: SessionStore, p: ProcessRow, *, grace: float) -> bool:
    """End one recorded command: SIGTERM its process group (only while its leader
    is still the recorded process), up to ``grace`` seconds, then ``cgroup.kill``
    for everything left in its cgroup — processes that left the group with
    setsid or outlived a killed ``kbd exec`` included. Without a cgroup (bwrap
    on a host without one: its PID namespace holds the tree) the group alone.
    True when nothing of it is left."""
    from kbd.sandbox import cgroup  # not on the exec path

    hierarchy = cgroup.detect()
    name = p.cgroup or ""
    path = hierarchy.path(name)
    if path is None:
        return p.alive and terminate_group(p.pgid, grace=grace)
    if p.alive and grace > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while cgroup.populated(path) and time.monotonic() < deadline:
            time.sleep(0.02)
    if not cgroup.kill_tree(path):
        return False
    cgroup.remove(hierarchy, name)
    if not p.alive:  # no kbd exec is left to remove its record
        store.remove_process(p.session_id, p.pid)
    return True


def kill_unrecorded(sid: str) -> list[str]:
    """Kill every command tree of session ``sid`` still in a cgroup after its
    recorded commands were ended: a ``kbd exec`` SIGKILLed between starting its
    command and recording it leaves such a tree (found by review). Returns the
    cgroups that held processes."""
    from kbd.sandbox import cgroup  # not on the exec path

    hierarchy = cgroup.detect()
    killed = []
    for name in cgroup.of_session(hierarchy, sid):
        path = hierarchy.path(name)
        if path is not None and cgroup.populated(path):
            cgroup.kill_tree(path)
            killed.append(name)
        cgroup.remove(hierarchy, name)
    return killed


def terminate_group(pgid: int, *, grace: float) -> bool:
    """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL.
    True when the group is gone afterwards."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.02)
    return False


_PRIORITY = {"hidden": 3, "read_only": 2, "write": 1, "read": 0}


def check_path(plan: Plan, path: str, mode: str) -> dict[str, Any]:
    """May this plan touch ``path`` for ``mode`` (read|write)? For non-shell file tools.

    The deepest grant containing the path decides (an overlay beats its parent).
    The path must be absolute and free of ``..``; a symbolic link anywhere below
    the deciding grant is refused, so a link cannot smuggle access elsewhere.
    """
    if mode not in ("read", "write"):
        raise InvalidInput(f"mode {mode!r} is not allowed; allowed: read, write")
    if not path.startswith("/"):
        return {"allowed": False, "reason": "path must be absolute"}
    for comp in path.split("/"):
        if (problem := name_problem(comp)) is not None:
            return {"allowed": False, "reason": f"path {problem}"}
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        return {"allowed": False, "reason": "path must not contain '..'"}
    target = Path(pure)
    best = None
    for g in plan.grants:
        if target == g.path or g.path in target.parents:
            key = (len(g.path.parts), _PRIORITY[g.mode])
            if best is None or key > best[0]:
                best = (key, g)
    if best is None:
        return {"allowed": False, "reason": "not granted to this session"}
    grant = best[1]
    if grant.mode == "hidden":
        return {"allowed": False, "reason": f"hidden in this session ({grant.origin})"}
    if mode == "write" and grant.mode != "write":
        return {"allowed": False, "reason": f"read-only ({grant.origin})"}
    if mode == "write" and grant.origin.kind == "kb_write":
        # A source's notes/: exactly the names `kbd notes write` accepts.
        try:
            note_parts(_spelled_below(grant.path, path))
        except KbdError as err:
            return {"allowed": False, "reason": err.message}
    link = _symlink_below(grant.path, target, folder=names_folder(path))
    if link is not None:
        return {"allowed": False, "reason": link}
    return {"allowed": True, "reason": f"{grant.mode} grant ({grant.origin})"}


def _spelled_below(root: Path, path: str) -> str:
    """The caller's own spelling of ``path`` below the grant ``root`` (empty and
    ``.`` components, which PurePosixPath dropped, and a trailing ``/`` kept),
    so the note-name rule judges exactly what was asked."""
    want = list(root.parts[1:])
    raw = path.split("/")[1:]
    i = 0
    while want and i < len(raw):
        if raw[i] not in ("", "."):
            want.pop(0)
        i += 1
    return "/".join(raw[i:])


def _symlink_below(root: Path, target: Path, *, folder: bool = False) -> str | None:
    """Why ``target`` (inside the grant ``root``) must not be used, or None.

    Its folder is pinned from ``/`` without following any link, then the name
    itself is checked with lstat: a link anywhere on the way is refused. A
    folder that does not exist yet is fine (a writer creates it; nothing below a
    missing folder can be a link), unless something else stands in its place.
    With ``folder`` (the path ended with ``/``), the target must be a folder.
    """
    if target == Path("/"):
        return None
    parent = target.parent
    missing: list[str] = [target.name]
    while True:
        try:
            pinned = pin_dir(parent)
            break
        except PathNotFound as exc:
            if parent == root or parent == Path("/") or root not in parent.parents:
                return exc.message
            missing.insert(0, parent.name)
            parent = parent.parent
        except KbdError as exc:
            return exc.message
    with pinned:
        try:
            st = os.stat(missing[0], dir_fd=pinned.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
    if stat.S_ISLNK(st.st_mode):
        return "the path is a symbolic link; kbd never follows links inside grants"
    if len(missing) > 1 and not stat.S_ISDIR(st.st_mode):
        return "a component of the path is not a folder"
    if folder and not stat.S_ISDIR(st.st_mode):
        return "the path ends with '/' but names a file, not a folder"
    return None
