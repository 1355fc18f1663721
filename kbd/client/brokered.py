"""``kbd exec`` as a thin client of the daemon's exec broker (docs/daemon.md).

Runs before every agent shell command, so it imports only what it needs:
``os``, ``sys``, ``_socket`` and ``_signal`` (the ``socket`` and ``signal``
modules cost ≈6 ms of enum and selectors imports), the pure wire codec
(:mod:`kbd.core.wire`), and ``json`` only to read an error answer.

One connection carries one command: the request and this process's fds 0-2
(``SCM_RIGHTS``) in one ``sendmsg``; then ``101`` and frames. INT, TERM, HUP,
QUIT and WINCH received here are forwarded as SIGNAL frames; NOTICE lines go to
stderr; EXIT's status or ERROR's exit code is this process's exit status, and
ERROR prints exactly what :func:`kbd.cli.boundary.print_error` prints in-process.
The daemon kills the command's tree when this connection closes, so the death
of this process ends the command too.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stubs: the signal module without its enum import
import _socket
import errno
import os
import sys

from kbd.core import wire
from kbd.errors import WireError

# Not ``typing.TYPE_CHECKING``: ``typing`` costs ≈7 ms of imports (see kbd.cli.entry).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

UNAVAILABLE = 69
PERMISSION_DENIED = 77
DAEMON_DIED = "the kbd daemon stopped while the command ran; the command was terminated"
# The daemon answers an exec request (101, or a refusal) once it has read and
# authenticated it: milliseconds. A daemon that accepts and never answers (hung,
# stopped, a stray listener on the socket) must not hang every agent command.
ANSWER_TIMEOUT = 30.0
# Connecting to the *default* socket: these mean "no daemon here for you";
# the command then runs in-process, as it always did.
NO_DAEMON = (errno.ENOENT, errno.ECONNREFUSED, errno.EACCES, errno.ENOTDIR)


def default_root(environ: dict[str, str] | os._Environ[str]) -> str:
    """:func:`kbd.core.config.default_root` without importing it (16 ms of
    dataclasses and pathlib on this path); a unit test keeps the two equal."""
    if environ.get("KBD_ROOT"):
        return environ["KBD_ROOT"]
    xdg = environ.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "kbd")
    return os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".local", "share", "kbd")


#: The system service's root and socket (systemd/kbd.service, kbd.socket; docs/multi-user.md "Deploying on a host").
SYSTEM_ROOT = "/var/lib/kbd"
SYSTEM_SOCKET = "/run/kbd/kbd.sock"


def chosen_root(environ: dict[str, str] | os._Environ[str]) -> str:
    """The root of a command given no ``--root`` (kbd.cli.commands.choose_root, which a
    unit test keeps equal): ``$KBD_ROOT``, else your own when it exists, else
    the system root when that exists, else your own (for its usual error)."""
    personal = default_root(environ)
    if environ.get("KBD_ROOT") or os.path.lexists(personal) or not os.path.isdir(SYSTEM_ROOT):
        return personal
    return SYSTEM_ROOT


def default_socket(root: str) -> str:
    """The root's own socket (``kbd.core.config.RootConfig.socket_path`` without a
    ``socket:`` key); the system root's is the service's socket."""
    if os.path.normpath(root) == SYSTEM_ROOT:
        return SYSTEM_SOCKET
    return os.path.join(root, "state", "run", "kbd.sock")


def print_error(code: str, message: str, hint: str) -> None:
    """Print kbd's error lines through :func:`kbd.errors.render.print_error`, the
    one printer of ``error[code]:`` lines (imported only on this rare path)."""
    from kbd.errors import KbdError
    from kbd.errors.render import print_error as boundary_print

    err = KbdError(message, hint=hint)
    err.code = code
    boundary_print(err)


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Refused(Exception):
    """kbd's own refusal: print it like the boundary does and exit with ``exit_code``."""

    def __init__(self, exit_code: int, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.code, self.message, self.hint = exit_code, code, message, hint


def connect(path: str, *, explicit: bool) -> _socket.socket | None:
    """A connection to the daemon at ``path``; None when ``path`` is the default
    socket and no daemon answers there. Refused for an explicit socket."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        if not explicit and exc.errno in NO_DAEMON:
            return None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise Refused(PERMISSION_DENIED, "permission-denied", f"the kbd daemon's socket {path} refuses this user",
                          "ask the host's operator for access (group kbd), or unset KBD_SOCKET") from None  # fmt: skip
        raise Refused(UNAVAILABLE, "unavailable", f"cannot reach the kbd daemon at {path}: {exc.strerror or exc}",
                      "is `kbd serve` running there? unset KBD_SOCKET (and --socket) to run in-process") from None  # fmt: skip
    return sock


def _send_request(sock: _socket.socket, data: bytes, stdio: Sequence[int]) -> None:
    rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in stdio)
    sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    if sent < len(data):  # a long argv: the descriptors went with the first bytes
        sock.sendall(data[sent:])


def _http_refusal(status: int, head: wire.Head, rest: bytes, sock: _socket.socket) -> Refused:
    """The daemon's HTTP error answer (API envelope, ``x-kbd-exit``)."""
    try:
        size = min(wire.content_length(head), 1 << 20)
    except WireError:
        size = len(rest)
    while len(rest) < size:
        more = sock.recv(65536)
        if not more:
            break
        rest += more
    exit_raw = head.headers.get("x-kbd-exit", "")
    exit_code = int(exit_raw) if exit_raw.isdigit() and int(exit_raw) < 256 else UNAVAILABLE
    import json  # only on this path: it imports re

    try:
        err = json.loads(rest[:size])["error"]
        return Refused(exit_code, str(err["code"]), str(err["message"]), str(err.get("hint") or ""))
    except (ValueError, KeyError, TypeError):
        return Refused(exit_code, "unavailable", f"the kbd daemon refused the command (HTTP {status})")


class Exchange:
    """One brokered command on ``sock``: read the answer and the frames."""

    def __init__(self, sock: _socket.socket, notice: Callable[[str], None]) -> None:
        self.sock = sock
        self.notice = notice
        self.pid: int | None = None
        self.generation: int | None = None

    def answer(self) -> bytes:
        """Wait for the daemon's answer; the bytes after its head (the first
        frames). Raises Refused for an HTTP refusal or a daemon that vanished."""
        buf = b""
        self.sock.settimeout(ANSWER_TIMEOUT)
        while True:
            try:
                more = self.sock.recv(65536)
            except TimeoutError:
                raise Refused(UNAVAILABLE, "unavailable",
                              f"the kbd daemon did not answer within {ANSWER_TIMEOUT:g} s; nothing was run",
                              "check the daemon's log; KBD_NO_DAEMON=1 runs the command in-process") from None  # fmt: skip
            if not more:
                raise Refused(UNAVAILABLE, "unavailable", "the kbd daemon closed the connection before answering",
                              "check the daemon's log; KBD_NO_DAEMON=1 runs the command in-process")  # fmt: skip
            buf += more
            parsed = wire.parse_response_head(buf)
            if parsed is not None:
                break
        self.sock.settimeout(None)  # the command itself may run for as long as it runs
        status, head = parsed
        rest = buf[head.size :]
        if status != 101:
            raise _http_refusal(status, head, rest, self.sock)
        return rest

    def relay(self, first: bytes) -> int:
        """Frames until EXIT or ERROR: the command's status (Refused for ERROR)."""
        reader = wire.FrameReader(wire.TO_CLIENT)
        data = first
        while True:
            for kind, payload in reader.feed(data):
                if kind == wire.NOTICE:
                    self.notice(wire.decode_notice(payload))
                elif kind == wire.STARTED:
                    self.pid, self.generation = wire.decode_started(payload)
                elif kind == wire.EXIT:
                    return wire.decode_exit(payload)
                else:
                    raise Refused(*wire.decode_error(payload))
            try:
                data = self.sock.recv(65536)
            except ConnectionError:
                data = b""
            if not data:
                raise Refused(UNAVAILABLE, "unavailable", DAEMON_DIED,
                              "check the daemon's log; KBD_NO_DAEMON=1 runs the command in-process")  # fmt: skip


def request_bytes(
    sid: str,
    argv: Sequence[str | bytes],
    *,
    cwd: str | bytes | None = None,
    as_principal: str | None = None,
    root: str | bytes | None = None,
    env: dict[str, str] | None = None,
    token: str | None = None,
    flags: int = 0,
) -> bytes:
    """The request line, headers and body of one exec request."""
    request = wire.Request(
        sid,
        [os.fsencode(a) for a in argv],
        cwd=os.fsencode(cwd) if cwd is not None else None,
        env={k: v for k, v in (env or {}).items() if k in wire.ENV_NAMES},
        as_principal=as_principal,
        root=os.fsencode(root) if root is not None else None,
        flags=flags,
    )
    body = wire.encode_request(request)
    return wire.request_head(len(body), token=token) + body


def call(
    socket_path: str,
    sid: str,
    argv: Sequence[str | bytes],
    *,
    explicit: bool = True,
    stdio: Sequence[int] = (0, 1, 2),
    cwd: str | bytes | None = None,
    as_principal: str | None = None,
    root: str | bytes | None = None,
    env: dict[str, str] | None = None,
    token: str | None = None,
    forward_signals: bool = False,
    notice: Callable[[str], None] = _write_stderr,
    flags: int = 0,
) -> int | None:
    """Run one command through the daemon at ``socket_path`` with ``stdio`` as
    its fds 0-2 and return its exit status (128+N for signal N). kbd's own
    refusals raise :class:`Refused` (its ``exit_code``, ``code``, ``message``,
    ``hint``); a malformed request raises WireError. None: ``explicit`` is
    False and no daemon listens at ``socket_path``. The entry point for
    :mod:`kbd.client` (``forward_signals`` only from the main thread;
    ``notice`` receives kbd's WARNING lines)."""
    data = request_bytes(sid, argv, cwd=cwd, as_principal=as_principal, root=root, env=env, token=token,
                         flags=flags)  # fmt: skip
    sock = connect(socket_path, explicit=explicit)
    if sock is None:
        return None
    return _exchange(sock, data, stdio, forward_signals=forward_signals, notice=notice)


def run(
    socket_path: str,
    sid: str,
    argv: Sequence[str],
    *,
    explicit: bool,
    cwd: str | None = None,
    as_principal: str | None = None,
    root: str | None = None,
    env: dict[str, str] | None = None,
    token: str | None = None,
    flags: int = 0,
) -> int | None:
    """``kbd exec`` through the daemon: :func:`call` with this process's fds
    0-2 and signals, and kbd's refusals printed as the boundary prints them
    (their exit code returned)."""
    try:
        return call(socket_path, sid, argv, explicit=explicit, cwd=cwd, as_principal=as_principal, root=root,
                    env=env, token=token, forward_signals=True, flags=flags)  # fmt: skip
    except Refused as r:
        print_error(r.code, r.message, r.hint)
        return r.exit_code
    except WireError as exc:
        print_error(exc.code, exc.message, exc.hint or "")
        return exc.exit_code


def _exchange(
    sock: _socket.socket, data: bytes, stdio: Sequence[int], *, forward_signals: bool,
    notice: Callable[[str], None],
) -> int:  # fmt: skip
    previous: dict[int, object] = {}
    try:
        if forward_signals:

            def forward(signum: int, frame: object) -> None:
                try:  # noqa: SIM105 - contextlib is one more import on this path
                    sock.send(wire.signal_frame(signum))
                except OSError:
                    pass

            for signum in sorted(wire.FORWARDED_SIGNALS):
                previous[signum] = _signal.signal(signum, forward)
        try:
            _send_request(sock, data, stdio)
        except OSError as exc:
            raise Refused(UNAVAILABLE, "unavailable", f"cannot send the command to the kbd daemon: {exc.strerror or exc}",
                          "KBD_NO_DAEMON=1 runs the command in-process") from None  # fmt: skip
        exchange = Exchange(sock, notice)
        try:
            return exchange.relay(exchange.answer())
        except ConnectionError:
            raise Refused(UNAVAILABLE, "unavailable", DAEMON_DIED,
                          "check the daemon's log; KBD_NO_DAEMON=1 runs the command in-process") from None  # fmt: skip
    finally:
        for signum, handler in previous.items():
            _signal.signal(signum, handler)
        sock.close()
