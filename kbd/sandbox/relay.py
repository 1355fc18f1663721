"""A command's stdio when the caller's descriptors are sockets: pipes, relayed.

Why (docs/multi-user.md "Channels", docs/sandbox.md "stdio"): a Unix socket carries
descriptors (``SCM_RIGHTS``) both ways. A command whose fd 0-2 is the caller's
socket could send a descriptor out (a write-granted ``notes/`` to a process
outside, which keeps writing after a revocation) or receive one from outside
(a descriptor of ``workflows/``, which the command could ``fstat`` or watch
with inotify beyond its grants: Landlock mediates neither). A pipe carries
bytes only. So wherever one of the caller's stdio descriptors is a socket
(``S_ISSOCK``: Unix, TCP, a listening or a datagram socket alike), the
command gets a pipe end in its place and a :class:`Relay` thread copies the
bytes: socket → pipe for stdin, pipe → socket for stdout and stderr. Other
descriptors (files, pipes, ttys) are handed over as they are.

The rules:

* **Bounded, never busy.** One thread per relayed command, blocked in
  ``poll``; each direction holds at most :data:`CHUNK` bytes, read only once
  the previous chunk is written. The caller's sockets are never switched to
  ``O_NONBLOCK`` (the flag belongs to the open file, which the caller's other
  processes share: an ``ssh`` session's shell would see ``EAGAIN``):
  every call passes ``MSG_DONTWAIT`` instead.
* **One pipe per socket.** stdout and stderr on the same socket (``2>&1``)
  share one pipe, so their order is the order the command wrote them in.
* **End of input:** when the caller's socket reaches end of file (or an
  error), the pipe's write end is closed and the command reads EOF. When the
  command closes its stdin, the relay stops reading the socket.
* **End of output:** once every process of the command has exited (the
  caller of :meth:`Relay.finish` guarantees it: the exec path kills the tree
  first) the relay reads what is left in each pipe and writes it to the
  socket, then closes its own copy of the socket, exactly as a command that
  held the socket itself would have ended. It does **not** call
  ``shutdown(SHUT_WR)``: that acts on the socket, not on one descriptor, and
  the caller's own processes still write to it (the thin client's error
  lines; the rest of an ``ssh`` session's script, ``kbd exec S -- cmd; echo
  done``).
* **Nothing lost, nothing reordered:** :meth:`Relay.finish` returns only when
  every byte the command wrote has been written to the caller's socket, so
  the broker sends the exit status after the output. A reader that is gone
  (``EPIPE``, a reset) closes the pipe instead: the command's next write fails
  as it would have on the socket.
* **The caller gone:** ``hangup`` (the broker's client connection) hanging up
  abandons the relay at once (the broker has already killed the command's
  tree by then).
* **What a relay cannot keep:** input it read ahead (at most :data:`CHUNK`
  bytes plus the pipe's 64 KiB) that the command did not read before it
  exited is lost to the caller's next reader (as with ssh's own relay);
  datagram and seqpacket sockets lose their message boundaries.

A broker command with socket stdio holds at most seven more descriptors in the
daemon while it runs (three pipes and an eventfd); the caller's sockets are
used through the descriptors it already received, never duplicated.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import stat
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

CHUNK = 1 << 16
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_BROKEN = select.POLLNVAL


def is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:  # closed: nothing to relay
        return False


def _borrow(fd: int) -> socket.socket:
    """A socket object over the caller's descriptor ``fd`` (detached again by
    :meth:`_Flow.close`, never closed here). ``SOCK_NONBLOCK`` in the type
    keeps Python from touching the open file's ``O_NONBLOCK`` (it sets it when a
    default timeout is configured); the family is never used (send and recv
    only), so it need not be the socket's own."""
    import socket

    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK, 0, fileno=fd)


class _Flow:
    """One direction: ``src`` → ``dst`` through a buffer of at most CHUNK bytes.
    ``pipe`` is this process's end of the command's pipe (non-blocking: it is
    ours alone), ``end`` the command's."""

    def __init__(self, sock_fd: int, *, output: bool) -> None:
        import socket

        self.flags = socket.MSG_DONTWAIT | (socket.MSG_NOSIGNAL if output else 0)
        r, w = os.pipe2(os.O_CLOEXEC)
        self.pipe, self.end = (r, w) if output else (w, r)
        try:
            os.set_blocking(self.pipe, False)
            self.sock: socket.socket | None = _borrow(sock_fd)
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        self.pending = memoryview(b"")
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pending = memoryview(b"")
            with contextlib.suppress(OSError):
                os.close(self.pipe)
            if self.sock is not None:
                self.sock.detach()  # the caller's descriptor: its owner closes it
                self.sock = None

    def sock_fd(self) -> int:
        assert self.sock is not None
        return self.sock.fileno()

    def flush(self) -> None:
        """Write what is pending to the destination, as far as it takes it now."""
        raise NotImplementedError


class _Out(_Flow):
    """The command's stdout and/or stderr → the caller's socket."""

    def __init__(self, sock_fd: int) -> None:
        super().__init__(sock_fd, output=True)

    def fill(self, *, final: bool) -> None:
        """Read the next chunk from the pipe. ``final``: the command's tree is
        dead, so an empty pipe is the end even while another writer (a copy
        that escaped the tree) keeps the write end open."""
        try:
            data = os.read(self.pipe, CHUNK)
        except BlockingIOError:
            if final:
                self.close()
            return
        if not data:
            self.close()
            return
        self.pending = memoryview(data)
        self.flush()

    def flush(self) -> None:
        assert self.sock is not None
        try:
            sent = self.sock.send(self.pending, self.flags)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # nobody reads the socket any more: the command's next write fails (EPIPE)
            self.close()
            return
        self.pending = self.pending[sent:]


class _In(_Flow):
    """The caller's socket → the command's stdin."""

    def __init__(self, sock_fd: int) -> None:
        super().__init__(sock_fd, output=False)

    def fill(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(CHUNK, self.flags)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a reset, a listening or unconnected socket: no more input
            data = b""
        if not data:
            self.close()  # the command reads end of file
            return
        self.pending = memoryview(data)
        self.flush()

    def flush(self) -> None:
        try:
            written = os.write(self.pipe, self.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EPIPE: the command closed its stdin; stop reading the socket
            self.close()
            return
        self.pending = self.pending[written:]


class Relay:
    """The pipes that stand in for the socket slots of ``stdio`` and the thread
    that relays them. :attr:`command_stdio` is what the command gets;
    :meth:`start` starts relaying, :meth:`finish` (once the command's tree is
    dead) delivers the rest and ends, :meth:`close` abandons. ``stdio`` stays
    the caller's to close, after :meth:`finish` or :meth:`close`."""

    def __init__(self, stdio: Sequence[int], *, hangup: int | None = None) -> None:
        self._hangup = hangup
        self._inflow: _In | None = None
        self._outs: list[_Out] = []
        self._mine: list[int] = []  # this process's copies of the command's ends
        self._final = threading.Event()
        self._abandon = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = -1
        by_socket: dict[tuple[int, int], _Out] = {}
        slots = list(stdio)
        try:
            self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            for n, fd in enumerate(stdio):
                if not is_socket(fd):
                    continue
                if n == 0:
                    self._inflow = _In(fd)
                    slots[0] = self._inflow.end
                    self._mine.append(self._inflow.end)
                    continue
                st = os.fstat(fd)
                out = by_socket.get((st.st_dev, st.st_ino))
                if out is None:
                    out = by_socket[(st.st_dev, st.st_ino)] = _Out(fd)
                    self._outs.append(out)
                    self._mine.append(out.end)
                slots[n] = out.end
        except BaseException:
            self._close_all()
            raise
        self.command_stdio: tuple[int, int, int] = (slots[0], slots[1], slots[2])

    @classmethod
    def around(cls, stdio: Sequence[int], *, hangup: int | None = None) -> Relay | None:
        """A relay for ``stdio``, or None when none of it is a socket."""
        if not any(is_socket(fd) for fd in stdio):
            return None
        return cls(stdio, hangup=hangup)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kbd-relay", daemon=True)
            self._thread.start()

    def handed(self) -> None:
        """The command's ends are no longer needed here: close this process's
        copies (then the pipes end with the command's own)."""
        mine, self._mine = self._mine, []
        for fd in mine:
            with contextlib.suppress(OSError):
                os.close(fd)

    def finish(self) -> None:
        """Every process that held the command's ends is dead: deliver what
        is left in the pipes to the caller's sockets and end (stdin is not
        read any further). Returns once all of it is written, or the caller
        hung up, or a reader went away."""
        self.handed()
        self._final.set()
        self._stop_thread()
        self._close_all()

    def close(self) -> None:
        """Abandon the relay: nothing more is read or written."""
        self._abandon.set()
        self.handed()
        self._stop_thread()
        self._close_all()

    # -- the thread ----------------------------------------------------------------------
    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        self._thread.join()
        self._thread = None

    def _close_all(self) -> None:
        self.handed()
        if self._inflow is not None:
            self._inflow.close()
        for out in self._outs:
            out.close()
        if self._wake >= 0:
            with contextlib.suppress(OSError):
                os.close(self._wake)
            self._wake = -1

    def _run(self) -> None:
        # A write into a pipe the command closed must fail with EPIPE, never
        # end this process (a thread-directed signal, left pending here).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        try:
            while self._step():
                pass
        except Exception:  # never a stuck broker thread: abandon, say so
            import logging  # only here: the in-process exec path does not load logging

            logging.getLogger("kbd.relay").exception("relay: copying a command's stdio failed")
        finally:
            if self._inflow is not None:
                self._inflow.close()
            for out in self._outs:
                out.close()

    def _step(self) -> bool:
        """One round: act on what is ready; False when the relay is done."""
        if self._abandon.is_set():
            return False
        final = self._final.is_set()
        inflow = self._inflow if self._inflow is not None and not self._inflow.closed else None
        if final and inflow is not None:
            inflow.close()  # the command is gone: its stdin is not read any further
            inflow = None
        outs = [o for o in self._outs if not o.closed]
        if final:
            for out in outs:
                if not out.pending:
                    out.fill(final=True)
            outs = [o for o in outs if not o.closed]
            if not outs:
                return False
            if any(not o.pending for o in outs):
                # A chunk went out whole and the pipe may hold more: read on at once. In the final
                # phase a pipe is never waited for, so a poll now would wait only for a wake-up
                # already taken (it hung with output left in the pipe).
                return True
        elif not outs and inflow is None:
            return False
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        if self._hangup is not None:
            poller.register(self._hangup, _POLLRDHUP)
        # One socket can carry stdin and stdout (an ssh session's): both flows wait on its
        # descriptor, one to read and one to write, so the events are combined per descriptor
        # and each flow acts on its own (registering the descriptor twice would keep only one).
        watch: dict[int, list[tuple[_Flow, int]]] = {}
        for flow in [*outs, *([inflow] if inflow is not None else [])]:
            if flow.pending:  # waiting to write: the destination
                fd, event = (flow.sock_fd() if isinstance(flow, _Out) else flow.pipe), select.POLLOUT
            elif isinstance(flow, _Out) and not final:
                fd, event = flow.pipe, select.POLLIN
            elif isinstance(flow, _In):
                fd, event = flow.sock_fd(), select.POLLIN
            else:
                continue
            watch.setdefault(fd, []).append((flow, event))
        for fd, waiting in watch.items():
            mask = 0
            for _, event in waiting:
                mask |= event
            poller.register(fd, mask)
        ready = dict(poller.poll())
        if any(ev & _BROKEN for ev in ready.values()):
            raise OSError("a relayed descriptor was closed under the relay")
        if self._hangup is not None and self._hangup in ready:
            return False  # the caller is gone (its command's tree is being killed)
        if self._wake in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake)
        for fd, waiting in watch.items():
            for flow, event in waiting:
                # Its own event, or the descriptor's error or hang-up (the action then sees why).
                if not ready.get(fd, 0) & (event | select.POLLERR | select.POLLHUP) or flow.closed:
                    continue
                if flow.pending:
                    flow.flush()
                elif isinstance(flow, _Out):
                    flow.fill(final=False)
                else:
                    assert isinstance(flow, _In)
                    flow.fill()
        return True


class OwnStdio:
    """The in-process ``kbd exec``: this process's fd 0-2 are what the command
    inherits, so a socket among them is replaced, for the command's run, by the
    pipe end the relay copies through; :meth:`restore` puts the caller's
    descriptors back (once the command's tree is dead) and delivers the rest."""

    def __init__(self, saved: tuple[int, int, int], relay: Relay, swapped: list[int]) -> None:
        self.saved = saved
        self.relay = relay
        self.swapped = swapped

    @classmethod
    def swap(cls) -> OwnStdio | None:
        """None (and nothing changed) when none of fd 0-2 is a socket."""
        if not any(is_socket(fd) for fd in (0, 1, 2)):
            return None
        dups: list[int] = []
        try:
            for fd in (0, 1, 2):
                dups.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3))
            saved = (dups[0], dups[1], dups[2])
            relay = Relay(saved)
        except BaseException:
            for fd in dups:
                os.close(fd)
            raise
        swapped = [n for n in (0, 1, 2) if relay.command_stdio[n] != saved[n]]
        done: list[int] = []
        try:
            for n in swapped:
                os.dup2(relay.command_stdio[n], n)
                done.append(n)
        except BaseException:
            for n in done:
                os.dup2(saved[n], n)
            relay.close()
            for fd in saved:
                os.close(fd)
            raise
        relay.handed()  # fd 0-2 hold them now
        relay.start()
        return cls(saved, relay, swapped)

    def restore(self) -> None:
        for n in self.swapped:
            os.dup2(self.saved[n], n)  # the pipe end at n goes with it
        self.relay.finish()
        for fd in self.saved:
            with contextlib.suppress(OSError):
                os.close(fd)
