"""The seccomp filter's Unix-socket rule for commands carrying the grant group
(kbd/sandbox/seccomp.py ``unix_pairs_only``; docs/multi-user.md "Channels"): decided
by a small BPF interpreter over every architecture kbd knows, then installed
for real in a child process on this kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kbd.sandbox import seccomp
from tests.security.test_sandbox_hardening import run_bpf

SOCK_DGRAM, SOCK_RAW, SOCK_CLOEXEC, SOCK_NONBLOCK = 2, 3, 0o2000000, 0o4000
# socket(2) and socketpair(2), written out here rather than read from the filter's tables.
NUMBERS = {"x86_64": (41, 53), "aarch64": (198, 199)}


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
@pytest.mark.parametrize("net", [True, False])
def test_unix_pairs_only_refuses_unix_sockets_and_datagram_pairs(machine: str, net: bool) -> None:
    arch = seccomp.ARCHES[machine]
    sock, pair = NUMBERS[machine]
    allow, noaf = seccomp.RET_ALLOW, seccomp.ret_errno(seccomp.EAFNOSUPPORT)
    confined = seccomp.program(block_network=net, unix_pairs_only=True, machine=machine)
    plain = seccomp.program(block_network=net, machine=machine)

    def verdict(prog: bytes, nr: int, *args: int) -> int:
        return run_bpf(prog, arch=arch.audit, nr=nr, args=args)

    for kind in (seccomp.SOCK_STREAM, SOCK_DGRAM, seccomp.SOCK_SEQPACKET, seccomp.SOCK_STREAM | SOCK_CLOEXEC):
        assert verdict(confined, sock, seccomp.AF_UNIX, kind, 0) == noaf, kind
        assert verdict(plain, sock, seccomp.AF_UNIX, kind, 0) == allow, kind  # no grant group: as before
    inet = noaf if net else allow
    assert verdict(confined, sock, seccomp.AF_INET, 1, 0) == inet
    assert verdict(confined, sock, seccomp.AF_INET6, 2, 0) == inet
    for kind in (seccomp.SOCK_STREAM, seccomp.SOCK_SEQPACKET):
        for flags in (0, SOCK_CLOEXEC, SOCK_NONBLOCK | SOCK_CLOEXEC):
            assert verdict(confined, pair, seccomp.AF_UNIX, kind | flags, 0) == allow, (kind, flags)
    # A datagram socket, even one of a pair, can sendto() any socket path.
    for kind in (SOCK_DGRAM, SOCK_DGRAM | SOCK_CLOEXEC, SOCK_RAW):
        assert verdict(confined, pair, seccomp.AF_UNIX, kind, 0) == noaf, kind
        assert verdict(plain, pair, seccomp.AF_UNIX, kind, 0) == allow, kind
    assert verdict(confined, pair, seccomp.AF_INET, seccomp.SOCK_STREAM, 0) == noaf
    # Everything else is decided as without the flag (read, write, a keyring call).
    for nr in (0, 1, 63, 64):
        assert verdict(confined, nr) == verdict(plain, nr), nr


INSTALLED = """
import ctypes, errno, socket, struct
from kbd.sandbox import seccomp
prog = seccomp.program(block_network=True, unix_pairs_only=True)
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(prog, len(prog))
fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
def attempt(name, make):
    try:
        for s in make():
            s.close()
        print(name + ":ok")
    except OSError as e:
        print(name + ":" + errno.errorcode[e.errno])
attempt("unix", lambda: [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)])
attempt("unix-dgram", lambda: [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)])
attempt("pair-stream", lambda: socket.socketpair())
attempt("pair-seqpacket", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
attempt("pair-dgram", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))
a, b = socket.socketpair()
a.sendall(b"through the pair")
print("pair-works:" + b.recv(100).decode())
"""


def test_the_installed_filter_refuses_unix_sockets_and_keeps_stream_pairs() -> None:
    r = subprocess.run(
        [sys.executable, "-c", INSTALLED], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n") == [
        "unix:EAFNOSUPPORT", "unix-dgram:EAFNOSUPPORT", "pair-stream:ok", "pair-seqpacket:ok",
        "pair-dgram:EAFNOSUPPORT", "pair-works:through the pair", "",
    ], r.stdout  # fmt: skip
