"""Workflows, their sources, the candidates they could attach, and writer grants.

The one home of these operations, for every interface. Each one authorizes its
actor, does its work through the pure core (manifest, audience, resolve) and
the root's registry (:class:`kbd.service.root.Root`), records every refused
change in the audit log before the caller hears of it, and returns a typed
result whose ``to_json()`` is the docs/cli.md "JSON shapes" shape shared by ``--json`` and the
HTTP API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from kbd.core import audience
from kbd.core.manifest import (
    Entry,
    Manifest,
    SourceRef,
    validate_readers,
    validate_sources,
    validate_writers,
    with_access,
    with_sources,
)
from kbd.core.principals import Principal
from kbd.core.records import Record, key
from kbd.core.resolve import Attachment, resolve_new
from kbd.errors import (
    GrantGroupMissing,
    InvalidInput,
    InvalidManifest,
    KbdError,
    NotFound,
    PermissionDenied,
    SourceUnusable,
    WorkflowExists,
)
from kbd.fs.registry import Found, Missing, probe_kb
from kbd.service import JsonObject
from kbd.service.root import Root

if TYPE_CHECKING:
    from kbd.fs.workflow_folder import Ownership

# How a change builds the new attachment list from the manifest as it is now.
SourcesBuilder: TypeAlias = Callable[[Manifest], list[SourceRef]]


@dataclass(frozen=True)
class WorkflowRow(Record):
    """One discovered workflow folder, with its registry status."""

    id: str | None
    label: str | None
    path: str
    status: str
    problem: str | None
    nested_in: str | None  # a workflow folder inside another one (docs/on-disk.md "Registry")
    contains: tuple[str, ...]


@dataclass(frozen=True)
class WorkflowList(Record):
    workflows: tuple[WorkflowRow, ...]


@dataclass(frozen=True)
class Candidate(Record):
    """A workflow the consumer could attach now (labels, never paths)."""

    workflow_id: str
    label: str
    write_granted: bool


@dataclass(frozen=True)
class CandidateList(Record):
    workflow_id: str
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class SourcesView(Record):
    """A workflow's attachments as resolved now (``kbd sources list|set``,
    ``GET|PUT /v1/workflows/{wid}/sources``)."""

    workflow_id: str
    version: str
    sources: tuple[Attachment, ...]


@dataclass(frozen=True)
class WorkflowDetail(Record):
    """Everything a builder needs about one workflow (``kbd workflows show``)."""

    workflow_id: str
    label: str
    path: str
    version: str
    host: str | None
    legacy: bool
    owners: tuple[str, ...]
    editors: tuple[str, ...]
    readers: tuple[str, ...]
    sources: tuple[Attachment, ...]
    # The sources whose notes/ it may write into now.
    writes_into: tuple[str, ...] = field(init=False, metadata=key(computed=True))
    allowed_kb_writers: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    can_manage: bool
    # May the actor grant/revoke writers into this KB and review contributions
    # to its notes/ (its owners and admins)? What a page needs to offer those.
    can_grant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "writes_into", tuple(a.workflow_id for a in self.sources if a.writable))


@dataclass(frozen=True)
class Detached(Record):
    workflow_id: str
    alias: str = field(metadata=key(name="detached"))


@dataclass(frozen=True)
class WriterRow(Record):
    workflow_id: str
    exists: bool  # a grant may name a workflow that is gone now


@dataclass(frozen=True)
class WritersView(Record):
    workflow_id: str
    writers: tuple[WriterRow, ...]
    legacy: bool


@dataclass(frozen=True)
class WriterChange(Record):
    """The outcome of a grant or a revoke. ``consumer`` is the consumer's ID as
    recorded (surrounding blanks trimmed, as the grant list and the audit record
    hold it) for both, whichever interface asked."""

    source: str
    consumer: str
    granted: bool
    changed: bool


# -- queries --------------------------------------------------------------------------


def list_workflows(root: Root, *, actor: Principal) -> WorkflowList:
    """The workflows ``actor`` may inspect, with registry problems (admins and
    services also see unreadable folders)."""
    rows: list[WorkflowRow] = []
    for folder in root.registry.folders():
        status = root.registry.status_of(folder)
        m = folder.manifest
        if m is not None and status == "ok" and not audience.can_inspect(actor, m):
            continue
        if m is None and not (actor.enabled_admin or actor.is_service):
            continue
        rows.append(
            WorkflowRow(
                id=m.id if m else folder.known_id,
                label=m.label if m else None,
                path=str(folder.path),
                status=status,
                problem=folder.problem if m is None else None,
                # A workflow folder inside another one (docs/on-disk.md "Registry"): both are
                # ambiguous_id until an operator resolves it.
                nested_in=str(folder.nested_in) if folder.nested_in is not None else None,
                contains=tuple(str(p) for p in root.registry.contained(folder)),
            )
        )
    return WorkflowList(tuple(rows))


def inspectable(root: Root, wid: str, *, actor: Principal) -> Found:
    """``wid``'s folder, for an actor who may inspect it (else not found: IDs cannot be probed)."""
    found = root.workflow(wid)
    audience.require_inspectable(actor, found.manifest, wid)
    return found


def show(root: Root, wid: str, *, actor: Principal) -> WorkflowDetail:
    """Everything a builder needs: attachments, write grants, candidates."""
    found = inspectable(root, wid, actor=actor)
    m = found.manifest
    return WorkflowDetail(
        workflow_id=m.id, label=m.label, path=str(found.folder.path), version=m.version,
        host=m.host, legacy=m.is_legacy, owners=tuple(m.effective_owners), editors=tuple(m.access.editors),
        readers=tuple(m.access.readers), sources=tuple(root.resolve(m)),
        allowed_kb_writers=tuple(m.access.allowed_kb_writers),
        candidates=candidates(root, wid, actor=actor).candidates,
        can_manage=audience.can_manage_sources(actor, m), can_grant=audience.can_grant_writers(actor, m),
    )  # fmt: skip


def sources(root: Root, wid: str, *, actor: Principal) -> SourcesView:
    """``wid``'s attachments as resolved now (refused to an actor who may not inspect it)."""
    m = inspectable(root, wid, actor=actor).manifest
    return SourcesView(m.id, m.version, tuple(root.resolve(m)))


def candidates(root: Root, wid: str, *, actor: Principal) -> CandidateList:
    """Workflow IDs ``wid`` could attach now: readable by its whole audience,
    on this host, not itself, not ambiguous, KB present. Labels, never paths."""
    consumer = inspectable(root, wid, actor=actor).manifest
    attached = {e.workflow_id for e in consumer.entries}
    out: list[Candidate] = []
    for folder in root.registry.folders():
        source = folder.manifest
        if source is None or source.id == consumer.id or source.id in attached:
            continue
        if root.registry.status_of(folder) != "ok":
            continue
        if source.host is not None and source.host != root.config.host:
            continue
        if not audience.can_read(consumer, source, root.principals):
            continue
        if probe_kb(folder.path).problem is not None:
            continue
        out.append(Candidate(source.id, source.label, audience.can_write(consumer, source, root.principals)))
    return CandidateList(wid, tuple(sorted(out, key=lambda c: c.workflow_id)))


def writers(root: Root, source_id: str, *, actor: Principal) -> WritersView:
    """The consumers ``source_id``'s owners let write into its notes/ (each
    marked when it no longer exists)."""
    m = inspectable(root, source_id, actor=actor).manifest
    rows = tuple(WriterRow(w, isinstance(root.registry.find(w), Found)) for w in m.access.allowed_kb_writers)
    return WritersView(m.id, rows, m.is_legacy)


# -- source changes ---------------------------------------------------------------------


def attach(root: Root, wid: str, source_id: str, *, alias: str, access: str, actor: Principal) -> Attachment:
    """Attach ``source_id``'s KB to ``wid`` as ``alias``; the new attachment as resolved now."""

    def build(current: Manifest) -> list[SourceRef]:
        refs = _current_refs(current)
        entry = {"workflow_id": source_id, "alias": alias, "access": access}
        return validate_sources([r.to_json() for r in refs] + [entry], self_id=current.id)

    saved = _save_sources(root, wid, actor, build, action="attach", source=source_id)
    return next(a for a in root.resolve(saved) if a.alias == alias)


def detach(root: Root, wid: str, alias: str, *, actor: Principal) -> Detached:
    """Remove the attachment ``alias`` from ``wid``."""

    def build(current: Manifest) -> list[SourceRef]:
        if not any(e.alias == alias for e in current.entries):
            raise NotFound(
                f"workflow {wid!r} has no attachment with alias {alias!r}",
                hint=f"`kbd sources list {wid}` shows the attached aliases",
            )
        keep = [e for e in current.entries if e.alias != alias]
        bad = [e for e in keep if e.ref is None]
        if bad:
            raise InvalidManifest(
                f"knowledgebase_sources[{bad[0].index}] is invalid ({bad[0].problem}); detach or replace it too"
            )
        return [e.ref for e in keep if e.ref is not None]

    _save_sources(root, wid, actor, build, action="detach", source=alias)
    return Detached(wid, alias)


def set_sources(
    root: Root, wid: str, raw: object, *, actor: Principal, expected_version: str | None = None
) -> SourcesView:
    """Replace ``wid``'s whole attachment list with ``raw`` (parsed JSON: a list
    of entries, validated here); refused unless the manifest is at
    ``expected_version`` when one is given."""

    def build(current: Manifest) -> list[SourceRef]:
        return validate_sources(raw, self_id=current.id)

    saved = _save_sources(root, wid, actor, build, action="set", expected_version=expected_version)
    return SourcesView(saved.id, saved.version, tuple(root.resolve(saved)))


ACCESS_MODES = ("read", "write")


def set_access(
    root: Root, wid: str, alias: str, access: str, *, actor: Principal, expected_version: str | None = None
) -> Attachment:
    """Change the access of ``wid``'s attachment ``alias`` to ``access`` in one
    locked read-modify-write of its manifest (every other entry unchanged):
    refused when the manifest is no longer at ``expected_version`` (when one
    is given), so a change decided on an older view never lands. The new
    attachment as resolved now; a ``write`` whose grant is missing is saved as
    write-pending, as an attach with write access is."""
    if access not in ACCESS_MODES:
        raise InvalidInput(f"access must be 'read' or 'write', not {access[:40]!r}")

    def build(current: Manifest) -> list[SourceRef]:
        if not any(e.alias == alias for e in current.entries):
            raise NotFound(
                f"workflow {wid!r} has no attachment with alias {alias!r}",
                hint=f"`kbd sources list {wid}` shows the attached aliases",
            )
        entries = [r.to_json() for r in _current_refs(current)]
        for entry in entries:
            if entry["alias"] == alias:
                entry["access"] = access
        return validate_sources(entries, self_id=current.id)

    saved = _save_sources(root, wid, actor, build, action="access", source=alias,
                          expected_version=expected_version)  # fmt: skip
    return next(a for a in root.resolve(saved) if a.alias == alias)


def _require_manage(actor: Principal, m: Manifest) -> None:
    if not audience.can_manage_sources(actor, m):
        audience.require_inspectable(actor, m, m.id)
        raise _because(
            PermissionDenied(
                f"{actor.id!r} may not manage the sources of {m.id!r} (owners, editors and admins may; "
                "readers only inspect)"
            ),
            "not_manager",
        )


def _current_refs(current: Manifest) -> list[SourceRef]:
    bad = [e for e in current.entries if e.ref is None]
    if bad:
        raise InvalidManifest(
            f"knowledgebase_sources[{bad[0].index}] is invalid ({bad[0].problem}); "
            "detach or replace it before other changes",
            hint=f"`kbd sources detach WF {bad[0].alias}` or `kbd sources set WF --file -`"
            if bad[0].alias
            else "`kbd sources set WF --file -` replaces the whole list",
        )
    return [e.ref for e in current.entries if e.ref is not None]


def _check_new_entries(root: Root, consumer: Manifest, old: tuple[Entry, ...], refs: list[SourceRef]) -> None:
    """Every new or changed entry must resolve now; unchanged ones may stay as they are."""
    unchanged = {e.ref for e in old if e.ref is not None}
    for i, ref in enumerate(refs):
        if ref in unchanged:
            continue
        att = resolve_new(
            ref, consumer, index=i, view=root, principals=root.principals, host=root.config.host
        )
        if not att.available:
            raise SourceUnusable(
                f"cannot attach {ref.workflow_id!r} as {ref.alias!r}: {att.reason}: {att.message}",
                reason=att.reason or "invalid_entry",
                source=ref.workflow_id,
            )
        if ref.access == "write" and att.write is not None and not att.write.available:
            found = root.registry.find(ref.workflow_id)
            if isinstance(found, Found) and found.manifest.is_legacy:
                raise SourceUnusable(
                    f"cannot attach {ref.workflow_id!r} with write access: it has no owner, "
                    "so nobody can ever grant write access",
                    reason="write_not_granted",
                    hint="attach it with --access read, or give the source an owner first",
                    source=ref.workflow_id,
                )


def _save_sources(
    root: Root,
    wid: str,
    actor: Principal,
    build: SourcesBuilder,
    *,
    action: str,
    source: str | None = None,
    expected_version: str | None = None,
) -> Manifest:
    try:
        return _update_sources(root, wid, actor, build, action=action, expected_version=expected_version)
    except KbdError as err:
        # Every refusal is recorded (who, what, target, why) before the caller hears of it.
        root.audit_refusal("sources_refused", err, actor=actor, action=action, workflow_id=wid,
                           source=err.source if isinstance(err, SourceUnusable) else source)  # fmt: skip
        raise


def _update_sources(
    root: Root,
    wid: str,
    actor: Principal,
    build: SourcesBuilder,
    *,
    action: str,
    expected_version: str | None,
) -> Manifest:
    found = root.workflow(wid)
    folder = found.folder
    # Who may change the sources, before the locked update compares the
    # expected version: an outsider's stale version must get the missing
    # workflow's answer, never the manifest's current version (checked again
    # under the lock, on the manifest as it is then).
    _require_manage(actor, found.manifest)
    before: list[Manifest] = []

    def change(current: Manifest) -> JsonObject:
        before.append(current)
        _require_manage(actor, current)
        if current.sources_problem is not None and action != "set":
            raise InvalidManifest(f"{current.sources_problem}; replace the whole list with `kbd sources set`")
        refs = build(current)
        _check_new_entries(root, current, current.entries, refs)
        # Audited under the manifest lock, before the file changes: if the
        # log cannot be written, nothing changes.
        root.audit("sources_changed", workflow_id=wid, actor=actor.id, action=action,
                   sources=[r.to_json() for r in refs])  # fmt: skip
        return with_sources(current.raw, refs)

    from kbd.fs import manifest_store  # filelock: only for writers, never on the exec path

    saved = manifest_store.update(
        folder.path,
        change,
        state_dir=root.config.state_dir,
        timeout=root.config.lock_timeout,
        expected_version=expected_version,
        dry_run=root.dry_run,
    )
    root.events.manifest_saved(wid, before[0] if before else None, saved, folder=folder.path)
    return saved


# -- writer grants ----------------------------------------------------------------------


def grant(root: Root, source_id: str, consumer_id: str, *, actor: Principal,
          request_id: int | None = None) -> WriterChange:  # fmt: skip
    """Let ``consumer_id`` write into ``source_id``'s notes/ (its owners and admins only); the
    access request it approves, if any, is named in the audit record."""
    return _change_writers(root, source_id, consumer_id, actor=actor, grant=True, request_id=request_id)


def revoke(root: Root, source_id: str, consumer_id: str, *, actor: Principal) -> WriterChange:
    """Withdraw ``consumer_id``'s write grant on ``source_id``."""
    return _change_writers(root, source_id, consumer_id, actor=actor, grant=False)


@dataclass(frozen=True)
class ReadersChange(Record):
    """The outcome of ``kbd readers grant|revoke``: the principals asked for, and the
    workflow's ``access.readers`` as saved."""

    workflow_id: str
    principals: tuple[str, ...]
    granted: bool
    changed: bool
    readers: tuple[str, ...]
    #: Of ``principals``: those principals.yaml does not hold (an audience may name them before
    #: they exist; a typo shows here).
    unknown: tuple[str, ...]


def grant_readers(root: Root, wid: str, principals: tuple[str, ...], *, actor: Principal,
                  request_id: int | None = None) -> ReadersChange:  # fmt: skip
    """Add ``principals`` to ``wid``'s readers (its owners and admins only): the change that admits
    a consumer's whole audience (``audience_denied``; docs/access.md "Access rules")."""
    return _change_readers(root, wid, principals, actor=actor, grant=True, request_id=request_id)


def revoke_readers(root: Root, wid: str, principals: tuple[str, ...], *, actor: Principal) -> ReadersChange:
    """Remove ``principals`` from ``wid``'s readers (owners and editors are not readers: they keep reading)."""
    return _change_readers(root, wid, principals, actor=actor, grant=False)


def _change_readers(root: Root, wid: str, principals: tuple[str, ...], *, actor: Principal,
                    grant: bool, request_id: int | None = None) -> ReadersChange:  # fmt: skip
    try:
        asked = tuple(validate_readers(list(principals)))

        def compute(current: Manifest) -> list[str]:
            readers = list(current.access.readers)
            if not grant:
                return [r for r in readers if r not in asked]
            if current.is_legacy:
                raise InvalidInput(f"{wid!r} has no owner: it is account-visible, so readers change nothing",
                                   hint="set access.owners first")  # fmt: skip
            return [*readers, *(p for p in asked if p not in readers)]

        changed = save_access(root, wid, "readers", compute, actor=actor,
                              event="readers_granted" if grant else "readers_revoked", what="who reads",
                              command="kbd readers grant", workflow_id=wid, principals=list(asked),
                              **_request(request_id))  # fmt: skip
    except KbdError as err:
        root.audit_refusal("readers_refused", err, actor=actor, action="grant" if grant else "revoke",
                           workflow_id=wid, principals=[p[:80] for p in principals[:20]])  # fmt: skip
        raise
    readers = root.workflow(wid).manifest.access.readers
    unknown = tuple(p for p in asked if root.principals.get(p) is None)
    return ReadersChange(wid, asked, granted=grant, changed=changed, readers=tuple(readers), unknown=unknown)


def _change_writers(
    root: Root,
    source_id: str,
    consumer_id: str,
    *,
    actor: Principal,
    grant: bool,
    request_id: int | None = None,
) -> WriterChange:
    try:
        changed = _update_writers(
            root, source_id, consumer_id, actor=actor, grant=grant, request_id=request_id
        )
    except KbdError as err:
        # Every refusal is recorded (who, what, target, why) before the caller hears of it.
        root.audit_refusal("writer_grant_refused" if grant else "writer_revoke_refused", err,
                           actor=actor, source=source_id, consumer=consumer_id)  # fmt: skip
        raise
    return WriterChange(source_id, consumer_id.strip(), granted=grant, changed=changed)


def _request(request_id: int | None) -> dict[str, int]:
    """The audit field naming the access request a grant approves (none: no field)."""
    return {} if request_id is None else {"request_id": request_id}


def _update_writers(root: Root, source_id: str, consumer_id: str, *, actor: Principal, grant: bool,
                    request_id: int | None = None) -> bool:  # fmt: skip
    def compute(current: Manifest) -> list[str]:
        writers = list(current.access.allowed_kb_writers)
        if not grant:
            return [w for w in writers if w != consumer_id.strip()]
        if current.is_legacy:
            raise InvalidInput(
                f"{source_id!r} has no owner; a legacy workflow cannot grant write access",
                hint="set access.owners on the source first",
            )
        target = validate_writers([consumer_id], self_id=current.id)[0]
        root.workflow(target)  # must exist and be unambiguous now
        return validate_writers([*writers, target], self_id=current.id)

    return save_access(root, source_id, "allowed_kb_writers", compute, actor=actor,
                       event="writer_granted" if grant else "writer_revoked", what="who writes into",
                       command="kbd writers grant", source=source_id, consumer=consumer_id.strip(),
                       **_request(request_id))  # fmt: skip


def save_access(
    root: Root,
    wid: str,
    name: str,
    compute: Callable[[Manifest], list[str]],
    *,
    actor: Principal,
    event: str,
    what: str,
    command: str,
    **audited: object,
) -> bool:
    """One locked read-modify-write of ``wid``'s list ``access.<name>`` (writers or readers):
    only its owners and admins may; ``compute`` gives the new list from the manifest as it is
    under the lock (raising refuses, nothing is written). Audited before the manifest changes
    (see _update_sources); every other field is kept. Whether the list changed."""
    folder = root.workflow(wid).folder
    changed = False
    before: list[Manifest] = []

    def change(current: Manifest) -> JsonObject:
        nonlocal changed
        before.append(current)
        if not audience.can_grant_writers(actor, current):
            audience.require_inspectable(actor, current, wid)
            raise _because(
                PermissionDenied(f"{actor.id!r} may not change {what} {wid!r}: only its owners or an admin may",
                                 hint=f"ask an owner of {wid} to run `{command}`"),
                "not_owner",
            )  # fmt: skip
        new = compute(current)
        changed = new != list(getattr(current.access, name))  # the list as kbd reads it
        root.audit(event, actor=actor.id, changed=changed, **audited)
        return with_access(current.raw, name, new) if changed else current.raw

    from kbd.fs import manifest_store

    saved = manifest_store.update(
        folder.path, change, state_dir=root.config.state_dir, timeout=root.config.lock_timeout,
        dry_run=root.dry_run,
    )  # fmt: skip
    root.events.manifest_saved(wid, before[0] if before else None, saved, folder=folder.path)
    return changed


def _because(err: KbdError, reason: str) -> KbdError:
    """``err`` with its specific reason code (recorded by :meth:`Root.audit_refusal`)."""
    err.reason = reason
    return err


# -- creating a workflow folder (docs/multi-user.md "The permission model") ---------------------------------------------

MAX_LABEL = 200


@dataclass(frozen=True)
class WorkflowCreated(Record):
    """A workflow folder kbd made for its builder."""

    workflow_id: str
    label: str
    owners: tuple[str, ...]  # its one owner
    path: str


def create(
    root: Root, wid: str, *, label: str | None, owner: str | None, actor: Principal
) -> WorkflowCreated:
    """Make ``<workflows>/<wid>/`` for ``owner`` (default: the actor), owned by
    the owner's uid and the host's grant group (else the owner's primary
    group): a user principal for herself, an admin for any principal with a
    uid; a service never. Audited either way; a ``workflow.changed`` event."""
    try:
        made = _create(root, wid, label=label, owner=owner, actor=actor)
    except KbdError as err:
        root.audit_refusal(
            "workflow_create_refused", err, actor=actor, workflow_id=wid, owner=owner or actor.id
        )
        raise
    root.events.emit("workflow.changed", workflow_id=made.workflow_id)
    return made


def _create(
    root: Root, wid: str, *, label: str | None, owner: str | None, actor: Principal
) -> WorkflowCreated:
    from kbd.core.identifiers import id_problem

    if actor.is_service:
        raise _because(PermissionDenied(f"{actor.id!r} is a service principal; services do not own workflows",
                                        hint="create it as the builder who will own it, or as an admin"),
                       "service")  # fmt: skip
    target = actor.id if owner is None else owner
    if target != actor.id and not actor.enabled_admin:
        raise _because(
            PermissionDenied(f"{actor.id!r} may create workflows only for itself, not for {target!r}",
                             hint="leave out --owner, or ask an admin"),
            "not_admin",
        )  # fmt: skip
    if (problem := id_problem(wid)) is not None:
        raise InvalidInput(f"workflow ID {problem}")
    if wid.startswith("."):
        raise InvalidInput(f"workflow ID {wid!r} must not start with '.' (it names the workflow's folder)")
    text = wid if label is None else label
    if not text.strip() or len(text) > MAX_LABEL or any(not c.isprintable() for c in text):
        raise InvalidInput(f"label must be 1 to {MAX_LABEL} printable characters, not {text[:MAX_LABEL]!r}")
    principal = root.principals.get(target)
    if principal is None or principal.disabled:
        raise InvalidInput(f"owner {target!r} is not an enabled principal on this host",
                           hint="`kbd principals list` shows them")  # fmt: skip
    if principal.is_service or principal.uid is None:
        raise InvalidInput(
            f"owner {target!r} must be a user principal with a uid (the folder is owned by that uid)",
            hint=f"`kbd principals add {target} --uid N`",
        )
    if not isinstance(root.registry.find(wid), Missing):
        raise WorkflowExists(f"workflow ID {wid!r} is taken on this host")
    who = _ownership(root, principal.uid)
    import orjson

    from kbd.core.watching import PathChange
    from kbd.fs import workflow_folder

    manifest = {"id": wid, "label": text, "created_by": target, "access": {"owners": [target]},
                "knowledgebase_sources": []}  # fmt: skip
    data = orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n"
    # Audited before the folder exists (as every change here): if the log
    # cannot be written, nothing is made. A failure after it is recorded too.
    root.audit("workflow_created", workflow_id=wid, actor=actor.id, owner=target)
    path = workflow_folder.create(root.config.workflow_roots[0], wid, data, who)
    root.registry.apply([PathChange("added", str(path))])  # found at once, not at the next sweep
    return WorkflowCreated(wid, text, (target,), str(path))


def _ownership(root: Root, uid: int) -> Ownership:
    from kbd.fs.workflow_folder import Ownership

    name = root.config.sandbox.grant_group
    if name is not None:
        import grp

        try:
            return Ownership(uid, grp.getgrnam(name).gr_gid, grant=True)
        except KeyError:
            raise GrantGroupMissing(
                f"sandbox.grant_group {name!r} in kbd.yaml is not a group on this host"
            ) from None
    import pwd

    try:
        return Ownership(uid, pwd.getpwuid(uid).pw_gid, grant=False)
    except KeyError:
        raise InvalidInput(f"uid {uid} has no account on this host (no passwd entry)") from None
