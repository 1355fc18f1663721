"""The stdio relay (kbd/sandbox/relay.py) with real sockets, pipes and child
processes: a socket never becomes a command's descriptor, the bytes still
arrive whole and in order, end of file travels both ways, and the caller's
sockets are left as they were."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator

import pytest

from kbd.sandbox.relay import Relay, is_socket
from tests.waiting import wait_for

# The command reports what its fd 0-2 are, then copies stdin to stdout.
SHOW_AND_CAT = (
    "import os, sys\n"
    "kinds = [os.readlink(f'/proc/self/fd/{n}').split(':')[0] for n in (0, 1, 2)]\n"
    "sys.stderr.write(' '.join(kinds) + '\\n'); sys.stderr.flush()\n"
    "while chunk := os.read(0, 65536):\n"
    "    os.write(1, chunk)\n"
)


def _start(relay: Relay, code: str) -> subprocess.Popen[bytes]:
    stdin, stdout, stderr = relay.command_stdio
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", code], stdin=stdin, stdout=stdout, stderr=stderr
    )
    relay.start()
    return proc


def _read_to_eof(sock: socket.socket, into: bytearray, done: threading.Event) -> None:
    while chunk := sock.recv(1 << 16):
        into += chunk
    done.set()


@pytest.fixture
def pairs() -> Iterator[tuple[socket.socket, socket.socket, socket.socket, socket.socket]]:
    """An ssh session's shape: (ours, theirs) for stdin+stdout, (ours, theirs) for stderr."""
    a, a_cmd = socket.socketpair()
    b, b_cmd = socket.socketpair()
    yield a, a_cmd, b, b_cmd
    for s in (a, a_cmd, b, b_cmd):
        s.close()


def test_descriptors_that_are_not_sockets_need_no_relay(tmp_path: object) -> None:
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        assert Relay.around((r, w, null)) is None
        assert not is_socket(r) and not is_socket(12345)
    finally:
        for fd in (r, w, null):
            os.close(fd)


def test_socket_stdio_reaches_the_command_as_pipes_and_every_byte_comes_back(
    pairs: tuple[socket.socket, socket.socket, socket.socket, socket.socket],
) -> None:
    a, a_cmd, b, b_cmd = pairs
    relay = Relay((a_cmd.fileno(), a_cmd.fileno(), b_cmd.fileno()))
    # stdin and stdout share a socket (as under ssh) but travel in separate pipes.
    assert len(set(relay.command_stdio)) == 3
    assert not any(is_socket(fd) for fd in relay.command_stdio)
    proc = _start(relay, SHOW_AND_CAT)
    payload = os.urandom(3 << 20)
    out, err = bytearray(), bytearray()
    got_out, got_err = threading.Event(), threading.Event()
    readers = [
        threading.Thread(target=_read_to_eof, args=(a, out, got_out), daemon=True),
        threading.Thread(target=_read_to_eof, args=(b, err, got_err), daemon=True),
    ]
    for t in readers:
        t.start()
    a.sendall(payload)
    a.shutdown(socket.SHUT_WR)  # end of input: the command's read returns 0 and it exits
    assert proc.wait(timeout=60) == 0
    relay.finish()
    a_cmd.close()  # the caller's copies (the broker closes the client's descriptors)
    b_cmd.close()
    assert got_out.wait(60) and got_err.wait(60)
    assert bytes(out) == payload
    assert bytes(err) == b"pipe pipe pipe\n"


def test_stdout_and_stderr_on_one_socket_share_one_pipe_and_keep_their_order() -> None:
    ours, theirs = socket.socketpair()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        relay = Relay((null, theirs.fileno(), theirs.fileno()))
        assert relay.command_stdio[0] == null
        assert relay.command_stdio[1] == relay.command_stdio[2]
        code = "import os\nfor i in range(2000):\n    os.write(1 + i % 2, b'%d\\n' % i)\n"
        proc = _start(relay, code)
        out, done = bytearray(), threading.Event()
        threading.Thread(target=_read_to_eof, args=(ours, out, done), daemon=True).start()
        assert proc.wait(timeout=60) == 0
        relay.finish()
        theirs.close()
        assert done.wait(60)
        assert out.decode().split() == [str(i) for i in range(2000)]
    finally:
        os.close(null)
        ours.close()
        theirs.close()


def _queued(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4), "little")


def test_output_flows_while_the_socket_that_is_also_stdin_stays_silent() -> None:
    """An ssh session's socket is stdin and stdout at once: output that waits for the socket
    to take it is written as soon as it can be, while no input arrives (the relay once waited
    only for input on that descriptor, so output stalled until the caller typed)."""
    ours, theirs = socket.socketpair()
    null = os.open(os.devnull, os.O_WRONLY)
    size = 4 << 20  # far more than the socket and the pipe hold
    try:
        relay = Relay((theirs.fileno(), theirs.fileno(), null))
        proc = _start(relay, f"import os\nos.write(1, b'x' * {size})\n")
        # The socket full before anyone reads: the relay now holds output it can only write later.
        wait_for(lambda: _queued(ours) >= 150_000, 20, "the caller's socket filled by the relay")
        got = 0
        ours.settimeout(20)
        while got < size:  # never writes: stdin stays silent while the command runs
            chunk = ours.recv(1 << 16)
            assert chunk, "the relay ended the output early"
            got += len(chunk)
        assert got == size and proc.wait(timeout=60) == 0
        relay.finish()
    finally:
        os.close(null)
        ours.close()
        theirs.close()


def test_finish_returns_only_once_the_output_is_in_the_callers_socket() -> None:
    """What the exit status frame waits for: after finish() every byte is
    readable at once, without waiting for anything."""
    ours, theirs = socket.socketpair()
    size = 1 << 20
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        relay = Relay((null, theirs.fileno(), null))
        proc = _start(relay, f"import os\nos.write(1, b'x' * {size})\n")
        assert proc.wait(timeout=60) == 0
        relay.finish()
        ours.setblocking(False)
        got = bytearray()
        try:
            while chunk := ours.recv(1 << 20):
                got += chunk
        except BlockingIOError:
            pass
        assert len(got) == size
    finally:
        os.close(null)
        ours.close()
        theirs.close()


def test_the_callers_socket_stays_blocking_and_open_for_its_other_writers() -> None:
    """No O_NONBLOCK on the caller's open file and no shutdown(SHUT_WR): after
    the command, the caller's own processes still write to the socket (an ssh
    session's script goes on after ``kbd exec``)."""
    ours, theirs = socket.socketpair()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        relay = Relay((null, theirs.fileno(), theirs.fileno()))
        assert not fcntl.fcntl(theirs.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        proc = _start(relay, "import os\nos.write(1, b'from the command\\n')\n")
        assert proc.wait(timeout=60) == 0
        relay.finish()
        assert not fcntl.fcntl(theirs.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        theirs.sendall(b"after\n")
        theirs.close()
        out = bytearray()
        _read_to_eof(ours, out, threading.Event())
        assert bytes(out) == b"from the command\nafter\n"
    finally:
        os.close(null)
        ours.close()
        theirs.close()


def test_a_reader_that_went_away_is_the_commands_broken_pipe() -> None:
    ours, theirs = socket.socketpair()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        relay = Relay((null, theirs.fileno(), null))
        code = "import os, signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\nwhile True:\n    os.write(1, b'y' * 4096)\n"
        proc = _start(relay, code)
        ours.recv(1)  # it runs
        ours.close()
        assert proc.wait(timeout=60) == -13  # SIGPIPE, as it would have been on the socket itself
        relay.finish()
    finally:
        os.close(null)
        theirs.close()


def test_the_command_closing_its_stdin_stops_the_relay_reading() -> None:
    ours, theirs = socket.socketpair()
    out_r, out_w = os.pipe()
    try:
        relay = Relay((theirs.fileno(), out_w, out_w))
        proc = _start(relay, "import os\nos.close(0)\nos.write(1, b'closed\\n')\n")
        assert os.read(out_r, 100) == b"closed\n"
        assert proc.wait(timeout=60) == 0
        relay.finish()  # the socket never reached end of file: finish does not wait for it
    finally:
        for fd in (out_r, out_w):
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_hangup_on_the_callers_connection_ends_the_relay() -> None:
    """The broker's client died: the relay stops at once, though the command's
    stdin never reached end of file and its output was never read."""
    ours, theirs = socket.socketpair()
    conn, client = socket.socketpair()
    try:
        relay = Relay((theirs.fileno(), theirs.fileno(), theirs.fileno()), hangup=conn.fileno())
        proc = _start(relay, "import os\nos.write(1, b'z' * (4 << 20))\n")
        client.close()
        proc.kill()  # the broker kills the tree when its client dies
        proc.wait(timeout=60)
        relay.finish()
    finally:
        for s in (ours, theirs, conn, client):
            s.close()


def test_the_in_process_exec_swaps_its_own_socket_stdio_for_the_commands_run() -> None:
    """kbd exec without a daemon (kbd.service.execute.run): its own fd 0-2 are
    what the command inherits."""
    code = (
        "import os, socket, sys\n"
        "from kbd.sandbox.relay import OwnStdio\n"
        "own = OwnStdio.swap()\n"
        "assert own is not None\n"
        "import subprocess\n"
        "subprocess.run(['readlink', '/proc/self/fd/0', '/proc/self/fd/1'], check=True)\n"
        "own.restore()\n"
        "os.write(1, b'restored ' + os.readlink('/proc/self/fd/1').split(':')[0].encode() + b'\\n')\n"
    )
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=theirs.fileno(),
            stdout=theirs.fileno(),
            stderr=subprocess.PIPE,
        )
        theirs.close()
        out = bytearray()
        _read_to_eof(ours, out, threading.Event())
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else b""
        lines = out.decode().split()
        assert [line.split(":")[0] for line in lines] == ["pipe", "pipe", "restored", "socket"], lines
    finally:
        ours.close()
        if proc.stderr:
            proc.stderr.close()


def test_output_left_in_the_pipe_when_the_command_ends_is_all_delivered(
    pairs: tuple[socket.socket, socket.socket, socket.socket, socket.socket],
) -> None:
    """More than one chunk still in the pipe when the command's tree is gone (a
    relay that lagged behind a loaded host): the final phase reads on until the
    pipe is empty. It polled for the wake-up it had already consumed after the
    first chunk it sent whole, and hung (a `kbd exec` that never ended)."""
    ours, theirs, _, _ = pairs
    relay = Relay([os.open(os.devnull, os.O_RDONLY), theirs.fileno(), theirs.fileno()])
    _, out, _ = relay.command_stdio
    fcntl.fcntl(out, 1031, 1 << 20)  # F_SETPIPE_SZ: room for several chunks while nobody reads
    payload = os.urandom(5 * (1 << 16) + 123)
    view = memoryview(payload)
    while view:
        view = view[os.write(out, view) :]
    got, done = bytearray(), threading.Event()
    reader = threading.Thread(target=_read_to_eof, args=(ours, got, done), daemon=True)
    reader.start()
    relay._final.set()  # the command is gone before the relay ran once: all of it is left for the end
    relay.start()
    finisher = threading.Thread(target=relay.finish, daemon=True)
    finisher.start()
    finisher.join(timeout=20)
    assert not finisher.is_alive(), "the relay's final phase hung with output left in the pipe"
    theirs.close()
    assert done.wait(20) and bytes(got) == payload
