"""kbd's Landlock helper: apply a Landlock ruleset to itself, then exec a command.

Run as ``python3 -I -S landlock_helper.py SPEC_JSON -- CMD [ARG...]``. It is
self-contained (stdlib only, no kbd imports) because it runs *inside* the
bubblewrap sandbox, after the mounts, where only this one file is present (its
source bound read-only, or its bytecode copied: kbd.sandbox.bwrap.helper_opt);
the Landlock-only backend runs the source directly. Applying Landlock before
bwrap would break bwrap's own mounts, so Landlock is always the last layer.

It runs before every command of a write plan, so it imports only what it
needs, and only modules that cost no further imports: ``_json``'s scanner
instead of ``json`` (which pulls in ``re`` and ``enum``: about 5 ms of a 15 ms
start), ``_signal`` instead of ``signal`` (``enum`` again), and ``_ctypes``
with the C types it uses declared here instead of the ``ctypes`` package
(whose module body builds every C type and costs 2 ms).

SPEC_JSON: ``{"handled": [right…], "rules": [{"path": p, "access": [right…]}…],
"min_abi": n, "drop_caps": bool, "scope": bool, "deny_tcp": bool, "seccomp": hex,
"rlimits": [[resource, value]…]}``:
``drop_caps`` empties the capability sets and bounding set (for the Landlock-only
backend, which has no bubblewrap to do it); ``scope`` confines signals and
abstract Unix sockets to the sandbox (ABI >= 6); ``deny_tcp`` handles TCP bind
and connect with no rule allowing them (ABI >= 4); ``seccomp`` is a classic-BPF
program (kbd.sandbox.seccomp) installed last, and required with ``drop_caps``
(inside bubblewrap, bwrap's ``--seccomp`` has installed it already). Rights
missing from the running kernel's ABI are dropped from both sides (a right the
kernel cannot handle cannot be denied either), except that a right named in
``required`` must be supported or the helper refuses. ``rlimits`` are set
first, soft and hard alike (so the command cannot raise them again): inside
bubblewrap the helper is the command's only predecessor, so it replaces the
``sh -c ulimit …`` step a read plan runs (kbd.sandbox.limits).
``confine`` (set when the command carries the host's grant group) first
applies a layer of its own that handles every right and allows all of them
beneath this mount namespace's ``/`` only: a descriptor from outside the
sandbox (received over a Unix socket, or injected by a same-uid tracer) walks
up to the host's root, never to the sandbox's, so the grant group opens
nothing through it. With ``confine``, ``handled`` may be absent (a read plan).
``log`` asks the kernel to report the command's refusals (ABI >= 7:
``LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON``, for every layer the helper makes;
without it Landlock reports only what the helper itself is refused, before its
exec). ``report_fd``: an inherited Unix socket; the helper writes one byte to it
and closes it first thing, so that the reader learns this process's pid as its
own PID namespace numbers it (``SO_PASSCRED``): the pid the kernel's audit
records name as the domain's creator (kbd.sandbox.denials).
Any failure exits 69 before the command runs: fail closed, never run unconfined.
"""

from __future__ import annotations

import _ctypes
import _signal  # type: ignore[import-not-found]  # no stubs: the signal module without its enum import
import errno
import os
import sys

TYPE_CHECKING = False  # typing itself is not imported: it costs milliseconds
if TYPE_CHECKING:
    from typing import Any

RIGHTS = {
    "execute": 1 << 0,
    "write_file": 1 << 1,
    "read_file": 1 << 2,
    "read_dir": 1 << 3,
    "remove_dir": 1 << 4,
    "remove_file": 1 << 5,
    "make_char": 1 << 6,
    "make_dir": 1 << 7,
    "make_reg": 1 << 8,
    "make_sock": 1 << 9,
    "make_fifo": 1 << 10,
    "make_block": 1 << 11,
    "make_sym": 1 << 12,
    "refer": 1 << 13,
    "truncate": 1 << 14,
    "ioctl_dev": 1 << 15,
}
# Rights the kernel accepts on a rule for a non-directory.
FILE_RIGHTS = (
    RIGHTS["execute"] | RIGHTS["write_file"] | RIGHTS["read_file"] | RIGHTS["truncate"] | RIGHTS["ioctl_dev"]
)
# All filesystem rights known at each ABI version.
ABI_MASK = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
ABI_MASK.update({5: (1 << 16) - 1, 6: (1 << 16) - 1, 7: (1 << 16) - 1})

# Kernel numbers: copies of kbd.fs.libc's (this file cannot import kbd, see
# above); tests/unit/fs/test_libc.py checks each equals its kbd.fs.libc name.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
SYS_CAPSET = 126 if os.uname().machine == "x86_64" else 91  # x86_64; the generic table (aarch64, ...)
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1  # ABI >= 7
EX_UNAVAILABLE = 69
S_IFMT, S_IFDIR = 0o170000, 0o040000

REASONS = {
    errno.ENOSYS: "the kernel has no Landlock support (ENOSYS: too old or not compiled in)",
    errno.EOPNOTSUPP: "Landlock is supported but disabled at boot (EOPNOTSUPP: add 'landlock' to lsm=)",
}


# The C types used below, declared as the ctypes package declares them (so
# named as there: c_ulong is also size_t on Linux, ILP32 and LP64 alike).
class c_int(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "i"


class c_long(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "l"


class c_ulong(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "L"


class c_uint32(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "I"


class c_uint64(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "Q"


class c_ushort(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "H"


class c_void_p(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "P"


class c_char(_ctypes._SimpleCData):  # type: ignore[type-arg]
    _type_ = "c"


c_size_t, c_int32 = c_ulong, c_int


class _Function(_ctypes.CFuncPtr):
    """A libc function as ``ctypes.CDLL(None, use_errno=True)`` makes it."""

    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = c_int


class _Libc:
    """libc, loaded here as kbd.fs.libc loads it for the parent
    (``ctypes.CDLL(None, use_errno=True)``): the process's own symbols."""

    _handle = _ctypes.dlopen(None, 0)  # type: ignore[arg-type] # None: this process, as CDLL(None)

    def __init__(self) -> None:
        self.prctl = _Function(("prctl", self))  # type: ignore[arg-type]
        self.setrlimit = _Function(("setrlimit", self))  # type: ignore[arg-type]
        self.syscall = _Function(("syscall", self))  # type: ignore[arg-type]
        self.syscall.restype = c_long


_libc = _Libc()
byref, addressof, get_errno = _ctypes.byref, _ctypes.addressof, _ctypes.get_errno


class RulesetAttr(_ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", c_uint64),
        ("handled_access_net", c_uint64),  # ABI >= 4
        ("scoped", c_uint64),  # ABI >= 6
    )


class Rlimit(_ctypes.Structure):
    _fields_ = (("cur", c_ulong), ("max", c_ulong))


class SockFprog(_ctypes.Structure):
    _fields_ = (("len", c_ushort), ("filter", c_void_p))


class CapHeader(_ctypes.Structure):
    _fields_ = (("version", c_uint32), ("pid", c_int))


class CapData(_ctypes.Structure):
    _fields_ = (
        ("effective", c_uint32),
        ("permitted", c_uint32),
        ("inheritable", c_uint32),
    )


NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
# Copies of kbd.fs.libc's too (checked by the same test).
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
CAP_VERSION_3 = 0x20080522


def drop_capabilities() -> None:
    """Empty the bounding set (so exec as root regains nothing), the ambient set,
    and the effective, permitted and inheritable sets."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and get_errno() == errno.EINVAL:
            break  # EINVAL: past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = CapHeader(CAP_VERSION_3, 0)
    data = (CapData * 2)()
    if _libc.syscall(SYS_CAPSET, byref(header), data) != 0:
        fail(f"capset: {os.strerror(get_errno())}")


def install_seccomp(program: bytes) -> None:
    buf = (c_char * len(program)).from_buffer_copy(program)
    prog = SockFprog(len(program) // 8, addressof(buf))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, byref(prog), 0, 0) != 0:
        fail(f"seccomp filter: {os.strerror(get_errno())}")


class PathBeneathAttr(_ctypes.Structure):
    _pack_ = 1  # the kernel struct is packed
    _fields_ = (("allowed_access", c_uint64), ("parent_fd", c_int32))


def fail(message: str) -> None:
    sys.stderr.write(f"error[sandbox-unavailable]: landlock: {message}\n")
    sys.stderr.flush()
    os._exit(EX_UNAVAILABLE)


def set_rlimits(pairs: list[list[int]]) -> None:
    """Each ``[resource, value]``: soft and hard limit ``value``. The failure
    message and status are the ``sh -c ulimit`` step's (kbd.sandbox.limits)."""
    for res, value in pairs:
        if _libc.setrlimit(int(res), byref(Rlimit(int(value), int(value)))) != 0:
            sys.stderr.write("kbd: cannot set resource limits\n")
            sys.stderr.flush()
            os._exit(EX_UNAVAILABLE)


class _Decoding:
    """What ``_json.make_scanner`` reads from ``json.JSONDecoder``'s defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """``json.loads`` without importing ``json`` (its decoder imports ``re``):
    the same C scanner json.loads uses, over the whole text."""
    try:
        from _json import make_scanner
    except ImportError:  # an interpreter built without the accelerator
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        value, end = make_scanner(_Decoding())(text, start)  # type: ignore[arg-type]
    except StopIteration:
        raise ValueError("expecting a JSON value") from None
    if text[end:].strip(" \t\n\r"):
        raise ValueError(f"extra data at character {end}")
    return value


def abi_version() -> int:
    abi = _libc.syscall(SYS_CREATE_RULESET, None, c_size_t(0), c_uint32(CREATE_RULESET_VERSION))
    if abi < 0:
        err = get_errno()
        fail(REASONS.get(err, f"cannot query the ABI: {os.strerror(err)}"))
    return int(abi)


def mask_of(names: list[str]) -> int:
    out = 0
    for n in names:
        if n not in RIGHTS:
            fail(f"unknown right {n!r}")
        out |= RIGHTS[n]
    return out


def apply(spec: dict[str, object]) -> None:
    abi = abi_version()
    min_abi = int(spec.get("min_abi", 1))  # type: ignore[call-overload]
    if abi < min_abi:
        fail(f"kernel Landlock ABI {abi} is older than the required {min_abi}")
    supported = ABI_MASK.get(abi, ABI_MASK[7])
    handled = mask_of(list(spec["handled"])) & supported  # type: ignore[call-overload]
    if not handled:
        fail("nothing to enforce (empty handled set): refusing to run unconfined")
    if spec.get("drop_caps"):
        # No bubblewrap around us (it would have installed the filter): without
        # one, keyrings, user namespaces and every socket family stay open.
        if not spec.get("seccomp"):
            fail("no seccomp filter for a sandbox without bubblewrap: refusing to run")
        drop_capabilities()
    net = NET_BIND_TCP | NET_CONNECT_TCP if spec.get("deny_tcp") and abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if spec.get("scope") and abi >= 6 else 0
    attr = RulesetAttr(handled, net, scoped)
    # The struct grew with the ABI: pass only the part this kernel knows.
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _libc.syscall(SYS_CREATE_RULESET, byref(attr), c_size_t(size), c_uint32(0))
    if ruleset < 0:
        fail(f"landlock_create_ruleset: {os.strerror(get_errno())}")
    for rule in spec["rules"]:  # type: ignore[attr-defined]
        path = str(rule["path"])
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # an optional system path absent on this host grants nothing
        except OSError as exc:
            fail(f"cannot open {path}: {exc.strerror}")
        try:
            allowed = mask_of(list(rule["access"])) & handled
            if os.fstat(fd).st_mode & S_IFMT != S_IFDIR:
                allowed &= FILE_RIGHTS
            if not allowed:
                continue
            pb = PathBeneathAttr(allowed, fd)
            if (
                _libc.syscall(
                    SYS_ADD_RULE,
                    c_int(ruleset),
                    c_int(RULE_PATH_BENEATH),
                    byref(pb),
                    c_uint32(0),
                )
                < 0
            ):
                fail(f"landlock_add_rule {path}: {os.strerror(get_errno())}")
        finally:
            os.close(fd)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail(f"prctl(NO_NEW_PRIVS): {os.strerror(get_errno())}")
    flags = RESTRICT_SELF_LOG_NEW_EXEC_ON if spec.get("log") and abi >= 7 else 0
    if _libc.syscall(SYS_RESTRICT_SELF, c_int(ruleset), c_uint32(flags)) < 0:
        fail(f"landlock_restrict_self: {os.strerror(get_errno())}")
    os.close(ruleset)
    if spec.get("seccomp"):
        install_seccomp(bytes.fromhex(str(spec["seccomp"])))


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \\ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def check_mounts(expected: list[str], prefixes: list[str]) -> None:
    """Refuse to run unless every mount point is one kbd asked for. A source that
    swapped a mount destination in its own folder for a symlink would show up as
    a mount somewhere else (e.g. over a program): fail closed."""
    allowed = set(expected)
    seen = set()
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                point = _unescape(line.split()[4])
                seen.add(point)
                if point not in allowed and not any(point.startswith(p) for p in prefixes):
                    fail(
                        f"unexpected mount point {point!r}: a mount destination was redirected; nothing was run"
                    )
    except OSError as exc:
        fail(f"cannot read the mount table: {exc.strerror}")
    missing = sorted(p for p in allowed if p not in seen)
    if missing:
        fail(
            f"expected mount point {missing[0]!r} is missing: a mount destination was redirected; nothing was run"
        )


def confine_layer() -> dict[str, Any]:
    """The layer ``confine`` asks for: every right, and all of them beneath
    ``/`` (the sandbox's own root), nothing beneath anything else (also what
    kbd.sandbox.bwrap.helper_layers says the sandbox holds)."""
    every = list(RIGHTS)
    return {"handled": every, "rules": [{"path": "/", "access": every}], "min_abi": 1, "scope": True}


def confine(log: bool) -> None:
    apply({**confine_layer(), "log": log})


def report_pid(fd: object) -> None:
    """One byte on ``report_fd``: the reader's SO_PASSCRED gives it this pid."""
    if isinstance(fd, int) and not isinstance(fd, bool) and fd > 2:
        # try/except, not contextlib.suppress: an import the helper does not pay for.
        try:  # noqa: SIM105
            os.write(fd, b"p")
        except OSError:
            pass  # the reader is gone: nobody collects this command's refusals
        try:  # noqa: SIM105
            os.close(fd)  # never the command's: it could name another pid
        except OSError:
            pass


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        fail("usage: landlock_helper.py SPEC_JSON -- CMD [ARG...]")
    try:
        spec = loads(argv[1])
    except ValueError as exc:
        fail(f"bad spec: {exc}")
    if not isinstance(spec, dict):
        fail("bad spec: not a JSON object")
    report_pid(spec.get("report_fd"))
    set_rlimits(list(spec.get("rlimits", [])))
    if "mounts" in spec:
        check_mounts(list(spec["mounts"]), list(spec.get("mount_prefixes", [])))
    if spec.get("confine"):
        confine(bool(spec.get("log")))
    elif "handled" not in spec:
        fail("bad spec: neither handled rights nor confine")
    if "handled" in spec:
        apply(spec)
    # Python starts with SIGPIPE and SIGXFSZ ignored and exec keeps ignored
    # signals: give the command the default actions, so RLIMIT_FSIZE stops a
    # writer (SIGXFSZ) as it would outside kbd.
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
    try:
        os.execvp(argv[3], argv[3:])  # noqa: S606 - argv list, no shell
    except OSError as exc:
        sys.stderr.write(f"kbd: cannot run {argv[3]}: {exc.strerror}\n")
        os._exit(127 if exc.errno == errno.ENOENT else 126)


if __name__ == "__main__":
    main(sys.argv)
