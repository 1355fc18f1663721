"""The change feed's producers (docs/daemon.md): the :class:`EventSink` every
operation reports to, and who may see an event when it is delivered.

Operations report through ``Root.events`` (an :class:`EventSink`):

* ``emit`` — ``session.opened|closed`` and ``note.written`` (API, CLI and
  command-written notes). A process working directly on the root (the CLI,
  an in-process ``kbd exec``) has a :class:`LogSink`: it appends to the root's
  shared event log itself (:class:`kbd.state.events.EventLog` is safe across
  processes), so the event exists whether or not a daemon runs, and a daemon
  delivers it by following the file. Deriving these events from the audit log
  instead would lose every one written while no daemon ran, and tie the feed
  to the audit record format.
* ``manifest_saved`` — kbd saved a workflow.json. Manifest events
  (``workflow.changed``, ``sources.changed``, ``writers.changed``) come from ONE
  place, the daemon's :class:`ManifestTracker`, which diffs the manifest's
  facts (:func:`kbd.core.events.manifest_change_types`) against the last state
  it knows. The daemon's own saves feed it at once; the watcher feeds it
  every manifest change it sees on disk (a hand edit, a CLI save, a restore);
  whichever reports a change second finds nothing left to emit, so nothing is
  emitted twice and a hand edit gives exactly the events a CLI edit gives. A
  :class:`LogSink` therefore ignores ``manifest_saved``: the watcher of a
  running daemon sees the file change, and a daemon that was not running
  appends ``resync`` when it starts.

An event is best effort for the operation that caused it: the operation has
already happened (and is in the audit log), so a log that cannot be written
loses the event rather than failing the operation; the daemon answers what it
cannot deliver with ``resync``.

This module is imported by :mod:`kbd.service.root`, so by ``kbd exec``: it
imports only the standard library's typing and threading at import, and the
event rules (regular expressions: milliseconds) and the log on first use.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kbd.errors import KbdError

if TYPE_CHECKING:  # types only: nothing here needs the event rules, the manifest parser or the log at import
    from kbd.core.events import FieldValue, ManifestFacts
    from kbd.core.manifest import Manifest
    from kbd.core.principals import Principal
    from kbd.state.events import EventLog


class EventSink(Protocol):
    """Where operations report what changed (see the module docstring)."""

    def emit(self, event_type: str, /, *, workflow_id: str | None, **fields: FieldValue) -> None:
        """One event off the allow-list of :mod:`kbd.core.events` (a type or
        field off it raises :class:`kbd.core.events.EventRefused`: a bug)."""

    def resync(self, reason: str) -> None:
        """Continuity is lost for everyone (a watcher overflow, a restart)."""

    def manifest_saved(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> None:
        """kbd saved ``workflow_id``'s workflow.json: ``old`` before, ``new`` after."""


class LogSink:
    """A process on the root appends to ``<state>/events.log`` itself (opened on
    the first event: a command that reports nothing never pays for the log)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._log: EventLog | None = None
        self._mutex = threading.Lock()

    def _opened(self) -> EventLog:
        with self._mutex:
            if self._log is None:
                import weakref

                from kbd.state.events import EventLog

                self._log = EventLog(self.state_dir, sync_interval=0.05)
                # Closed (its descriptor, its fsync thread, the last batched
                # fsync) with this sink or at exit: a process that makes many
                # roots (tests, tools) keeps one open log per live root only.
                weakref.finalize(self, self._log.close)
            return self._log

    def emit(self, event_type: str, /, *, workflow_id: str | None, **fields: FieldValue) -> None:
        from kbd.core.events import check_event

        check_event(event_type, workflow_id, fields)  # a producer bug is never swallowed
        try:
            self._opened().append(event_type, workflow_id=workflow_id, **fields)
        except (KbdError, OSError):
            # The operation already happened and is audited; its notice is lost
            # (a full disk, a lock held too long), which a daemon cannot see:
            # the same as an event written while no subscriber was connected.
            return

    def resync(self, reason: str) -> None:
        self.emit("resync", workflow_id=None, reason=reason)

    def manifest_saved(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> None:
        return None  # the daemon's ManifestTracker is the one producer (module docstring)


# -- manifest changes: the one diff-based producer ----------------------------------------------


class ManifestTracker:
    """The last manifest facts seen per workflow, and the events a new state gives.

    :meth:`observe` is called by the daemon for its own saves and by its
    watcher for every manifest change on disk; it returns the event types to
    emit and remembers the new state, so a second report of the same change
    returns nothing. It also keeps the last parsed manifest of each workflow,
    which decides who may see events about a workflow that has since been
    removed. Thread-safe."""

    def __init__(self) -> None:
        self._facts: dict[str, ManifestFacts | None] = {}
        self._manifests: dict[str, Manifest] = {}
        self._mutex = threading.Lock()

    def observe(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> tuple[str, ...]:
        """The event types for ``workflow_id`` now being ``new`` (None: gone).
        ``old`` is the caller's idea of the state before; the tracker's own
        memory wins when it has one (it may already have seen this change)."""
        from kbd.core.events import ManifestFacts, manifest_change_types, manifest_facts

        where = str(folder) if folder is not None else None
        after = manifest_facts(new, folder=where) if new is not None else None
        with self._mutex:
            if workflow_id in self._facts:
                before = self._facts[workflow_id]
            else:
                before = manifest_facts(old) if old is not None else None
            if after is not None and before is not None and after.folder is None:
                after = ManifestFacts(after.version, before.folder, after.sources, after.sources_problem,
                                      after.writers)  # fmt: skip
            self._facts[workflow_id] = after
            if new is not None:
                self._manifests[workflow_id] = new
            elif old is not None and workflow_id not in self._manifests:
                self._manifests[workflow_id] = old
        return manifest_change_types(before, after)

    def remember(self, manifest: Manifest) -> None:
        """A manifest seen on a lookup: who may see events about it if it vanishes."""
        with self._mutex:
            self._manifests[manifest.id] = manifest

    def last_manifest(self, workflow_id: str) -> Manifest | None:
        with self._mutex:
            return self._manifests.get(workflow_id)


# -- who sees what ---------------------------------------------------------------------------------


def may_see(actor: Principal, workflow_id: str | None, manifest: Manifest | None) -> bool:
    """May ``actor`` receive an event about ``workflow_id`` whose manifest is now
    ``manifest`` (its last known one when it was removed; None when never
    known)? ``resync`` (no workflow) goes to everyone; services and enabled
    admins see every workflow; anyone else only what they may inspect now
    (:func:`kbd.core.audience.can_inspect`): an unknown workflow is hidden."""
    from kbd.core.audience import can_inspect

    if actor.disabled:
        return False
    if workflow_id is None or sees_every_workflow(actor):
        return True
    return manifest is not None and can_inspect(actor, manifest)


def sees_every_workflow(actor: Principal) -> bool:
    """Services and enabled admins see every workflow's events (no manifest
    needs looking up to decide)."""
    return not actor.disabled and (actor.is_service or actor.enabled_admin)
