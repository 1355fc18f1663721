"""``kbd why``: the facts an explanation may use, gathered with the caller's visibility
(docs/access.md "Why: explaining a decision"); the explanation itself is pure
(:mod:`kbd.core.why`).

What the caller learns is decided here, before anything reaches the explainer: a source's owners,
the audience members it does not admit, and a workflow folder a path lies in that the session has
not attached are facts only where the caller may inspect that workflow
(:func:`kbd.core.audience.can_inspect`; the root's own operator sees everything). An agent's
``kb_why`` (``anonymous``) learns no principal and no workflow the session has not attached.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from kbd.core import audience
from kbd.core.identifiers import id_problem
from kbd.core.manifest import MAX_WRITERS, Manifest, SourceRef, validate_sources
from kbd.core.principals import Actor, LocalOperator, Principal
from kbd.core.resolve import Attachment, resolve_new
from kbd.core.why import Facts, SourceFacts, Why, explain, explain_attach, locate
from kbd.errors import InvalidInput
from kbd.fs import datafiles
from kbd.fs.registry import Found
from kbd.service.preview import WhatIf
from kbd.service.root import Root

if TYPE_CHECKING:
    from kbd.service.sessions import RootSessions

MODES = ("read", "write")


def why_path(sessions: RootSessions, sid: str, asked: str, mode: str, *, actor: Actor,
             anonymous: bool = False) -> Why:  # fmt: skip
    """Why session ``sid`` may or may not ``mode`` the path ``asked`` (any spelling
    :func:`kbd.core.why.locate` takes), and the smallest change that would allow it."""
    from kbd.service.sessions import check_path

    _check_mode(mode, "mode")
    if not isinstance(asked, str) or not asked or "\x00" in asked or not _encodes(asked):
        raise InvalidInput("path must be a non-empty string without NUL", hint="a host path, ALIAS:RELPATH or "
                           "$WORKFLOW_KB_<ALIAS>/RELPATH")  # fmt: skip
    plan = sessions.plan(sid, actor=actor)  # authorizes (refusals audited) and rebuilds
    row = sessions.store.get(sid)
    root = sessions.host
    consumer = root.workflow(plan.workflow_id).manifest
    where = locate(plan, asked)
    verdict = check_path(plan, where.path, mode) if where.path is not None else None
    sources = _LazySources({a.workflow_id: a for a in plan.sources},
                           lambda a: _source_facts(root, consumer, a, actor, anonymous))  # fmt: skip
    elsewhere = None
    if (
        where.path is not None
        and where.path.startswith("/")
        and not anonymous
        and not (verdict and verdict.allowed)
    ):
        elsewhere = _elsewhere(root, consumer, where.path, mode, actor, taken={a.alias for a in plan.sources})
    facts = Facts(
        policy=datafiles.consumer_kind(row.kind),
        item_kb_write=row.item_kb_write,
        managers=_usable(root, _managers(consumer)),
        sources=sources,
        elsewhere=elsewhere,
        anonymous=anonymous,
    )
    return explain(plan, asked, mode, verdict, facts)


class _LazySources(Mapping[str, SourceFacts]):
    """An attached source's facts, gathered when the explanation first asks for them: an allowed
    answer asks for none, a refusal for the one source it is about (each gathering probes the
    registry and the source's KB)."""

    def __init__(
        self, attachments: dict[str, Attachment], gather: Callable[[Attachment], SourceFacts | None]
    ) -> None:
        self._attachments, self._gather = attachments, gather
        self._known: dict[str, SourceFacts | None] = {}

    def __getitem__(self, wid: str) -> SourceFacts:
        if wid not in self._known:
            att = self._attachments[wid]  # KeyError: not attached, as a dict would say
            self._known[wid] = self._gather(att)
        found = self._known[wid]
        if found is None:
            raise KeyError(wid)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._attachments)

    def __len__(self) -> int:
        return len(self._attachments)


def why_attach(root: Root, wid: str, source_id: str, access: str, *, actor: Principal) -> Why:
    """Would attaching ``source_id`` to ``wid`` with ``access`` give a usable attachment, and if
    not, why and what would fix it. A source the caller may not inspect gets the answer a missing
    one gets (docs/access.md "Invisible is not found")."""
    from kbd.service.workflows import inspectable

    _check_mode(access, "access")
    consumer = inspectable(root, wid, actor=actor).manifest
    facts = Facts(policy=datafiles.consumer_kind("builder"), item_kb_write=False,
                  managers=_usable(root, _managers(consumer)),
                  sources={})  # fmt: skip
    found = root.registry.find(source_id)
    alias = next((e.alias for e in consumer.entries if e.workflow_id == source_id), None)
    # Attached already, its status is the consumer's to see (kbd sources list shows it); else a
    # source the caller may not inspect answers as a missing one.
    if alias is None and (not isinstance(found, Found) or not _sees(actor, found.manifest)):
        return explain_attach(consumer.id, None, None, access, facts)
    if alias is None:
        alias = free_alias(source_id, {e.alias for e in consumer.entries})
        # Refused as `kbd sources attach` refuses it (itself, too many sources …).
        entries = [e.ref.to_json() for e in consumer.entries if e.ref is not None]
        validate_sources(
            [*entries, {"workflow_id": source_id, "alias": alias, "access": access}], self_id=consumer.id
        )
    att = _prospective(root, consumer, source_id, alias, access)
    src = (
        _facts_of(root, consumer, found, att, actor, anonymous=False)
        if isinstance(found, Found)
        else SourceFacts(source_id, folder=None, owners=None, legacy=False)  # its status says why
    )
    return explain_attach(consumer.id, src, att, access, facts)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False  # a lone surrogate: no path, and the answer echoes it
    return True


def _check_mode(value: str, name: str) -> None:
    if value not in MODES:
        raise InvalidInput(f"{name} {str(value)[:40]!r} is not allowed; allowed: {', '.join(MODES)}")


def _sees(actor: Actor, m: Manifest) -> bool:
    return isinstance(actor, LocalOperator) or audience.can_inspect(actor, m)


def _managers(m: Manifest) -> tuple[str, ...]:
    """Who may manage ``m``'s sources and open its sessions by name (admins and services too,
    unnamed). A caller who may use one of its sessions may inspect it, so may see these."""
    return tuple(dict.fromkeys((*m.effective_owners, *m.access.editors)))


def _prospective(
    view: Root | WhatIf, consumer: Manifest, source_id: str, alias: str, access: str
) -> Attachment:
    root = view if isinstance(view, Root) else view.root
    return resolve_new(SourceRef(source_id, alias, access), consumer, index=len(consumer.entries), view=view,
                       principals=root.principals, host=root.config.host)  # fmt: skip


def _source_facts(root: Root, consumer: Manifest, att: Attachment, actor: Actor,
                  anonymous: bool) -> SourceFacts | None:  # fmt: skip
    found = root.registry.find(att.workflow_id)
    if not isinstance(found, Found):
        return None
    return _facts_of(root, consumer, found, att, actor, anonymous=anonymous)


def _facts_of(root: Root, consumer: Manifest, found: Found, att: Attachment, actor: Actor, *,
              anonymous: bool) -> SourceFacts:  # fmt: skip
    source = found.manifest
    visible = _sees(actor, source) and not anonymous
    missing = None
    if visible and att.reason == "audience_denied" and not consumer.is_legacy:
        names = audience.not_admitted(consumer, source, root.principals)
        # A name no principal could have (an unknown tier holds any text) cannot be granted: no fix.
        if names and len(names) <= MAX_WRITERS and all(id_problem(n) is None for n in names):
            missing = tuple(names)
    write = None
    if att.available and att.access == "read":
        # The status the entry would have with access write: is the consumer granted?
        write = _prospective(root, consumer, source.id, att.alias, "write").write
    elif missing:
        # ... and once the missing readers are admitted (the readers fix), resolved as then.
        readers = (*source.access.readers, *missing)
        then = WhatIf(root, {source.id: replace(source, access=replace(source.access, readers=readers))})
        write = _prospective(then, consumer, source.id, att.alias, "write").write
    return SourceFacts(
        workflow_id=source.id,
        # An available source's KB path is in the plan already; another's folder only where visible.
        folder=found.folder.path if (visible or att.available) else None,
        owners=_usable(root, source.effective_owners) if visible else None,
        legacy=source.is_legacy,
        missing=missing,
        write=write,
    )


def _usable(root: Root, names: tuple[str, ...]) -> tuple[str, ...]:
    """The principals of ``names`` who could run a fix now (known and enabled): a fix names no one else."""
    return tuple(n for n in names if (p := root.principals.get(n)) is not None and not p.disabled)


def _elsewhere(root: Root, consumer: Manifest, path: str, mode: str, actor: Actor,
               taken: set[str]) -> tuple[SourceFacts, Attachment] | None:  # fmt: skip
    """The workflow folder (other than the consumer's) holding ``path``, when the caller may
    see it, with the attachment it would get: for "not attached" and its fix."""
    deepest = None
    path = str(PurePosixPath(path))  # spelled as the explainer judges it (no '//' or '/./')
    for folder in root.registry.folders():
        if folder.manifest is None or folder.manifest.id == consumer.id:
            continue
        p = str(folder.path)
        if (path == p or path.startswith(p.rstrip("/") + "/")) and (
            deepest is None or len(p) > len(str(deepest.path))
        ):
            deepest = folder
    if deepest is None or deepest.manifest is None or not _sees(actor, deepest.manifest):
        return None
    found = root.registry.find(deepest.manifest.id)
    if not isinstance(found, Found) or found.folder.path != deepest.path:
        return None
    access = "write" if mode == "write" else "read"
    att = _prospective(root, consumer, found.manifest.id, free_alias(found.manifest.id, taken), access)
    return _facts_of(root, consumer, found, att, actor, anonymous=False), att


def free_alias(workflow_id: str, taken: set[str]) -> str:
    """An alias for ``workflow_id`` that ``taken`` does not hold: the ID in alias form
    (lower case, ``_`` for anything else, a letter first, at most 48 characters)."""
    base = re.sub(r"[^a-z0-9_]", "_", workflow_id.lower())
    if not base[:1].isalpha():
        base = "kb_" + base
    base = base[:44]
    alias, n = base, 2
    while alias in taken or alias == "access":
        alias, n = f"{base}_{n}", n + 1
    return alias
