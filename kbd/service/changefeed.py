"""The daemon's change feed (docs/daemon.md): its :class:`kbd.service.events.EventSink`,
and delivery to subscribers of ``GET /v1/events``.

One shared :class:`kbd.state.events.EventLog` holds every event, whoever
appended it: the daemon (its own operations, its manifest diffs) or a CLI
process on the root. A single pump task follows the log (woken at once by the
daemon's own appends, and by a stat of the file every ``poll_interval`` for
the others) and hands each new event to every subscriber's bounded queue.

Delivery decides visibility *when an event is delivered*, replays included:
the subscriber's credentials are authenticated again against the current
principals, and each event's workflow is looked up in the registry now
(:func:`kbd.service.events.may_see`). A reader removed from a source's audience
stops receiving its events at the next event, and a replay never shows what
the subscriber may no longer see. The state lock is taken only for those
lookups, never while waiting for events, and never for more than
``LOOKUP_BATCH`` of them at a time: the decision itself is made on the
snapshot the lookups took, outside the lock.

Continuity: a subscriber that presents a ``Last-Event-ID`` gets exactly the
events after it, in order, then the live ones; where that cannot be promised
(an id of another epoch, older than the daemon's in-memory ring of the newest
events reaches, a queue that overflowed because the subscriber did not read)
it gets ``resync`` carrying the id to resume from after reloading its state. A
daemon start appends ``resync`` (``restart``) for everyone: what the watcher
would have seen while no daemon ran is not in the log.

What a subscriber costs is bounded (docs/daemon.md "The change feed", docs/multi-user.md "Threat model"): a
replay comes from the ring only (the log files are never read for
a subscriber), and :class:`StreamLimits` caps streams per peer uid and
replays (:func:`kbd.core.events.is_replay`) in all and per uid, answering one
more with :class:`kbd.errors.StreamLimit` before its stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio.to_thread

from kbd.core.events import (
    CHUNK,
    RESYNC,
    STREAM_CAPS,
    Event,
    FieldValue,
    Resync,
    StreamCaps,
    check_event,
    is_replay,
    parse_id,
    resync_event,
    stream_refusal,
)
from kbd.errors import KbdError, StreamLimit
from kbd.fs.registry import Ambiguous, Found
from kbd.service.events import ManifestTracker, may_see, sees_every_workflow

if TYPE_CHECKING:
    from kbd.core.manifest import Manifest
    from kbd.core.principals import Principal
    from kbd.service.root import Root
    from kbd.state.events import EventLog

log = logging.getLogger("kbd.events")

#: Events a subscriber may have waiting; beyond, its queue is dropped for one ``resync``.
QUEUE_SIZE = 1024
#: How soon an event appended by another process (the CLI) is noticed.
POLL_INTERVAL = 0.25
#: A keep-alive comment this often on an idle stream: under the daemon's
#: write-stall timeout, and it tells a subscriber the daemon is still there.
PING_INTERVAL = 15.0
#: Workflows looked up per hold of the state lock when deciding what a
#: subscriber may see (the lock is released, and others served, between holds).
LOOKUP_BATCH = 16
#: A finite replay without an id (``kbd events``): at most this many recent events.
RECENT = 1000
#: How long a delivery waits for the state lock before it ends the stream (the
#: subscriber resumes from its last id: nothing is lost).
LOCK_WAIT = 2.0
PING = b": ping\n\n"

#: Re-authenticates the subscriber now: its principal, or None to end the stream.
Who = Callable[[], "Principal | None"]
#: A peer uid (``SO_PEERCRED``); None when the transport has none.
Uid = int | None
T = TypeVar("T")


class Subscriber:
    """One subscriber's bounded queue (used on the event loop only)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queue: deque[Event] = deque()
        self.ready = asyncio.Event()

    def push(self, event: Event) -> None:
        if len(self.queue) >= self.size:
            # It did not read: drop what waits, and tell it to reload. The
            # resync carries this event's id, which a reload covers.
            self.queue.clear()
            self.queue.append(resync_event(event.id, "overflow", ns=time.time_ns()))
        else:
            self.queue.append(event)
        self.ready.set()

    def take(self, n: int) -> list[Event]:
        out: list[Event] = []
        while self.queue and len(out) < n:
            out.append(self.queue.popleft())
        return out


class StreamLimits:
    """Open event streams and replays in progress, per peer uid and in all,
    against :class:`kbd.core.events.StreamCaps`. Used on the event loop only
    (like the daemon's connection caps), so it needs no lock."""

    def __init__(self, caps: StreamCaps = STREAM_CAPS) -> None:
        self.caps = caps
        self.streams: Counter[Uid] = Counter()
        self.replays: Counter[Uid] = Counter()

    def check(self, uid: Uid, *, replay: bool) -> None:
        """Raise StreamLimit unless one more stream (``replay``: starting with a replay) is admitted."""
        refusal = stream_refusal(self.caps, uid_streams=self.streams[uid], replay=replay,
                                 replays=sum(self.replays.values()), uid_replays=self.replays[uid])  # fmt: skip
        if refusal is not None:
            raise StreamLimit(refusal.message, hint=refusal.hint)

    def admit(self, uid: Uid, *, replay: bool) -> Ticket:
        self.check(uid, replay=replay)
        self.streams[uid] += 1
        if replay:
            self.replays[uid] += 1
        return Ticket(self, uid, replay=replay)

    @staticmethod
    def _drop(counter: Counter[Uid], uid: Uid) -> None:
        counter[uid] -= 1
        if counter[uid] <= 0:
            del counter[uid]


class Ticket:
    """One admitted stream's slots: its replay slot is given back when the
    replay has been sent, its stream slot when the stream ends (both once)."""

    def __init__(self, limits: StreamLimits, uid: Uid, *, replay: bool) -> None:
        self._limits, self._uid = limits, uid
        self._replay, self._open = replay, True

    def replayed(self) -> None:
        if self._replay:
            self._replay = False
            self._limits._drop(self._limits.replays, self._uid)

    def close(self) -> None:
        self.replayed()
        if self._open:
            self._open = False
            self._limits._drop(self._limits.streams, self._uid)


class Subscription:
    """An admitted subscriber: its queue (already receiving live events), the
    backlog to send first, and its slots. :meth:`close` (idempotent) leaves."""

    def __init__(self, feed: Feed, sub: Subscriber, backlog: list[Event], ticket: Ticket | None) -> None:
        self.feed, self.sub, self.backlog, self.ticket = feed, sub, backlog, ticket

    def replayed(self) -> None:
        if self.ticket is not None:
            self.ticket.replayed()

    def close(self) -> None:
        self.feed._subs.discard(self.sub)
        if self.ticket is not None:
            self.ticket.close()


def _workflows_of(event: Event) -> tuple[str, ...]:
    """Every workflow a subscriber must be able to see to receive ``event``: its own, and for an
    access request the consumer too (docs/daemon.md "The change feed")."""
    second = event.fields.get("consumer")
    own = () if event.workflow_id is None else (event.workflow_id,)
    return (*own, second) if isinstance(second, str) else own


def _manifest_of(manifests: dict[str, Manifest | None], workflow_id: str | None) -> Manifest | None:
    return manifests.get(workflow_id) if workflow_id is not None else None


def _after(last: tuple[str, int] | None, event: Event) -> bool:
    """Is ``event`` news for a subscriber that has seen up to ``last``? An
    event of another epoch always is (the log was recreated)."""
    if last is None:
        return True
    parsed = parse_id(event.id)
    return parsed is None or parsed[0] != last[0] or parsed[1] > last[1]


class Feed:
    """The daemon's event sink and its subscribers (see the module docstring).

    ``lock`` is the daemon's state lock: the registry and principals are read
    under it when deciding who sees an event. ``caps``: what :meth:`open`
    admits (:attr:`limits`)."""

    def __init__(
        self,
        host: Root,
        log: EventLog,
        *,
        lock: threading.RLock,
        queue_size: int = QUEUE_SIZE,
        poll_interval: float = POLL_INTERVAL,
        caps: StreamCaps = STREAM_CAPS,
    ) -> None:
        self.host = host
        self.log = log
        self.lock = lock
        self.queue_size = queue_size
        self.poll_interval = poll_interval
        self.tracker = ManifestTracker()
        self.limits = StreamLimits(caps)
        self.lost = 0  # events that could not be appended (each answered with a resync)
        self._subs: set[Subscriber] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._pump: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self._cursor = ""
        self._file_sig: tuple[int, int, int] | None = None
        self._failing = False

    # -- EventSink: called by the operations, on any thread ----------------------------------

    def emit(self, event_type: str, /, *, workflow_id: str | None, **fields: FieldValue) -> None:
        check_event(event_type, workflow_id, fields)  # a producer bug is never swallowed
        self._append([(event_type, workflow_id, fields)])

    def resync(self, reason: str) -> None:
        self.emit(RESYNC, workflow_id=None, reason=reason)

    def manifest_saved(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> None:
        self.observe(workflow_id, old, new, folder=folder)

    def observe(
        self, workflow_id: str, old: Manifest | None, new: Manifest | None, *, folder: Path | None = None
    ) -> tuple[str, ...]:
        """The one producer of manifest events: the daemon's own saves and the
        watcher (for every workflow whose manifest it saw change, and every
        entry of a ``RegistryDelta.changed``) report here; a change already
        reported gives nothing. Returns the event types appended."""
        types = self.tracker.observe(workflow_id, old, new, folder=folder)
        if types:
            self._append([(t, workflow_id, {}) for t in types])
        return types

    def _append(self, items: Sequence[tuple[str, str | None, dict[str, FieldValue]]]) -> None:
        try:
            self.log.append_many(items)
        except (KbdError, OSError):
            # The operation happened; its notice did not make it into the log.
            # Subscribers cannot be told which, so they all reload.
            self.lost += len(items)
            self._call_soon(self._broadcast_resync, "event-lost")
            return
        self._call_soon(self._wake)

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between: the daemon is stopping
                return

    # -- the pump: on the event loop ---------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _broadcast_resync(self, reason: str) -> None:
        event = resync_event(self._cursor, reason, ns=time.time_ns()) if self._cursor else None
        if event is not None:
            for sub in list(self._subs):
                sub.push(event)

    async def _ensure_pump(self) -> None:
        async with self._starting:
            if self._pump is not None and not self._pump.done():
                return
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._cursor = await anyio.to_thread.run_sync(lambda: self.log.last_id)
            self._file_sig = self._stat()
            self._pump = self._loop.create_task(self._run(), name="kbd-events-pump")

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.log.path, follow_symlinks=False)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            try:
                await asyncio.wait_for(self._wakeup.wait(), self.poll_interval)
            except TimeoutError:
                sig = self._stat()
                if sig == self._file_sig:
                    continue  # nobody else appended
            self._wakeup.clear()
            self._file_sig = self._stat()
            try:
                await self._pump_once()
            except (KbdError, OSError):
                # The log cannot be read now (a failing disk, a lock held too
                # long): the pump tries again; subscribers hear it once per streak.
                if not self._failing:
                    log.warning("the event log cannot be read now; retrying", exc_info=True)
                    self._broadcast_resync("event-log-error")
                self._failing = True
                self._wakeup.set()
                await asyncio.sleep(self.poll_interval)
            else:
                self._failing = False

    async def _pump_once(self) -> None:
        result = await anyio.to_thread.run_sync(self.log.since, self._cursor)
        if isinstance(result, Resync):
            # The log cannot continue from where the pump was (recreated,
            # another epoch): everyone reloads and continues from its end.
            self._cursor = await anyio.to_thread.run_sync(lambda: self.log.last_id)
            self._broadcast_resync(result.reason)
            return
        for i, event in enumerate(result.events, start=1):
            for sub in list(self._subs):
                sub.push(event)
            self._cursor = event.id
            if i % CHUNK == 0:
                await asyncio.sleep(0)  # let subscribers drain between chunks

    # -- subscribing ----------------------------------------------------------------------------

    def _replay(self, last_id: str) -> list[Event]:
        """The events after ``last_id`` from the ring (never the files: a
        subscriber costs at most the ring), or one ``resync`` carrying the id
        to resume from (``too-old`` when the ring does not reach back to it)."""
        result = self.log.since(last_id, files=False)
        if isinstance(result, Resync):
            return [resync_event(self.log.last_id, result.reason, ns=time.time_ns())]
        return list(result.events)

    def _recent(self) -> list[Event]:
        return list(self.log.recent(RECENT))

    async def open(
        self, who: Who, *, since: str | None, follow: bool, uid: Uid = None, limited: bool = True
    ) -> Subscription:
        """Admit one subscriber and read its backlog: the events after
        ``since`` (without it: none, or with ``follow=False`` the recent ones).
        With ``limited``, :attr:`limits` decide first, so a refusal
        (StreamLimit) comes before any stream starts. Send it with
        :meth:`frames`, and :meth:`Subscription.close` it in any case."""
        if limited:
            self.limits.check(uid, replay=False)  # refused before any work
        await self._ensure_pump()
        sub = Subscriber(self.queue_size)
        self._subs.add(sub)  # before the replay is read: nothing falls between the two
        try:
            backlog: list[Event] = []
            if since is not None:
                backlog = await anyio.to_thread.run_sync(self._replay, since)
            elif not follow:
                backlog = await anyio.to_thread.run_sync(self._recent)
            ticket = self.limits.admit(uid, replay=is_replay(len(backlog))) if limited else None
        except BaseException:
            self._subs.discard(sub)
            raise
        return Subscription(self, sub, backlog, ticket)

    async def frames(
        self, subscription: Subscription, who: Who, *, follow: bool, ping: float = PING_INTERVAL
    ) -> AsyncGenerator[bytes, None]:
        """Server-Sent Events frames for an opened subscriber: its backlog, a
        chunk at a time (its replay slot is given back once the backlog is
        sent), then, with ``follow``, the live events and a keep-alive comment
        every ``ping`` seconds. Ends when the subscriber may no longer
        authenticate, or the state lock stays busy (it resumes from its id);
        the subscription is closed when it ends."""
        sub = subscription.sub
        backlog, subscription.backlog = subscription.backlog, []
        last: tuple[str, int] | None = None
        try:
            yield b": kbd events\n\n"  # the stream is open (headers and a first byte now)
            while True:
                for start in range(0, len(backlog), CHUNK):
                    fresh = [e for e in backlog[start : start + CHUNK] if _after(last, e)]
                    if not fresh:
                        continue
                    last = parse_id(fresh[-1].id)
                    shown = await self._visible(who, fresh)
                    if shown is None:
                        return
                    if shown:
                        yield b"".join(event.sse() for event in shown)  # one write a chunk
                backlog = []
                subscription.replayed()
                if not follow:
                    return
                if not sub.queue:
                    sub.ready.clear()
                    try:
                        await asyncio.wait_for(sub.ready.wait(), ping)
                    except TimeoutError:
                        yield PING
                        continue
                backlog = sub.take(CHUNK)
        finally:
            subscription.close()

    async def stream(
        self, who: Who, *, since: str | None, follow: bool, ping: float = PING_INTERVAL
    ) -> AsyncIterator[bytes]:
        """:meth:`open` (without the caps: an in-process follower such as
        ``kbd ui`` on the root) and :meth:`frames` in one."""
        subscription = await self.open(who, since=since, follow=follow, limited=False)
        try:
            async with contextlib.aclosing(
                self.frames(subscription, who, follow=follow, ping=ping)
            ) as frames:
                async for frame in frames:
                    yield frame
        finally:
            subscription.close()

    async def _visible(self, who: Who, events: list[Event]) -> list[Event] | None:
        """The events the subscriber may see now (None: it may see nothing any
        more, or the state lock stayed busy). Its principal and the manifests
        of the events' workflows are read under the state lock, at most
        LOOKUP_BATCH lookups a hold; the decision is made outside it."""
        wids = list(dict.fromkeys(w for e in events for w in _workflows_of(e)))
        first = await self._locked(self._authenticate_and_look_up, who, wids[:LOOKUP_BATCH])
        if first is None:
            return None
        actor, manifests = first
        if actor is None:
            return None
        if not sees_every_workflow(actor):
            for start in range(LOOKUP_BATCH, len(wids), LOOKUP_BATCH):
                await asyncio.sleep(0)  # the lock is free between holds: others go first
                more = await self._locked(self._look_up, wids[start : start + LOOKUP_BATCH])
                if more is None:
                    return None
                manifests.update(more)
        return [
            e for e in events if all(may_see(actor, w, _manifest_of(manifests, w)) for w in _workflows_of(e))
        ]

    async def _locked(self, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)`` under the state lock (one short hold), or None when the
        lock stays busy for LOCK_WAIT. On the event loop when the lock is free
        (no thread-pool hop), else the wait moves to a worker thread."""
        if self.lock.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self.lock.release()

        def waited() -> T | None:
            if not self.lock.acquire(timeout=LOCK_WAIT):
                return None
            try:
                return fn(*args)
            finally:
                self.lock.release()

        return await anyio.to_thread.run_sync(waited)

    def _authenticate_and_look_up(
        self, who: Who, wids: list[str]
    ) -> tuple[Principal | None, dict[str, Manifest | None]]:
        actor = who()
        if actor is None or sees_every_workflow(actor):
            return actor, {}
        return actor, self._look_up(wids)

    def _look_up(self, wids: list[str]) -> dict[str, Manifest | None]:
        return {wid: self._manifest(wid) for wid in wids}

    def _manifest(self, workflow_id: str) -> Manifest | None:
        """The workflow's manifest now; the last one seen when it was removed or
        cannot be read now; None (hidden) when two folders claim the ID."""
        try:
            found = self.host.registry.find(workflow_id)
        except (KbdError, OSError):
            found = None
        if isinstance(found, Found):
            self.tracker.remember(found.manifest)
            return found.manifest
        if isinstance(found, Ambiguous):
            return None  # fail closed, as every lookup of an ambiguous ID does
        return self.tracker.last_manifest(workflow_id)
