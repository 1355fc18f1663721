"""Previews: what a grant change would do, computed without doing it (docs/access.md "Previews").

A change is previewed by running the very operation that makes it on a :class:`Draft` of the root:
the same authorization, validation and locked read-modify-write, except that nothing is written,
audited or announced — the draft keeps the manifests (and the principals table) the operation would
have saved. :func:`effects` then compares the world as it is with the world as it would be, using
the same pure functions the real change reaches: every open session's plan is built for both
(:func:`kbd.core.plan.build_plan` over :func:`kbd.core.resolve.resolve_all`), a running command is
acted on when its grants shrink or its principal loses the session (:func:`kbd.core.plan.grants_shrunk`,
the daemon's pushed revocation), and every attachment of every consumer is resolved for both.

What the caller may learn: sessions and consumers of workflows she may not inspect are counted
(``unseen``), never named (docs/access.md "Invisible is not found").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kbd.core import audience
from kbd.core.lookup import Found, KbProbe, Lookup
from kbd.core.manifest import Manifest
from kbd.core.plan import Grant, Plan, access_at, build_plan, grants_shrunk
from kbd.core.principals import Actor, LocalOperator, Principals
from kbd.core.records import Record
from kbd.core.resolve import Attachment, resolve_all
from kbd.errors import KbdError
from kbd.fs import datafiles
from kbd.fs.folders import resolve_folders
from kbd.service.root import Root

if TYPE_CHECKING:
    from kbd.service.sessions import RootSessions
    from kbd.state.sessions import SessionRow


@dataclass(frozen=True)
class PlanChange(Record):
    """One thing a session gains or loses: reading or writing a path, or a variable."""

    kind: Literal["read", "write", "variable"]
    target: str


@dataclass(frozen=True)
class SessionEffect(Record):
    session_id: str
    workflow_id: str
    gained: tuple[PlanChange, ...]
    lost: tuple[PlanChange, ...]


@dataclass(frozen=True)
class CommandEffect(Record):
    session_id: str
    pid: int
    effect: Literal["terminated", "stale"]


@dataclass(frozen=True)
class ConsumerEffect(Record):
    """An attachment whose status would change: ``status`` is what it would be (``available``,
    ``unavailable``, ``writable``, ``read_only`` — writing lost —, ``attached``, ``detached``)."""

    workflow_id: str
    alias: str
    status: str
    reason: str | None


@dataclass(frozen=True)
class Preview(Record):
    """The answer of every ``--dry-run`` (docs/access.md "Previews"): nothing changed."""

    dry_run: bool
    sessions: tuple[SessionEffect, ...]
    commands: tuple[CommandEffect, ...]
    consumers: tuple[ConsumerEffect, ...]
    #: Affected sessions and attachments of workflows the caller may not inspect: counted only.
    unseen: int


# -- the draft root --------------------------------------------------------------------------------


class _Kept:
    """The event sink of a draft: keeps the manifests an operation reports as saved."""

    def __init__(self) -> None:
        self.manifests: dict[str, Manifest] = {}

    def manifest_saved(self, workflow_id: str, old: Manifest | None, new: Manifest, *, folder: Path) -> None:
        self.manifests[workflow_id] = new

    def emit(self, *_: object, **__: object) -> None:
        """A draft announces nothing."""


class Draft(Root):
    """The root as a change would leave it, made by running the change's own operation with
    nothing written: :mod:`kbd.fs.manifest_store` and :mod:`kbd.fs.principals_file` compute and
    check the new file and stop before writing (``dry_run``), audits and events are kept here."""

    dry_run = True

    def __init__(self, root: Root) -> None:
        self.__dict__.update(root.__dict__)
        self.kept = _Kept()
        self.events = self.kept  # type: ignore[assignment]
        self.would_principals: Principals | None = None

    def audit(self, event: str, **fields: object) -> None:
        """A preview changes nothing, so it records nothing."""

    def keep_principals(self, principals: Principals) -> None:
        self.would_principals = principals


def draft(root: Root, change: Callable[[Root], object]) -> Draft:
    """Run ``change`` (the real operation, on the draft it is given) and return the draft holding
    what it would have saved. Its refusals are raised as the real change raises them."""
    d = Draft(root)
    change(d)
    return d


# -- what it would do ----------------------------------------------------------------------------


class WhatIf:
    """The registry with ``manifests`` in place of the saved ones (a :class:`SourceView`)."""

    def __init__(self, root: Root, manifests: dict[str, Manifest]) -> None:
        self.root = root
        self.manifests = manifests

    def find(self, workflow_id: str) -> Lookup:
        found = self.root.find(workflow_id)
        if workflow_id in self.manifests and isinstance(found, Found):
            return Found(replace(found.folder, manifest=self.manifests[workflow_id]))
        return found

    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe:
        return self.root.probe_kb(workflow_folder, notes=notes)


class _World:
    """One side of the comparison — the root as it is, or as the change leaves it — with each
    workflow's attachments and each distinct plan computed once: sessions of one workflow opened
    alike share their plan, and a consumer's attachments are the ones its plans were built from."""

    def __init__(self, sessions: RootSessions, view: WhatIf, principals: Principals) -> None:
        self.sessions, self.view, self.principals = sessions, view, principals
        self._attachments: dict[str, list[Attachment] | None] = {}
        self._plans: dict[tuple[object, ...], Plan | None] = {}

    def attachments(self, wid: str) -> list[Attachment] | None:
        """``wid``'s attachments in this world (None: no readable manifest, or unreadable sources)."""
        if wid not in self._attachments:
            found = self.view.find(wid)
            out = None
            if isinstance(found, Found) and found.manifest.sources_problem is None:
                try:
                    out = resolve_all(found.manifest, view=self.view, principals=self.principals,
                                      host=self.sessions.host.config.host)  # fmt: skip
                except KbdError:
                    out = None
            self._attachments[wid] = out
        return self._attachments[wid]

    def plan(self, row: SessionRow) -> Plan | None:
        """``row``'s plan in this world (None: it would have none: its workflow gone or unreadable)."""
        uid = self.sessions.folder_uid(row)
        key = (row.workflow_id, row.kind, row.kb_access, row.item_kb_write, uid)
        if key not in self._plans:
            self._plans[key] = self._build(row, uid)
        return self._plans[key]

    def _build(self, row: SessionRow, uid: int | None) -> Plan | None:
        found = self.view.find(row.workflow_id)
        attachments = self.attachments(row.workflow_id)
        if not isinstance(found, Found) or attachments is None:
            return None
        m = found.manifest
        try:
            folders = resolve_folders(
                m.raw.get("folder_access"), roots=self.sessions.folder_roots(), as_uid=uid
            )
            return build_plan(workflow_id=m.id, workflow_folder=found.folder.path,
                              policy=datafiles.consumer_kind(row.kind), kb_access=row.kb_access,
                              item_kb_write=row.item_kb_write, attachments=attachments, folders=list(folders))  # fmt: skip
        except KbdError:
            return None


def effects(sessions: RootSessions, d: Draft, *, actor: Actor) -> Preview:
    """What the change kept in ``d`` would do to every open session, its running commands and
    every consumer's attachments, as ``actor`` may see it."""
    root = sessions.host
    now = _World(sessions, WhatIf(root, {}), root.principals)
    then = _World(sessions, WhatIf(root, d.kept.manifests), d.would_principals or root.principals)
    unseen = 0
    session_effects: list[SessionEffect] = []
    command_effects: list[CommandEffect] = []
    effect: Literal["terminated", "stale"] = "terminated" if root.config.revoke_immediately else "stale"
    diffs: dict[tuple[int, int], tuple[tuple[PlanChange, ...], tuple[PlanChange, ...]]] = {}
    for row in sessions.store.rows():
        before, after = now.plan(row), then.plan(row)
        if before is None:
            continue
        # Sessions opened alike share their plans (_World): their difference is computed once.
        pair = (id(before), id(after))
        if pair not in diffs:
            diffs[pair] = _diff(before, after)
        gained, lost = diffs[pair]
        acted = [p for p in sessions.commands.of_session(row.id) if p.alive and (
            (after is None or (lost and grants_shrunk(before, after)))
            or (p.principal is not None and _loses(p.principal, row, then.view, then.principals)))]  # fmt: skip
        if not (gained or lost or acted):
            continue
        if not _sees(actor, now.view, row.workflow_id):
            unseen += 1
            continue
        if gained or lost:
            session_effects.append(SessionEffect(row.id, row.workflow_id, gained, lost))
        command_effects += [CommandEffect(row.id, p.pid, effect) for p in acted]
    consumers: list[ConsumerEffect] = []
    for folder in root.registry.folders():
        m = folder.manifest
        if m is None:
            continue
        changes = _consumer_changes(m.id, now, then)
        if changes and not _sees(actor, now.view, m.id):
            unseen += len(changes)
            continue
        consumers += changes
    return Preview(True, tuple(session_effects), tuple(command_effects), tuple(consumers), unseen)


_LEVEL = {"read": 1, "write": 2}


def _diff(before: Plan, after: Plan | None) -> tuple[tuple[PlanChange, ...], tuple[PlanChange, ...]]:
    """What ``after`` gains and loses against ``before``: at every grant path of either (access is
    piecewise constant between them, :func:`kbd.core.plan.grants_shrunk`), and each variable."""
    new_grants: tuple[Grant, ...] = after.grants if after is not None else ()
    new_env = after.env if after is not None else {}
    gained: list[PlanChange] = []
    lost: list[PlanChange] = []
    for path in sorted({g.path for g in before.grants} | {g.path for g in new_grants}):
        was, will = access_at(before.grants, path), access_at(new_grants, path)
        for kind, level in _LEVEL.items():
            if was < level <= will:
                gained.append(PlanChange(kind, str(path)))  # type: ignore[arg-type]
            elif will < level <= was:
                lost.append(PlanChange(kind, str(path)))  # type: ignore[arg-type]
    for name in sorted(set(before.env) | set(new_env)):
        if name == "WORKFLOW_KB_ACCESS" or before.env.get(name) == new_env.get(name):
            continue
        if name in new_env:
            gained.append(PlanChange("variable", f"{name}={new_env[name]}"))
        if name in before.env:
            lost.append(PlanChange("variable", f"{name}={before.env[name]}"))
    return tuple(gained), tuple(lost)


def _loses(principal: str, row: SessionRow, view: WhatIf, principals: Principals) -> bool:
    """Would ``principal`` lose the right to use ``row`` (the daemon then ends its commands)?
    The rule :class:`kbd.service.sessions.RootSessions` applies, asked of this world."""
    actor = principals.get(principal)
    found = view.find(row.workflow_id)
    if actor is None or not isinstance(found, Found):
        return True
    return not audience.may_use_session(actor, row.opened_by, found.manifest,
                                        readers_may_open=datafiles.consumer_kind(row.kind).readers_may_open)  # fmt: skip


def _consumer_changes(wid: str, now: _World, then: _World) -> list[ConsumerEffect]:
    before = {a.alias: a for a in now.attachments(wid) or []}
    after = {a.alias: a for a in then.attachments(wid) or []}
    out = []
    for alias in sorted(set(before) | set(after)):
        b, a = before.get(alias), after.get(alias)
        if a is None:
            out.append(ConsumerEffect(wid, alias, "detached", None))
        elif b is None or (b.workflow_id, b.access) != (a.workflow_id, a.access):
            out.append(ConsumerEffect(wid, alias, "attached" if a.available else "unavailable", a.reason))
        elif b.available != a.available:
            out.append(ConsumerEffect(wid, alias, "available" if a.available else "unavailable", a.reason))
        elif a.available and b.writable != a.writable:
            reason = a.write.reason if a.write is not None else None
            out.append(ConsumerEffect(wid, alias, "writable" if a.writable else "read_only", reason))
    return out


def _sees(actor: Actor, view: WhatIf, wid: str) -> bool:
    if isinstance(actor, LocalOperator):
        return True
    found = view.find(wid)
    return isinstance(found, Found) and audience.can_inspect(actor, found.manifest)


def preview_manifest(sessions: RootSessions, data: bytes, *, actor: Actor) -> Preview:
    """``kbd preview FILE``: what saving ``data`` (a hand-edited workflow.json) as the manifest of
    the workflow its ``id`` names would do. The file is checked as kbd reads a manifest; a workflow
    the caller may not inspect is not found."""
    from kbd.core.manifest import parse_manifest

    new = parse_manifest(data)
    root = sessions.host
    found = root.workflow(new.id)
    if not isinstance(actor, LocalOperator):
        audience.require_inspectable(actor, found.manifest, new.id)
    d = Draft(root)
    d.kept.manifests[new.id] = new
    return effects(sessions, d, actor=actor)
