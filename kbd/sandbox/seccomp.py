"""A small seccomp filter for sandboxed commands, built as classic BPF. Pure.

Why: commands may run as uid 0 with every capability dropped, and a file's
owner may still ``chmod u+s`` it. A contributor could then leave a setuid-root
program in a source's ``notes/`` (or the consumer's own folder) that someone on
the host later runs (found by review). Landlock has no right for mode changes,
so the filter refuses, with EPERM:

* setting S_ISUID or S_ISGID through chmod, fchmod, fchmodat, fchmodat2, or
  when creating a file (open, openat, creat, mknod, mknodat);
* ``openat2`` (its mode sits in a struct the filter cannot read: callers fall
  back to openat) and ``io_uring_setup`` (io_uring would bypass the filter);
* with ``block_network``: ``socket()`` for IPv4, IPv6 and packet sockets (the
  Landlock-only backend has no network namespace to remove them with).

Foreign ABIs (i386 ``int 0x80``, x32) are killed: the filter only knows the
native numbers of x86_64 and aarch64.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

LD_W_ABS = 0x20
JEQ_K = 0x15
JGE_K = 0x35
JSET_K = 0x45
RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
EPERM, ENOSYS = 1, 38
SETID_BITS = 0o6000
X32_BIT = 0x40000000
AF_UNIX, AF_INET, AF_INET6, AF_PACKET = 1, 2, 10, 17


def ret_errno(errno: int) -> int:
    return 0x00050000 | errno


@dataclass(frozen=True)
class Arch:
    audit: int
    mode_arg: dict[int, int]  # syscall number -> index of its mode argument
    deny: dict[int, int]  # syscall number -> errno
    socket: int
    x32: bool
    # Metadata changes Landlock cannot see: mode, owner, timestamps, xattrs.
    metadata: tuple[int, ...] = ()


ARCHES = {
    "x86_64": Arch(
        audit=0xC000003E,
        # chmod, fchmod, creat, mknod, open, openat, mknodat, fchmodat, fchmodat2
        mode_arg={90: 1, 91: 1, 85: 1, 133: 1, 2: 2, 257: 3, 259: 2, 268: 2, 452: 2},
        deny={437: ENOSYS, 425: ENOSYS},  # openat2, io_uring_setup
        socket=41,
        x32=True,
        # chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes futimesat
        # utimensat setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr
        # setxattrat removexattrat
        metadata=(
            90,
            91,
            268,
            452,
            92,
            93,
            94,
            260,
            132,
            235,
            261,
            280,
            188,
            189,
            190,
            197,
            198,
            199,
            463,
            466,
        ),
    ),
    "aarch64": Arch(
        audit=0xC00000B7,
        # fchmod, fchmodat, openat, mknodat, fchmodat2
        mode_arg={52: 1, 53: 2, 56: 3, 33: 2, 452: 2},
        deny={437: ENOSYS, 425: ENOSYS},
        socket=198,
        x32=False,
        metadata=(52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466),
    ),
}


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program(*, block_network: bool, block_metadata: bool = False, machine: str | None = None) -> bytes:
    """The filter as a sock_filter array (what ``bwrap --seccomp FD`` reads).

    ``block_metadata`` (the Landlock-only backend, where the command's uid 0 owns
    host files Landlock cannot protect from chmod, chown, utimes or xattrs)
    refuses those calls outright, and Unix-domain sockets too (Landlock cannot
    stop a connect to a root-owned socket such as kbd's own).
    """
    name = machine or os.uname().machine  # not platform.machine(): its import costs the exec path
    arch = ARCHES.get(name)
    if arch is None:
        raise ValueError(f"no seccomp filter for architecture {name!r}")
    out = [
        _ins(LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _ins(JEQ_K, 1, 0, arch.audit),
        _ins(RET_K, 0, 0, RET_KILL_PROCESS),
        _ins(LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if arch.x32:
        out += [_ins(JGE_K, 0, 1, X32_BIT), _ins(RET_K, 0, 0, RET_KILL_PROCESS)]
    if block_metadata:
        for nr in arch.metadata:
            out += [_ins(JEQ_K, 0, 1, nr), _ins(RET_K, 0, 0, ret_errno(EPERM))]
    for nr, arg in sorted(arch.mode_arg.items()):
        # if nr matches: load the low 32 bits of the mode argument, refuse set-id bits.
        out += [
            _ins(JEQ_K, 0, 4, nr),
            _ins(LD_W_ABS, 0, 0, 16 + 8 * arg),
            _ins(JSET_K, 0, 1, SETID_BITS),
            _ins(RET_K, 0, 0, ret_errno(EPERM)),
            _ins(RET_K, 0, 0, RET_ALLOW),
        ]
    for nr, err in sorted(arch.deny.items()):
        out += [_ins(JEQ_K, 0, 1, nr), _ins(RET_K, 0, 0, ret_errno(err))]
    families = ([AF_INET, AF_INET6, AF_PACKET] if block_network else []) + (
        [AF_UNIX] if block_metadata else []
    )
    if families:
        n = len(families)
        out += [_ins(JEQ_K, 0, n + 3, arch.socket), _ins(LD_W_ABS, 0, 0, 16)]
        # Each family check jumps to the refusal on a match.
        out += [_ins(JEQ_K, n - i, 0, fam) for i, fam in enumerate(families)]
        out += [_ins(RET_K, 0, 0, RET_ALLOW), _ins(RET_K, 0, 0, ret_errno(EPERM))]
    out.append(_ins(RET_K, 0, 0, RET_ALLOW))
    return b"".join(out)
