"""The daemon's HTTP protocol: uvicorn's httptools protocol with the peer's uid
on every request, the connection caps, the header, body and write-stall
timeouts, the API's envelope on a request the parser rejects, and the hand-off
of exec connections to the broker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kbd.core import wire
from kbd.daemon.broker import Broker
from kbd.daemon.canned import BODY_TOO_SLOW, HEADERS_TOO_LARGE, HEADERS_TOO_SLOW, OVER_CAP, error_response
from kbd.daemon.limits import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_UID,
    MAX_HEADER_BYTES,
    WRITE_STALL_TIMEOUT,
    ConnectionLimits,
)
from kbd.daemon.routes import EVENTS_PATH, PEER_UID
from kbd.errors import InvalidInput


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
