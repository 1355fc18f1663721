"""Landlock facts for the parent process (ABI detection, the fallback backend's
system rules). The enforcing code runs in :mod:`kbd.sandbox.landlock_helper`,
a standalone file executed in the child, so there is one implementation."""

from __future__ import annotations

import ctypes
import errno
import os

from kbd.fs.libc import LANDLOCK_CREATE_RULESET_VERSION, SYS_LANDLOCK_CREATE_RULESET, libc
from kbd.sandbox.landlock_helper import RIGHTS
from kbd.sandbox.spec import ETC_FILES

DEV_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

LANDLOCK_ALL = tuple(RIGHTS)


def _query_abi() -> tuple[int, int]:
    """(ABI version or 0, errno when 0)."""
    abi = int(
        libc.syscall(
            SYS_LANDLOCK_CREATE_RULESET,
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
        )
    )
    return (abi, 0) if abi > 0 else (0, ctypes.get_errno())


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable."""
    return _query_abi()[0]


def landlock_status() -> str:
    abi, err = _query_abi()
    if abi > 0:
        return f"ABI {abi}"
    return {errno.ENOSYS: "not supported by this kernel", errno.EOPNOTSUPP: "disabled at boot"}.get(
        err, os.strerror(err)
    )


def system_rules() -> list[dict[str, object]]:
    """What every Landlock-only sandbox may use besides its grants."""
    ro = ["read_file", "read_dir", "execute"]
    rules: list[dict[str, object]] = [
        {"path": p, "access": ro} for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/opt")
    ]
    # The same curated /etc as the bubblewrap backend (never all of /etc: /etc/shadow
    # is readable by its owner, uid 0, even without capabilities).
    rules += [{"path": p, "access": ro} for p in ETC_FILES]
    # No /proc rule: other processes' environ and cmdline stay unreadable.
    rules += [{"path": p, "access": ["read_file", "write_file", "ioctl_dev"]} for p in DEV_FILES]
    # No rule for /tmp: Landlock cannot give a private /tmp, and a rule on it would
    # open every root that lives there. Commands get a private TMPDIR instead.
    return rules
