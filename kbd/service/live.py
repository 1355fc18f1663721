"""The daemon's live state (docs/daemon.md): watched changes applied to the registry,
change events, and pushed revocation.

One thread (``kbd-live``) serialises everything that changes the daemon's view:
the watcher's batches and health reports (:mod:`kbd.fs.watch`, handed over
through a queue) and a periodic verifier. Each pass, under the daemon's state
lock (the one the API takes for registry and session-store work):

1. re-reads ``kbd.yaml`` / ``principals.yaml`` / the policy tables when they
   changed;
2. applies the reported paths to the registry (:meth:`Registry.apply`), or
   re-checks everything (:meth:`Registry.verify_now`) on a lossy batch and on
   every verifier pass;
3. diffs the registry's index against the copy taken by the previous pass and
   reports each changed ID to the change feed's one manifest-event producer
   (:meth:`kbd.service.changefeed.Feed.observe`, which the daemon's own
   saves report to as well, so nothing is announced twice): a hand edit of
   ``workflow.json`` and a CLI edit give the same ``workflow.changed`` /
   ``sources.changed`` / ``writers.changed``, and a change absorbed by some
   lookup in between is not missed;
4. re-plans the open sessions the change can affect (their workflow or one of
   its sources changed; every session after a config change; every session
   with running commands on each verifier pass), appends
   ``session.plan_changed`` when the generation moved, and for every command
   running under an older generation whose grants shrank
   (:func:`kbd.core.plan.grants_shrunk` against the plan of the command's own
   generation; unknown, e.g. after a restart, counts as shrunk) either
   terminates its whole tree (``revocation.immediate``: SIGTERM,
   ``grace_seconds``, ``cgroup.kill``, on a worker thread outside the lock) or
   leaves it marked stale (the older generation ``kbd session show`` lists);
   either way ``command.terminated`` / ``command.stale`` and one
   ``session_revoke`` audit record with ``pushed: true``.

The watcher only accelerates: every lookup still verifies its grants on disk,
and the verifier runs every ``HEALTHY_VERIFY`` seconds (``DEGRADED_VERIFY``
while the watcher is unhealthy), so a lost event delays a push, never makes a
stale grant live. ``resync`` is appended for lossy batches, full rescans and
every watcher failure. The registry's own sweep runs every
``HEALTHY_SWEEP`` seconds only while the watcher is healthy (its configured
interval otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kbd.core.layout import KB_DIR
from kbd.core.lookup import Folder
from kbd.core.manifest import Manifest
from kbd.core.plan import Plan, grants_shrunk
from kbd.core.watching import PathChange, WatchBatch, WatchHealth
from kbd.errors import KbdError
from kbd.fs import datafiles
from kbd.fs.registry import Registry, RegistryDelta
from kbd.fs.watch import Watcher
from kbd.service.root import Root
from kbd.service.sessions import RootSessions, end_command, running_commands
from kbd.state.processes import ProcessRow
from kbd.state.sessions import SessionRow

log = logging.getLogger("kbd.live")

HEALTHY_VERIFY = 10.0
DEGRADED_VERIFY = 1.0
# While every event arrives, the registry's per-lookup sweep is only a safety net.
HEALTHY_SWEEP = 30.0
# More folders added since the watch segments were built than this: rebuild them.
MAX_DELTA_FOLDERS = 256
# Rebuilt watches looked at again (each look may find more to watch) at most this often per pass.
REWATCH_ROUNDS = 3
# The same resync reason within this window is one loss of continuity, not two.
RESYNC_QUIET = 1.0
POLICY_NAMES = (datafiles.KINDS_NAME, datafiles.INJECTION_NAME)
STOP_TIMEOUT = 5.0


# -- pure helpers ------------------------------------------------------------------------------

# One changed ID: (workflow ID, manifest before, manifest after, its one folder now).
Changed = tuple[str, Manifest | None, Manifest | None, Path | None]


def single(index: dict[Path, Folder], paths: Iterable[Path]) -> Manifest | None:
    """The manifest of an ID held by exactly one readable, un-nested folder."""
    found = [index[p] for p in paths if p in index]
    if len(found) == 1 and found[0].nested_in is None:
        return found[0].manifest
    return None


def sources_key(m: Manifest | None) -> object:
    if m is None:
        return None
    return (m.sources_problem, tuple((e.workflow_id, e.alias, e.access, e.problem) for e in m.entries))


def commands_to_act(
    procs: Iterable[ProcessRow],
    *,
    new: Plan | None,
    history: dict[int, Plan],
    acted: set[tuple[int, int]],
    lost: Callable[[str], bool] = lambda principal: False,
) -> list[ProcessRow]:
    """The running commands to end, not acted on yet: those whose principal
    ``lost`` the right to use the session (disabled, removed, or no longer in
    a role that may use it), and those whose grants shrank — started under an
    older generation than ``new`` (every one when the session has no plan now)
    and either with no known plan for their generation (fail safe) or with
    grants ``new`` narrows."""
    out = []
    for p in procs:
        if (p.pid, p.generation) in acted:
            continue
        if p.principal is not None and lost(p.principal):
            out.append(p)
            continue
        if new is not None and p.generation >= new.generation:
            continue
        base = history.get(p.generation)
        if new is None or base is None or grants_shrunk(base, new):
            out.append(p)
    return out


class LiveSink(Protocol):
    """Where the live state's events go: the daemon's change feed
    (:class:`kbd.service.changefeed.Feed`)."""

    def emit(self, event_type: str, /, *, workflow_id: str | None, **fields: str | int) -> None: ...

    def observe(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> tuple[str, ...]: ...


# -- the live state --------------------------------------------------------------------------


@dataclass
class _Work:
    changes: list[PathChange] = field(default_factory=list)
    lossy: bool = False
    verify: bool = False
    health: list[WatchHealth] = field(default_factory=list)  # in the order reported
    stop: bool = False


class LiveState:
    """See the module docstring. ``lock`` is the daemon's state lock."""

    def __init__(
        self,
        host: Root,
        sessions: RootSessions,
        *,
        lock: threading.RLock,
        events: LiveSink,
        healthy_verify: float = HEALTHY_VERIFY,
        degraded_verify: float = DEGRADED_VERIFY,
    ) -> None:
        self.host = host
        self.sessions = sessions
        self.lock = lock
        self.events = events
        self._healthy_verify = healthy_verify
        self._degraded_verify = degraded_verify
        self._base_sweep = host.registry.sweep_interval
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self.watcher = Watcher(on_batch=self._on_batch, on_health=self._on_health)
        self.healthy = False
        self.health: WatchHealth | None = None
        self.passes = 0
        self.last_verify = 0.0
        self._registry = host.registry
        self._seen: dict[Path, Folder] = {}
        self._paths_by_id: dict[str, set[Path]] = {}
        self._delta: set[Path] = set()
        self._plans: dict[str, dict[int, Plan]] = {}
        self._acted: dict[str, set[tuple[int, int]]] = {}
        # The generation of every open session as this state last saw it: a
        # session first seen by a pass is recorded as the store had it then.
        self._generations: dict[str, int] = {}
        self._policy_sig = self._policy_signature()
        self._last_resync: tuple[str, float] = ("", 0.0)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the first index copy, re-plan every session with running
        commands (their old plans are unknown after a restart: fail safe),
        start watching and the live thread."""
        with self.lock:
            self._registry = self.host.registry
            paths = self._registry.watch_paths()
            self._reindex(self._registry.index())
            self._set_segments(paths)
            for row in self._open_rows():
                self._generations[row.id] = row.generation
                if self._has_commands(row.id):
                    self._replan(row, trigger="restart")
        self.watcher.start()
        self._thread = threading.Thread(target=self._run, name="kbd-live", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop watching and the live thread; wait for terminations in flight
        (each bounded by ``grace_seconds`` and the cgroup kill)."""
        self.watcher.stop(timeout)
        self._queue.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + self.host.config.revoke_grace + timeout
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))

    @property
    def running(self) -> bool:
        """The live thread runs (between :meth:`start` and :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict[str, object]:
        """For metrics: the watcher's health and the verifier's last run."""
        h = self.health
        return {"healthy": self.healthy, "reason": h.reason if h else None, "watches": h.watches if h else 0,
                "expected": h.expected if h else 0, "passes": self.passes, "last_verify": self.last_verify}  # fmt: skip

    # -- watcher callbacks (watcher threads) -------------------------------------------------------
    def _on_batch(self, batch: WatchBatch) -> None:
        self._queue.put(("batch", batch))

    def _on_health(self, health: WatchHealth) -> None:
        self._queue.put(("health", health))

    # -- the live thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        next_verify = time.monotonic() + self._interval()
        while True:
            work = self._collect(max(0.0, next_verify - time.monotonic()))
            if work.stop:
                return
            for health in work.health:
                self._health_changed(health)
                work.verify = True  # "events may have been lost": verify now, and when health returns
            if time.monotonic() >= next_verify:
                work.verify = True
            try:
                self._pass(work)
            except Exception:  # the live thread must survive anything; the verifier retries
                log.exception("live: pass failed")
                self._resync("internal")
            if work.verify:
                next_verify = time.monotonic() + self._interval()

    def _interval(self) -> float:
        return self._healthy_verify if self.healthy else self._degraded_verify

    def _collect(self, timeout: float) -> _Work:
        """Everything queued now (waiting up to ``timeout`` for the first item):
        one pass absorbs a burst of batches."""
        work = _Work()
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return work
        while True:
            kind, value = item
            if kind == "stop":
                work.stop = True
            elif kind == "health" and isinstance(value, WatchHealth):
                work.health.append(value)
            elif kind == "batch" and isinstance(value, WatchBatch):
                work.changes.extend(value.changes)
                work.lossy = work.lossy or value.lossy
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return work

    def _health_changed(self, health: WatchHealth) -> None:
        self._registry.sweep_interval = (
            max(self._base_sweep, HEALTHY_SWEEP) if health.ok else self._base_sweep
        )
        if not health.ok:
            log.warning(
                "live: watcher unhealthy (%s): verifying every %gs", health.reason, self._degraded_verify
            )
            self._resync(health.reason or "watcher")
        self.health = health
        self.healthy = health.ok  # last: whoever sees the flag sees everything above done

    # -- one pass ------------------------------------------------------------------------------------------
    def _pass(self, work: _Work) -> None:
        trigger = "verify" if work.verify else "watch"
        with self.lock:
            self.passes += 1
            config_changed = self._refresh_config()
            registry = self.host.registry
            rebuild = registry is not self._registry
            if rebuild:  # workflow_roots changed: a new registry, new watches
                self._registry = registry
                self._health_sweep()
            if work.lossy:
                self._resync("queue_overflow")
            delta = registry.verify_now() if (work.verify or work.lossy or rebuild) else self._apply(work)
            if work.verify:
                self.last_verify = time.time()
            if delta.full:
                self._resync("rescan")
            found: list[Changed] = []
            touched, new_sources = self._diff(registry.index(), found)
            rewatched = self._grow_segments(delta, new_sources, rebuild=rebuild or delta.full)
            if rewatched:
                more, config_more = self._look_again(registry, new_sources, found)
                touched |= more
                config_changed = config_changed or config_more
            for wid, m_old, m_new, folder in found:
                self._observe(wid, m_old, m_new, folder)
            touched |= self._touched_by_paths(work.changes, registry.index())
            rows = self._open_rows()
            self._forget(rows)
            for row in rows:
                self._generations.setdefault(row.id, row.generation)
            for row in self._affected(rows, touched, everything=config_changed, procs=work.verify,
                                      new_sessions=self._new_procs(work.changes)):  # fmt: skip
                self._replan(row, trigger=trigger)

    def _look_again(
        self, registry: Registry, new_sources: set[str], found: list[Changed]
    ) -> tuple[set[str], bool]:
        """Verify once more after watch segments were (re)built. A change made
        before a new watch was in place raised no event: in a folder new to the
        watch, and in every folder of a rebuilt segment between its old watch's
        end (which also drops what it had not delivered yet) and its new one's
        start (:meth:`Watcher.set_segment` returns with the new watch in place).
        Looking now, so whoever sees an event may rely on every later change
        being pushed, instead of leaving it to the periodic verifier. Folders
        and sources the look finds are watched in turn (bounded: a tree that
        keeps growing is left to the next pass). The IDs touched, and whether
        the config changed."""
        touched: set[str] = set()
        config_changed = False
        known = set(new_sources)
        for round_ in range(1, REWATCH_ROUNDS + 1):
            config_changed = self._refresh_config() or config_changed
            delta = registry.verify_now()
            if delta.full:
                self._resync("rescan")
            more, sources_more = self._diff(registry.index(), found)
            touched |= more
            fresh = sources_more - known
            known |= fresh
            if round_ == REWATCH_ROUNDS or not self._grow_segments(delta, fresh, rebuild=delta.full):
                break
        return touched, config_changed

    def _apply(self, work: _Work) -> RegistryDelta:
        if not work.changes:
            return RegistryDelta()
        return self._registry.apply(work.changes)

    def _health_sweep(self) -> None:
        self._base_sweep = self._registry.sweep_interval
        if self.healthy:
            self._registry.sweep_interval = max(self._base_sweep, HEALTHY_SWEEP)

    # -- config ---------------------------------------------------------------------------------------------
    def _policy_signature(self) -> tuple[object, ...]:
        out: list[object] = []
        for name in POLICY_NAMES:
            try:
                st = os.stat(datafiles.policy_path(name))
            except OSError:
                out.append(None)
                continue
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def _refresh_config(self) -> bool:
        """Re-read the root's config files and the policy tables when they
        changed; True when anything a plan depends on did."""
        before = (self.host.config, self.host.principals)
        try:
            self.host.refresh()
        except KbdError as err:  # an invalid new file: the old settings stay in force
            log.warning("live: config not reloaded: %s", err.message)
        # Root.refresh swaps in new objects only when a file changed.
        changed = self.host.config is not before[0] or self.host.principals is not before[1]
        sig = self._policy_signature()
        if sig != self._policy_sig:
            self._policy_sig = sig
            datafiles.consumer_kinds.cache_clear()
            datafiles.injection_rules.cache_clear()
            changed = True
        return changed

    # -- the index diff -------------------------------------------------------------------------------------
    def _reindex(self, index: dict[Path, Folder]) -> None:
        self._seen = index
        self._paths_by_id = {}
        for path, folder in index.items():
            if folder.known_id is not None:
                self._paths_by_id.setdefault(folder.known_id, set()).add(path)

    def _diff(self, index: dict[Path, Folder], found: list[Changed]) -> tuple[set[str], set[str]]:
        """What changed since the last copy (added to ``found`` as (workflow ID,
        manifest before, manifest after, its one folder now)); the IDs touched,
        and the source IDs newly attached somewhere."""
        old = self._seen
        changed = [p for p, f in index.items() if old.get(p) is not f]
        changed += [p for p in old if p not in index]
        if not changed:
            return set(), set()
        ids: set[str] = set()
        for p in changed:
            for f in (old.get(p), index.get(p)):
                if f is not None and f.known_id is not None:
                    ids.add(f.known_id)
        before = {wid: self._paths_by_id.get(wid, set()).copy() for wid in ids}
        for p in changed:
            f_old, f_new = old.get(p), index.get(p)
            if f_old is not None and f_old.known_id is not None:
                self._paths_by_id.get(f_old.known_id, set()).discard(p)
            if f_new is not None and f_new.known_id is not None:
                self._paths_by_id.setdefault(f_new.known_id, set()).add(p)
        self._seen = index
        new_sources: set[str] = set()
        for wid in sorted(ids):
            after = self._paths_by_id.get(wid, set())
            if not after:
                self._paths_by_id.pop(wid, None)
            m_old, m_new = single(old, before[wid]), single(index, after)
            found.append((wid, m_old, m_new, next(iter(after)) if len(after) == 1 else None))
            if m_new is not None and sources_key(m_old) != sources_key(m_new):
                new_sources |= {e.workflow_id for e in m_new.entries if e.ref is not None}
        return ids, new_sources

    def _touched_by_paths(self, changes: list[PathChange], index: dict[Path, Folder]) -> set[str]:
        """IDs of the workflow folders a change lies in (their knowledgebase or
        its notes appearing, vanishing or being replaced)."""
        out: set[str] = set()
        for change in changes:
            path = Path(change.path)
            for candidate in (path, path.parent, path.parent.parent):
                folder = index.get(candidate)
                if folder is not None and folder.known_id is not None:
                    out.add(folder.known_id)
                    break
        return out

    # -- sessions --------------------------------------------------------------------------------------------
    def _open_rows(self) -> list[SessionRow]:
        try:
            return self.sessions.store.rows(include_closed=False)
        except KbdError as err:
            log.warning("live: sessions unreadable: %s", err.message)
            return []

    def _has_commands(self, sid: str) -> bool:
        """Records of running commands exist (cheap: one listing; the records
        themselves are checked by the re-plan)."""
        try:
            return bool(os.listdir(self.sessions.commands.path / sid))
        except OSError:
            return False

    def _forget(self, rows: list[SessionRow]) -> None:
        """Drop what is kept for sessions no longer open."""
        open_ids = {row.id for row in rows}
        for sid in [s for s in self._plans if s not in open_ids]:
            del self._plans[sid]
        for sid in [s for s in self._acted if s not in open_ids]:
            del self._acted[sid]
        for sid in [s for s in self._generations if s not in open_ids]:
            del self._generations[sid]

    def _new_procs(self, changes: list[PathChange]) -> set[str]:
        """Sessions whose first command just started (their records folder appeared)."""
        procs = str(self.sessions.commands.path)
        return {Path(c.path).name for c in changes if c.kind == "added" and str(Path(c.path).parent) == procs}

    def _consumer_sources(self, wid: str) -> set[str]:
        m = single(self._seen, self._paths_by_id.get(wid, ()))
        return set() if m is None else {e.workflow_id for e in m.entries}

    def _affected(
        self,
        rows: list[SessionRow],
        touched: set[str],
        *,
        everything: bool,
        procs: bool,
        new_sessions: set[str],
    ) -> list[SessionRow]:
        out = []
        for row in rows:
            if (
                everything
                or row.id in new_sessions
                or row.workflow_id in touched
                or (touched and self._consumer_sources(row.workflow_id) & touched)
                or (procs and self._has_commands(row.id))
            ):
                out.append(row)
        return out

    def _replan(self, row: SessionRow, *, trigger: str) -> None:
        history = self._plans.setdefault(row.id, {})
        try:
            new: Plan | None = self.sessions.rebuild(row)
        except KbdError:
            new = None  # the session has no plan now (workflow gone, unreadable): it grants nothing
        known = self._generations.get(row.id, row.generation)
        if new is not None:
            self._generations[row.id] = max(known, new.generation)
            if new.generation > known:
                self._emit("session.plan_changed", workflow_id=row.workflow_id, session_id=row.id,
                           generation=new.generation)  # fmt: skip
            history[new.generation] = new
        procs = running_commands(self.sessions.commands, row.id)
        acted = self._acted.setdefault(row.id, set())
        act = commands_to_act(procs, new=new, history=history, acted=acted,
                              lost=lambda principal: not self.sessions.may_use(row, principal))  # fmt: skip
        acted.intersection_update({(p.pid, p.generation) for p in procs})
        acted.update((p.pid, p.generation) for p in act)
        keep = {p.generation for p in procs} | ({new.generation} if new is not None else set())
        for generation in [g for g in history if g not in keep]:
            del history[generation]
        if act:
            self._act(row, act, trigger=trigger)

    def _act(self, row: SessionRow, procs: list[ProcessRow], *, trigger: str) -> None:
        cfg = self.host.config
        if not cfg.revoke_immediately:
            for p in procs:
                self._emit("command.stale", workflow_id=row.workflow_id, session_id=row.id, pid=p.pid,
                           generation=p.generation)  # fmt: skip
            self._audit(row, immediate=False, terminated=[], still=[p.pid for p in procs], trigger=trigger)
            return
        worker = threading.Thread(
            target=self._terminate,
            args=(row, procs, cfg.revoke_grace, trigger),
            name="kbd-revoke",
            daemon=True,
        )
        self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def _terminate(self, row: SessionRow, procs: list[ProcessRow], grace: float, trigger: str) -> None:
        """Terminate each command's tree (in parallel: each may wait ``grace``)."""
        results: dict[int, bool] = {}

        def one(p: ProcessRow) -> None:
            try:
                results[p.pid] = end_command(self.sessions.commands, p, grace=grace)
            except Exception:
                log.exception("live: terminating %s of session %s failed", p.pid, row.id)
                results[p.pid] = False

        threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        terminated = [p.pid for p in procs if results.get(p.pid)]
        for p in procs:
            if results.get(p.pid):
                self._emit("command.terminated", workflow_id=row.workflow_id, session_id=row.id, pid=p.pid,
                           generation=p.generation)  # fmt: skip
        self._audit(row, immediate=True, terminated=terminated,
                    still=[p.pid for p in procs if not results.get(p.pid)], trigger=trigger)  # fmt: skip

    def _audit(
        self, row: SessionRow, *, immediate: bool, terminated: list[int], still: list[int], trigger: str
    ) -> None:
        try:
            self.host.audit("session_revoke", session=row.id, immediate=immediate, terminated=terminated,
                            still_running=still, pushed=True, trigger=trigger, actor="kbd-daemon")  # fmt: skip
        except (KbdError, OSError) as err:
            log.error("live: audit record of a pushed revocation failed: %s", err)

    # -- events --------------------------------------------------------------------------------------------------
    def _emit(self, event_type: str, *, workflow_id: str | None, **fields: str | int) -> None:
        try:
            self.events.emit(event_type, workflow_id=workflow_id, **fields)
        except (KbdError, OSError, ValueError) as err:  # a full disk must not stop revocation
            log.error("live: event %s not appended: %s", event_type, err)

    def _observe(self, wid: str, old: Manifest | None, new: Manifest | None, folder: Path | None) -> None:
        try:
            self.events.observe(wid, old, new, folder=folder)
        except (KbdError, OSError, ValueError) as err:
            log.error("live: manifest events of %s not appended: %s", wid, err)

    def _resync(self, reason: str) -> None:
        now = time.monotonic()
        last_reason, at = self._last_resync
        if reason == last_reason and now - at < RESYNC_QUIET:
            return
        self._last_resync = (reason, now)
        self._emit("resync", workflow_id=None, reason=reason)

    # -- watch segments ---------------------------------------------------------------------------------------
    def _set_segments(self, paths: dict[str, list[Path]]) -> None:
        # The root folder (kbd.yaml and principals.yaml are replaced by rename),
        # the policy tables, and the running-command records (a session's folder
        # appears with its first command: its plan is cached before any change).
        # One segment: every segment costs an inotify instance (128 per user).
        procs = self.sessions.commands.path
        with contextlib.suppress(OSError):
            procs.mkdir(parents=True, exist_ok=True, mode=0o750)
        config = [self.host.config.root, datafiles.policy_path(datafiles.KINDS_NAME).parent, procs]
        self.watcher.set_segment("config", config)
        for name, folders in paths.items():
            self.watcher.set_segment(name, folders)
        self._delta.clear()
        self.watcher.set_segment("delta", [])

    def _grow_segments(self, delta: RegistryDelta, new_sources: set[str], *, rebuild: bool) -> bool:
        """Watch folders that entered the index (and the KBs newly attached)
        in a small ``delta`` segment; rebuild every segment when it grew large
        or the registry was rescanned. Whether any segment was (re)built."""
        added = set(delta.folders_added)
        for path in list(added):
            if (path / KB_DIR).is_dir():
                added.add(path / KB_DIR)
        for wid in new_sources:
            paths = self._paths_by_id.get(wid, set())
            if len(paths) == 1:
                added.add(next(iter(paths)) / KB_DIR)
        if rebuild or len(self._delta | added) > MAX_DELTA_FOLDERS:
            self._set_segments(self._registry.watch_paths())
            return True
        new = added - self._delta
        if not new:
            return False
        self._delta |= new
        self.watcher.set_segment("delta", sorted(self._delta))
        return True
