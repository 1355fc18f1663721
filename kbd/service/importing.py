"""``kbd import WF DIR``: Markdown documents into a workflow's own
``knowledgebase/context/`` (docs/search.md "Importing markdown").

The operation takes *documents* (names relative to the imported folder, and
their bytes), never a path: the folder is read by whoever runs the command, as
themselves (:func:`kbd.fs.importing.read_folder`, in the CLI), and through the
daemon only the bytes travel. A daemon that opened a path of its caller's
choosing would read it as root for them: a confused deputy.

Only an owner or editor of WF (an admin; any account on a legacy workflow: the
rule for managing a workflow, :func:`kbd.core.audience.can_manage_sources`) may
import; others get 77, or 66 when they may not see WF. Writes go only beneath
WF's own ``knowledgebase/context/`` (the KB pinned with the identity the
registry saw), under the workflow's import lock, each one atomic and confined
(:mod:`kbd.fs.importing`); what each document becomes is decided by the pure
rules in :mod:`kbd.core.importing`. A bad document is reported, never fatal.
One audit record per import (``import``, with counts); a refusal is audited
too (``import_refused``).

Split in two steps for the daemon: :func:`target` needs the registry (under
its state lock); :func:`apply` only touches files (outside it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kbd.core import audience
from kbd.core import importing as rules
from kbd.core.layout import KB_DIR
from kbd.core.principals import Principal
from kbd.core.records import Record
from kbd.errors import InvalidInput, KbdError, PermissionDenied, SourceUnavailable, from_oserror
from kbd.fs import importing as disk
from kbd.fs.confined import pin_dir
from kbd.fs.locks import held
from kbd.service.root import Root

#: Documents (and reader-skipped entries) one call takes: the CLI sends larger imports in batches.
MAX_DOCS_PER_CALL = 2_000
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Imported(Record):
    """One document placed (or that would be, in a dry run): where from, where to, its title."""

    file: str
    path: str  # relative to the workflow's KB root
    title: str


@dataclass(frozen=True)
class Skipped(Record):
    file: str
    reason: str

    def __post_init__(self) -> None:
        # A name that is not UTF-8 is kept escaped, never as a lone surrogate
        # no JSON encoder or terminal takes (docs/search.md "Importing markdown").
        object.__setattr__(self, "file", rules.shown(self.file))
        object.__setattr__(self, "reason", rules.shown(self.reason))


@dataclass(frozen=True)
class ImportResult(Record):
    workflow_id: str
    dry_run: bool
    created: tuple[Imported, ...]
    updated: tuple[Imported, ...]
    unchanged: tuple[Imported, ...]
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class Target:
    """A workflow an actor may import into, as the registry sees it now."""

    host: Root
    workflow_id: str
    kb_path: Path
    kb_identity: tuple[int, int]
    actor: Principal


def target(host: Root, wid: str, *, actor: Principal) -> Target:
    """May ``actor`` import into ``wid``, and where is its KB? Raises NotFound
    (66, also for an actor who may not see it), PermissionDenied (77),
    SourceUnavailable (69: no usable knowledgebase/). Refusals are audited."""
    try:
        found = host.workflow(wid)
        m = found.manifest
        audience.require_inspectable(actor, m, wid)
        if not audience.can_manage_sources(actor, m):
            raise PermissionDenied(
                f"only an owner or editor of {wid!r} may import into its knowledge base",
                hint=f"`kbd workflows show {wid}` lists its owners and editors",
            )
        probe = host.probe_kb(found.folder.path)
        if probe.problem is not None or probe.identity is None:
            reason = probe.problem.reason if probe.problem is not None else "kb_missing"
            message = probe.problem.message if probe.problem is not None else "no knowledgebase/"
            raise SourceUnavailable(f"{wid!r} has no usable knowledge base: {message}", reason=reason)
    except KbdError as err:
        host.audit_refusal("import_refused", err, actor=actor, workflow_id=wid[:200])
        raise
    return Target(host, m.id, found.folder.path / KB_DIR, probe.identity, actor)


def _checked_skips(skipped: Sequence[tuple[str, str]]) -> list[Skipped]:
    out: list[Skipped] = []
    for file, reason in skipped:
        if not isinstance(file, str) or not isinstance(reason, str):
            raise InvalidInput("skipped: each entry needs a string file and a string reason")
        out.append(Skipped(file[:4096], reason[:MAX_REASON_CHARS]))
    return out


def apply(
    t: Target,
    docs: Sequence[tuple[str, bytes]],
    *,
    folder: str,
    skipped: Sequence[tuple[str, str]] = (),
    dry_run: bool = False,
    update: bool = False,
) -> ImportResult:
    """Import ``docs`` (name relative to the imported folder, bytes) into the
    target's ``context/``; ``folder`` is the imported folder's own name (the
    container of documents directly in it); ``skipped`` are documents the
    reader already passed over (reported as they are). Nothing is written in a
    dry run; the lists are the same."""
    if len(docs) + len(skipped) > MAX_DOCS_PER_CALL:
        raise InvalidInput(
            f"documents: at most {MAX_DOCS_PER_CALL} documents and skipped entries in one call, "
            f"not {len(docs) + len(skipped)}",
            hint="send larger imports in batches (the CLI does)",
        )
    if not isinstance(folder, str) or len(folder) > 255 or "/" in folder or "\x00" in folder:
        raise InvalidInput("folder must be one folder name (no '/', at most 255 characters)")
    folder = rules.shown(folder)  # a container name that is not UTF-8 is used escaped
    out = _Outcomes(skipped=_checked_skips(skipped))
    planned: dict[str, rules.Doc] = {}
    for file, data in docs:
        if rules.undecodable(file):
            out.skipped.append(Skipped(file[:4096], "the file name is not valid UTF-8"))
            continue
        try:
            doc = rules.derive(file, data, folder=folder)
        except rules.Skip as skip:
            out.skipped.append(Skipped(file[:4096], skip.reason))
            continue
        first = planned.get(doc.path)
        if first is not None:
            out.skipped.append(Skipped(file, f"same target {doc.path} as {first.file} (imported first)"))
            continue
        planned[doc.path] = doc
    try:
        _write(t, list(planned.values()), out, dry_run=dry_run, update=update)
    except KbdError as err:
        t.host.audit_refusal("import_refused", err, actor=t.actor, workflow_id=t.workflow_id)
        raise
    except OSError as exc:
        failed = from_oserror(exc, what="import into context/")
        t.host.audit_refusal("import_refused", failed, actor=t.actor, workflow_id=t.workflow_id)
        raise failed from None
    result = ImportResult(t.workflow_id, dry_run, tuple(out.created), tuple(out.updated), tuple(out.unchanged),
                          tuple(out.skipped))  # fmt: skip
    t.host.audit("import", actor=t.actor.id, workflow_id=t.workflow_id, dry_run=dry_run, update=update,
                 created=len(result.created), updated=len(result.updated), unchanged=len(result.unchanged),
                 skipped=len(result.skipped))  # fmt: skip
    return result


@dataclass
class _Outcomes:
    skipped: list[Skipped]
    created: list[Imported] = field(default_factory=list)
    updated: list[Imported] = field(default_factory=list)
    unchanged: list[Imported] = field(default_factory=list)


def _write(t: Target, docs: list[rules.Doc], out: _Outcomes, *, dry_run: bool, update: bool) -> None:
    """Decide and (unless a dry run) write each document, holding the import
    lock of the workflow's KB so two imports never interleave their decisions."""
    config = t.host.config
    with pin_dir(t.kb_path, expect=t.kb_identity) as kb:
        lock = held(config.state_dir, "import", disk.kb_key(kb.fd), timeout=config.lock_timeout,
                    what=f"the knowledge base of {t.workflow_id!r}", who={"workflow": t.workflow_id})  # fmt: skip
        with lock, disk.open_context(kb.fd, create=not dry_run and bool(docs)) as ctx:
            for doc in docs:
                _, container, name = doc.path.split("/")
                try:
                    now = disk.existing(ctx, container, name)
                except KbdError as err:
                    out.skipped.append(Skipped(doc.file, f"{doc.path}: {err.message}"))
                    continue
                what, reason = rules.outcome(doc, now, update=update)
                if what == "skipped":
                    out.skipped.append(Skipped(doc.file, reason or "skipped"))
                    continue
                if what != "unchanged" and not dry_run:
                    assert ctx is not None
                    try:
                        disk.write_doc(ctx, container, name, doc.data)
                    except KbdError as err:
                        out.skipped.append(Skipped(doc.file, f"{doc.path}: {err.message}"))
                        continue
                row = Imported(doc.file, doc.path, doc.title)
                {"created": out.created, "updated": out.updated, "unchanged": out.unchanged}[what].append(row)


def import_docs(
    host: Root,
    wid: str,
    docs: Sequence[tuple[str, bytes]],
    *,
    folder: str,
    actor: Principal,
    skipped: Sequence[tuple[str, str]] = (),
    dry_run: bool = False,
    update: bool = False,
) -> ImportResult:
    """:func:`target` then :func:`apply` (the CLI on the root)."""
    return apply(target(host, wid, actor=actor), docs, folder=folder, skipped=skipped, dry_run=dry_run,
                 update=update)  # fmt: skip
