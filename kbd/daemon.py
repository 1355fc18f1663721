"""``kbd serve``: the composition root of the daemon.

kbd creates its Unix socket itself — socket 0660 with group ``kbd`` when that
group exists (else the daemon's own group), never uvicorn's 0666; a folder it
has to create for the socket is 0750 with the same group, and a folder that
already exists is never chmod-ed — or takes one from systemd socket activation
(``LISTEN_FDS``) or ``--fd``, and serves the API with uvicorn. Each
connection's peer uid (``SO_PEERCRED``) is attached to every request on it, for
uid-mapped authentication.

Live state (DESIGN §9): at start the daemon opens the root's event log
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

Logs (issue 12, item 5): ``--log-level`` (``KBD_LOG_LEVEL``; default info)
and :func:`kbd.journal.configure`: journald's native protocol when stderr is
the journal (``$JOURNAL_STREAM``), else text on stderr; uvicorn's own loggers
go the same way (it configures no handlers of its own), and its access log is
off: :class:`kbd.access.AccessLog` writes one line per request instead.

No client can starve the others (issue 9, item 7): the open-file limit is
raised to its hard limit at start; connections are capped per peer uid and in
total, and a connection over a cap is answered 503 and closed at once (its
descriptor never lingers); a request whose headers do not arrive within
``HEADER_TIMEOUT`` is answered 408 and closed, and an idle keep-alive
connection is closed after ``KEEP_ALIVE_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import http
import logging
import os
import resource
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kbd import journal
from kbd.api import EVENTS_PATH, PEER_UID, create_app
from kbd.broker import Broker
from kbd.core import wire
from kbd.errors import (
    HeadersTooLarge,
    InvalidInput,
    KbdError,
    Overloaded,
    RequestTimeout,
    Unavailable,
    UnsafeSocketFolder,
    http_answer,
)
from kbd.sandbox import cgroup, spawn
from kbd.service.live import LiveState
from kbd.service.root import Root
from kbd.state.events import EventLog

SD_LISTEN_FDS_START = 3
SOCKET_GROUP = "kbd"
# A local client sends its request line and headers in one write; five seconds
# is generous and bounds how long a half-sent request can hold a descriptor.
HEADER_TIMEOUT = 5.0
# The body of a request (at most a few MiB: see kbd.api.MAX_BODY_BYTES) arrives
# in milliseconds over a local socket. Without a deadline, a request whose
# headers arrived but whose body never does holds its connection (one of the
# uid's capped slots) forever.
BODY_TIMEOUT = 10.0
# The request line and headers of an API request are a few hundred bytes (a
# bearer token, a path). The HTTP parser buffers a header until it ends, with
# no limit of its own: within the header timeout, one connection could make the
# daemon hold tens of MiB, and a uid's connections several GiB.
MAX_HEADER_BYTES = 64 * 1024
# A client that stops reading its answer (up to a 2 MiB file, or the event
# stream) makes the daemon hold the unsent bytes; 200 such connections held
# over 1 GiB for as long as they stayed open. An answer that makes no progress
# at all (the transport's buffer stays above its high-water mark) for this long
# is abandoned and the connection dropped.
WRITE_STALL_TIMEOUT = 15.0
KEEP_ALIVE_TIMEOUT = 5
# 64 concurrent API clients of one service principal are a budgeted load
# (DESIGN §8); four times that per uid leaves room, and needs several uids to
# reach the total cap. Descriptors the daemon needs besides connections (state
# files, locks, pinned folders, thread-pool work) are kept in reserve.
MAX_CONNECTIONS_PER_UID = 256
MAX_CONNECTIONS = 4096
# asyncio accepts up to BACKLOG connections per loop iteration before any of
# their connection_made runs (where the caps close them), so bursts of accepted
# descriptors need room beyond the cap: uvicorn's default of 2048 would let a
# flood reach EMFILE in a few iterations.
BACKLOG = 128
FD_RESERVE = 4 * BACKLOG + 256


# -- connection limits ------------------------------------------------------------------------


def raise_nofile_limit() -> int:
    """Raise the soft open-file limit to the hard one (a service's default soft
    limit of 1024 is soon exhausted by connections); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return MAX_CONNECTIONS + FD_RESERVE if soft == resource.RLIM_INFINITY else soft


def connection_caps(nofile: int) -> tuple[int, int]:
    """The (total, per-uid) connection caps for an open-file limit of ``nofile``:
    never so many connections that accepting one more could fail with EMFILE,
    and no uid allowed more than a quarter of them."""
    total = max(16, min(MAX_CONNECTIONS, nofile - FD_RESERVE))
    return total, max(4, min(MAX_CONNECTIONS_PER_UID, total // 4))


class ConnectionLimits:
    """Counts open connections, in total and per peer uid (``None``: peer unknown).

    Only the event loop thread uses it (protocol callbacks), so it needs no lock.
    """

    def __init__(self, *, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self.open: Counter[int | None] = Counter()

    def admit(self, uid: int | None) -> bool:
        if sum(self.open.values()) >= self.total or self.open[uid] >= self.per_uid:
            return False
        self.open[uid] += 1
        return True

    def release(self, uid: int | None) -> None:
        self.open[uid] -= 1
        if self.open[uid] <= 0:
            del self.open[uid]


def error_response(err: KbdError, *, extra: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 response with the API's answer to ``err`` (the one
    mapping, :func:`kbd.errors.http_answer`), closing the connection: for
    answers given before (or without) the application. ``extra``: more
    headers (the broker's ``x-kbd-exit``)."""
    code, envelope, headers = http_answer(err)
    headers = {**headers, **(extra or {})}
    body = orjson.dumps(envelope)
    status = http.HTTPStatus(code)
    lines = "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items())
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{lines}\r\n"
    )
    return head.encode("ascii") + body


OVER_CAP = error_response(
    Overloaded("too many open connections from this client", hint="close idle connections and retry")
)
HEADERS_TOO_SLOW = error_response(
    RequestTimeout(f"the request headers did not arrive within {HEADER_TIMEOUT:g}s")
)
HEADERS_TOO_LARGE = error_response(
    HeadersTooLarge(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")
)
BODY_TOO_SLOW = error_response(
    RequestTimeout(
        f"the request body did not arrive within {BODY_TIMEOUT:g}s",
        hint="send the whole request body at once",
    )
)


class _PeerApp:
    """Adds the connection's peer uid to every ASGI scope of that connection."""

    def __init__(self, app: ASGIApp, uid: int | None) -> None:
        self.app = app
        self.uid = uid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.uid is not None and scope.get("type") in ("http", "websocket"):
            scope = {**scope, PEER_UID: self.uid}
        await self.app(scope, receive, send)


def _peer_uid(transport: asyncio.Transport) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return int(struct.unpack("3i", creds)[1])
    return None


class PeerCredProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (a C HTTP parser: the API's hot path is
    per-request overhead) with the peer's uid attached to every request, the
    connection caps, a header timeout, and the API's error envelope on a
    request the parser rejects."""

    limits: ConnectionLimits = ConnectionLimits(total=MAX_CONNECTIONS, per_uid=MAX_CONNECTIONS_PER_UID)
    broker: Broker | None = None  # set by serve(): where exec connections go
    _uid: int | None = None
    _sniff: socket.socket | None = None  # a dup of the connection while its first bytes are peeked
    _admitted = False
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0  # received while the current request's headers are incomplete
    _write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        uid = _peer_uid(transport)
        self._uid = uid
        self.app = _PeerApp(self.app, uid)
        super().connection_made(transport)
        if not self.limits.admit(uid):
            # Refused before anything is parsed: the descriptor is freed now,
            # not when the client gives up.
            transport.write(OVER_CAP)
            transport.close()
            return
        self._admitted = True
        self._arm_header_timer()
        self._start_sniff(transport)

    # -- the front door: exec requests go to the broker ---------------------------------------
    # asyncio adds the transport's reader in the callback right after
    # connection_made, paused or not (Python 3.11), and nothing can have been
    # read before it: the read is stopped again in the next callback
    # (_hold_paused), before the loop polls, and the first bytes are peeked
    # (MSG_PEEK) on a dup of the socket. An exec request (wire.SNIFF) goes to
    # the broker with its socket — and the SCM_RIGHTS descriptors still queued
    # with its first bytes, which uvicorn's recv() would have dropped; anything
    # else resumes and uvicorn parses it as before. The header timer covers the
    # peek.
    def _start_sniff(self, transport: asyncio.Transport) -> None:
        sock = transport.get_extra_info("socket")
        if self.broker is None or sock is None or sock.family != socket.AF_UNIX:
            return
        transport.pause_reading()
        self.loop.call_soon(self._hold_paused)
        self._sniff = socket.socket(fileno=os.dup(sock.fileno()))
        self._sniff.setblocking(False)
        self.loop.add_reader(self._sniff.fileno(), self._peek)

    def _hold_paused(self) -> None:
        if self._sniff is not None and not self.transport.is_closing():
            # Resume-then-pause removes the reader asyncio added after
            # connection_made (and cancels a read already queued).
            self.transport.resume_reading()
            self.transport.pause_reading()

    def _stop_sniff(self) -> socket.socket | None:
        sock, self._sniff = self._sniff, None
        if sock is not None:
            self.loop.remove_reader(sock.fileno())
        return sock

    def _peek(self) -> None:
        if self._sniff is None:
            return
        try:
            first = self._sniff.recv(len(wire.SNIFF), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            first = b""
        if first and len(first) < len(wire.SNIFF) and wire.SNIFF.startswith(first):
            # A partial prefix: look again shortly (the readiness stays level).
            self.loop.remove_reader(self._sniff.fileno())
            self.loop.call_later(0.01, self._resume_peek)
            return
        sock = self._stop_sniff()
        assert sock is not None
        if first == wire.SNIFF and self.broker is not None:
            self._disarm_header_timer()
            self.broker.adopt(sock)
            self.transport.abort()  # the broker holds its own descriptor
            return
        sock.close()
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def _resume_peek(self) -> None:
        if self._sniff is not None and not self.transport.is_closing():
            self.loop.add_reader(self._sniff.fileno(), self._peek)

    def connection_lost(self, exc: Exception | None) -> None:
        sniff = self._stop_sniff()
        if sniff is not None:
            sniff.close()
        self._disarm_header_timer()
        self._disarm_body_timer()
        self._disarm_write_timer()
        if self._admitted:
            self._admitted = False
            self.limits.release(self._uid)
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(HEADERS_TOO_SLOW)
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(WRITE_STALL_TIMEOUT, self._write_stalled)

    def resume_writing(self) -> None:
        self._disarm_write_timer()
        super().resume_writing()

    def _disarm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        self.transport.abort()  # drops the unsent bytes now (close() would wait for them)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            if self.cycle is not None and not self.cycle.response_started:
                self.transport.write(BODY_TOO_SLOW)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        # The header timer is armed exactly while a request's headers are
        # incomplete. Bytes of a chunk that starts a pipelined request after
        # another's end are not counted (at most one chunk more is allowed).
        if self._header_timer is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._header_timer is not None and self._header_bytes > MAX_HEADER_BYTES:
            self._disarm_header_timer()
            if not self.transport.is_closing():
                self.transport.write(HEADERS_TOO_LARGE)
                self.transport.close()

    def on_message_begin(self) -> None:
        # The first byte of every request (also the next one on a keep-alive
        # connection) starts the clock for its headers.
        super().on_message_begin()
        self._header_bytes = 0
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()
        # Until the message is complete (at once for a request without a body),
        # its body is on the clock.
        self._disarm_body_timer()
        self._body_timer = self.loop.call_later(BODY_TIMEOUT, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._disarm_body_timer()
        super().on_message_complete()

    def shutdown(self) -> None:
        # A graceful stop waits for in-flight responses, and an event stream
        # (GET /v1/events) never completes by itself: close its connection, so
        # the stream sees the disconnect and ends now. Its subscriber resumes
        # from its last id at the next daemon.
        super().shutdown()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.scope.get("path") == EVENTS_PATH:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer is plain text; the API answers in its envelope.
        self._disarm_header_timer()
        self._disarm_body_timer()
        answer = error_response(InvalidInput(f"malformed HTTP request: {msg.rstrip('.')}",
                                             hint="send an HTTP/1.1 request; see /openapi.json for the routes"))  # fmt: skip
        self.transport.write(answer)
        self.transport.close()


# -- the socket ---------------------------------------------------------------------------------


def socket_gid() -> int:
    """Group ``kbd`` if it exists, else the daemon's own group (DESIGN §10)."""
    try:
        return grp.getgrnam(SOCKET_GROUP).gr_gid
    except KeyError:
        return os.getegid()


def unsafe_folder(mode: int) -> bool:
    """Writable by others without the sticky bit: anyone could replace the socket."""
    return bool(mode & stat.S_IWOTH) and not mode & stat.S_ISVTX


def foreign_owner(uid: int, *, me: int) -> bool:
    """A folder's owner may rename or replace any entry in it (sticky bit or not):
    only root and the daemon's own user may own a folder above the socket."""
    return uid not in (0, me)


def _check_ancestors(folder: Path) -> None:
    """Refuse a socket whose folder (or a folder above it) others may rename or
    replace entries in. The folders checked are the real ones: a symlinked
    component is resolved, so a link to someone else's folder is seen as that
    folder (its owner could swap the socket for their own and collect tokens)."""
    me = os.geteuid()
    # A link on the way is as good as a folder to its owner: they may retarget it
    # between this check and the bind (in a sticky folder too: it is theirs).
    for f in (folder, *folder.parents):
        try:
            lst = os.lstat(f)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(lst.st_mode) and foreign_owner(lst.st_uid, me=me):
            raise UnsafeSocketFolder(
                f"{f} on the socket's path is a link owned by uid {lst.st_uid}, neither root nor the daemon's "
                f"uid {me}: its owner could point it elsewhere"
            )
    real = Path(os.path.realpath(folder))
    for f in (real, *real.parents):
        try:
            st = os.stat(f)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeSocketFolder(f"socket folder {f} is not a folder")
        if foreign_owner(st.st_uid, me=me):
            raise UnsafeSocketFolder(
                f"socket folder {f} belongs to uid {st.st_uid}, neither root nor the daemon's uid {me}: its "
                "owner could replace the socket"
            )
        if unsafe_folder(st.st_mode):
            raise UnsafeSocketFolder(
                f"socket folder {f} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) without the "
                "sticky bit: anyone could replace the socket; kbd never changes the mode of a folder it did not "
                "create"
            )


def _make_folders(folder: Path, gid: int) -> None:
    """Create the missing folders above the socket, each 0750 with group ``gid``;
    existing folders are left exactly as they are."""
    missing: list[Path] = []
    for f in (folder, *folder.parents):
        if os.path.lexists(f):
            break
        missing.append(f)
    for f in reversed(missing):
        try:
            os.mkdir(f, 0o700)  # born private: no window where it is wider than 0750
        except FileExistsError:
            raise UnsafeSocketFolder(f"socket folder {f} appeared while kbd was creating it") from None
        os.chown(f, -1, gid)
        os.chmod(f, 0o750)  # noqa: S103 - the group traverses to reach the 0660 socket


def bind_socket(path: Path) -> socket.socket:
    """Create the listening socket: 0660 with the socket group, in a folder that
    is safe; a folder kbd creates is 0750 with that group; stale socket replaced."""
    gid = socket_gid()
    _check_ancestors(path.parent)
    _make_folders(path.parent, gid)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise Unavailable(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise Unavailable(f"another kbd daemon is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window where it is wider
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chown(path, -1, gid)
    os.chmod(path, 0o660)
    sock.listen(BACKLOG)
    return sock


def inherited_socket(fd: int | None) -> socket.socket | None:
    if (
        fd is None
        and os.environ.get("LISTEN_PID") == str(os.getpid())
        and os.environ.get("LISTEN_FDS") == "1"
    ):
        fd = SD_LISTEN_FDS_START
    if fd is None:
        return None
    return socket.socket(fileno=fd)


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
        # them was committed, and nothing will be (README "Staged contributions").
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
    change feed (one event log per daemon; :func:`kbd.api.create_app` opened it
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
    at ``log_level`` and above go to journald or stderr (:func:`kbd.journal.configure`),
    one access line per request through ``kbd.access`` at INFO."""
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
        broker = Broker(host, state.sessions, lock=state.lock)
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
