"""File watching for the daemon (docs/daemon.md): watchfiles' RustNotify in threads,
with every known way of losing events detected and reported.

The watcher accelerates and pushes; it is never the source of truth. Its
consumers (the registry, the plan cache) re-read the disk for whatever a batch
names, lookups verify every grant themselves, and a periodic verifier covers
what no event reported. So a failure here may delay a push, never make a stale
grant live; what this module owes is to *notice* every failure, say which, and
come back.

Folders are watched non-recursively (a recursive watch would cover run outputs
and ``node_modules``: floods and watch exhaustion), in named *segments*, each
one RustNotify (one inotify instance) drained by one Python thread. What
watchfiles 1.3 hides, and how each is caught here:

* **queue overflow** — the kernel's overflow notice is a path-less event that
  watchfiles drops (watchfiles issue #348). A burst of changes big enough to
  have overflowed the queue is reported ``lossy`` (:func:`kbd.core.watching.lossy_threshold`),
  health ``queue_overflow``, and the segment is rebuilt.
* **watch limit** — with ``ignore_permission_denied`` (needed so one
  unreadable folder cannot sink a build) RustNotify leaves folders unwatched
  *silently* once ``max_user_watches`` is reached. After every build, and every
  ``check_interval``, the inodes the segment's inotify fd really watches (read
  from ``/proc/self/fdinfo``) are compared with the folders at its paths:
  health ``watch_limit``.
* **a watched folder replaced** — its watch stays on the old inode (events
  inside the moved-away folder even arrive under the old path). An event naming
  the watched path itself, or the periodic identity check (which also catches a
  mount over the path, which raises no event at all): health ``folder_replaced``.
* **the thread dying** — a file name that is not UTF-8 makes every later
  ``watch()`` raise (sticky), so any folder owner can kill a segment; any
  exception, a thread that is gone, or one that has not come back from
  ``watch()`` within ``stall_after``: health ``watcher_died`` / ``stalled``.

Every failure makes the segment unhealthy and schedules a rebuild with backoff
(1 s doubling to 30 s, reset after a minute of health). Callbacks run on the
watcher's threads, never under the watcher's lock: ``on_batch`` on the segment
threads (concurrently for different segments; it may call :meth:`Watcher.set_segment`),
``on_health`` on the supervisor thread, in order, within ~50 ms of the change
(and, for reports left at :meth:`Watcher.stop`, on the caller's thread). The
daemon's adapter hands both to its event loop (``loop.call_soon_threadsafe``).
Every unhealthy report means "events may have been lost": the consumer runs
its verifier (``Registry.verify_now``) then, and again when health returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from watchfiles._rust_notify import RustNotify

from kbd.core.watching import (
    BUILD_FAILED,
    QUEUE_OVERFLOW,
    STALLED,
    WATCH_LIMIT,
    WATCHER_DIED,
    Ident,
    WatchBatch,
    WatchHealth,
    backoff,
    burst_size,
    coverage,
    is_lossy,
    lossy_threshold,
    parse_inotify_fdinfo,
    to_changes,
    touched_watched,
)
from kbd.core.watching import FOLDER_REPLACED as FOLDER_REPLACED

log = logging.getLogger("kbd.watch")

# watch() returns at least this often (and at least four times per
# ``stall_after``), so a live thread's heartbeat stays fresh.
_WATCH_TIMEOUT_MS = 500
_TICK = 0.05  # supervisor resolution (seconds)
_HEALTHY_RESET = 60.0  # a segment healthy this long starts its backoff from 1 s again
_JOIN = 1.0  # how long a rebuild waits for the old thread to let go of its watches

# Only one notifier is built at a time, so the inotify fd that appears during
# a build belongs to that segment.
_BUILD_LOCK = threading.Lock()


class Notifier(Protocol):
    """What a segment needs from RustNotify."""

    def watch(
        self, debounce_ms: int, step_ms: int, timeout_ms: int, stop_event: threading.Event | None
    ) -> set[tuple[int, str]] | str: ...

    def close(self) -> None: ...


def rust_notify(paths: list[str]) -> Notifier:
    """A non-recursive RustNotify over ``paths`` (inotify; permission errors ignored).
    The one place kbd builds watchfiles' private ``RustNotify`` (its version is
    bounded in pyproject.toml; tests/unit/test_dependency_internals.py)."""
    notifier: Notifier = RustNotify(paths, False, False, 50, False, True)
    return notifier


def inotify_fds() -> set[int]:
    """This process's inotify file descriptors."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:inotify":
                out.add(int(name))
    return out


def watched_inodes(fds: Iterable[int]) -> set[Ident]:
    """The (st_dev, st_ino) of everything the given inotify fds watch now."""
    out: set[Ident] = set()
    for fd in fds:
        try:
            with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as fh:
                out |= parse_inotify_fdinfo(fh.read())
        except OSError:
            continue
    return out


def folder_ident(path: str) -> Ident | None:
    """(st_dev, st_ino) of the real folder at ``path`` (never through a link), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def max_queued_events() -> int:
    try:
        with open("/proc/sys/fs/inotify/max_queued_events", encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 16384  # the kernel default


@dataclass
class _Segment:
    name: str
    paths: tuple[str, ...]
    recorded: dict[str, Ident] = field(default_factory=dict)  # path -> folder watched at build
    fds: set[int] = field(default_factory=set)
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    generation: int = 0
    beat: float = 0.0
    broken: tuple[str, str] | None = None  # (reason, detail)
    failures: int = 0
    retry_at: float = 0.0
    healthy_since: float = 0.0
    watches: int = 0
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))


class Watcher:
    """Segments of non-recursively watched folders, each drained by a thread,
    supervised: every failure is reported through ``on_health`` and repaired by
    a rebuild with backoff. Thread-safe."""

    def __init__(
        self,
        *,
        on_batch: Callable[[WatchBatch], None],
        on_health: Callable[[WatchHealth], None],
        debounce_ms: int = 100,
        step_ms: int = 25,
        source: Callable[[list[str]], Notifier] = rust_notify,
        check_interval: float = 10.0,
        stall_after: float = 2.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        lossy_at: int | None = None,
    ) -> None:
        self._on_batch = on_batch
        self._on_health = on_health
        self._debounce_ms = debounce_ms
        self._step_ms = step_ms
        self._source = source
        self._check_interval = check_interval
        self._stall_after = stall_after
        self._watch_timeout_ms = max(20, min(_WATCH_TIMEOUT_MS, int(stall_after * 250)))
        self._backoff = (backoff_initial, backoff_max)
        self._lossy_at = lossy_at if lossy_at is not None else lossy_threshold(max_queued_events())
        self._lock = threading.RLock()
        self._segments: dict[str, _Segment] = {}
        self._running = False
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._last_health: WatchHealth | None = None
        # Health reports wait here and are handed to on_health by the supervisor
        # thread only, outside the lock: a consumer may call back into the
        # watcher, or take its own locks, without any risk of deadlock.
        self._pending: deque[WatchHealth] = deque()
        self._next_check = 0.0

    # -- public API --------------------------------------------------------
    def set_segment(self, name: str, paths: Iterable[Path | str]) -> None:
        """Watch exactly ``paths`` (folders; missing ones are skipped) as segment
        ``name``, replacing what it watched before; no paths removes it.

        While the watcher runs, the new watch is in place when this returns (or
        the segment is reported unhealthy). The old watch ends first (it drops
        what it had not delivered yet), so a change made during the call may
        raise no event at all: the caller looks at the folders once more after
        it (the daemon verifies)."""
        wanted = tuple(sorted({str(p) for p in paths}))
        with self._lock:
            old = self._segments.pop(name, None)
            if old is not None:
                self._halt(old)
            if not wanted:
                self._report()
                return
            segment = _Segment(name, wanted)
            if old is not None:
                segment.failures, segment.generation = old.failures, old.generation
            self._segments[name] = segment
            if self._running:
                self._launch(segment)
            self._report()

    def start(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
            self._closing.clear()
            for segment in self._segments.values():
                self._launch(segment)
            self._next_check = time.monotonic() + self._check_interval
            self._supervisor = threading.Thread(
                target=self._supervise, name="kbd-watch-supervisor", daemon=True
            )
            self._supervisor.start()
            self._report()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every thread and release every watch (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._running = False
            self._closing.set()
        supervisor = self._supervisor
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout)
        self._deliver_health()  # the supervisor is gone: nobody else delivers now
        with self._lock:  # and no rebuild can start a thread
            threads = []
            for segment in self._segments.values():
                segment.stop.set()
                if segment.thread is not None:
                    threads.append(segment.thread)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def check(self) -> WatchHealth:
        """Check every segment now (thread alive and not stalled, every folder
        watched, every watched path still the folder that was watched); report
        and schedule repairs for what failed. Returns the overall health."""
        with self._lock:
            now = time.monotonic()
            for segment in list(self._segments.values()):
                if segment.broken is None:
                    self._check_alive(segment, now)
                if segment.broken is None:
                    self._check_coverage(segment)
            return self._report()

    def health(self) -> WatchHealth:
        with self._lock:
            return self._overall()

    # -- segments ----------------------------------------------------------
    def _launch(self, segment: _Segment) -> None:
        """Build the segment's notifier and start its thread (lock held)."""
        segment.generation += 1
        segment.stop = threading.Event()
        segment.broken = None
        existing = [p for p in segment.paths if folder_ident(p) is not None]
        segment.recorded = {p: ident for p in existing if (ident := folder_ident(p)) is not None}
        segment.thread = None
        segment.fds = set()
        if not segment.recorded:
            return  # nothing to watch (yet): the owner sets the segment again when there is
        try:
            with _BUILD_LOCK:
                before = inotify_fds()
                notifier = self._source(list(segment.recorded))
                segment.fds = inotify_fds() - before
        except FileNotFoundError as exc:  # a folder vanished between the check and the build
            self._fail(segment, BUILD_FAILED, f"a folder vanished during the build: {exc}")
            return
        except OSError as exc:
            reason = WATCH_LIMIT if "limit" in str(exc).lower() else BUILD_FAILED
            self._fail(segment, reason, f"cannot watch the segment's folders: {exc}")
            return
        segment.beat = time.monotonic()
        segment.healthy_since = segment.beat
        thread = threading.Thread(
            target=self._drain,
            args=(segment, notifier, segment.generation, segment.stop),
            name=f"kbd-watch-{segment.name}",
            daemon=True,
        )
        segment.thread = thread
        thread.start()
        self._check_coverage(segment)

    def _halt(self, segment: _Segment) -> None:
        """Stop a segment's thread and wait (briefly) until it released its
        watches, so a rebuild does not hold the old and the new ones at once."""
        segment.stop.set()
        thread = segment.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN)

    def _drain(self, segment: _Segment, notifier: Notifier, generation: int, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                segment.beat = time.monotonic()
                result = notifier.watch(self._debounce_ms, self._step_ms, self._watch_timeout_ms, stop)
                if isinstance(result, str):
                    continue  # "timeout" (heartbeat), "stop", or "signal" (not delivered to threads)
                self._deliver(segment, generation, result)
        except Exception as exc:  # any failure kills the segment: report it, never raise
            with self._lock:
                if segment.generation == generation and not stop.is_set():
                    self._fail(segment, WATCHER_DIED, f"{type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):
                notifier.close()

    def _deliver(self, segment: _Segment, generation: int, raw: set[tuple[int, str]]) -> None:
        changes = to_changes(raw)
        now = time.monotonic()
        segment.history.append((now, len(changes)))
        lossy = is_lossy(burst_size(segment.history, now=now), threshold=self._lossy_at)
        # Delivered even from a thread that was replaced meanwhile: a batch is only
        # a hint of where to look, and a late one is better than none.
        self._on_batch(WatchBatch(segment.name, changes, lossy))
        with self._lock:
            if segment.generation != generation:
                return
            if lossy:
                segment.history.clear()
                self._fail(
                    segment, QUEUE_OVERFLOW, f"{len(changes)} changes in one burst: events were probably lost"
                )
                return
            for path in touched_watched(changes, segment.recorded):
                now_ident = folder_ident(path)
                if now_ident is not None and now_ident != segment.recorded[path]:
                    self._fail(
                        segment, FOLDER_REPLACED, f"{path} now names another folder than the one watched"
                    )
                    return

    # -- supervision ---------------------------------------------------------
    def _supervise(self) -> None:
        last = time.monotonic()
        while not self._closing.wait(_TICK):
            self._deliver_health()
            with self._lock:
                if not self._running:
                    return
                now = time.monotonic()
                if now - last > self._stall_after / 2:
                    # The supervisor was not scheduled either (the whole process was
                    # stopped or starved): nobody is stuck; start the clocks again.
                    for segment in self._segments.values():
                        segment.beat = max(segment.beat, now)
                last = now
                for segment in list(self._segments.values()):
                    if segment.broken is not None:
                        if now >= segment.retry_at:
                            self._rebuild(segment)
                        continue
                    self._check_alive(segment, now)
                    if segment.broken is None and now - segment.healthy_since > _HEALTHY_RESET:
                        segment.failures = 0
                if now >= self._next_check:
                    self._next_check = now + self._check_interval
                    for segment in list(self._segments.values()):
                        if segment.broken is None:
                            self._check_coverage(segment)
                self._report()

    def _rebuild(self, segment: _Segment) -> None:
        log.info("watch: rebuilding segment %s after %s", segment.name, segment.broken)
        self._halt(segment)
        self._launch(segment)
        self._report()

    def _check_alive(self, segment: _Segment, now: float) -> None:
        if not segment.recorded:
            return
        thread = segment.thread
        if thread is None or not thread.is_alive():
            self._fail(segment, WATCHER_DIED, "the watcher thread is gone")
        elif now - segment.beat > self._stall_after:
            self._fail(
                segment, STALLED, f"the watcher thread has not come back for {now - segment.beat:.1f} s"
            )

    def _check_coverage(self, segment: _Segment) -> None:
        watched = watched_inodes(segment.fds)
        segment.watches = len(watched)
        current = {p: folder_ident(p) for p in segment.recorded}
        result = coverage(segment.recorded, current, watched)
        reason = result.reason()
        if reason is not None:
            paths = result.replaced or result.unwatched
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            what = "now name other folders than the ones watched" if result.replaced else "have no watch"
            self._fail(
                segment,
                reason,
                f"{len(paths)} of {len(segment.recorded)} folders {what} ({segment.watches} watches): {shown}",
            )

    def _fail(self, segment: _Segment, reason: str, detail: str) -> None:
        """Mark a segment broken and schedule its rebuild (lock held, or from its
        own thread which takes it)."""
        with self._lock:
            if segment.broken is not None:
                return
            segment.failures += 1
            segment.broken = (reason, detail)
            segment.retry_at = time.monotonic() + backoff(
                segment.failures, initial=self._backoff[0], maximum=self._backoff[1]
            )
            if reason in (WATCHER_DIED, STALLED):
                segment.stop.set()  # dead or stuck; otherwise it keeps pushing what it still sees
            log.warning("watch: segment %s unhealthy (%s): %s", segment.name, reason, detail)
            self._report()

    # -- health ----------------------------------------------------------------
    def _overall(self) -> WatchHealth:
        watches = sum(s.watches for s in self._segments.values())
        expected = sum(len(s.recorded) for s in self._segments.values())
        for name in sorted(self._segments):
            segment = self._segments[name]
            if segment.broken is not None:
                reason, detail = segment.broken
                return WatchHealth(False, reason, watches, expected, segment=name, detail=detail)
        return WatchHealth(True, None, watches, expected)

    def _report(self) -> WatchHealth:
        """Tell ``on_health`` when the health changed (ok, reason or segment)."""
        health = self._overall()
        last = self._last_health
        key = (health.ok, health.reason, health.segment)
        if last is None or key != (last.ok, last.reason, last.segment):
            self._last_health = health
            self._pending.append(health)
        return health

    def _deliver_health(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                health = self._pending.popleft()
            try:
                self._on_health(health)
            except Exception:  # a consumer's bug must not stop supervision
                log.exception("watch: on_health callback failed")
