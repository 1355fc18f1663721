"""A small seccomp filter for sandboxed commands, built as classic BPF. Pure.

Why: commands may run as uid 0 with every capability dropped, and a file's
owner may still ``chmod u+s`` it. A contributor could then leave a setuid-root
program in a source's ``notes/`` (or the consumer's own folder) that someone on
the host later runs (found by review). Landlock has no right for mode changes,
so the filter refuses, with EPERM:

* setting S_ISUID or S_ISGID through chmod, fchmod, fchmodat, fchmodat2, or
  when creating a file or folder (open, openat, creat, mknod, mknodat, mkdir,
  mkdirat), as systemd's RestrictSUIDSGID does. Always, whatever the host: a
  sandboxed command never needs them, and on a host with a grant group a
  setgid file made inside would hand that group to whoever runs it outside.
  (A folder made in a setgid folder still inherits S_ISGID from it: the kernel
  does that, not the mode argument, and it is how notes/ keeps its group.)
  ``openat2`` carries its mode in a struct, so it is refused whole (below);
* the kernel keyrings (``add_key``, ``request_key``, ``keyctl``): keyrings are
  not namespaced, so a sandboxed uid 0 could read a key planted in root's user
  keyring on the host, or pass data to another session through one. EPERM (as
  Docker's default profile answers) rather than ENOSYS: keyrings exist on this
  kernel, the sandbox forbids them, and callers that can live without them
  (libkeyutils users, Kerberos ccaches) treat either as "no keyring";
* new user namespaces: ``unshare`` and ``clone`` with CLONE_NEWUSER (a full
  capability set inside a child namespace is needless kernel attack surface);
* ``openat2`` (its mode sits in a struct the filter cannot read: callers fall
  back to openat), ``clone3`` (its flags sit in a struct too: glibc falls back
  to clone on ENOSYS, as under Docker and Chromium) and ``io_uring_setup``
  (io_uring would bypass the filter) — these three with ENOSYS;
* ``fallocate`` with FALLOC_FL_KEEP_SIZE (but not PUNCH_HOLE), with
  EOPNOTSUPP (as on a filesystem without it): it takes disk space past the end
  of a file, beyond ``limits.file_size_max`` (RLIMIT_FSIZE checks only sizes);
* ``ptrace``, ``process_vm_readv`` and ``process_vm_writev`` aimed at PID 1
  (bubblewrap's init in the sandbox: kbd's process, not the command's);
* every socket family not on an allow-list (see ``socket_families``), with
  EAFNOSUPPORT, the answer of a kernel built without that family, so programs
  degrade as they would there: netlink (host interfaces, routes, Unix sockets
  through sock_diag), packet, vsock (the host's hypervisor channel), AF_ALG,
  AF_KEY and the rest never exist inside a sandbox;
* with ``unix_pairs_only`` (a command carrying the host's grant group, docs/multi-user.md "Channels"),
  ``socket(AF_UNIX, …)`` too, and datagram ``socketpair`` types:
  a Unix socket is a descriptor channel, and a ``connect`` (or a datagram
  ``sendto``) to a pathname socket a process outside listens on is mediated by
  neither Landlock nor the mount namespace (the caller's own workflow folder
  is in it). A stream or seqpacket pair reaches nothing outside the command's
  tree. EAFNOSUPPORT again, as on the Landlock-only backend, so one program
  sees one answer whatever the backend: the C library's ``syslog``, nscd and
  NSS lookups take it as "no such service" and carry on.

Foreign ABIs (i386 ``int 0x80``, x32) are killed: the filter only knows the
native numbers of x86_64 and aarch64.
"""

from __future__ import annotations

import errno as _errno  # as _errno: the block builders take an ``errno`` argument
import os
import struct
from dataclasses import dataclass, field

LD_W_ABS = 0x20
JEQ_K = 0x15
JGE_K = 0x35
JSET_K = 0x45
RET_K = 0x06
ALU_AND_K = 0x54
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
EPERM, ENOSYS, EAFNOSUPPORT, EOPNOTSUPP = _errno.EPERM, _errno.ENOSYS, _errno.EAFNOSUPPORT, _errno.EOPNOTSUPP
# fallocate modes: KEEP_SIZE without PUNCH_HOLE takes disk space past the end.
FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE = 0x01, 0x02
SETID_BITS = 0o6000
CLONE_NEWUSER = 0x10000000
X32_BIT = 0x40000000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 5, 0xF
PRIO_USER, IOPRIO_WHO_USER = 2, 3


def ret_errno(errno: int) -> int:
    return 0x00050000 | errno


@dataclass(frozen=True)
class Arch:
    audit: int
    mode_arg: dict[int, int]  # syscall number -> index of its mode argument
    deny: dict[int, int]  # syscall number -> errno
    socket: int
    socketpair: int
    # Syscalls whose first argument carries clone flags (clone, unshare).
    clone_flags: tuple[int, ...]
    x32: bool
    # Metadata changes Landlock cannot see: mode, owner, timestamps, xattrs.
    metadata: tuple[int, ...] = ()
    # Calls that change another process's rlimits or scheduling, allowed for any
    # process of the same uid (Landlock does not mediate them): syscall number ->
    # index of the target-PID argument, which must be 0 (the caller itself).
    # prlimit64, sched_setparam, sched_setscheduler, sched_setaffinity, sched_setattr.
    self_only: dict[int, int] = field(default_factory=dict)
    # setpriority and ioprio_set (which, who, ...): ``who`` 0 only, never "every
    # process of this uid".
    setpriority: int = -1
    ioprio_set: int = -1
    fallocate: int = -1
    # System V IPC and POSIX message queues (objects of the IPC namespace).
    ipc: tuple[int, ...] = ()
    # ptrace (target PID in argument 1), process_vm_readv/writev (argument 0).
    ptrace: int = -1
    process_vm: tuple[int, ...] = ()


ARCHES = {
    "x86_64": Arch(
        audit=0xC000003E,
        # chmod, fchmod, creat, mknod, open, openat, mknodat, fchmodat, fchmodat2, mkdir, mkdirat
        mode_arg={90: 1, 91: 1, 85: 1, 133: 1, 2: 2, 257: 3, 259: 2, 268: 2, 452: 2, 83: 1, 258: 2},
        # openat2, io_uring_setup, clone3 (ENOSYS); add_key, request_key, keyctl (EPERM)
        deny={437: ENOSYS, 425: ENOSYS, 435: ENOSYS, 248: EPERM, 249: EPERM, 250: EPERM},
        socket=41,
        socketpair=53,
        clone_flags=(56, 272),  # clone, unshare
        x32=True,
        self_only={302: 0, 142: 0, 144: 0, 203: 0, 314: 0},
        setpriority=141,
        ioprio_set=251,
        fallocate=285,
        # shmget shmat shmctl semget semop semctl shmdt msgget msgsnd msgrcv msgctl
        # semtimedop mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
        ipc=(29, 30, 31, 64, 65, 66, 67, 68, 69, 70, 71, 220, 240, 241, 242, 243, 244, 245),
        ptrace=101,
        process_vm=(310, 311),
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
        # fchmod, fchmodat, openat, mknodat, fchmodat2, mkdirat
        mode_arg={52: 1, 53: 2, 56: 3, 33: 2, 452: 2, 34: 2},
        deny={437: ENOSYS, 425: ENOSYS, 435: ENOSYS, 217: EPERM, 218: EPERM, 219: EPERM},
        socket=198,
        socketpair=199,
        clone_flags=(220, 97),  # clone, unshare
        x32=False,
        self_only={261: 0, 118: 0, 119: 0, 122: 0, 274: 0},
        setpriority=140,
        ioprio_set=30,
        fallocate=47,
        ipc=tuple(range(180, 198)),  # mq_open … shmdt
        ptrace=117,
        process_vm=(270, 271),
        metadata=(52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466),
    ),
}


def socket_families(*, network: bool, unix: bool) -> tuple[int, ...]:
    """The families ``socket()`` may create: an allow-list, so a family the
    kernel adds later is refused too. ``network`` (``sandbox.network: host``)
    adds IPv4 and IPv6; ``unix`` adds Unix-domain sockets (withheld on the
    Landlock-only backend, where Landlock cannot stop a connect to a host socket
    such as kbd's own, and from commands carrying the grant group, which could
    reach a socket their caller listens on). ``socketpair`` always allows
    AF_UNIX: a stream or seqpacket pair reaches nothing outside the process tree."""
    return ((AF_UNIX,) if unix else ()) + ((AF_INET, AF_INET6) if network else ())


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _arg(index: int) -> int:
    # Offset of the low 32 bits of argument ``index`` in struct seccomp_data
    # (little-endian): every value checked here (modes, families, flags) fits.
    return 16 + 8 * index


def _refuse_bits(nr: int, *, arg: int, bits: int, errno: int) -> list[bytes]:
    """``nr`` with any of ``bits`` set in argument ``arg``: errno; else allow.
    (The accumulator then holds the argument, so the block must end the match.)"""
    return [
        _ins(JEQ_K, 0, 4, nr),
        _ins(LD_W_ABS, 0, 0, _arg(arg)),
        _ins(JSET_K, 0, 1, bits),
        _ins(RET_K, 0, 0, ret_errno(errno)),
        _ins(RET_K, 0, 0, RET_ALLOW),
    ]


def _allow_only(nr: int, *, arg: int, values: tuple[int, ...], errno: int) -> list[bytes]:
    """``nr`` with argument ``arg`` in ``values``: allow; any other value: errno."""
    n = len(values)
    # Each match jumps over the remaining comparisons and the refusal.
    body = [_ins(LD_W_ABS, 0, 0, _arg(arg))]
    body += [_ins(JEQ_K, n - i, 0, v) for i, v in enumerate(values)]
    body += [_ins(RET_K, 0, 0, ret_errno(errno)), _ins(RET_K, 0, 0, RET_ALLOW)]
    return [_ins(JEQ_K, 0, len(body), nr), *body]


def _own_process_or_group(nr: int, *, everyone: int, errno: int) -> list[bytes]:
    """``nr(which, who, ...)``: allow ``who`` 0 (the caller, its group) unless
    ``which`` is ``everyone`` (every process of the caller's uid)."""
    return [
        _ins(JEQ_K, 0, 6, nr),
        _ins(LD_W_ABS, 0, 0, _arg(0)),
        _ins(JEQ_K, 3, 0, everyone),
        _ins(LD_W_ABS, 0, 0, _arg(1)),
        _ins(JEQ_K, 0, 1, 0),
        _ins(RET_K, 0, 0, RET_ALLOW),
        _ins(RET_K, 0, 0, ret_errno(errno)),
    ]


def _refuse_if(nr: int, *, arg: int, value: int, errno: int) -> list[bytes]:
    """``nr`` with argument ``arg`` equal to ``value``: errno; else allow."""
    return [
        _ins(JEQ_K, 0, 4, nr),
        _ins(LD_W_ABS, 0, 0, _arg(arg)),
        _ins(JEQ_K, 0, 1, value),
        _ins(RET_K, 0, 0, ret_errno(errno)),
        _ins(RET_K, 0, 0, RET_ALLOW),
    ]


def _no_keep_size_allocation(nr: int, *, errno: int) -> list[bytes]:
    """``fallocate(fd, mode, …)`` with FALLOC_FL_KEEP_SIZE but not PUNCH_HOLE: errno.
    Such an allocation takes disk blocks past the end of the file without
    growing it, so RLIMIT_FSIZE (``limits.file_size_max``) never sees it."""
    return [
        _ins(JEQ_K, 0, 5, nr),
        _ins(LD_W_ABS, 0, 0, _arg(1)),
        _ins(ALU_AND_K, 0, 0, FALLOC_KEEP_SIZE | FALLOC_PUNCH_HOLE),
        _ins(JEQ_K, 0, 1, FALLOC_KEEP_SIZE),
        _ins(RET_K, 0, 0, ret_errno(errno)),
        _ins(RET_K, 0, 0, RET_ALLOW),
    ]


def _unix_pair_types(nr: int, *, types: tuple[int, ...], errno: int) -> list[bytes]:
    """``socketpair``: AF_UNIX of one of ``types`` (flags masked off) only."""
    n = len(types)
    body = [
        _ins(LD_W_ABS, 0, 0, _arg(0)),
        _ins(JEQ_K, 0, n + 2, AF_UNIX),
        _ins(LD_W_ABS, 0, 0, _arg(1)),
        _ins(ALU_AND_K, 0, 0, SOCK_TYPE_MASK),
    ]
    body += [_ins(JEQ_K, n - i, 0, t) for i, t in enumerate(types)]
    body += [_ins(RET_K, 0, 0, ret_errno(errno)), _ins(RET_K, 0, 0, RET_ALLOW)]
    return [_ins(JEQ_K, 0, len(body), nr), *body]


def program(
    *,
    block_network: bool,
    block_metadata: bool = False,
    host_namespaces: bool = False,
    unix_pairs_only: bool = False,
    machine: str | None = None,
) -> bytes:
    """The filter as a sock_filter array (what ``bwrap --seccomp FD`` reads).

    ``block_network`` (any ``sandbox.network`` but ``host``) withholds IPv4 and
    IPv6 sockets. ``unix_pairs_only`` (bubblewrap with the host's grant group:
    ``confine``) withholds ``socket(AF_UNIX)`` and allows ``socketpair`` of the
    stream and seqpacket types only (see the module docstring).
    ``block_metadata`` (the Landlock-only backend, where the
    command's uid 0 owns host files Landlock cannot protect from chmod, chown,
    utimes or xattrs) refuses those calls outright, and Unix-domain ``socket()``
    too (Landlock cannot stop a connect to a root-owned socket such as kbd's
    own). Keyrings, user namespaces, clone3, openat2, io_uring and every other
    socket family are refused whatever the flags.

    ``host_namespaces`` (the Landlock-only backend: no PID namespace, the command is
    uid 0 beside the host's root processes) refuses to change any process's
    rlimits, nice value, scheduling policy, CPU affinity or I/O priority but the
    caller's own (``prlimit``, ``renice``, ``chrt``, ``taskset``, ``ionice`` on a
    host daemon would pass the kernel's same-uid check; Landlock scopes only
    signals and ptrace), and ``socketpair`` to stream and seqpacket types: a
    datagram socket, even one of a pair, can ``sendto`` any Unix socket path on
    the host (``/dev/log``, journald), which Landlock does not mediate. It also
    means the host's IPC namespace: System V shared memory, semaphores and
    message queues and POSIX message queues answer ENOSYS (as on a kernel
    without them), since objects there outlive the session, pass data between
    sessions, and include the host's own (which uid 0 could attach or remove).
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
    for nr, err in sorted(arch.deny.items()):
        out += [_ins(JEQ_K, 0, 1, nr), _ins(RET_K, 0, 0, ret_errno(err))]
    # The blocks below load an argument and end with a verdict: they come last.
    for nr, arg in sorted(arch.mode_arg.items()):
        out += _refuse_bits(nr, arg=arg, bits=SETID_BITS, errno=EPERM)
    for nr in arch.clone_flags:
        out += _refuse_bits(nr, arg=0, bits=CLONE_NEWUSER, errno=EPERM)
    out += _no_keep_size_allocation(arch.fallocate, errno=EOPNOTSUPP)
    # PID 1: bubblewrap's own init in the sandbox (same uid, so the kernel would
    # let the command trace it: stopped, it never reports the command's exit and
    # kbd exec waits forever), or the host's init on the Landlock-only backend.
    out += _refuse_if(arch.ptrace, arg=1, value=1, errno=EPERM)
    for nr in arch.process_vm:
        out += _refuse_if(nr, arg=0, value=1, errno=EPERM)
    if host_namespaces:
        for nr in arch.ipc:
            out += [_ins(JEQ_K, 0, 1, nr), _ins(RET_K, 0, 0, ret_errno(ENOSYS))]
        for nr, arg in sorted(arch.self_only.items()):
            out += _allow_only(nr, arg=arg, values=(0,), errno=EPERM)  # the command itself only
        out += _own_process_or_group(arch.setpriority, everyone=PRIO_USER, errno=EPERM)
        out += _own_process_or_group(arch.ioprio_set, everyone=IOPRIO_WHO_USER, errno=EPERM)
    families = socket_families(network=not block_network, unix=not (block_metadata or unix_pairs_only))
    out += _allow_only(arch.socket, arg=0, values=families, errno=EAFNOSUPPORT)
    if host_namespaces or unix_pairs_only:
        out += _unix_pair_types(arch.socketpair, types=(SOCK_STREAM, SOCK_SEQPACKET), errno=EAFNOSUPPORT)
    else:
        out += _allow_only(arch.socketpair, arg=0, values=(AF_UNIX,), errno=EAFNOSUPPORT)
    out.append(_ins(RET_K, 0, 0, RET_ALLOW))
    return b"".join(out)
