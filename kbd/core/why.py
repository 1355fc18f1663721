"""Why a session may or may not touch a path, and the smallest change that would
let it (docs/access.md "Why: explaining a decision"). Pure.

The verdict is never decided here: it is the path guard's (:func:`kbd.core.pathguard.decide`
followed by the file system's link check), handed in, so ``kbd why`` and ``kbd check`` cannot
disagree. This module only explains it: which element of the plan allows the path, or every
reason it is refused, in the documented order, and a fix.

A fix is found by trying it, not by a second copy of the rules: each candidate change (a session
opened with another ``--kb-access``, the attachment made writable, the writer granted, the source
attached) is applied to the plan's inputs, the plan is built again with
:func:`kbd.core.plan.build_plan`, and the path guard judges the path under it. Only a change that
makes the path allowed is offered; a path no change can open (hidden, protected) has no fix.

What the caller may learn is decided by the service (:mod:`kbd.service.why`) before the facts
reach this module: a source's owners, a workflow the path lies in, the audience members a source
does not admit are in :class:`Facts` only where the caller could already see them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

from kbd.core import pathguard
from kbd.core.identifiers import ALIAS_RE
from kbd.core.layout import INDEX_NAME, KB_DIR, MANIFEST, NOTES_DIR
from kbd.core.pathguard import LinkCheckNeeded, PathCheck
from kbd.core.plan import Plan, build_plan
from kbd.core.records import Record, key
from kbd.core.relpaths import is_index_name, note_parts
from kbd.core.resolve import WRITE_NOT_GRANTED, Attachment, WriteStatus
from kbd.errors import KbdError

if TYPE_CHECKING:
    from kbd.core.policy import KindPolicy

# Reason codes, in the order a refusal lists them (docs/access.md "Why: explaining a decision").
REASON_ORDER = (
    "invalid_path",
    "not_attached",
    "attachment_unavailable",
    "folder_unavailable",
    "kb_access",
    "kind",
    "hidden",
    "protected",
    "read_only_attachment",
    "write_not_granted",
    "notes_unavailable",
    "read_only_folder",
    "invalid_name",
    "symlink",
    "outside_grants",
)
NEVER = "nothing: this path is never granted"


@dataclass(frozen=True)
class GrantedBy(Record):
    """The plan element that allows the path."""

    kind: Literal["own", "source", "folder"]
    alias: str | None = field(default=None, metadata=key(omit_none=True))
    workflow_id: str | None = field(default=None, metadata=key(omit_none=True))


@dataclass(frozen=True)
class Reason(Record):
    """One reason a path or an attachment is refused."""

    code: str
    message: str


@dataclass(frozen=True)
class FixStep(Record):
    """One command of a fix, and who may run it (empty: anyone who may make that change)."""

    command: str
    by: tuple[str, ...]


@dataclass(frozen=True)
class Fix(Record):
    """The smallest change that allows the question: its first command and who may run it,
    and every step (a fix may need two people: the consumer's manager and the source's owner)."""

    command: str
    by: tuple[str, ...]
    steps: tuple[FixStep, ...]


@dataclass(frozen=True)
class Why(Record):
    """The answer of ``kbd why`` (docs/access.md "Why: explaining a decision")."""

    path: str | None
    mode: str
    allowed: bool
    granted_by: GrantedBy | None
    reasons: tuple[Reason, ...]
    fix: Fix | None
    #: When there is no fix: why not (``nothing: this path is never granted``, or what only an
    #: operator can change); None when allowed or when a fix is given.
    no_fix: str | None = field(default=None, metadata=key(omit_none=True))


def make_fix(steps: list[FixStep]) -> Fix | None:
    return Fix(steps[0].command, steps[0].by, tuple(steps)) if steps else None


# -- what the caller may know (filled in by kbd.service.why) -------------------------------------


@dataclass(frozen=True)
class SourceFacts:
    """A workflow the explanation may name. ``owners`` and ``missing`` are None where the caller
    may not see them (then a fix names no one)."""

    workflow_id: str
    folder: Path | None
    owners: tuple[str, ...] | None
    legacy: bool
    #: Audience members of the consumer this source does not admit (for ``audience_denied``).
    missing: tuple[str, ...] | None = None
    #: The write status the consumer's entry would have with access write.
    write: WriteStatus | None = None


@dataclass(frozen=True)
class Facts:
    """Everything :func:`explain` reads besides the plan."""

    policy: KindPolicy
    item_kb_write: bool
    #: Who may manage the consumer's sources and open its sessions (owners, editors).
    managers: tuple[str, ...]
    #: Attached sources, by workflow ID (visible parts only).
    sources: Mapping[str, SourceFacts]
    #: An unattached workflow whose folder holds the path, when the caller may see it, with
    #: the attachment it would get (resolved as a prospective entry).
    elsewhere: tuple[SourceFacts, Attachment] | None = None
    #: Leave principals' names out of fixes (an agent's ``kb_why`` names none).
    anonymous: bool = False


# -- where the asked path points -----------------------------------------------------------------

_VAR = re.compile(r"^\$(?:\{(?P<braced>[A-Z][A-Z0-9_]*)\}|(?P<bare>[A-Z][A-Z0-9_]*))(?P<rest>/.*)?$")
_ALIASED = re.compile(r"^(?P<alias>[a-z][a-z0-9_]{0,47}):(?P<rest>.*)$", re.S)


@dataclass(frozen=True)
class Located:
    """What the asked spelling names: a host path, or an attachment that has none now."""

    path: str | None
    attachment: Attachment | None = None
    problem: Reason | None = None
    #: With an attachment and no path: the path asked for below its KB.
    rel: str = ""


def locate(plan: Plan, asked: str) -> Located:
    """``asked`` as a host path: a host or sandbox path (the sandbox binds every grant at its host
    path), a path relative to the workflow folder (a command's default working folder),
    ``$WORKFLOW_KB_<ALIAS>/…`` (or any variable of the plan) or ``ALIAS:RELPATH``."""
    if (m := _VAR.match(asked)) is not None:
        name = m.group("braced") or m.group("bare")
        rest = m.group("rest") or ""
        if name in plan.env and plan.env[name].startswith("/"):
            return Located(plan.env[name] + rest)
        att = next((a for a in plan.sources if a.env == name), None)
        if att is not None:
            # Attached, but not in this session's environment: its mode reads and writes nothing there.
            return Located(None if att.path is None else f"{att.path}{rest}", att, rel=rest.lstrip("/"))
        return Located(None, problem=Reason("not_attached", f"this session has no variable ${name}"))
    if (m := _ALIASED.match(asked)) is not None and ALIAS_RE.fullmatch(m.group("alias")):
        alias, rest = m.group("alias"), m.group("rest").lstrip("/")
        att = next((a for a in plan.sources if a.alias == alias), None)
        if att is None:
            attached = ", ".join(a.alias for a in plan.sources) or "none"
            return Located(None, problem=Reason(
                "not_attached", f"{plan.workflow_id} has no attachment {alias!r} (attached: {attached})"))  # fmt: skip
        if att.path is None:
            return Located(None, att, rel=rest)
        return Located(f"{att.path}/{rest}" if rest else str(att.path), att)
    if asked and not asked.startswith("/"):
        return Located(f"{plan.workflow_folder}/{asked}")
    return Located(asked)


# -- the explanation -----------------------------------------------------------------------------


def explain(plan: Plan, asked: str, mode: str, verdict: PathCheck | None, facts: Facts) -> Why:
    """The answer for ``asked`` (as spelled) under ``plan``: ``verdict`` is the path guard's for
    the located path (None when ``asked`` names no host path: then it is refused)."""
    where = locate(plan, asked)
    if verdict is not None and verdict.allowed:
        assert where.path is not None
        return Why(asked, mode, True, _granted_by(plan, where.path, mode), (), None)
    reasons, steps, no_fix = _refusal(plan, where, mode, verdict, facts)
    if not reasons:  # the guard refused for a reason not classified above: say its words
        reasons = [Reason("outside_grants", verdict.reason if verdict is not None else "not granted")]
    ordered = tuple(sorted(reasons, key=lambda r: REASON_ORDER.index(r.code)))
    fix = None if no_fix is not None else make_fix(steps)
    if fix is None and no_fix is None:
        no_fix = "no change kbd can make allows it"
    return Why(asked, mode, False, None, ordered, fix, no_fix)


def _granted_by(plan: Plan, path: str, mode: str) -> GrantedBy:
    decided = pathguard.decide(plan, path, mode)
    assert isinstance(decided, LinkCheckNeeded), "an allowed path has a deciding grant"
    origin = decided.grant.origin
    if origin.kind in ("kb", "kb_write"):
        att = next(a for a in plan.sources if a.alias == origin.alias)
        return GrantedBy("source", origin.alias, att.workflow_id)
    if origin.kind == "folder":
        return GrantedBy("folder", origin.alias)
    return GrantedBy("own", workflow_id=plan.workflow_id)


Refusal = tuple[list[Reason], list[FixStep], "str | None"]


def _refusal(plan: Plan, where: Located, mode: str, verdict: PathCheck | None, facts: Facts) -> Refusal:
    if where.problem is not None:
        return [where.problem], [], None
    if where.path is None:
        assert where.attachment is not None
        return _attachment(plan, where.attachment, where.rel, mode, facts)
    target = where.path
    pure = PurePosixPath(target)
    if not target.startswith("/") or ".." in pure.parts or "\x00" in target:
        reason = verdict.reason if verdict is not None else "path must be absolute"
        return (
            [Reason("invalid_path", reason)],
            [],
            "nothing: name the path without '..', as an absolute path",
        )
    path = Path(pure)
    for att in plan.sources:
        if att.path is not None and _under(path, att.path.parent):
            rel = None if not _under(path, att.path) else _rel(path, att.path)
            return _attachment(plan, att, rel, mode, facts, verdict)
    for att in plan.sources:
        src = facts.sources.get(att.workflow_id)
        if att.path is None and src is not None and src.folder is not None and _under(path, src.folder):
            kb = src.folder / KB_DIR
            return _attachment(plan, att, _rel(path, kb) if _under(path, kb) else None, mode, facts)
    if _under(path, plan.workflow_folder):
        return _own(plan, path, mode, facts, verdict)
    for f in plan.folders:
        if f.path is not None and _under(path, f.path):
            if f.available and mode == "write" and f.access != "read_write":
                return [Reason("read_only_folder", f"folder grant {f.alias} is read-only "
                               "(folder_access in the workflow's workflow.json)")], [], \
                    "only a change of the workflow's folder_access in its workflow.json"  # fmt: skip
            if not f.available:
                return [Reason("folder_unavailable", f"folder grant {f.alias} is unavailable: {f.reason}")], [], \
                    "only the folder grant's owner or an operator"  # fmt: skip
            return _guard_reason(verdict), [], None
    if facts.elsewhere is not None:
        src, att = facts.elsewhere
        if src.folder is not None and _under(path, src.folder):
            return _not_attached(plan, path, mode, src, att, facts)
    return [Reason("outside_grants", "not granted to this session (inside the sandbox, system folders are "
                   "read-only and /tmp is private to each command)")], [], NEVER  # fmt: skip


def _guard_reason(verdict: PathCheck | None) -> list[Reason]:
    """The link check's or the note-name rule's refusal of a path the grants cover."""
    if verdict is None:
        return []
    code = "symlink" if "link" in verdict.reason else "invalid_name"
    return [Reason(code, verdict.reason)]


def _attachment(
    plan: Plan,
    att: Attachment,
    rel: str | None,
    mode: str,
    facts: Facts,
    verdict: PathCheck | None = None,
    src: SourceFacts | None = None,
) -> Refusal:
    """``rel``: the path below the source's KB (None: outside it, in the source's own folder);
    ``src``: the source's facts when it is not one of the plan's attachments."""
    src = src or facts.sources.get(att.workflow_id)
    if rel is None and (att.path is not None or (src is not None and src.folder is not None)):
        return (
            [Reason("hidden", f"{att.workflow_id}'s own folder: only its {KB_DIR}/ is ever shared")],
            [],
            NEVER,
        )
    if rel is not None and (never := _never(rel, mode)) is not None:
        return [never], [], NEVER
    if mode == "write" and rel is not None and _protected(rel):
        # Never writable whatever else changes: the one reason that matters.
        return [Reason("protected", f"{rel or 'the KB root'} is {att.workflow_id}'s own: only notes/ of an "
                       f"attached source is ever writable, never notes/{INDEX_NAME}")], [], NEVER  # fmt: skip
    reasons, steps, no_fix = _status(plan.workflow_id, att, src, mode, facts)
    kb = att.path or (src.folder / KB_DIR if src is not None and src.folder is not None else None)
    if kb is not None:
        fixed = _fixed(att, kb, mode)
        others = tuple(a for a in plan.sources if a.alias != att.alias)
        mode_steps, mode_reason = _session_mode(plan, facts, _probe(kb, mode), mode, (*others, fixed))
        if mode_reason is not None:
            reasons.append(mode_reason)
            if mode_steps is None:
                no_fix = f"nothing in a session of kind {plan.kind}: its kind decides"
            else:
                steps += mode_steps  # last: the question is then asked in the new session
    if not reasons:
        reasons = _guard_reason(verdict)
        if reasons:
            no_fix = "nothing: name a file kbd accepts (docs/access.md \"Names\")" \
                if reasons[0].code == "invalid_name" else NEVER  # fmt: skip
    return reasons, steps, no_fix


def _status(consumer: str, att: Attachment, src: SourceFacts | None, mode: str, facts: Facts) -> Refusal:
    """What the attachment's own status refuses for ``mode``: unavailable, attached read-only,
    writing not granted by the source's owner; and the steps that would change it."""
    head = f"{att.alias} ({att.workflow_id})"
    reasons: list[Reason] = []
    steps: list[FixStep] = []
    no_fix: str | None = None
    if not att.available:
        message = f"{head} is unavailable: {att.reason}: {att.message}"
        if att.reason == "audience_denied" and src is not None and src.missing:
            message += f" (the source does not admit {', '.join(src.missing)})"
            steps.append(_readers_step(src, facts))
        else:
            return [Reason("attachment_unavailable", message)], steps, _unavailable_remedy(att.reason)
        # Once admitted, the attachment's write status is what stands in the way (the service
        # resolved it as if available: SourceFacts.write).
        reasons.append(Reason("attachment_unavailable", message))
    if mode != "write":
        return reasons, steps, no_fix
    if att.access == "read":
        reasons.append(
            Reason("read_only_attachment", f"{head} is attached read-only in {consumer}'s workflow.json")
        )
        steps.append(_step(["sources", "access", consumer, att.alias, "write"], facts.managers, facts))
    # The write status the entry has (access write and available), or would have (the service's facts).
    status = (
        att.write if att.access == "write" and att.available else (src.write if src is not None else None)
    )
    if status is None or status.available:
        return reasons, steps, no_fix
    if status.reason == WRITE_NOT_GRANTED:
        reasons.append(Reason("write_not_granted", status.message or f"{att.workflow_id}'s owner has not granted "
                              f"{consumer} write access"))  # fmt: skip
        if src is None or src.legacy:
            no_fix = f"{att.workflow_id} has no owner who could grant writing its notes/"
        else:
            steps.append(_writers_step(att.workflow_id, consumer, src, facts))
    else:
        reasons.append(Reason("notes_unavailable", f"{head}: {status.message or status.reason}"))
        no_fix = "only the source's owner, by repairing its notes/ folder"
    return reasons, steps, no_fix


def _never(rel: str, mode: str) -> Reason | None:
    """A path below a KB that no change could open, judged before any fix is offered: ``..``
    (invalid_path), or, for a write, a name ``kbd notes write`` refuses (invalid_name)."""
    parts = rel.split("/")
    if ".." in parts:
        return Reason("invalid_path", "path must not contain '..'")
    if mode == "write" and parts[:1] == [NOTES_DIR] and len(parts) > 1 and not _protected(rel):
        try:
            note_parts("/".join(parts[1:]))
        except KbdError as err:
            return Reason("invalid_name", err.message)
    return None


def _protected(rel: str) -> bool:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    return (
        not parts or parts[0] != NOTES_DIR or len(parts) == 1 or (len(parts) == 2 and is_index_name(parts[1]))
    )


def _unavailable_remedy(reason: str | None) -> str:
    return {
        "not_found": "only creating the source again, or detaching it",
        "ambiguous_id": "only an operator removing the extra workflow.json",
        "manifest_unreadable": "only repairing the source's workflow.json",
        "other_host": "only fleet mode (docs/fleet.md)",
        "audience_denied": "only the source's owners, by admitting the consumer's whole audience",
        "invalid_entry": "only repairing the entry in the consumer's workflow.json",
    }.get(reason or "", "only the source's owner, by repairing its knowledgebase/ folder")


def _session_mode(
    plan: Plan, facts: Facts, probe: str, mode: str, attachments: tuple[Attachment, ...]
) -> tuple[list[FixStep] | None, Reason | None]:
    """Does the session's ``--kb-access`` (or a missing ``--item-kb-write``) or its kind stand in
    the way of ``mode`` at ``probe`` (with ``attachments`` as they would be once their own refusals
    are fixed)? Decided by building the plan again (see the module): no reason when the session as
    it is allows it; else the smallest new session that would (a fix), or the kind (no fix: the
    consumer kind's policy, policies/consumer_kinds.yaml, decides)."""

    def allows(kb_access: str, item: bool) -> bool:
        other = build_plan(workflow_id=plan.workflow_id, workflow_folder=plan.workflow_folder, policy=facts.policy,
                           kb_access=kb_access, item_kb_write=item, attachments=list(attachments),
                           folders=list(plan.folders))  # fmt: skip
        return isinstance(pathguard.decide(other, probe, mode), LinkCheckNeeded)

    if allows(plan.kb_access, facts.item_kb_write):
        return [], None
    requested = "" if plan.effective == plan.kb_access else f", requested {plan.kb_access}"
    items = (
        (facts.item_kb_write,) if facts.item_kb_write or not facts.policy.needs_item_flag else (False, True)
    )
    for item in items:
        for candidate in ("read", "read-write", "write"):
            if (candidate, item) == (plan.kb_access, facts.item_kb_write) or not allows(candidate, item):
                continue
            argv = ["session", "open", plan.workflow_id, "--kind", plan.kind, "--kb-access", candidate]
            flag = ["--item-kb-write"] if item else []
            said = f"--kb-access {candidate}" + (
                " --item-kb-write" if item and not facts.item_kb_write else ""
            )
            return [_step(argv + flag, facts.managers, facts)], Reason(
                "kb_access", f"this session's knowledge-base access is {plan.effective}{requested}; a new "
                f"session with {said} would allow it")  # fmt: skip
    return None, Reason("kind", f"no {plan.kind} session may {mode} this (effective access {plan.effective}"
                        f"{requested}): the kind's policy decides")  # fmt: skip


def _fixed(att: Attachment, kb: Path, mode: str) -> Attachment:
    """``att`` as it would be once its own refusals are fixed (available at ``kb``, writable for a write)."""
    write = WriteStatus(True, None) if mode == "write" else att.write
    access = "write" if mode == "write" else att.access
    return replace(att, available=True, reason=None, message=None, path=kb, access=access, write=write)


def _probe(kb: Path, mode: str) -> str:
    """A path standing for "this source's KB" to the mode check: its root for a read, a note for a
    write (the note-name rule is the verdict's business, not the session's)."""
    return f"{kb}/{NOTES_DIR}/why.md" if mode == "write" else str(kb)


def _own(plan: Plan, path: Path, mode: str, facts: Facts, verdict: PathCheck | None) -> Refusal:
    rel = _rel(path, plan.workflow_folder)
    if rel == MANIFEST and mode == "write":
        return [Reason("protected", f"{plan.workflow_id}'s workflow.json is never writable in a session "
                       "(kbd sources and kbd writers change it)")], [], NEVER  # fmt: skip
    if isinstance(pathguard.decide(plan, str(path), mode), LinkCheckNeeded):
        return _guard_reason(verdict), [], NEVER
    steps, reason = _session_mode(plan, facts, str(path), mode, plan.sources)
    assert reason is not None, "the grants refuse it, so the session's mode does"
    return [reason], steps or [], None if steps is not None else f"nothing in a session of kind {plan.kind}"


def _not_attached(
    plan: Plan, path: Path, mode: str, src: SourceFacts, att: Attachment, facts: Facts
) -> Refusal:
    """A path in a workflow the caller may see that the session's workflow has not attached:
    ``att`` is the attachment it would get (resolved as a prospective entry with the access
    ``mode`` needs)."""
    kb = src.folder / KB_DIR if src.folder is not None else None
    if kb is None or not _under(path, kb):
        return (
            [Reason("hidden", f"{src.workflow_id}'s own folder: only its {KB_DIR}/ is ever shared")],
            [],
            NEVER,
        )
    attach = ["sources", "attach", plan.workflow_id, src.workflow_id, "--alias", att.alias]
    steps = [
        _step([*attach, *(["--access", "write"] if att.access == "write" else [])], facts.managers, facts)
    ]
    more, more_steps, no_fix = _attachment(plan, att, _rel(path, kb), mode, facts, src=src)
    reasons = [Reason("not_attached", f"{src.workflow_id}'s knowledge base is not attached to {plan.workflow_id}"),
               *more]  # fmt: skip
    return reasons, steps + more_steps, no_fix


def _readers_step(src: SourceFacts, facts: Facts) -> FixStep:
    owners = src.owners or ()
    return _step(["readers", "grant", src.workflow_id, *(src.missing or ())], owners, facts)


def _writers_step(source: str, consumer: str, src: SourceFacts | None, facts: Facts) -> FixStep:
    owners = src.owners if src is not None and src.owners is not None else ()
    return _step(["writers", "grant", source, consumer], owners, facts)


def _step(argv: list[str], by: tuple[str, ...], facts: Facts) -> FixStep:
    """One fix step: ``kbd ARGV`` run as the first of ``by`` (who may run it), every word quoted
    for a shell: IDs come from manifests, and a fix is meant to be pasted."""
    names = _names(by, facts)
    words = ["kbd", *argv, *(["--as", names[0]] if names else [])]
    return FixStep(" ".join(shlex.quote(w) for w in words), names)


def _names(by: tuple[str, ...], facts: Facts) -> tuple[str, ...]:
    return () if facts.anonymous else tuple(by)


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _rel(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder)) if path != folder else ""


# -- a prospective attachment ----------------------------------------------------------------------


def explain_attach(consumer_id: str, source: SourceFacts | None, att: Attachment | None, access: str,
                   facts: Facts) -> Why:  # fmt: skip
    """``kbd why attach``: would ``source`` attached to ``consumer_id`` with ``access`` be usable?
    ``source`` None: not found or not visible to the caller (one answer for both)."""
    if source is None or att is None:
        return Why(None, access, False, None, (Reason("not_found", "no such workflow"),), None,
                   "nothing: no workflow you can see has this ID")  # fmt: skip
    reasons, steps, no_fix = _status(consumer_id, att, source, access, facts)
    if not reasons:
        return Why(None, access, True, GrantedBy("source", att.alias, source.workflow_id), (), None)
    fix = None if no_fix is not None else make_fix(steps)
    return Why(None, access, False, None, tuple(reasons), fix, no_fix)
