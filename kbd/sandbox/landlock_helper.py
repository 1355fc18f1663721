"""kbd's Landlock helper: apply a Landlock ruleset to itself, then exec a command.

Run as ``python3 -I -S landlock_helper.py SPEC_JSON -- CMD [ARG...]``. It is
self-contained (stdlib only, no kbd imports) because it runs *inside* the
bubblewrap sandbox, after the mounts, where only this one file is bound; the
Landlock-only backend runs the same file directly. Applying Landlock before
bwrap would break bwrap's own mounts, so Landlock is always the last layer.

SPEC_JSON: ``{"handled": [right…], "rules": [{"path": p, "access": [right…]}…],
"min_abi": n, "drop_caps": bool, "scope": bool, "deny_tcp": bool, "seccomp": hex}``:
``drop_caps`` empties the capability sets and bounding set (for the Landlock-only
backend, which has no bubblewrap to do it); ``scope`` confines signals and
abstract Unix sockets to the sandbox (ABI >= 6); ``deny_tcp`` handles TCP bind
and connect with no rule allowing them (ABI >= 4); ``seccomp`` is a classic-BPF
program (kbd.sandbox.seccomp) installed last, and required with ``drop_caps``
(inside bubblewrap, bwrap's ``--seccomp`` has installed it already). Rights
missing from the running kernel's ABI are dropped from both sides (a right the
kernel cannot handle cannot be denied either), except that a right named in
``required`` must be supported or the helper refuses.
Any failure exits 69 before the command runs: fail closed, never run unconfined.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import sys

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
EX_UNAVAILABLE = 69

REASONS = {
    errno.ENOSYS: "the kernel has no Landlock support (ENOSYS: too old or not compiled in)",
    errno.EOPNOTSUPP: "Landlock is supported but disabled at boot (EOPNOTSUPP: add 'landlock' to lsm=)",
}

# Loaded here, as kbd.fs.libc loads it for the parent (the same two lines).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI >= 4
        ("scoped", ctypes.c_uint64),  # ABI >= 6
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


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
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # EINVAL: past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = CapHeader(CAP_VERSION_3, 0)
    data = (CapData * 2)()
    if _libc.syscall(SYS_CAPSET, ctypes.byref(header), data) != 0:
        fail(f"capset: {os.strerror(ctypes.get_errno())}")


def install_seccomp(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        fail(f"seccomp filter: {os.strerror(ctypes.get_errno())}")


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel struct is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def fail(message: str) -> None:
    sys.stderr.write(f"error[sandbox-unavailable]: landlock: {message}\n")
    sys.stderr.flush()
    os._exit(EX_UNAVAILABLE)


def abi_version() -> int:
    abi = _libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    if abi < 0:
        err = ctypes.get_errno()
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
    ruleset = _libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        fail(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
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
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                allowed &= FILE_RIGHTS
            if not allowed:
                continue
            pb = PathBeneathAttr(allowed, fd)
            if (
                _libc.syscall(
                    SYS_ADD_RULE,
                    ctypes.c_int(ruleset),
                    ctypes.c_int(RULE_PATH_BENEATH),
                    ctypes.byref(pb),
                    ctypes.c_uint32(0),
                )
                < 0
            ):
                fail(f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail(f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    if _libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        fail(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
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


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        fail("usage: landlock_helper.py SPEC_JSON -- CMD [ARG...]")
    try:
        spec = json.loads(argv[1])
    except ValueError as exc:
        fail(f"bad spec: {exc}")
    if "mounts" in spec:
        check_mounts(list(spec["mounts"]), list(spec.get("mount_prefixes", [])))
    apply(spec)
    # Python starts with SIGPIPE and SIGXFSZ ignored and exec keeps ignored
    # signals: give the command the default actions, so RLIMIT_FSIZE stops a
    # writer (SIGXFSZ) as it would outside kbd.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    try:
        os.execvp(argv[3], argv[3:])  # noqa: S606 - argv list, no shell
    except OSError as exc:
        sys.stderr.write(f"kbd: cannot run {argv[3]}: {exc.strerror}\n")
        os._exit(127 if exc.errno == errno.ENOENT else 126)


if __name__ == "__main__":
    main(sys.argv)
