"""The daemon's side of the pre-forked launcher (:mod:`kbd.sandbox.launcher`).

:meth:`Launcher.start` runs the launcher process (from the daemon's main
thread: its parent-death signal follows the spawning thread) and keeps a pool
of stubs — children of the launcher already sitting in fresh per-command
cgroups with their limits written. A brokered command :meth:`takes
<Launcher.take>` a stub, is recorded under the stub's pid and cgroup, and
:meth:`Stub.launch` hands the stub its descriptors, argv, environment and the
caller's identity: the stub execs at once, so the cgroup migration (an RCU
grace period), ``fork`` and the shell gate are all off the critical path. The
pool refills in the background. An empty pool, a dead launcher or a request
the stub cannot carry answers None / raises :class:`Unusable`, and the caller
uses the slower in-daemon path instead: correct either way.

Thread-safe: broker threads take and launch, one reader thread handles the
launcher's messages.
"""

from __future__ import annotations

import array
import collections
import contextlib
import itertools
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbd.sandbox import cgroup
from kbd.sandbox.limits import lower

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from kbd.core.config import LimitsConfig

log = logging.getLogger("kbd.launcher")
SOURCE = Path(__file__).with_name("launcher.py")
MAX_FDS = 253  # SCM_MAX_FD: the stub refuses more
# One request is one SEQPACKET packet: bounded by the socket's send buffer.
MAX_REQUEST = 160_000
FAILURES = 3  # stubs that could not be made in a row before the pool stops asking
TAKE_WAIT = 0.02  # how long a command waits for a stub on its way before the slow path
START_TIMEOUT = 2.0  # how long a starting daemon waits for its pool


class Unusable(Exception):
    """This command cannot go through a stub (the caller falls back)."""


@dataclass
class Child:
    """A command a stub became: Popen's ``pid``, ``returncode`` and ``wait``,
    plus :meth:`exited`, which waits for the exit without reaping (the
    launcher keeps the zombie until :meth:`wait`, so a signal forwarded to the
    group before that can only reach the command's own group)."""

    pid: int
    launcher: Launcher
    sock: socket.socket | None = None  # the stub's socket: close-on-exec in the stub
    returncode: int | None = None
    _rc: int | None = None
    _exited: threading.Event = field(default_factory=threading.Event)
    _why: str | None = None

    def failure(self) -> str | None:
        """Why the stub could not exec the command (it reported it before it
        exited 127), or None: it did (end of file). Call after :meth:`exited`."""
        if self.sock is None:
            return self._why
        try:
            answer = self.sock.recv(4096, socket.MSG_DONTWAIT)
        except OSError:  # still open: the stub was killed before it read the request
            answer = b""
        finally:
            self.sock.close()
            self.sock = None
        if answer:
            why = json.loads(answer)
            self._why = f"{why.get('where')}: {why.get('error')}"
        return self._why

    def exited(self) -> int:
        self._exited.wait()
        return self._rc if self._rc is not None else -9

    def wait(self) -> int:
        rc = self.exited()
        self.failure()  # read (and kept) before the socket is closed
        if self.returncode is None:
            self.launcher.reap(self.pid)
            self.returncode = rc
        return rc

    def release(self, status: int) -> None:
        """The command's status is known another way (bubblewrap's status
        pipe) and the signal forwarding is disarmed: let the launcher reap it
        whenever it exits, without waiting here (the caller's cgroup wait is
        what proves the tree dead)."""
        if self.returncode is None:
            self.returncode = status
            self.failure()
            self.launcher.reap(self.pid)

    def _exit(self, rc: int) -> None:
        self._rc = rc
        self._exited.set()


@dataclass
class Stub:
    """A launcher child waiting in its cgroup ``name`` for a command."""

    pid: int
    name: str
    sock: socket.socket
    key: str  # the cgroup limits it was made with (cgroup.stub_dirs as JSON)
    launcher: Launcher
    used: bool = False

    def box(self) -> cgroup.Box:
        return cgroup.Box.existing(self.launcher.hierarchy, self.name)

    def close(self) -> None:
        """Let the stub go unused (it exits; its cgroups are removed); nothing
        once it was used."""
        if not self.used:
            self.used = True
            self.launcher.discard(self)

    def _abandon(self) -> None:
        """Let the stub exit; its cgroups are now the caller's, who runs the
        command there the slow way and removes them afterwards."""
        self.used = True
        self.sock.close()

    def launch(
        self, argv: Sequence[str], *, env: Mapping[str, str], fds: Sequence[int], targets: Sequence[int],
        uid: int, gid: int, groups: Sequence[int], umask: int,
        rlimits: Mapping[int, tuple[int, int]], cwd: str | None = None,
        attach: Sequence[Mapping[str, object]] = (),
    ) -> Child:  # fmt: skip
        """Exec ``argv`` in the stub with ``fds[i]`` as number ``targets[i]``
        (nothing else open) and exactly the given identity; rlimits are
        lowered to the caller's, never raised above the daemon's (which the
        stub has). Returns as soon as the stub has the request (it execs
        while the caller goes on: :meth:`Child.failure` says afterwards
        whether the exec failed); raises :class:`Unusable` before sending
        anything the stub could not carry or when the stub is gone.
        ``attach``: the staging overlays the stub attaches before it takes the
        caller's identity (kbd.sandbox.launcher.attach_overlays)."""
        limits = []
        for res, (soft, hard) in sorted(rlimits.items()):
            own = resource.getrlimit(res)
            new_hard = lower(hard, own[1])
            new = (lower(lower(soft, own[0]), new_hard), new_hard)
            if new != own:  # the stub has the daemon's limits: only what differs
                limits.append([res, *new])
        request = {"argv": list(argv), "env": dict(env), "targets": list(targets), "uid": uid,
                   "gid": gid, "groups": list(groups), "umask": umask, "rlimits": limits, "cwd": cwd,
                   "attach": [dict(a) for a in attach]}  # fmt: skip
        data = json.dumps(request).encode()
        if len(data) > MAX_REQUEST or len(fds) > MAX_FDS:
            self._abandon()
            raise Unusable(f"the request ({len(data)} bytes, {len(fds)} descriptors) is too large for a stub")
        self.used = True
        child = self.launcher.expect(self.pid, self.sock)
        try:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as exc:  # the stub died waiting (killed, OOM), or the packet is too big: nothing ran
            self._abandon()
            self.launcher.reap(self.pid)
            raise Unusable(f"the stub cannot take the command ({exc.strerror or exc})") from None
        except BaseException:
            self.sock.close()
            raise
        # The command is on its way: now its replacement (a no-op when the
        # pool is full already).
        self.launcher._refill(self.key)
        return child


class Launcher:
    """The daemon's handle on its launcher process and stub pool."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, hierarchy: cgroup.Hierarchy,
                 pool_size: int) -> None:  # fmt: skip
        self.proc = proc
        self.sock = sock
        self.hierarchy = hierarchy
        self.pool_size = pool_size
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)  # a stub came, or the launcher died
        self._pool: collections.deque[Stub] = collections.deque()
        # Stubs asked for: tag → the limits key they are made with. The launcher
        # echoes the tag, since stubs come back in the order they got ready,
        # not the order they were asked for (a stub under old limits must never
        # be taken as one under new limits).
        self._asked: dict[int, str] = {}
        self._tags = itertools.count(1)
        self._children: dict[int, Child] = {}
        self._discarded: dict[int, str] = {}  # pid → cgroup of a stub let go
        self._key: str | None = None
        # Stubs that could not be made in a row (no delegated cgroup, say): after
        # FAILURES the pool stops asking until the limits change.
        self._failures = 0
        self.alive = True
        self.ready = threading.Event()  # the pool is full (or cannot fill: failed, or gone)
        self.on_death: Callable[[], None] | None = None  # called (reader thread) when the launcher dies
        self._reader = threading.Thread(target=self._read, name="kbd-launcher", daemon=True)

    @classmethod
    def start(
        cls, hierarchy: cgroup.Hierarchy, limits: LimitsConfig, *, pool_size: int = 2
    ) -> Launcher | None:
        """Start the launcher and fill its pool; None where it cannot help
        (no v2 cgroups, or not the main thread: the parent-death signal would
        follow a thread that may end)."""
        if hierarchy.v2 is None or threading.current_thread() is not threading.main_thread():
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Stubs enter a root-owned user namespace while they wait (docs/multi-user.md "The permission
            # model"): none of a caller's other processes then
            # holds a capability over her command's namespaces.
            config = json.dumps(
                {"parent": os.getpid(), "control": theirs.fileno(), "userns": own_userns_usable()}
            )
            # -I -S: no site, no user paths, no environment: the launcher runs as
            # root and imports nothing but the standard library. Its own session:
            # a terminal's ^C goes to the daemon, which stops it in order.
            proc = subprocess.Popen(  # noqa: S603
                [sys.executable, "-I", "-S", str(SOURCE), config], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            log.warning("launcher: cannot start: %s", exc)
            ours.close()
            return None
        finally:
            theirs.close()
        launcher = cls(proc, ours, hierarchy, pool_size)
        launcher._reader.start()
        launcher.refill(limits)
        return launcher

    # -- the pool ---------------------------------------------------------------------
    def take(self, limits: LimitsConfig, *, wait: float = TAKE_WAIT, refill: bool = True) -> Stub | None:
        """A stub whose cgroups carry ``limits``, or None (none came within
        ``wait`` seconds, or the launcher is gone). Stubs made with other limits
        (``limits`` changed in kbd.yaml) are let go. Asks for replacements at
        once, or, with ``refill`` False, only when no other stub is left for
        the next command: the stub asks once it has its command
        (:meth:`Stub.launch`), so the launcher's fork of the replacement is
        not on the way to that command's start; the caller calls
        :meth:`refill` when the stub is let go unused."""
        key = self._key_of(limits)
        got, stale = self._pop(key)
        for stub in stale:
            stub.close()
        stale = []
        if refill or got is None or not self._spare(key):
            self.refill(limits)
        if got is None and wait > 0:
            # A stub on its way (it is paying its grace period) is usually
            # sooner than the slow path, which pays one too, and more.
            deadline = time.monotonic() + wait
            with self._arrived:
                while self.alive:
                    got, outdated = self._pop(key)
                    stale += outdated
                    left = deadline - time.monotonic()
                    coming = key in self._asked.values()
                    if got is not None or not coming or left <= 0 or not self._arrived.wait(left):
                        break
            for stub in stale:
                stub.close()
            if got is not None:
                self.refill(limits)
        return got

    def _spare(self, key: str) -> bool:
        """A pooled stub made for ``key`` is ready."""
        with self._lock:
            return any(s.key == key for s in self._pool)

    def _pop(self, key: str) -> tuple[Stub | None, list[Stub]]:
        """The first pooled stub made for ``key`` and the outdated ones before it
        (taken out of the pool; the caller closes them)."""
        stale: list[Stub] = []
        with self._lock:
            while self._pool:
                stub = self._pool.popleft()
                if stub.key == key:
                    return stub, stale
                stale.append(stub)
        return None, stale

    def refill(self, limits: LimitsConfig) -> None:
        self._refill(self._key_of(limits))

    def _refill(self, key: str) -> None:
        with self._lock:
            if key != self._key:
                self._failures = 0
            if not self.alive or self._failures >= FAILURES:
                return
            self._key = key
            have = sum(s.key == key for s in self._pool) + sum(k == key for k in self._asked.values())
            tags = [next(self._tags) for _ in range(max(0, self.pool_size - have))]
            self._asked.update(dict.fromkeys(tags, key))  # counted under the lock: no two refills ask twice
        for tag in tags:
            self._send({"op": "spawn", "tag": tag, "dirs": json.loads(key)})

    def _ask(self, key: str) -> None:
        """Ask the launcher for one more stub made with ``key``'s cgroup limits."""
        with self._lock:
            tag = next(self._tags)
            self._asked[tag] = key
        self._send({"op": "spawn", "tag": tag, "dirs": json.loads(key)})

    def _key_of(self, limits: LimitsConfig) -> str:
        return json.dumps(cgroup.stub_dirs(self.hierarchy, limits))

    def discard(self, stub: Stub) -> None:
        with self._lock:
            self._discarded[stub.pid] = stub.name
        stub.sock.close()  # the stub reads end of file and exits

    def expect(self, pid: int, sock: socket.socket | None = None) -> Child:
        child = Child(pid, self, sock)
        with self._lock:
            self._children[pid] = child
            alive = self.alive
        if not alive:
            child._exit(-9)
        return child

    def reap(self, pid: int) -> None:
        with self._lock:
            self._children.pop(pid, None)
        self._send({"op": "reap", "pid": pid})

    def _send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a dead launcher: the reader ends everything
            self.sock.send(json.dumps(message).encode())

    # -- the launcher's messages (the reader thread) -------------------------------------
    def _read(self) -> None:
        try:
            while True:
                data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(4))
                if not data:
                    return
                fds = _fds(anc)
                try:
                    self._handle(json.loads(data), fds)
                except Exception:  # one bad message must not stop the reader
                    log.exception("launcher: cannot handle a message")
                    for fd in fds:
                        os.close(fd)
        except OSError:
            return
        finally:
            self._died()

    def _handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "stub" and len(fds) == 1:
            sock = socket.socket(fileno=fds[0])
            with self._lock:
                key = self._asked.pop(_tag(message), "")
                stub = Stub(int(message["pid"]), str(message["cgroup"]), sock, key, self)
                current = key == self._key and self.alive
                self._failures = 0
                if current:
                    self._pool.append(stub)
                full = len(self._pool) >= self.pool_size
                self._arrived.notify_all()
            if not current:
                stub.close()
            if full:
                self.ready.set()
        elif op == "failed":
            with self._lock:
                self._asked.pop(_tag(message), None)
                self._failures += 1
                self._arrived.notify_all()  # nobody waits for a stub that will not come
            self.ready.set()
            log.warning("launcher: %s", message.get("error"))
        elif op == "exited":
            pid, rc = int(message["pid"]), int(message["rc"])
            with self._lock:
                child = self._children.get(pid)
                name = self._discarded.pop(pid, None)
                # A pooled stub that died waiting (killed, OOM): out of the pool.
                dead = [stub for stub in self._pool if stub.pid == pid]
                for stub in dead:
                    self._pool.remove(stub)
                    name = stub.name
            if child is not None:
                child._exit(rc)
                return
            self._send({"op": "reap", "pid": pid})  # a stub let go, or one that never got ready
            for stub in dead:
                stub.sock.close()
                if stub.key == self._key:
                    self._ask(stub.key)
            if name is not None:
                cgroup.remove(self.hierarchy, name)

    def _died(self) -> None:
        """The launcher is gone: no more stubs, and every command it started
        counts as killed (bubblewrap's --die-with-parent killed it; the caller
        kills whatever is left in its cgroup)."""
        with self._lock:
            self.alive = False
            children = list(self._children.values())
            pool, self._pool = list(self._pool), collections.deque()
            self._arrived.notify_all()
        for stub in pool:
            stub.sock.close()
        for child in children:
            child._exit(-9)
        self.ready.set()
        hook = self.on_death
        if hook is not None:
            hook()

    def close(self, timeout: float = 5.0) -> None:
        """Let every pooled stub go, stop the launcher (it kills and reaps its
        children and removes the cgroups it made), and remove whatever stub
        cgroup is left of it."""
        with self._lock:
            pool, self._pool = list(self._pool), collections.deque()
            self.alive = False
        for stub in pool:
            stub.sock.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=timeout)
        self.sock.close()
        with contextlib.suppress(OSError):
            cgroup.sweep_launcher(self.hierarchy, self.proc.pid)


def own_userns_usable() -> bool:
    """Whether this process may give commands a root-owned user namespace: it
    is root, and the host allows user namespaces at all."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/sys/user/max_user_namespaces") as fh:
            return int(fh.read().strip() or "0") > 0
    except (OSError, ValueError):
        return False


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
            out.extend(got)
    return out


def _tag(message: dict[str, Any]) -> int:
    """The request tag the launcher echoed (-1: none, which matches no request)."""
    tag = message.get("tag")
    return tag if isinstance(tag, int) else -1
