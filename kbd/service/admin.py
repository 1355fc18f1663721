"""Root administration: init, doctor, validate, principals and their tokens,
the daemon's health and counters, the audit log.

These work on the root itself, whose file permissions are the trust boundary
(as for git): whoever may write the root's files may run them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from kbd.core.folders import FolderStatus, check_folders
from kbd.core.identifiers import id_problem
from kbd.core.layout import KB_DIR
from kbd.core.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    entry_problems,
    field_problems,
    manifest_document,
    parse_manifest,
    version_of,
    writer_problems,
)
from kbd.core.principals import Actor, Principal
from kbd.core.records import Keys, Record, key
from kbd.errors import InvalidInput, KbdError, NotFound, PermissionDenied
from kbd.service import JsonObject
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from kbd.state import audit

# -- init -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Initialised(Record):
    root: str
    host: str
    demo_workflows: tuple[str, ...]
    replaced: bool  # kbd.yaml and principals.yaml (tokens, uid maps) were rewritten
    # --system only (None otherwise, and absent from the JSON): the groups it
    # created, and whether the config files were kept (an existing root).
    groups_created: tuple[str, ...] | None = field(default=None, metadata=key(omit_none=True))
    layout_only: bool | None = field(default=None, metadata=key(omit_none=True))


@dataclass(frozen=True)
class SystemLayout:
    """``kbd init --system``: the group that may reach the socket and the grant group."""

    group: str = "kbd"
    grant_group: str = "kbd-grant"


def init(
    root: Path, *, host: str | None, force: bool, demo: bool, system: SystemLayout | None = None
) -> Initialised:
    """Create a kbd root (kbd.yaml, principals.yaml, workflows/, state/). With
    ``system``: as a service host's root (groups, owners, modes; kbd.yaml names
    the grant group). On an existing root without ``force``, ``system`` applies
    the groups, owners and modes only and keeps the config files."""
    from kbd.fs.rootinit import init_root  # yaml and the demo: only for init

    if system is None:
        r = init_root(root, host=host, force=force, demo=demo)
        return Initialised(r["root"], r["host"], tuple(r["demo_workflows"]), r["replaced"])
    from kbd.core.layout import CONFIG_NAME
    from kbd.fs import systemlayout

    systemlayout.check_names(system.group, system.grant_group)
    if demo:
        raise InvalidInput("--demo and --system do not mix: a service root holds no example workflows")
    kept = (root / CONFIG_NAME).is_file() and not force
    if kept:
        host_name = Root(root).config.host  # the root must load: never re-layout a broken one
        r = {"root": str(root.resolve()), "host": host_name, "demo_workflows": [], "replaced": False}
    else:
        r = init_root(root, host=host, force=force, demo=False, grant_group=system.grant_group)
    created = systemlayout.apply_layout(root, group=system.group, grant_group=system.grant_group)
    return Initialised(r["root"], r["host"], (), r["replaced"], tuple(created), layout_only=kept)


# -- doctor -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorCheck(Record):
    check: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class DoctorReport(Record):
    ok: bool = field(init=False, metadata=key(computed=True))  # every check passed
    checks: tuple[DoctorCheck, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", all(c.ok for c in self.checks))


def doctor(root: Path, *, workflow_id: str | None = None) -> DoctorReport:
    """Check the root, its config, principals, registry health and this host's
    sandbox layers; with ``workflow_id``, also the KBs its sessions can read for
    multi-link files. A root whose config cannot be loaded is one failed check."""
    try:
        host = Root(root)
    except KbdError as err:
        return DoctorReport((DoctorCheck("config", False, f"{err.code}: {err.message}"),))
    return DoctorReport((DoctorCheck("config", True, f"host {host.config.host}, root {host.config.root}"),
                         *_root_checks(host, workflow_id), *_layout_checks(host), *_sandbox_checks(host)))  # fmt: skip


def _layout_checks(host: Root) -> list[DoctorCheck]:
    """A host with a grant group (docs/multi-user.md "The permission model"): the group has no members, the
    root is not open to others, and each workflow folder is group-owned by the
    grant group, setgid, closed to others, with a group-writable notes/. One
    FAIL line per problem, naming the path and the fix."""
    name = host.config.sandbox.grant_group
    if name is None:
        return []
    from kbd.fs import systemlayout

    problems = systemlayout.grant_group_problems(name)
    out = [
        DoctorCheck("grant group", not problems, problems[0] if problems else f"{name}: exists, no members")
    ]
    found = systemlayout.root_problems(host.config.root)
    folders = host.registry.folders()
    for f in folders:
        found += systemlayout.workflow_problems(f.path, grant_group=name)
    out += [DoctorCheck("permissions", False, p) for p in found]
    if not found:
        out.append(DoctorCheck("permissions", True, f"root and {len(folders)} workflow folders as laid out"))
    return out + _install_checks()


def _install_checks() -> list[DoctorCheck]:
    """On a multi-user host every user runs this kbd: its interpreter and package must be theirs to run
    (docs/multi-user.md "Deploying on a host")."""
    import sys

    import kbd
    from kbd.fs import systemlayout

    found = [p for path, run in ((Path(sys.executable), True), (Path(kbd.__file__), False))
             if (p := systemlayout.others_cannot_use(path, run=run)) is not None]  # fmt: skip
    if found:
        return [DoctorCheck("install", False, p + "; make the venv from /usr/bin/python3") for p in found]
    return [DoctorCheck("install", True, f"{sys.executable} and the kbd package: usable by every user")]


def _root_checks(host: Root, workflow_id: str | None) -> list[DoctorCheck]:
    from kbd.fs import lint  # walks every workflow folder (bounded): only for doctor

    ps = list(host.principals)
    out = [
        DoctorCheck(
            "principals", True, f"{len(ps)} principals, {sum(p.enabled_admin for p in ps)} enabled admins"
        )
    ]
    folders = host.registry.folders()
    bad = [(f, s) for f in folders if (s := host.registry.status_of(f)) != "ok"]
    detail = "all ok" if not bad else "; ".join(f"{f.path}: {s} ({f.known_id})" for f, s in bad)
    out.append(DoctorCheck("registry", not bad, f"{len(folders)} workflow folders; {detail}"))
    if host.registry.truncated:
        out.append(
            DoctorCheck(
                "registry-depth", False, f"walk stopped at depth limit under {host.registry.truncated[0]}"
            )
        )
    found = [lint.nesting_check(host.registry, folders)]
    if workflow_id is not None:
        found += lint.kb_link_checks(_readable_kbs(host, workflow_id))
    return out + [DoctorCheck(c.name, c.ok, c.detail) for c in found]


def _readable_kbs(host: Root, workflow_id: str) -> list[tuple[str, Path]]:
    """The KBs the workflow's sessions can read: its own and every available source's."""
    found = host.workflow(workflow_id)
    kbs: list[tuple[str, Path]] = [(f"own KB of {workflow_id}", found.folder.path / KB_DIR)]
    for att in host.resolve(found.manifest):
        if att.available and att.path is not None:
            kbs.append((f"source {att.alias} ({att.workflow_id})", att.path))
    return kbs


def _sandbox_checks(host: Root) -> list[DoctorCheck]:
    from kbd.sandbox.probe import containment, landlock_only_summary, layers, limits  # runs real sandboxes

    backend = host.config.sandbox.backend
    lay = layers(backend=backend)
    out = [
        DoctorCheck("bubblewrap", lay["bwrap"]["ok"] or backend == "landlock", lay["bwrap"]["detail"]),
        DoctorCheck("landlock", lay["landlock"]["abi"] > 0, f"Landlock {lay['landlock']['detail']}"),
        DoctorCheck("read sessions", lay["usable"], lay["read_sessions"]),
        DoctorCheck("write sessions", not lay["write_sessions"].startswith("REFUSED"), lay["write_sessions"]),
        # Said whatever the backend: what would still run if bubblewrap went away.
        DoctorCheck("landlock-only kinds", True, landlock_only_summary()),
        DoctorCheck("containment", *containment(bwrap_ok=lay["bwrap"]["ok"], backend=backend)),
        # Informational: commands run either way; only their refusal reports depend on it.
        DoctorCheck("refusal reports", True, _refusal_reports(host)),
    ]
    # Informational: an unenforceable limit is reported, never a failure of the
    # root; a limit kbd exec would refuse to run under is one.
    out += [
        DoctorCheck(f"limit {key}", not detail.startswith("REFUSED"), detail)
        for key, detail in limits(host.config.limits).items()
    ]
    return out


def _refusal_reports(host: Root) -> str:
    """Whether ``kbd exec`` can say what a command's Landlock layers refused (docs/sandbox.md
    "Refusals the kernel reports"), as this process sees it."""
    if not host.config.sandbox.report_denials:
        return "off (sandbox.report_denials: false in kbd.yaml)"
    from kbd.sandbox.denials import unavailable

    why = unavailable()
    if why is not None:
        return f"unavailable: {why}; kbd exec reports none (its --json says why)"
    return (
        "available: kbd exec lists what Landlock refused after each command (Landlock alone: every refusal; "
        "under bubblewrap, the inner layer's: its mounts refuse with EROFS and ENOENT, which the kernel does not report)"
    )


# -- validate ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Validation(Record):
    """Every problem of a workflow.json (syntax and field rules, not reachability).

    Its JSON is written by hand (docs/architecture.md "Typed operations"): ``entries`` (the CLI's count of
    sources) is not in it, and ``valid`` stands between the fields."""

    file: str
    workflow_id: str | None
    version: str | None
    entries: int
    problems: tuple[str, ...]

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> JsonObject:
        return {"file": self.file, "workflow_id": self.workflow_id, "valid": self.valid,
                "problems": list(self.problems), "version": self.version}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str = "") -> Validation:
        """The validation ``data`` spells (``entries``, never written: 0)."""
        k = _VALIDATION.read(cls, data, where)
        return cls(k["file"], k["workflow_id"], k["version"], 0, tuple(k["problems"]))

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _VALIDATION.schema(cls, defs)


_VALIDATION = Keys(lambda: {"file": str, "workflow_id": str | None, "valid": bool, "problems": list[str],
                            "version": str | None})  # fmt: skip


def unreadable_json(file: Path, err: KbdError) -> JsonObject:
    """``kbd validate --json``'s answer for a file that could not be checked at all."""
    return {"file": str(file), "workflow_id": None, "valid": False, "problems": [err.message], "version": None,
            "error": err.to_dict()}  # fmt: skip


def validate(file: Path) -> Validation:
    """Every problem of ``file``: each top-level field's, else each entry's and
    grant's; KbdError when it cannot be read or is not a JSON object at all."""
    data = _read_manifest(file)
    doc = manifest_document(data, name=file.name)
    if problems := field_problems(doc, name=file.name):
        wid = doc.get("id") if id_problem(doc.get("id")) is None else None
        return Validation(str(file), wid, version_of(data), 0, tuple(problems))
    m = parse_manifest(data)
    return Validation(str(file), m.id, m.version, len(m.entries), tuple(manifest_problems(m)))


def _read_manifest(file: Path) -> bytes:
    try:
        # Non-blocking and checked before reading: a FIFO or a device never hangs validate.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise NotFound(f"{file} does not exist", hint="pass the path of a workflow.json file") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidInput(f"{file} is not a regular file")
        return fh.read(MAX_MANIFEST_BYTES + 1)


def manifest_problems(m: Manifest) -> list[str]:
    """Every problem of every entry (not only the first one the lookup keeps),
    of the writer grants and of the folder grants."""
    raw_entries = m.raw.get("knowledgebase_sources") or []
    problems: list[str] = []
    for e in m.entries:
        if e.problem:
            own = entry_problems(raw_entries[e.index], self_id=m.id)
            problems += [f"knowledgebase_sources[{e.index}]: {p}" for p in own or [e.problem]]
    problems += writer_problems(m.raw, self_id=m.id)
    # The rules alone (no approved roots, nothing opened): a file being validated
    # may not belong to this host at all.
    for i, f in enumerate(check_folders(m.raw.get("folder_access"), roots=())):
        if isinstance(f, FolderStatus) and f.reason == "invalid_entry":
            problems.append(f"folder_access[{i}]: {f.message}")
    return problems


# -- principals -------------------------------------------------------------------------


@dataclass(frozen=True)
class PrincipalRow(Record):
    """A principal as ``kbd principals list`` shows it (whether it has a token, never the token)."""

    id: str
    kind: str
    admin: bool
    disabled: bool
    uid: int | None
    has_token: bool
    label: str | None

    @classmethod
    def of(cls, p: Principal) -> PrincipalRow:
        return cls(p.id, p.kind, p.admin, p.disabled, p.uid, p.token_sha256 is not None, p.label)


@dataclass(frozen=True)
class PrincipalList(Record):
    principals: tuple[PrincipalRow, ...]


# -- the daemon's own counters ---------------------------------------------------------------


@dataclass(frozen=True)
class Metrics(Record):
    requests: dict[str, int]  # by first path segment after /v1
    registry_scans: int
    open_sessions: int


def may_see_metrics(*, actor: Principal) -> None:
    """PermissionDenied unless ``actor`` is an enabled admin or a service (cheap:
    the daemon asks before it waits for its state lock)."""
    if not (actor.enabled_admin or actor.is_service):
        raise PermissionDenied("metrics are for admins and services", hint="ask an operator")


def metrics(sessions: RootSessions, *, actor: Principal, requests: dict[str, int]) -> Metrics:
    """Host-wide counters, for operators only (admins and services): they
    reveal how busy the host is, not what any workflow holds."""
    may_see_metrics(actor=actor)
    return Metrics(requests, sessions.host.registry.scans, len(sessions.store.rows()))


# -- health --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Health(Record):
    """The daemon is up: on which host, for how long (anyone may ask)."""

    status: Literal["ok"] = field(init=False, metadata=key(computed=True))
    host: str
    uptime_seconds: float  # to a tenth of a second

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", "ok")
        object.__setattr__(self, "uptime_seconds", round(self.uptime_seconds, 1))


def health(host: Root, *, started: float, now: float) -> Health:
    return Health(host.config.host, now - started)


# -- the audit log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditRecords(Record):
    events: tuple[JsonObject, ...]
    skipped_lines: int  # torn lines that are not a JSON record


@dataclass(frozen=True)
class AuditChunk(Record):
    """The complete records from byte ``offset`` of the log on (at most
    AUDIT_CHUNK_BYTES of it), unselected, and the offset the next chunk starts
    at: a line still being written is left for the next one."""

    events: tuple[JsonObject, ...]
    skipped_lines: int
    offset: int


AUDIT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class AuditScope:
    """One workflow's records (docs/access.md "The audit log"): those that name
    ``workflow`` as consumer, source or target, and those of its sessions (the
    store keeps every session, closed ones included)."""

    workflow: str
    sessions: frozenset[str]

    def wants(self, record: JsonObject) -> bool:
        if any(record.get(k) == self.workflow for k in audit.WORKFLOW_FIELDS):
            return True
        session = record.get("session")
        return isinstance(session, str) and session in self.sessions


def audit_scope(sessions: RootSessions, *, actor: Actor, workflow: str | None) -> AuditScope | None:
    """Which records of the audit log ``actor`` reads: ``workflow``'s, when it
    names one, else all (None). The root's operator (who can read the file
    anyway) and admins may read any workflow's, a removed one's too; anyone
    else only the records of a workflow it owns. Needs the registry and the
    session store (the daemon holds its state lock); the log itself is read
    without it."""
    principal = actor if isinstance(actor, Principal) and not actor.enabled_admin else None
    if workflow is None:
        if principal is None:
            return None
        raise PermissionDenied(
            f"principal {principal.id!r} may read only the audit records of workflows it owns",
            hint="name one: kbd audit --workflow WF (admins read the whole log)",
        )
    if principal is not None:
        from kbd.service.workflows import inspectable

        found = inspectable(sessions.host, workflow, actor=principal)  # an outsider learns nothing: not found
        if principal.disabled or principal.id not in found.manifest.effective_owners:
            raise PermissionDenied(
                f"principal {principal.id!r} does not own workflow {workflow!r}, so it may not read its audit "
                "records",
                hint="its owners and the admins may",
            )
    rows = sessions.store.rows(workflow_id=workflow, include_closed=True)
    return AuditScope(workflow, frozenset(r.id for r in rows))


def audit_chunk(host: Root, *, offset: int, scope: AuditScope | None) -> AuditChunk:
    """The chunk at ``offset``, only the records ``scope`` wants (all: None).
    Skipped records still move the offset on: the next chunk starts after them."""
    if offset < 0:
        raise InvalidInput(f"offset must be 0 or more, not {offset}")
    tail = audit.Tail(host.config.state_dir, offset=offset)
    events = tail.poll(max_bytes=AUDIT_CHUNK_BYTES)
    if scope is not None:
        events = [e for e in events if scope.wants(e)]
    if len(tail.pending) >= AUDIT_CHUNK_BYTES:
        # One "line" longer than a chunk is no record kbd wrote: skip it as torn,
        # or no reader could ever get past it.
        return AuditChunk(tuple(events), tail.torn + 1, tail.offset)
    return AuditChunk(tuple(events), tail.torn, tail.offset - len(tail.pending))


class AuditFeed:
    """The audit log as ``kbd audit`` shows it: the records a selection wants
    (at or after ``since``, touching ``workflow``), first all that are there,
    then at each :meth:`poll` those appended since. ``chunk(offset)`` reads the
    log (:func:`audit_chunk`, on the root or through the daemon); the selection
    is made here, as it learns a workflow's sessions from the records it sees."""

    def __init__(
        self, chunk: Callable[[int], AuditChunk], *, since: datetime | None, workflow: str | None,
        actor: str | None = None, events: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self._chunk = chunk
        self._offset = 0
        self._select = audit.Selection(since=since, workflow=workflow, actor=actor, events=events)
        self.skipped_lines = 0

    def poll(self) -> list[JsonObject]:
        out: list[JsonObject] = []
        while True:
            got = self._chunk(self._offset)
            self.skipped_lines += got.skipped_lines
            out += [e for e in got.events if self._select.wants(e)]
            moved, self._offset = got.offset != self._offset, got.offset
            # A chunk the server selected nothing from (an owner's view) still moves on:
            # only an offset that stays put means the end of the log so far.
            if not moved:
                return out

    def records(self) -> AuditRecords:
        """Everything there now, as one result."""
        return AuditRecords(tuple(self.poll()), self.skipped_lines)
