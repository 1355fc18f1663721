"""Workflows, their sources, the candidates they could attach, and writer grants.

Each operation authorizes its actor through :class:`kbd.service.root.Root` (which audits
every refused change) and returns a typed result whose ``to_json()`` is the
DESIGN §6 shape shared by ``--json`` and the HTTP API.
"""

from __future__ import annotations

from dataclasses import dataclass

from kbd.core import audience
from kbd.core.principals import Principal
from kbd.core.resolve import Attachment
from kbd.service import JsonObject
from kbd.service.root import Root


@dataclass(frozen=True)
class WorkflowRow:
    """One discovered workflow folder, with its registry status."""

    id: str | None
    label: str | None
    path: str
    status: str
    problem: str | None
    nested_in: str | None  # a workflow folder inside another one (DESIGN §2)
    contains: tuple[str, ...]

    def to_json(self) -> JsonObject:
        return {"id": self.id, "label": self.label, "path": self.path, "status": self.status,
                "problem": self.problem, "nested_in": self.nested_in, "contains": list(self.contains)}  # fmt: skip


@dataclass(frozen=True)
class WorkflowList:
    workflows: tuple[WorkflowRow, ...]

    def to_json(self) -> JsonObject:
        return {"workflows": [w.to_json() for w in self.workflows]}


@dataclass(frozen=True)
class Candidate:
    """A workflow the consumer could attach now (labels, never paths)."""

    workflow_id: str
    label: str
    write_granted: bool

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "label": self.label, "write_granted": self.write_granted}


@dataclass(frozen=True)
class CandidateList:
    workflow_id: str
    candidates: tuple[Candidate, ...]

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "candidates": [c.to_json() for c in self.candidates]}


@dataclass(frozen=True)
class SourcesView:
    """A workflow's attachments as resolved now (``kbd sources list|set``,
    ``GET|PUT /v1/workflows/{wid}/sources``)."""

    workflow_id: str
    version: str
    sources: tuple[Attachment, ...]

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "version": self.version,
                "sources": [a.to_json() for a in self.sources]}  # fmt: skip


@dataclass(frozen=True)
class WorkflowDetail:
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
    allowed_kb_writers: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    can_manage: bool

    @property
    def writes_into(self) -> list[str]:
        return [a.workflow_id for a in self.sources if a.writable]

    def to_json(self) -> JsonObject:
        return {
            "workflow_id": self.workflow_id,
            "label": self.label,
            "path": self.path,
            "version": self.version,
            "host": self.host,
            "legacy": self.legacy,
            "owners": list(self.owners),
            "editors": list(self.editors),
            "readers": list(self.readers),
            "sources": [a.to_json() for a in self.sources],
            "writes_into": self.writes_into,
            "allowed_kb_writers": list(self.allowed_kb_writers),
            "candidates": [c.to_json() for c in self.candidates],
            "can_manage": self.can_manage,
        }


@dataclass(frozen=True)
class Detached:
    workflow_id: str
    alias: str

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "detached": self.alias}


@dataclass(frozen=True)
class WriterRow:
    workflow_id: str
    exists: bool  # a grant may name a workflow that is gone now

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "exists": self.exists}


@dataclass(frozen=True)
class WritersView:
    workflow_id: str
    writers: tuple[WriterRow, ...]
    legacy: bool

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "writers": [w.to_json() for w in self.writers],
                "legacy": self.legacy}  # fmt: skip


@dataclass(frozen=True)
class WriterChange:
    """The outcome of a grant or a revoke. ``consumer`` is the consumer's ID as
    recorded (surrounding blanks trimmed, as the grant list and the audit record
    hold it) for both, whichever interface asked."""

    source: str
    consumer: str
    granted: bool
    changed: bool

    def to_json(self) -> JsonObject:
        return {"source": self.source, "consumer": self.consumer, "granted": self.granted,
                "changed": self.changed}  # fmt: skip


def _workflow_row(r: JsonObject) -> WorkflowRow:
    return WorkflowRow(id=r["id"], label=r["label"], path=r["path"], status=r["status"], problem=r["problem"],
                       nested_in=r["nested_in"], contains=tuple(r["contains"]))  # fmt: skip


def _candidate(row: JsonObject) -> Candidate:
    return Candidate(workflow_id=row["workflow_id"], label=row["label"], write_granted=row["write_granted"])


# -- queries --------------------------------------------------------------------------


def list_workflows(host: Root, *, actor: Principal) -> WorkflowList:
    """The workflows ``actor`` may inspect, with registry problems (admins and
    services also see unreadable folders)."""
    rows = host.list_workflows(actor)
    return WorkflowList(tuple(_workflow_row(r) for r in rows))


def show(host: Root, wid: str, *, actor: Principal) -> WorkflowDetail:
    """Everything a builder needs: attachments, write grants, candidates."""
    m, attachments = host.sources(wid, actor)  # refuses an actor who may not inspect wid
    return WorkflowDetail(
        workflow_id=m.id, label=m.label, path=str(host.workflow(wid).folder.path), version=m.version,
        host=m.host, legacy=m.is_legacy, owners=tuple(m.effective_owners), editors=tuple(m.access.editors),
        readers=tuple(m.access.readers), sources=tuple(attachments),
        allowed_kb_writers=tuple(m.access.allowed_kb_writers),
        candidates=candidates(host, wid, actor=actor).candidates,
        can_manage=audience.can_manage_sources(actor, m),
    )  # fmt: skip


def sources(host: Root, wid: str, *, actor: Principal) -> SourcesView:
    m, attachments = host.sources(wid, actor)
    return SourcesView(m.id, m.version, tuple(attachments))


def candidates(host: Root, wid: str, *, actor: Principal) -> CandidateList:
    return CandidateList(wid, tuple(_candidate(c) for c in host.candidates(wid, actor)))


def writers(host: Root, source_id: str, *, actor: Principal) -> WritersView:
    d = host.writers(source_id, actor)
    rows = tuple(WriterRow(w["workflow_id"], w["exists"]) for w in d["writers"])
    return WritersView(d["workflow_id"], rows, d["legacy"])


# -- changes --------------------------------------------------------------------------


def attach(host: Root, wid: str, source_id: str, *, alias: str, access: str, actor: Principal) -> Attachment:
    """Attach ``source_id``'s KB to ``wid`` as ``alias``; the new attachment as resolved now."""
    return host.attach(wid, source_id, alias=alias, access=access, actor=actor)


def detach(host: Root, wid: str, alias: str, *, actor: Principal) -> Detached:
    host.detach(wid, alias, actor=actor)
    return Detached(wid, alias)


def set_sources(
    host: Root, wid: str, raw: object, *, actor: Principal, expected_version: str | None = None
) -> SourcesView:
    """Replace ``wid``'s whole attachment list with ``raw`` (parsed JSON: a list
    of entries, validated here); refused unless the manifest is at
    ``expected_version`` when one is given."""
    saved = host.set_sources(wid, raw, actor=actor, expected_version=expected_version)
    return SourcesView(saved.id, saved.version, tuple(host.resolve(saved)))


def grant(host: Root, source_id: str, consumer_id: str, *, actor: Principal) -> WriterChange:
    changed = host.grant(source_id, consumer_id, actor=actor)
    return WriterChange(source_id, consumer_id.strip(), granted=True, changed=changed)


def revoke(host: Root, source_id: str, consumer_id: str, *, actor: Principal) -> WriterChange:
    changed = host.revoke(source_id, consumer_id, actor=actor)
    return WriterChange(source_id, consumer_id.strip(), granted=False, changed=changed)
