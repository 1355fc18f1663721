"""The exec broker (docs/daemon.md): ``kbd exec`` through the daemon.

The daemon's front door (:mod:`kbd.daemon.server`) hands every connection that starts
with ``POST /v1/exec `` (:data:`kbd.core.wire.SNIFF`) to :meth:`Broker.adopt`.
From then on the connection belongs to two threads of its own, never to the
event loop (a command can run for hours; the loop must not wait for it):

* the *command thread* reads the request with ``recvmsg`` (the client's fds
  0-2 arrive with it as ``SCM_RIGHTS``), authenticates the caller exactly as
  the API does (:func:`kbd.service.auth.authenticate`: a bearer token, else the
  peer uid from ``SO_PEERCRED``; never a LocalOperator), answers ``101`` and
  runs the command through the one exec path
  (:func:`kbd.service.execute.execute`) with exactly the caller's identity:
  uid, gid and supplementary groups from the kernel (``SO_PEERCRED``,
  ``SO_PEERGROUPS``), umask and rlimits from the caller's /proc entry. A
  client descriptor that is a socket reaches the command as a pipe, relayed
  (:mod:`kbd.sandbox.relay`; docs/multi-user.md "Threat model"). It reports STARTED,
  NOTICE (kbd's warnings), then EXIT or ERROR, the exit status only once the
  relay has delivered all of the command's output.
* the *reader thread*, started once the command is, forwards SIGNAL frames
  to the command and, when the client's end closes (the client died) or
  breaks the framing, kills the command's whole tree (its cgroup). What the
  client sent before that (it may have died meanwhile) is acted on as the
  command starts.

A refusal before the command could be considered (a malformed request, no
credentials, fds missing) is an HTTP error in the API's envelope with
``x-kbd-exit: <exit code>``; everything after the upgrade (the plan lookup's
refusals included) is an ERROR frame carrying what ``kbd exec`` would print.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import select
import signal
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kbd.core import wire
from kbd.core.principals import Principal
from kbd.core.telemetry import OpsStats, exit_class
from kbd.daemon.canned import error_response
from kbd.errors import (
    KbdError,
    Overloaded,
    PermissionDenied,
    RequestTimeout,
    Unauthenticated,
    Unavailable,
    WireError,
)
from kbd.errors.render import internal_error
from kbd.sandbox import cgroup
from kbd.sandbox.relay import Relay
from kbd.sandbox.spawn import Launcher
from kbd.sandbox.start import Caller, Forwarder, warning_line
from kbd.service import auth
from kbd.service.execute import Launch, execute
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

# Not in Python 3.11's socket module (Linux >= 2.6.13): the peer's
# supplementary groups as the kernel recorded them at connect().
SO_PEERGROUPS = 59
# CPython caps getsockopt's buffer at 1024 bytes: 256 groups. A caller with
# more is refused (never run with a truncated group list).
_GROUPS_BUFLEN = 1024
# The whole request arrives in one sendmsg from kbd's clients; the bound keeps a
# silent connection from holding a thread and a slot.
log = logging.getLogger("kbd.broker")
REQUEST_TIMEOUT = 5.0
# A client that stops reading its socket cannot hold the command thread forever.
SEND_TIMEOUT = 10.0
_O_PATH = 0o10000000
_PROC_LIMITS = {
    "Max cpu time": "RLIMIT_CPU",
    "Max file size": "RLIMIT_FSIZE",
    "Max data size": "RLIMIT_DATA",
    "Max stack size": "RLIMIT_STACK",
    "Max core file size": "RLIMIT_CORE",
    "Max resident set": "RLIMIT_RSS",
    "Max processes": "RLIMIT_NPROC",
    "Max open files": "RLIMIT_NOFILE",
    "Max locked memory": "RLIMIT_MEMLOCK",
    "Max address space": "RLIMIT_AS",
    "Max file locks": "RLIMIT_LOCKS",
    "Max pending signals": "RLIMIT_SIGPENDING",
    "Max msgqueue size": "RLIMIT_MSGQUEUE",
    "Max nice priority": "RLIMIT_NICE",
    "Max realtime priority": "RLIMIT_RTPRIO",
    "Max realtime timeout": "RLIMIT_RTTIME",
}


@dataclass(frozen=True)
class PeerCreds:
    """The connecting process as the kernel recorded it at ``connect()``."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]


def peer_creds(sock: socket.socket) -> PeerCreds:
    """``SO_PEERCRED`` and ``SO_PEERGROUPS`` of a Unix stream socket. Raises
    PermissionDenied when the groups cannot be read whole."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BUFLEN)
    except OSError as exc:
        why = (
            "more than 256 supplementary groups" if exc.errno == errno.ERANGE else (exc.strerror or str(exc))
        )
        raise PermissionDenied(f"cannot read the caller's supplementary groups: {why}") from None
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % groups.itemsize])
    return PeerCreds(pid, uid, gid, tuple(groups))


def parse_limits(text: str) -> dict[int, tuple[int, int]]:
    """``/proc/<pid>/limits`` → {resource: (soft, hard)} (``unlimited`` = RLIM_INFINITY)."""
    import resource

    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines()[1:]:
        for label, name in _PROC_LIMITS.items():
            if line.startswith(label + " ") and hasattr(resource, name):
                words = line[len(label) :].split()
                if len(words) < 2:
                    break
                soft, hard = (resource.RLIM_INFINITY if w == "unlimited" else int(w) for w in words[:2])
                out[getattr(resource, name)] = (soft, hard)
                break
    return out


def parse_umask(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise ValueError("no Umask line")


def caller_of(creds: PeerCreds, stdio: tuple[int, int, int], env: dict[str, str]) -> Caller:
    """The identity a brokered command gets: the kernel's (never the client's
    word), with the caller's umask and rlimits from its /proc entry."""
    try:
        with open(f"/proc/{creds.pid}/status", encoding="ascii", errors="replace") as fh:
            umask = parse_umask(fh.read())
        with open(f"/proc/{creds.pid}/limits", encoding="ascii", errors="replace") as fh:
            limits = parse_limits(fh.read())
    except (OSError, ValueError) as exc:
        raise Unavailable(
            f"cannot read the calling process's umask and limits (pid {creds.pid}): {exc}"
        ) from None
    return Caller(creds.uid, creds.gid, creds.groups, umask, limits, env, stdio)


def check_stdio(fds: list[int]) -> tuple[int, int, int]:
    """Exactly three descriptors, none a folder or an ``O_PATH`` handle (either
    would let the command ``fchdir`` or ``openat`` outside its sandbox). A
    socket passes here but never reaches the command: :class:`Relay` puts a
    pipe in its place (it could carry descriptors both ways)."""
    if len(fds) != 3:
        raise WireError(f"the request carried {len(fds)} descriptors; send exactly 3 (stdin, stdout, stderr)")
    import fcntl

    for n, fd in enumerate(fds):
        if stat.S_ISDIR(os.fstat(fd).st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & _O_PATH:
            raise WireError(
                f"descriptor {n} is a folder or an O_PATH handle; stdio must be files, pipes, ttys or sockets"
            )
    return fds[0], fds[1], fds[2]


@dataclass
class BrokeredCommand:
    """One command the broker runs (or is about to run) for a client."""

    session_id: str
    principal: str
    uid: int
    argv: list[str]
    forward: Forwarder
    pid: int | None = None
    generation: int | None = None
    started_at: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)

    def signal(self, signum: int) -> None:
        self.forward.deliver(signum)

    def kill_tree(self) -> None:
        self.forward.abort()


class _Conn:
    """The socket of one brokered command: frames sent under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.closing = False

    def send(self, data: bytes) -> None:
        with self.lock, contextlib.suppress(OSError):  # a dead client: the reader thread ends the command
            self.sock.sendall(data)


class Broker:
    """Runs ``kbd exec`` for the daemon's clients, over the daemon's one view of
    its root: ``host``, ``sessions`` and the state ``lock`` the API and the live
    state share (held only while a plan is looked up or a command's notes are
    audited), so the plan a brokered command runs under is the one pushed
    revocation re-checks."""

    def __init__(
        self,
        host: Root,
        sessions: RootSessions,
        *,
        lock: threading.Lock | threading.RLock,
        per_uid: int = 64,
        total: int = 1024,
        launcher: Launcher | None = None,
        counted: OpsStats | None = None,
    ) -> None:
        self.host = host
        self.counted = counted if counted is not None else OpsStats()
        self.launcher = launcher  # None: every command takes the slower in-daemon start
        self.sessions = sessions
        self.lock = lock
        root = host.config.root
        st = os.stat(root)
        self.root_id = (st.st_dev, st.st_ino)
        self.per_uid = per_uid
        self.total = total
        self._guard = threading.Lock()
        self._open: Counter[int] = Counter()
        self._commands: list[BrokeredCommand] = []
        self._threads: set[threading.Thread] = set()
        self.stopping = False
        with contextlib.suppress(OSError):
            cgroup.sweep(cgroup.detect())  # what a killed daemon's commands left
        with contextlib.suppress(OSError):
            sessions.commands.drop_spares()
            for _ in range(2):  # record files for the first commands (kbd.state.processes)
                sessions.commands.make_spare()

    # -- the public interface ------------------------------------------------------------------
    def adopt(self, sock: socket.socket) -> None:
        """Take over an accepted connection whose first bytes are an exec
        request; returns at once (called on the event loop)."""
        try:
            creds = peer_creds(sock)
        except (OSError, KbdError) as exc:
            err = (
                exc
                if isinstance(exc, KbdError)
                else Unavailable(f"cannot read the peer's credentials: {exc}")
            )
            self._refuse_now(sock, err)
            return
        with self._guard:
            if self.stopping:
                refusal: KbdError | None = Unavailable("the kbd daemon is stopping", hint="retry in a moment")
            elif sum(self._open.values()) >= self.total or self._open[creds.uid] >= self.per_uid:
                refusal = Overloaded(
                    "too many brokered commands from this client", hint="retry when some ended"
                )
            else:
                refusal = None
                self._open[creds.uid] += 1
        if refusal is not None:
            self._refuse_now(sock, refusal)
            return
        thread = threading.Thread(target=self._serve, args=(sock, creds), name="kbd-exec", daemon=True)
        with self._guard:
            self._threads.add(thread)
        thread.start()

    def running(self, sid: str | None = None) -> list[BrokeredCommand]:
        """The commands running now (of session ``sid``, or all)."""
        with self._guard:
            return [c for c in self._commands if sid is None or c.session_id == sid]

    def terminate(self, cmd: BrokeredCommand, *, grace: float) -> bool:
        """SIGTERM the command's group, wait up to ``grace`` seconds, then kill
        its whole tree. Blocking (call it from a worker thread). True when it ended."""
        if grace > 0:
            cmd.signal(signal.SIGTERM)
            if cmd.done.wait(grace):
                return True
        cmd.kill_tree()
        return cmd.done.wait(5.0)

    def drain(self, grace: float) -> None:
        """Stop taking commands; let the running ones finish within ``grace``
        seconds, then terminate them (the daemon is stopping)."""
        with self._guard:
            self.stopping = True
        deadline = time.monotonic() + grace
        for cmd in self.running():
            cmd.done.wait(max(0.0, deadline - time.monotonic()))
        for cmd in self.running():
            self.terminate(cmd, grace=0)
        with self._guard:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5.0)

    # -- one connection ------------------------------------------------------------------------
    def _refuse_now(self, sock: socket.socket, err: KbdError) -> None:
        self.counted.refused(err.code)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(refusal_bytes(err))
        sock.close()

    def _serve(self, sock: socket.socket, creds: PeerCreds) -> None:
        fds: list[int] = []
        relay: Relay | None = None
        try:
            sock.settimeout(REQUEST_TIMEOUT)
            try:
                request, fds, token = read_request(sock)
                principal = self._authenticate(creds, token, request)
                stdio = check_stdio(fds)
                relay = _relay_for(stdio, hangup=sock.fileno())
                caller = caller_of(creds, stdio if relay is None else relay.command_stdio, dict(request.env))
            except KbdError as err:
                self.counted.refused(err.code)
                with contextlib.suppress(OSError):
                    sock.sendall(refusal_bytes(err))
                return
            sock.settimeout(SEND_TIMEOUT)
            self._run(_Conn(sock), request, principal, caller, relay)
        except OSError:
            pass  # the client went away while its request was read
        finally:
            if relay is not None:
                relay.close()  # finished already, unless the command never got that far
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._guard:
                self._open[creds.uid] -= 1
                if self._open[creds.uid] <= 0:
                    del self._open[creds.uid]
                self._threads.discard(threading.current_thread())

    def _authenticate(self, creds: PeerCreds, token: str | None, request: wire.Request) -> Principal:
        if os.geteuid() != 0 and creds.uid != os.geteuid():
            raise PermissionDenied(f"this kbd daemon runs as uid {os.geteuid()} and serves only that uid")
        if request.root is not None and not self._same_root(request.root):
            raise Unavailable(
                f"the kbd daemon on this socket serves {self.host.config.root}, not {os.fsdecode(request.root)}",
                hint="use that root's socket (KBD_SOCKET), or KBD_NO_DAEMON=1 to run in-process",
            )
        with self.lock:
            self.host.refresh()
            who = auth.authenticate(self.host.principals, authorization=token, peer_uid=creds.uid)
        if isinstance(who, auth.NotAuthenticated):
            raise Unauthenticated(who.message, hint=who.hint)
        if request.as_principal is not None and request.as_principal != who.id:
            raise PermissionDenied(
                f"--as names {request.as_principal!r} but this connection authenticates as {who.id!r}",
                hint="leave --as out (the daemon acts as your uid's or token's principal), "
                "or run in-process with KBD_NO_DAEMON=1",
            )
        return who

    def _same_root(self, raw: bytes) -> bool:
        try:
            st = os.stat(raw)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.root_id

    def _run(
        self, conn: _Conn, request: wire.Request, principal: Principal, caller: Caller, relay: Relay | None
    ) -> None:
        argv = [os.fsdecode(a) for a in request.argv]
        forward = Forwarder()
        cmd = BrokeredCommand(request.sid, principal.id, caller.uid, argv, forward)

        frames = wire.FrameReader(wire.TO_DAEMON)
        reader = threading.Thread(target=_read_frames, args=(conn, forward, frames), name="kbd-exec-in",
                                  daemon=True)  # fmt: skip

        def started(pid: int, generation: int) -> None:
            cmd.pid, cmd.generation = pid, generation
            if relay is not None:
                relay.start()  # from now on, not before: a refused command takes none of the caller's input
            # The client's frames are read from the moment its command runs, on
            # a thread started while bubblewrap sets up (not on the way to the
            # start). What came before waits in the socket and is acted on here
            # at once: a SIGNAL is delivered, end of file (the client died while
            # the command waited for its start) kills the tree.
            if _read_pending(conn, forward, frames):
                conn.send(wire.started_frame(pid, generation))
                reader.start()

        def notice(text: str) -> None:
            conn.send(wire.notice_frame(warning_line(text)))

        later: list[Callable[[], None]] = []
        launch = Launch(forward, caller=caller, notice=notice, started=started, lock=self.lock,
                        launcher=self.launcher, later=later, strict=bool(request.flags & wire.FLAG_STRICT),
                        report_json=bool(request.flags & wire.FLAG_JSON),
                        say=lambda text: conn.send(wire.notice_frame(text)))  # fmt: skip
        conn.send(wire.SWITCHING)
        with self._guard:
            self._commands.append(cmd)
        began = time.monotonic()
        klass = "internal"
        try:
            cwd = os.fsdecode(request.cwd) if request.cwd is not None else None
            status = execute(
                self.host, self.sessions, request.sid, argv, actor=principal, cwd=cwd, launch=launch
            )
            status = status if 0 <= status <= 255 else 255
            klass = exit_class(status)
            answer = wire.exit_frame(status)
        except KbdError as err:
            klass = "refused"
            self.counted.refused(err.code)
            answer = error_frame(err)
        except Exception as exc:  # the boundary of this connection: never a traceback to the client
            log.exception("broker: command of session %s failed unexpectedly", request.sid)
            answer = error_frame(internal_error(exc))
        finally:
            cmd.done.set()
            with self._guard:
                self._commands.remove(cmd)
            self.counted.exec_ended(klass, time.monotonic() - began)
        if relay is not None:
            # The tree is dead (execute killed it): its output reaches the
            # caller's sockets before its exit status does.
            try:
                relay.finish()
            except Exception:
                log.exception("broker: relaying the stdio of a command of session %s failed", request.sid)
        conn.closing = True
        conn.send(answer)
        for step in later:  # after the answer: what need not delay it
            try:
                step()
            except Exception:
                log.exception("broker: cleanup after a command of session %s failed", request.sid)
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        if reader.ident is not None:  # started with the command
            reader.join(timeout=5.0)


def _relay_for(stdio: tuple[int, int, int], *, hangup: int) -> Relay | None:
    """Pipes in place of the client's socket stdio (docs/multi-user.md "Threat model"), or None."""
    try:
        return Relay.around(stdio, hangup=hangup)
    except OSError as exc:
        raise Unavailable(
            f"cannot relay the command's stdio: {exc.strerror or exc}; nothing was run"
        ) from None


def _read_frames(conn: _Conn, forward: Forwarder, reader: wire.FrameReader) -> None:
    """SIGNAL frames → the command; EOF, a reset or broken framing (the client
    died or is not kbd's) → the command's whole tree is killed."""
    while True:
        try:
            data = conn.sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            data = b""
        if not _act_on(data, conn, forward, reader):
            return


def _read_pending(conn: _Conn, forward: Forwarder, reader: wire.FrameReader) -> bool:
    """Act at once on what the client sent before its command started (without
    waiting for more); False when that ended the connection (the tree is
    being killed)."""
    # poll, not MSG_DONTWAIT: a socket with a timeout waits for readability
    # before every recv, whatever its flags.
    ready = select.poll()
    ready.register(conn.sock.fileno(), select.POLLIN)
    while ready.poll(0):
        try:
            data = conn.sock.recv(4096)
        except OSError:
            data = b""
        if not _act_on(data, conn, forward, reader):
            return False
    return True


def _act_on(data: bytes, conn: _Conn, forward: Forwarder, reader: wire.FrameReader) -> bool:
    """One read's worth of the client's frames; False once the client is gone
    (end of file, a reset) or broke the framing: then its command's tree dies."""
    if not data:
        if not conn.closing:
            forward.abort()
        return False
    try:
        for _, payload in reader.feed(data):
            forward.deliver(wire.decode_signal(payload))
    except WireError:
        forward.abort()
        return False
    return True


def read_request(sock: socket.socket) -> tuple[wire.Request, list[int], str | None]:
    """The request, the descriptors that came with it, and its Authorization
    header. On any refusal the descriptors received so far are closed here."""
    buf = bytearray()
    fds: list[int] = []
    # One deadline for the whole request, not a timeout per recv: a client that
    # drips a byte at a time must not hold a broker thread and a cap slot.
    deadline = time.monotonic() + REQUEST_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"the exec request did not arrive within {REQUEST_TIMEOUT:g}s")
            sock.settimeout(left)
            try:
                data, anc, flags, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
            except TimeoutError:
                raise RequestTimeout(f"the exec request did not arrive within {REQUEST_TIMEOUT:g}s") from None
            first = not buf
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                    fds.extend(got)
                    # The client sends its three descriptors with the request's
                    # first bytes. Descriptors on any later message, or more than
                    # three in all, are refused at once (they are closed below):
                    # otherwise one connection could fill the daemon's fd table.
                    if not first:
                        raise WireError("descriptors may only come with the first bytes of the exec request")
                    if len(fds) > 3:
                        raise WireError("the request carried more descriptors than 3")
            if flags & socket.MSG_CTRUNC:
                raise WireError(
                    "the request carried more descriptors than 3 (or a truncated control message)"
                )
            if not data:
                raise WireError("the connection closed before the exec request was complete")
            buf += data
            head = wire.parse_request_head(bytes(buf))
            if head is None:
                continue
            need = head.size + wire.content_length(head)
            if len(buf) > need:
                raise WireError("bytes follow the exec request before the daemon answered")
            if len(buf) == need:
                request = wire.decode_request(bytes(buf[head.size :]))
                return request, fds, head.headers.get("authorization")
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def error_frame(err: KbdError) -> bytes:
    return wire.error_frame(max(0, min(255, err.exit_code)), err.code, err.message, err.hint or "")


def refusal_bytes(err: KbdError) -> bytes:
    """The API's HTTP answer to ``err`` plus ``x-kbd-exit`` (the exit code
    ``kbd exec`` ends with)."""
    return error_response(err, extra={"x-kbd-exit": str(err.exit_code)})
