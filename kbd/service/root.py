"""Management operations on a kbd root, shared by the CLI and the daemon.

Each operation authorizes its actor, does its work through the pure core
(manifest, audience, resolve) and the registry, and raises a
:class:`kbd.errors.KbdError` when it refuses. Interfaces do not call it
directly: :mod:`kbd.service` wraps it into typed results.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

from kbd.core import audience
from kbd.core.config import Config
from kbd.core.layout import CACHE_DIR, CONFIG_NAME, PRINCIPALS_NAME, racy
from kbd.core.manifest import (
    Entry,
    Manifest,
    SourceRef,
    validate_sources,
    validate_writers,
    with_sources,
    with_writers,
)
from kbd.core.principals import Principal, Principals
from kbd.core.resolve import Attachment, resolve_all, resolve_entry
from kbd.errors import (
    AmbiguousWorkflow,
    InvalidInput,
    InvalidManifest,
    KbdError,
    ManifestUnreadable,
    NotFound,
    PermissionDenied,
    SourceUnusable,
    workflow_not_found,
)
from kbd.fs.registry import Ambiguous, Found, KbProbe, Lookup, Missing, Registry, probe_kb
from kbd.fs.rootconfig import load_config, load_principals
from kbd.state import audit

# How a change builds the new attachment list from the manifest as it is now.
SourcesBuilder: TypeAlias = Callable[[Manifest], list[SourceRef]]


class Root:
    """One kbd root: config, principals and the workflow registry."""

    def __init__(self, root: Path, *, sweep_interval: float = 1.0) -> None:
        self._root = root
        self._sweep_interval = sweep_interval
        self._signature = self._config_signature()
        self.config: Config = load_config(root)
        self.principals: Principals = load_principals(self.config.root)
        self.registry = self._registry()
        self._reloading = threading.Lock()

    def _registry(self) -> Registry:
        return Registry(
            [r.resolve() for r in self.config.workflow_roots],
            cache_path=self.config.state_dir / CACHE_DIR / "registry.json",
            sweep_interval=self._sweep_interval,
        )

    def _config_signature(self) -> tuple[object, ...]:
        out: list[object] = []
        for name in (CONFIG_NAME, PRINCIPALS_NAME):
            try:
                st = os.stat(self._root / name)
            except OSError:
                out.append(None)
                continue
            # A file changed within the coarse-timestamp window is never trusted unchanged.
            sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            out.append(None if racy(st, time.time_ns()) else sig)
        return tuple(out)

    def refresh(self) -> None:
        """Re-read kbd.yaml and principals.yaml when they changed (a long-lived
        daemon must honour a disabled principal or a rotated token at once).
        New objects are built first and then swapped in, so a concurrent reader
        sees the old or the new ones, never a mix; an invalid new file raises and
        the old settings stay in force until it is fixed."""
        sig = self._config_signature()
        if sig == self._signature and None not in sig:
            return
        if not self._reloading.acquire(blocking=False):
            return  # another thread is reloading right now
        try:
            config = load_config(self._root)
            principals = load_principals(config.root)
            roots_changed = config.workflow_roots != self.config.workflow_roots
            self.config, self.principals = config, principals
            if roots_changed:
                self.registry = self._registry()
            self._signature = sig
        finally:
            self._reloading.release()

    # -- SourceView for the resolver ----------------------------------------
    def find(self, workflow_id: str) -> Lookup:
        return self.registry.find(workflow_id)

    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe:
        return probe_kb(workflow_folder, notes=notes)

    # -- helpers -------------------------------------------------------------
    def actor(self, pid: str) -> Principal:
        return self.principals.actor(pid)

    def audit(self, event: str, **fields: Any) -> None:
        audit.append(self.config.state_dir, event, **fields)

    def audit_refusal(self, event: str, err: KbdError, *, actor: Principal, **target: Any) -> None:
        """Record a refused change: who (``actor``), what (``event`` and its
        ``action``), the target fields, and why (``code``: the error's stable
        code; ``reason``: the specific reason code; ``message``). Outsiders who
        are told "not found" are recorded too: the log is the operator's."""
        self.audit(event, actor=actor.id, **target, code=err.code, reason=err.reason or err.code,
                   message=err.message[:300])  # fmt: skip

    def workflow(self, wid: str) -> Found:
        """The one readable folder holding ``wid``, or a specific error."""
        found = self.registry.find(wid)
        if isinstance(found, Missing):
            raise workflow_not_found(wid)
        if isinstance(found, Ambiguous):
            if found.nested:
                raise AmbiguousWorkflow(
                    f"{found.describe()}; it is not used until an operator resolves it",
                    hint="remove the workflow.json that does not belong, or move the nested folder out; "
                    "`kbd doctor` names both folders",
                )
            raise AmbiguousWorkflow(f"{len(found.folders)} folders claim workflow ID {wid!r}")
        if not isinstance(found, Found):
            raise ManifestUnreadable(
                f"workflow {wid!r} has an unreadable workflow.json: {found.folder.problem}"
            )
        return found

    def _inspectable(self, wid: str, actor: Principal) -> Found:
        found = self.workflow(wid)
        audience.require_inspectable(actor, found.manifest, wid)
        return found

    def resolve(self, consumer: Manifest) -> list[Attachment]:
        if consumer.sources_problem is not None:
            raise ManifestUnreadable(f"workflow {consumer.id!r}: {consumer.sources_problem}")
        return resolve_all(consumer, view=self, principals=self.principals, host=self.config.host)

    # -- queries ---------------------------------------------------------------
    def list_workflows(self, actor: Principal) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for folder in self.registry.folders():
            status = self.registry.status_of(folder)
            m = folder.manifest
            if m is not None and status == "ok" and not audience.can_inspect(actor, m):
                continue
            if m is None and not (actor.enabled_admin or actor.is_service):
                continue
            out.append(
                {
                    "id": m.id if m else folder.known_id,
                    "label": m.label if m else None,
                    "path": str(folder.path),
                    "status": status,
                    "problem": folder.problem if m is None else None,
                    # A workflow folder inside another one (DESIGN §2): both are
                    # ambiguous_id until an operator resolves it.
                    "nested_in": str(folder.nested_in) if folder.nested_in is not None else None,
                    "contains": [str(p) for p in self.registry.contained(folder)],
                }
            )
        return out

    def sources(self, wid: str, actor: Principal) -> tuple[Manifest, list[Attachment]]:
        found = self._inspectable(wid, actor)
        return found.manifest, self.resolve(found.manifest)

    def candidates(self, wid: str, actor: Principal) -> list[dict[str, Any]]:
        """Workflow IDs ``wid`` could attach now: readable by its whole audience,
        on this host, not itself, not ambiguous, KB present. Labels, never paths."""
        consumer = self._inspectable(wid, actor).manifest
        attached = {e.workflow_id for e in consumer.entries}
        out: list[dict[str, Any]] = []
        for folder in self.registry.folders():
            source = folder.manifest
            if source is None or source.id == consumer.id or source.id in attached:
                continue
            if self.registry.status_of(folder) != "ok":
                continue
            if source.host is not None and source.host != self.config.host:
                continue
            if not audience.can_read(consumer, source, self.principals):
                continue
            if probe_kb(folder.path).problem is not None:
                continue
            out.append(
                {
                    "workflow_id": source.id,
                    "label": source.label,
                    "write_granted": audience.can_write(consumer, source, self.principals),
                }
            )
        return sorted(out, key=lambda c: c["workflow_id"])

    def writers(self, wid: str, actor: Principal) -> dict[str, Any]:
        m = self._inspectable(wid, actor).manifest
        rows = []
        for w in m.access.allowed_kb_writers:
            f = self.registry.find(w)
            rows.append({"workflow_id": w, "exists": isinstance(f, Found)})
        return {"workflow_id": m.id, "writers": rows, "legacy": m.is_legacy}

    # -- changes -----------------------------------------------------------------
    @staticmethod
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

    def _check_new_entries(self, consumer: Manifest, old: tuple[Entry, ...], refs: list[SourceRef]) -> None:
        """Every new or changed entry must resolve now; unchanged ones may stay as they are."""
        unchanged = {e.ref for e in old if e.ref is not None}
        for i, ref in enumerate(refs):
            if ref in unchanged:
                continue
            entry = Entry(i, ref, None, ref.alias, ref.workflow_id, ref.access)
            att = resolve_entry(entry, consumer, view=self, principals=self.principals, host=self.config.host)
            if not att.available:
                raise SourceUnusable(
                    f"cannot attach {ref.workflow_id!r} as {ref.alias!r}: {att.reason}: {att.message}",
                    reason=att.reason or "invalid_entry",
                    source=ref.workflow_id,
                )
            if ref.access == "write" and att.write is not None and not att.write.available:
                found = self.registry.find(ref.workflow_id)
                if isinstance(found, Found) and found.manifest.is_legacy:
                    raise SourceUnusable(
                        f"cannot attach {ref.workflow_id!r} with write access: it has no owner, "
                        "so nobody can ever grant write access",
                        reason="write_not_granted",
                        hint="attach it with --access read, or give the source an owner first",
                        source=ref.workflow_id,
                    )

    def _save_sources(
        self,
        wid: str,
        actor: Principal,
        build: SourcesBuilder,
        *,
        action: str,
        source: str | None = None,
        expected_version: str | None = None,
    ) -> Manifest:
        try:
            return self._update_sources(wid, actor, build, action=action, expected_version=expected_version)
        except KbdError as err:
            # Every refusal is recorded (who, what, target, why) before the caller hears of it.
            self.audit_refusal("sources_refused", err, actor=actor, action=action, workflow_id=wid,
                               source=err.source if isinstance(err, SourceUnusable) else source)  # fmt: skip
            raise

    def _update_sources(
        self, wid: str, actor: Principal, build: SourcesBuilder, *, action: str, expected_version: str | None
    ) -> Manifest:
        folder = self.workflow(wid).folder

        def change(current: Manifest) -> dict[str, Any]:
            self._require_manage(actor, current)
            if current.sources_problem is not None and action != "set":
                raise InvalidManifest(
                    f"{current.sources_problem}; replace the whole list with `kbd sources set`"
                )
            refs = build(current)
            self._check_new_entries(current, current.entries, refs)
            # Audited under the manifest lock, before the file changes: if the
            # log cannot be written, nothing changes.
            self.audit("sources_changed", workflow_id=wid, actor=actor.id, action=action,
                       sources=[r.to_json() for r in refs])  # fmt: skip
            return with_sources(current.raw, refs)

        from kbd.fs import manifest_store  # filelock: only for writers, never on the exec path

        return manifest_store.update(
            folder.path,
            change,
            state_dir=self.config.state_dir,
            timeout=self.config.lock_timeout,
            expected_version=expected_version,
        )

    @staticmethod
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

    def attach(self, wid: str, source_id: str, *, alias: str, access: str, actor: Principal) -> Attachment:
        def build(current: Manifest) -> list[SourceRef]:
            refs = self._current_refs(current)
            entry = {"workflow_id": source_id, "alias": alias, "access": access}
            return validate_sources([r.to_json() for r in refs] + [entry], self_id=current.id)

        saved = self._save_sources(wid, actor, build, action="attach", source=source_id)
        return next(a for a in self.resolve(saved) if a.alias == alias)

    def detach(self, wid: str, alias: str, *, actor: Principal) -> None:
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
                    f"knowledgebase_sources[{bad[0].index}] is invalid ({bad[0].problem}); "
                    "detach or replace it too"
                )
            return [e.ref for e in keep if e.ref is not None]

        self._save_sources(wid, actor, build, action="detach", source=alias)

    def set_sources(
        self, wid: str, raw: object, *, actor: Principal, expected_version: str | None = None
    ) -> Manifest:
        def build(current: Manifest) -> list[SourceRef]:
            return validate_sources(raw, self_id=current.id)

        return self._save_sources(wid, actor, build, action="set", expected_version=expected_version)

    def _change_writers(self, source_id: str, consumer_id: str, *, actor: Principal, grant: bool) -> bool:
        try:
            return self._update_writers(source_id, consumer_id, actor=actor, grant=grant)
        except KbdError as err:
            # Every refusal is recorded (who, what, target, why) before the caller hears of it.
            self.audit_refusal("writer_grant_refused" if grant else "writer_revoke_refused", err,
                               actor=actor, source=source_id, consumer=consumer_id)  # fmt: skip
            raise

    def _update_writers(self, source_id: str, consumer_id: str, *, actor: Principal, grant: bool) -> bool:
        folder = self.workflow(source_id).folder
        event = "writer_granted" if grant else "writer_revoked"
        changed = False

        def change(current: Manifest) -> dict[str, Any]:
            nonlocal changed
            if not audience.can_grant_writers(actor, current):
                audience.require_inspectable(actor, current, source_id)
                raise _because(
                    PermissionDenied(
                        f"{actor.id!r} may not change who writes into {source_id!r}: "
                        "only its owners or an admin may",
                        hint="ask an owner of the source workflow to run `kbd writers grant`",
                    ),
                    "not_owner",
                )
            writers = list(current.access.allowed_kb_writers)
            if grant:
                if current.is_legacy:
                    raise InvalidInput(
                        f"{source_id!r} has no owner; a legacy workflow cannot grant write access",
                        hint="set access.owners on the source first",
                    )
                target = validate_writers([consumer_id], self_id=current.id)[0]
                self.workflow(target)  # must exist and be unambiguous now
                new = validate_writers([*writers, target], self_id=current.id)
            else:
                target = consumer_id.strip()
                new = [w for w in writers if w != target]
            changed = new != writers
            # Audited before the manifest changes (see _save_sources).
            self.audit(event, source=source_id, consumer=consumer_id.strip(), actor=actor.id, changed=changed)
            return with_writers(current.raw, new) if changed else current.raw

        from kbd.fs import manifest_store

        manifest_store.update(
            folder.path, change, state_dir=self.config.state_dir, timeout=self.config.lock_timeout
        )
        return changed

    def grant(self, source_id: str, consumer_id: str, *, actor: Principal) -> bool:
        return self._change_writers(source_id, consumer_id, actor=actor, grant=True)

    def revoke(self, source_id: str, consumer_id: str, *, actor: Principal) -> bool:
        return self._change_writers(source_id, consumer_id, actor=actor, grant=False)


def _because(err: KbdError, reason: str) -> KbdError:
    """``err`` with its specific reason code (recorded by :meth:`Root.audit_refusal`)."""
    err.reason = reason
    return err
