"""The root context every operation works in: one kbd root's config,
principals and workflow registry, its audit log, and the resolver's view of
the registry.

It decides nothing about who may do what: the operations
(:mod:`kbd.service.workflows`, :mod:`kbd.service.sessions`, ...) take a
:class:`Root` and authorize their actor themselves. A long-lived daemon keeps
one and calls :meth:`Root.refresh` so a changed config takes effect at once.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kbd.core.config import Config
from kbd.core.layout import CACHE_DIR, CONFIG_NAME, PRINCIPALS_NAME, racy
from kbd.core.manifest import Manifest
from kbd.core.principals import Principal, Principals
from kbd.core.resolve import Attachment, SourceView, resolve_all
from kbd.errors import AmbiguousWorkflow, KbdError, ManifestUnreadable, workflow_not_found
from kbd.fs.registry import Ambiguous, Found, KbProbe, Lookup, Missing, Registry, probe_kb
from kbd.fs.rootconfig import load_config, load_principals
from kbd.service.events import EventSink, LogSink
from kbd.state import audit


class Root:
    """One kbd root: config, principals, the workflow registry (which it lends
    the resolver as its :class:`kbd.core.resolve.SourceView`), the audit log,
    and ``events``, where operations report what changed (the change feed,
    :mod:`kbd.service.events`): by default the root's shared event log; the
    daemon puts its own feed there."""

    #: A :class:`kbd.service.preview.Draft` says True: its changes are computed, never written.
    dry_run = False

    def __init__(self, root: Path, *, sweep_interval: float = 1.0, events: EventSink | None = None) -> None:
        self._root = root
        self._sweep_interval = sweep_interval
        self._signature = self._config_signature()
        self.config: Config = load_config(root)
        self.events: EventSink = events if events is not None else LogSink(self.config.state_dir)
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
        # Another thread may be reloading right now (the daemon's watcher): wait
        # for it and look again, never answer with the settings it is replacing
        # (a principal disabled a moment ago must already be refused).
        with self._reloading:
            self._reload(self._config_signature())

    def _reload(self, sig: tuple[object, ...]) -> None:
        if sig == self._signature and None not in sig:
            return  # the thread we waited for loaded this very state
        config = load_config(self._root)
        principals = load_principals(config.root)
        roots_changed = config.workflow_roots != self.config.workflow_roots
        self.config, self.principals = config, principals
        if roots_changed:
            self.registry = self._registry()
        self._signature = sig

    # -- SourceView for the resolver ----------------------------------------
    def find(self, workflow_id: str) -> Lookup:
        return self.registry.find(workflow_id)

    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe:
        return probe_kb(workflow_folder, notes=notes)

    # -- helpers -------------------------------------------------------------
    def actor(self, pid: str) -> Principal:
        return self.principals.actor(pid)

    def keep_principals(self, principals: Principals) -> None:
        """Called with the principals a change of principals.yaml leaves; a
        :class:`kbd.service.preview.Draft` keeps them, a root has them on disk already."""

    def audit(self, event: str, **fields: object) -> None:
        """Append one record to the root's audit log (``fields`` are its JSON values)."""
        audit.append(self.config.state_dir, event, **fields)

    def audit_refusal(self, event: str, err: KbdError, *, actor: Principal, **target: object) -> None:
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

    def resolve(self, consumer: Manifest, *, view: SourceView | None = None) -> list[Attachment]:
        """Every attachment of ``consumer`` as it resolves now in this root
        (``view``: a view over this root's answers, e.g. one that records them)."""
        if consumer.sources_problem is not None:
            raise ManifestUnreadable(f"workflow {consumer.id!r}: {consumer.sources_problem}")
        return resolve_all(consumer, view=view or self, principals=self.principals, host=self.config.host)
