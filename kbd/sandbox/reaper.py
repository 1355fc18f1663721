"""Fallback containment where no cgroup v2 hierarchy is usable (docs/sandbox.md "Process containment").

``kbd exec`` makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): every
process of the command's tree that is orphaned — a ``setsid`` double fork
included — is reparented to ``kbd exec`` instead of init. After the command
exits, ``kill_descendants`` SIGKILLs its remaining children and reaps them;
their own children are then reparented to it in turn, until none are left.
Only *unreaped children* are ever signalled, and a child's PID cannot be
reused before it is reaped: no PID race, no pidfd needed.

Weaker than a cgroup: ``close``/``revoke`` from another process reach the tree
only through ``kbd exec`` (it kills the rest once the command's group is gone),
and a ``kbd exec`` killed with SIGKILL leaves orphans to init. ``kbd doctor``
says which containment this host has.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from kbd.fs.libc import PR_SET_CHILD_SUBREAPER, libc

_active = False


def become_subreaper() -> bool:
    """Make this process the subreaper of everything it starts; False if refused."""
    global _active
    _active = bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    return _active


def active() -> bool:
    return _active


def children() -> list[int]:
    """This process's children, reaped or not (all threads' ``children`` lists,
    or a /proc scan where the kernel lacks CONFIG_PROC_CHILDREN)."""
    me = os.getpid()
    out: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children", encoding="ascii") as fh:
                out.update(int(p) for p in fh.read().split())
        return sorted(out)
    except FileNotFoundError:
        pass
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{entry}/stat", "rb") as fh,
            ):
                if int(fh.read().rsplit(b")", 1)[1].split()[1]) == me:
                    out.add(int(entry))
    return sorted(out)


def kill_descendants(*, timeout: float = 5.0) -> bool:
    """SIGKILL and reap every child until there is none; True when none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # an unreaped child: its PID cannot have been reused
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return True
    return not children()
