"""What this host can do, probed for real, for the ``requires_*`` markers.

A test marked ``requires_bwrap`` (``requires_userns``, ``requires_landlock``,
``requires_cgroup``) is skipped, with the reason below, only when the probe
shows that the host truly lacks the feature. With ``KBD_REQUIRE_ALL_FEATURES=1``
(set by ``.ci/run``) a missing feature fails the test instead: on CI a security
test must never quietly turn into a skip.

The probes are independent of kbd's own detection (kbd/sandbox/probe.py), so a
bug in kbd's probe cannot hide the tests that would catch it. Each probe runs at
most once per test process.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

REQUIRE_ALL_ENV = "KBD_REQUIRE_ALL_FEATURES"

# Generic syscall number (the same on x86_64 and aarch64) and flag of
# landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION).
_SYS_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
_CLONE_NEWUSER = 0x10000000


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") == "1"


def _bwrap() -> str | None:
    # The same fixed directories kbd looks in: a PATH entry must not decide.
    for d in ("/usr/bin", "/bin", "/usr/local/bin"):
        if os.access(f"{d}/bwrap", os.X_OK):
            return f"{d}/bwrap"
    return None


@functools.cache
def missing_bwrap() -> str | None:
    """None when bubblewrap builds a real sandbox here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    path = _bwrap()
    if path is None:
        return "bubblewrap is not installed in /usr/bin, /bin or /usr/local/bin"
    # The namespaces kbd asks for: its own user namespace with nested ones disabled,
    # except where the host allows no user namespace at all (then root's bwrap
    # runs without one; kbd.sandbox.bwrap.userns_opts makes the same choice).
    try:
        with open("/proc/sys/user/max_user_namespaces", encoding="ascii") as f:
            userns = f.read().strip() != "0"
    except OSError:
        userns = True
    flags = ["--unshare-user", "--disable-userns", "--assert-userns-disabled"] if userns else []
    argv = [path, "--die-with-parent", "--unshare-pid", "--unshare-net", *flags, "--ro-bind", "/", "/",
            "--proc", "/proc", "--dev", "/dev", "--", "/bin/true"]  # fmt: skip
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap at {path} did not run: {exc}"
    if run.returncode != 0:
        return f"bubblewrap at {path} cannot create a sandbox here: {run.stderr.strip()[:200]}"
    return None


@functools.cache
def missing_userns() -> str | None:
    """None when this process may create a user namespace (tried in a child)."""
    if not sys.platform.startswith("linux"):
        return f"user namespaces need Linux (this is {sys.platform})"
    code = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"sys.exit(0 if libc.unshare({_CLONE_NEWUSER}) == 0 else ctypes.get_errno())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30, check=False)
    if run.returncode != 0:
        return f"unshare(CLONE_NEWUSER) is refused here: {os.strerror(run.returncode)}"
    return None


def landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(
        _SYS_LANDLOCK_CREATE_RULESET,
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(int(abi), 0)


@functools.cache
def missing_landlock(abi: int = 1) -> str | None:
    """None when the kernel offers Landlock ABI ``abi`` or newer."""
    if not sys.platform.startswith("linux"):
        return f"Landlock needs Linux (this is {sys.platform})"
    have = landlock_abi()
    if have == 0:
        return "the kernel offers no Landlock (not built in, or not in the lsm= boot list)"
    if have < abi:
        return f"the kernel offers Landlock ABI {have}; the test needs ABI {abi} or newer"
    return None


def missing_landlock_audit() -> str | None:
    """None when this process can read Landlock's audit records once kernel audit is on:
    Landlock ABI 7 (Linux 6.15), a kernel built with audit, and root (CAP_AUDIT_READ and
    CAP_AUDIT_CONTROL, to turn it on)."""
    if (why := missing_landlock(7)) is not None:
        return why
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}: reading and enabling kernel audit needs root"
    from kbd.sandbox.denials import audit_status

    try:
        audit_status()
    except OSError as exc:
        return f"the kernel's audit interface refuses: {exc.strerror} (built without CONFIG_AUDIT?)"
    return None


def _cgroup2_mount() -> str | None:
    """A cgroup v2 hierarchy mounted read-write, from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, super_fields = left.split(), right.split()
            if len(fields) >= 6 and super_fields[:1] == ["cgroup2"] and "rw" in fields[5].split(","):
                return fields[4].replace("\\040", " ")
    return None


@functools.cache
def missing_cgroup() -> str | None:
    """None when this process can create a cgroup v2 child with cgroup.kill (what
    per-command containment needs); the probe cgroup is removed at once."""
    if not sys.platform.startswith("linux"):
        return f"cgroups need Linux (this is {sys.platform})"
    try:
        mount = _cgroup2_mount()
    except OSError as exc:
        return f"cannot read /proc/self/mountinfo: {exc.strerror}"
    if mount is None:
        return "no cgroup v2 hierarchy is mounted read-write"
    probe = f"{mount.rstrip('/')}/kbd-test-probe-{uuid.uuid4().hex[:12]}"
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup under {mount}: {exc.strerror}"
    try:
        if not os.path.exists(f"{probe}/cgroup.kill"):
            return "the kernel has no cgroup.kill (Linux < 5.14)"
    finally:
        Path(probe).rmdir()
    return None


def missing_reachable_checkout() -> str | None:
    """None when a user the tests create can run kbd from this checkout: its
    interpreter, the kbd package and the libraries it imports reachable,
    readable and (the interpreter) executable by other users; else why not and
    what to do (a checkout under /root, or in a 0700 mktemp folder, is not)."""
    import click

    import kbd
    from kbd.fs.systemlayout import others_cannot_use

    for path, run in (
        (Path(sys.executable), True),
        (Path(kbd.__file__), False),
        (Path(click.__file__), False),
    ):
        if (problem := others_cannot_use(path, run=run)) is not None:
            return (f"{problem}: the users these tests create run kbd from this checkout; clone it (and make "
                    "its venv) in a folder every user may traverse, such as /srv/kbd, or give that folder o+x")  # fmt: skip
    return None


PROBES = {
    "requires_bwrap": "the test runs commands under a real bubblewrap sandbox",
    "requires_userns": "the test needs user namespaces (bwrap --unshare-user / --disable-userns)",
    "requires_landlock": "the test needs Landlock (requires_landlock(abi=N): ABI N or newer)",
    "requires_cgroup": "the test needs a writable cgroup v2 hierarchy with cgroup.kill",
    "requires_root": "the test acts as other users (chown, another uid's connections), which only root may do",
    "requires_reachable_checkout": "the test runs this checkout's kbd as users it creates, who must reach it",
    "requires_landlock_audit": "the test reads Landlock's audit records (ABI 7, kernel audit, root); "
    "the audit_on fixture turns kernel audit on",
}


def missing(marker: str, abi: int = 1) -> str | None:
    """Why the host lacks what ``marker`` asks for, or None when it has it."""
    if marker == "requires_bwrap":
        return missing_bwrap()
    if marker == "requires_userns":
        return missing_userns()
    if marker == "requires_landlock":
        return missing_landlock(abi)
    if marker == "requires_cgroup":
        return missing_cgroup()
    if marker == "requires_root":
        return None if os.geteuid() == 0 else f"running as uid {os.geteuid()}, not root"
    if marker == "requires_reachable_checkout":
        return missing_reachable_checkout()
    if marker == "requires_landlock_audit":
        return missing_landlock_audit()
    raise ValueError(f"unknown feature marker {marker!r}")


# What each sandbox backend needs from the host, for tests parametrized over backends.
# The Landlock-only backend also runs without a cgroup (its subreaper fallback).
BACKEND_MARKS: dict[str, tuple[pytest.MarkDecorator, ...]] = {
    "bwrap": (pytest.mark.requires_bwrap, pytest.mark.requires_landlock(abi=2)),
    "landlock": (pytest.mark.requires_landlock,),
}


def backends(*names: str) -> list[Any]:
    """``pytest.param`` per backend, each carrying the markers that backend needs."""
    return [pytest.param(n, marks=BACKEND_MARKS[n], id=n) for n in names]


def enable_kernel_audit() -> None:
    """Turn kernel audit on (AUDIT_SET enabled=1, as ``auditctl -e 1`` does). Left on: other
    test workers may be reading records, and with no audit daemon the records only reach
    subscribers and the kernel log."""
    import socket
    import struct

    from kbd.sandbox.denials import NETLINK_AUDIT, audit_status

    if audit_status()[1]:
        return
    status = struct.pack("=10I", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)  # mask AUDIT_STATUS_ENABLED, enabled 1
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT) as sock:
        sock.settimeout(1.0)
        sock.send(struct.pack("=IHHII", 16 + len(status), 1001, 1 | 4, 1, 0) + status)  # AUDIT_SET, ACK
        answer = sock.recv(4096)
    code = struct.unpack_from("=i", answer, 16)[0]
    if code:
        raise OSError(-code, f"AUDIT_SET: {os.strerror(-code)}")
