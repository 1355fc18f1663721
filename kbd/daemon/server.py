"""``kbd serve``: the composition root of the daemon.

kbd creates its Unix socket itself — socket 0660 with group ``kbd`` when that
group exists (else the daemon's own group), never uvicorn's 0666; a folder it
has to create for the socket is 0750 with the same group, and a folder that
already exists is never chmod-ed — or takes one from systemd socket activation
(``LISTEN_FDS``) or ``--fd``, and serves the API with uvicorn. Each
connection's peer uid (``SO_PEERCRED``) is attached to every request on it, for
uid-mapped authentication.

Live state (docs/daemon.md): at start the daemon opens the root's event log
(``state/events.log``), appends ``resync`` with reason ``restart`` (subscribers
cannot know what they missed while no daemon ran), and starts
:class:`kbd.service.live.LiveState` (the watcher, the verifier, pushed
revocation). Both are on the app's shared state for the routes:
``app.state.events`` (the :class:`~kbd.state.events.EventLog`) and
``app.state.live`` (the LiveState).

Lifecycle: SIGTERM and SIGINT stop the server gracefully: it stops accepting,
stops the watcher, gives the commands the daemon runs itself (the drain hooks
in ``app.state.drain``, each awaited with ``revocation.grace_seconds``) that
long to finish before they are terminated, finishes in-flight requests, removes
its socket and exits 0. Commands started by an in-process ``kbd exec`` are not
the daemon's: they keep running, and sessions survive restarts.

Logs (docs/daemon.md "Logs and metrics"): ``--log-level`` (``KBD_LOG_LEVEL``; default info)
and :func:`kbd.daemon.journal.configure`: journald's native protocol when stderr is
the journal (``$JOURNAL_STREAM``), else text on stderr; uvicorn's own loggers
go the same way (it configures no handlers of its own), and its access log is
off: :class:`kbd.daemon.access_log.AccessLog` writes one line per request instead.

No client can starve the others (docs/api.md "Limits"): the open-file limit is
raised to its hard limit at start; connections are capped per peer uid and in
total, and a connection over a cap is answered 503 and closed at once (its
descriptor never lingers); a request whose headers do not arrive within
``HEADER_TIMEOUT`` is answered 408 and closed, and an idle keep-alive
connection is closed after ``KEEP_ALIVE_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from kbd.daemon import journal
from kbd.daemon.broker import Broker
from kbd.daemon.limits import (
    BACKLOG,
    KEEP_ALIVE_TIMEOUT,
    ConnectionLimits,
    connection_caps,
    raise_nofile_limit,
)
from kbd.daemon.listen import bind_socket, inherited_socket
from kbd.daemon.protocol import PeerCredProtocol
from kbd.daemon.routes import create_app
from kbd.sandbox import cgroup, spawn
from kbd.service.live import LiveState
from kbd.service.root import Root
from kbd.state import audit
from kbd.state.events import EventLog

DrainHook = Callable[[float], Awaitable[None]]


class KbdServer(uvicorn.Server):
    """uvicorn's server with kbd's shutdown order: stop accepting, stop the
    watcher, drain the daemon's own commands (``grace`` seconds, then
    terminated), then uvicorn's own shutdown (in-flight requests)."""

    def __init__(self, config: uvicorn.Config, *, live: LiveState | None, drain: list[DrainHook],
                 grace: Callable[[], float],
                 on_start: Callable[[asyncio.AbstractEventLoop], None] | None = None) -> None:  # fmt: skip
        super().__init__(config)
        self.live = live
        self.drain = drain
        self.grace = grace
        self.on_start = on_start

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_start is not None:
            self.on_start(asyncio.get_running_loop())
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connection from here on (uvicorn's shutdown repeats it harmlessly)
        if self.live is not None:
            await asyncio.to_thread(self.live.stop)
        grace = self.grace()
        for hook in self.drain:
            try:
                await hook(grace)
            except Exception:  # one hook's failure must not keep the daemon from stopping
                logging.getLogger("kbd.daemon").exception("drain hook failed")
        await super().shutdown(sockets)


class LauncherKeeper:
    """The broker's launcher (:mod:`kbd.sandbox.spawn`), kept running.

    It is started on the main thread, and restarted there (through the event
    loop, with a backoff of 1 s doubling to 30 s) when it dies: its
    parent-death signal follows the thread that spawned it, and only the
    main thread lives as long as the daemon. Meanwhile commands take the
    slower in-daemon start. The old one is closed on a worker thread (its
    stub cgroups are swept)."""

    def __init__(self, broker: Broker, host: Root) -> None:
        self.broker = broker
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.backoff = 1.0
        self.since = 0.0

    def start(self) -> None:
        from kbd.sandbox import staging

        # Staging layers of commands a killed daemon never finished: nothing of
        # them was committed, and nothing will be (docs/notes.md "Staged contributions").
        staging.sweep(self.host.config.state_dir)
        self._install()
        if self.broker.launcher is not None:
            # Ready means fast: the first commands find their stubs waiting (a
            # pool that cannot fill only means the slower start).
            self.broker.launcher.ready.wait(spawn.START_TIMEOUT)

    def _install(self) -> None:
        launcher = spawn.Launcher.start(cgroup.detect(), self.host.config.limits)
        if launcher is not None:
            launcher.on_death = self._died
        self.broker.launcher = launcher
        self.since = time.monotonic()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def _died(self) -> None:  # the launcher's reader thread
        loop = self.loop
        if self.stopping or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing: so is the daemon
            loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:  # the main thread
        if time.monotonic() - self.since > 60:
            self.backoff = 1.0  # it ran a good while: no crash loop
        if self.loop is not None:
            self.loop.call_later(self.backoff, self._restart)
        self.backoff = min(self.backoff * 2, 30.0)

    def _restart(self) -> None:  # the main thread
        if self.stopping:
            return
        old = self.broker.launcher
        logging.getLogger("kbd.daemon").warning("the exec launcher died; starting a new one")
        self._install()
        if old is not None:
            threading.Thread(target=old.close, name="kbd-launcher-close", daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        launcher = self.broker.launcher
        if launcher is not None:
            launcher.on_death = None
            launcher.close()


def start_live(host: Root, app: FastAPI) -> tuple[EventLog, LiveState]:
    """Start the live state under the API's state lock, reporting to the API's
    change feed (one event log per daemon; :func:`kbd.daemon.routes.create_app` opened it
    and appended ``resync`` with reason ``restart``)."""
    state = app.state.kbd
    events: EventLog = state.event_log
    live = LiveState(host, state.sessions, lock=state.lock, events=state.feed)
    app.state.events = events
    app.state.live = live
    app.state.drain = []
    live.start()
    return events, live


def uvicorn_level(level: int) -> int:
    """uvicorn's own loggers: its INFO lines (server process started, …)
    repeat what kbd says; shown from ``debug`` on."""
    return level if level <= logging.DEBUG else max(level, logging.WARNING)


def serve(host: Root, *, socket_path: Path | None = None, fd: int | None = None, ready: bool = True,
          log_level: int = logging.INFO) -> None:  # fmt: skip
    """Serve the API until SIGTERM/SIGINT (see the module docstring). Logs
    at ``log_level`` and above go to journald or stderr (:func:`kbd.daemon.journal.configure`),
    one access line per request through ``kbd.daemon.access_log`` at INFO."""
    journal.configure(log_level)
    nofile = raise_nofile_limit()
    total, per_uid = connection_caps(nofile)
    PeerCredProtocol.limits = ConnectionLimits(total=total, per_uid=per_uid)
    sock = inherited_socket(fd)
    path = None
    if sock is None:
        path = socket_path or host.config.socket_path
        sock = bind_socket(path)
    try:
        app = create_app(host)
        events, live = start_live(host, app)
        state = app.state.kbd
        # One root view for the API, the live state and the broker: the plan a
        # brokered command runs under is the one pushed revocation re-checks.
        # The broker sweeps a dead daemon's cgroups before the launcher starts.
        broker = Broker(host, state.sessions, lock=state.lock, counted=state.counted)
        audit.observe(state.counted.audited)  # note writes and gate refusals (docs/daemon.md "Metrics")
        keeper = LauncherKeeper(broker, host)
        keeper.start()
    except BaseException:
        sock.close()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    PeerCredProtocol.broker = broker
    # Brokered commands get revocation.grace_seconds once accepting and watching
    # have stopped, then their trees are killed (KbdServer.shutdown's drain hooks).
    app.state.drain.append(lambda grace: asyncio.to_thread(broker.drain, grace))
    # log_config=None: uvicorn's loggers propagate to the handler kbd installed
    # (journald or stderr) instead of uvicorn configuring handlers of its own.
    config = uvicorn.Config(app, http=PeerCredProtocol, log_level=uvicorn_level(log_level), log_config=None,
                            lifespan="off",
                            timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
                            backlog=BACKLOG, access_log=False)  # fmt: skip
    server = KbdServer(config, live=live, drain=app.state.drain, grace=lambda: host.config.revoke_grace,
                       on_start=keeper.bind)  # fmt: skip
    # uvicorn.Server.serve captures SIGTERM/SIGINT (stop accepting, finish
    # in-flight requests) and re-raises the signal once it has stopped. These
    # handlers cover the moments outside that capture — from the readiness
    # line until uvicorn installs its own, and the re-raise — by asking the
    # server to stop (an exception raised from a handler could land inside an
    # event-loop callback, which asyncio would log and swallow).

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ready:
            # The socket is listening already (connections queue until the loop
            # accepts them), so this line is a truthful readiness signal for
            # scripts and tests.
            print(f"kbd: serving on {path or f'fd {sock.fileno()}'}", flush=True)
        asyncio.run(server.serve(sockets=[sock]))
        # Idempotent: the graceful shutdown drained already; a shutdown that
        # never ran its hooks still must not leave brokered commands behind.
        broker.drain(host.config.revoke_grace)
    finally:
        PeerCredProtocol.broker = None
        keeper.stop()  # unused stubs and their cgroups go with the launcher
        with contextlib.suppress(OSError):
            broker.sessions.commands.drop_spares()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        live.stop()  # idempotent: already stopped by a graceful shutdown
        events.close()
        sock.close()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        print("kbd: stopped", file=sys.stderr, flush=True)
