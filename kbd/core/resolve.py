"""Attachment resolution: each entry of a consumer → a status (docs/access.md).

Pure decisions over a :class:`SourceView` (the registry and KB probe behind a
small interface), so the rules can be tested with fakes and a fleet index could
replace the folder scan (docs/fleet.md). Every call re-runs every check: nothing is
remembered between lookups, so editing JSON by hand never grants more.

Attachments are not transitive: only the consumer's own entries are looked at;
a source's ``knowledgebase_sources`` are never read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kbd.core import audience
from kbd.core.identifiers import env_name
from kbd.core.lookup import Ambiguous, Found, KbProbe, Lookup, Missing, Unreadable
from kbd.core.records import JsonObject, Keys, Record

if TYPE_CHECKING:  # types only: principals.yaml loading stays out of the pure core
    from kbd.core.manifest import Entry, Manifest, SourceRef
    from kbd.core.principals import Principals

REASONS = (
    "not_found",
    "ambiguous_id",
    "manifest_unreadable",
    "audience_denied",
    "other_host",
    "kb_missing",
    "kb_not_dir",
    "kb_symlinked",
    "kb_mountpoint",
    "invalid_entry",
)
WRITE_NOT_GRANTED = "write_not_granted"
# Write-status reason added by kbd (docs/access.md "Statuses and reason codes"): the owner granted write, but the
# source's notes/ is missing, a link or a mount point.
NOTES_UNAVAILABLE = "notes_unavailable"


class SourceView(Protocol):
    def find(self, workflow_id: str) -> Lookup: ...
    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe: ...


@dataclass(frozen=True)
class WriteStatus(Record):
    available: bool
    reason: str | None
    message: str | None = None


@dataclass(frozen=True)
class Attachment(Record):
    """The status of one attachment, in the contract's JSON shape.

    Its JSON is written by hand (docs/architecture.md "Typed operations"): ``path`` is a Path and
    ``kb_identity`` is not in it."""

    alias: str
    workflow_id: str
    label: str | None
    access: str
    available: bool
    reason: str | None
    message: str | None
    write: WriteStatus | None
    path: Path | None  # canonical KB folder; None whenever not available
    kb_identity: tuple[int, int] | None = None  # (st_dev, st_ino) seen at resolution
    # Whether the source has owners who could grant write access (False: a legacy
    # source, whose notes/ no grant can open); None whenever not available. Lets an
    # interface offer "allow writing" only where it can succeed.
    write_grantable: bool | None = None

    @property
    def env(self) -> str:
        return env_name(self.alias) if self.alias else ""

    @property
    def writable(self) -> bool:
        return self.write is not None and self.write.available

    def to_json(self) -> JsonObject:
        return {
            "alias": self.alias,
            "workflow_id": self.workflow_id,
            "label": self.label,
            "access": self.access,
            "available": self.available,
            "reason": self.reason,
            "message": self.message,
            "write": None if self.write is None else self.write.to_json(),
            "env": self.env,
            "path": None if self.path is None else str(self.path),
            **({} if self.write_grantable is None else {"write_grantable": self.write_grantable}),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "") -> Attachment:
        """The attachment ``data`` spells (``kb_identity``: None, it is never written)."""
        k = _ATTACHMENT.read(cls, data, where)
        return cls(k["alias"], k["workflow_id"], k["label"], k["access"], k["available"], k["reason"],
                   k["message"], k["write"], None if k["path"] is None else Path(k["path"]),
                   write_grantable=k["write_grantable"])  # fmt: skip

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _ATTACHMENT.schema(cls, defs)


_ATTACHMENT = Keys(lambda: {"alias": str, "workflow_id": str, "label": str | None, "access": str, "available": bool,
                            "reason": str | None, "message": str | None, "write": WriteStatus | None, "env": str,
                            "path": str | None, "write_grantable": bool | None},
                   omitted=("write_grantable",))  # fmt: skip


def _unavailable(entry: Entry, reason: str, message: str, *, label: str | None = None) -> Attachment:
    write = WriteStatus(False, reason, message) if entry.access == "write" else None
    return Attachment(
        alias=entry.alias,
        workflow_id=entry.workflow_id,
        label=label,
        access=entry.access if entry.access in ("read", "write") else "read",
        available=False,
        reason=reason,
        message=message,
        write=write,
        path=None,
    )


def resolve_entry(
    entry: Entry, consumer: Manifest, *, view: SourceView, principals: Principals, host: str
) -> Attachment:
    """Resolve one entry of ``consumer``. Never raises for an unusable source:
    the attachment is returned unavailable with its reason."""
    if entry.ref is None:
        return _unavailable(entry, "invalid_entry", f"this entry is invalid: {entry.problem}")
    ref = entry.ref
    found = view.find(ref.workflow_id)
    if isinstance(found, Missing):
        return _unavailable(
            entry, "not_found", f"no workflow with ID {ref.workflow_id!r} exists on this host"
        )
    if isinstance(found, Ambiguous):
        return _unavailable(
            entry,
            "ambiguous_id",
            f"{found.describe()}; none is used until "
            + (
                "an operator removes the extra workflow.json or moves a folder"
                if found.nested
                else "the copies get distinct IDs"
            ),
        )
    if isinstance(found, Unreadable):
        return _unavailable(
            entry,
            "manifest_unreadable",
            f"the source's workflow.json is unreadable: {found.folder.problem}",
        )
    assert isinstance(found, Found)
    source = found.manifest
    if source.host is not None and source.host != host:
        return _unavailable(entry, "other_host", f"the source lives on host {source.host!r}, not on {host!r}")
    if not audience.can_read(consumer, source, principals):
        return _unavailable(
            entry,
            "audience_denied",
            "not everyone who can read this workflow may read the source"
            if not consumer.is_legacy
            else "this workflow has no owner (account-visible), so it may only attach account-visible sources",
        )
    # The label is shown only once the consumer's audience may read the source.
    probe = view.probe_kb(found.folder.path, notes=ref.access == "write")
    if probe.problem is not None:
        return _unavailable(entry, probe.problem.reason, probe.problem.message, label=source.label)
    write: WriteStatus | None = None
    if ref.access == "write":
        granted = audience.can_write(consumer, source, principals)
        if granted and probe.notes_problem is not None:
            # Granted, but there is no usable notes/ to write into: the write grant
            # is withheld (the read stays), instead of breaking every command.
            write = WriteStatus(False, NOTES_UNAVAILABLE, probe.notes_problem)
        elif granted:
            write = WriteStatus(True, None)
        elif source.is_legacy:
            write = WriteStatus(
                False, WRITE_NOT_GRANTED, "the source has no owner who could grant write access"
            )
        else:
            write = WriteStatus(
                False,
                WRITE_NOT_GRANTED,
                f"the source's owner has not granted {consumer.id!r} write access "
                f"(`kbd writers grant {ref.workflow_id} {consumer.id}`)",
            )
    return Attachment(
        alias=ref.alias,
        workflow_id=ref.workflow_id,
        label=source.label,
        access=ref.access,
        available=True,
        reason=None,
        message=None,
        write=write,
        path=found.folder.kb_path,
        kb_identity=probe.identity,
        write_grantable=not source.is_legacy,
    )


def resolve_new(
    ref: SourceRef, consumer: Manifest, *, index: int, view: SourceView, principals: Principals, host: str
) -> Attachment:
    """``ref`` resolved as entry ``index`` of ``consumer`` would be: an entry about to be saved
    (``kbd sources attach``) or asked about (``kbd why``)."""
    from kbd.core.manifest import Entry

    entry = Entry(index, ref, None, ref.alias, ref.workflow_id, ref.access)
    return resolve_entry(entry, consumer, view=view, principals=principals, host=host)


def resolve_all(
    consumer: Manifest, *, view: SourceView, principals: Principals, host: str
) -> list[Attachment]:
    """Every entry of ``consumer``, in manifest order, none dropped."""
    return [resolve_entry(e, consumer, view=view, principals=principals, host=host) for e in consumer.entries]
