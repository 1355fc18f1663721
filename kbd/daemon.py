"""``kbd serve``: the composition root of the daemon.

kbd creates its Unix socket itself — folder 0750, socket 0660 (never uvicorn's
0666) — or takes one from systemd socket activation (``LISTEN_FDS``) or
``--fd``, and serves the API with uvicorn. Each connection's peer uid
(``SO_PEERCRED``) is attached to every request on it, for uid-mapped
authentication. SIGTERM and SIGINT stop the server gracefully: uvicorn stops
accepting, finishes in-flight requests, and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import struct
import sys
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kbd.api import PEER_UID, create_app
from kbd.errors import Unavailable
from kbd.ops import Host

SD_LISTEN_FDS_START = 3


class _PeerApp:
    """Adds the connection's peer uid to every ASGI scope of that connection."""

    def __init__(self, app: Any, uid: int | None) -> None:
        self.app = app
        self.uid = uid

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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
    per-request overhead) with the peer's uid attached to every request."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.app = _PeerApp(self.app, _peer_uid(transport))
        super().connection_made(transport)


def bind_socket(path: Path) -> socket.socket:
    """Create the listening socket: parent folder 0750, socket 0660, stale socket replaced."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    os.chmod(path.parent, 0o750)  # noqa: S103 - group may traverse to reach the 0660 socket
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
    old = os.umask(0o117)  # the socket is born 0660: no window where it is wider
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    sock.listen(128)
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


class _Stop(Exception):
    pass


def _stopped(signum: int, frame: object) -> None:
    raise _Stop


def serve(host: Host, *, socket_path: Path | None = None, fd: int | None = None, ready: bool = True) -> None:
    sock = inherited_socket(fd)
    path = None
    if sock is None:
        path = socket_path or host.config.socket_path
        sock = bind_socket(path)
    app = create_app(host)
    config = uvicorn.Config(app, http=PeerCredProtocol, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=10, access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    if ready:
        # The socket is listening already (connections queue until the loop
        # accepts them), so this line is a truthful readiness signal for
        # scripts and tests.
        print(f"kbd: serving on {path or f'fd {sock.fileno()}'}", flush=True)
    # uvicorn.Server.serve captures SIGTERM/SIGINT (stop accepting, finish
    # in-flight requests) and re-raises the signal once it has stopped; these
    # handlers turn that re-raise into an orderly return so cleanup runs.
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        print("kbd: stopped", file=sys.stderr, flush=True)
