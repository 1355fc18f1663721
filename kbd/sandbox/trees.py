"""Ending the process trees of commands (session close, ``session revoke
--immediate``, the daemon's pushed revocation): the process group first, then
the command's cgroup (everything in it, processes that left the group with
setsid included). Takes plain values — a process group, a cgroup name, whether
the recorded leader is still the same process — never a record store: the
service layer composes these with :mod:`kbd.state.processes`."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from kbd.sandbox import cgroup


def end_tree(pgid: int, cgroup_name: str | None, *, alive: bool, grace: float) -> bool:
    """End one command: SIGTERM its process group (only while its leader is
    still the recorded process: ``alive``), up to ``grace`` seconds, then
    ``cgroup.kill`` for everything left in its cgroup, which is then removed.
    Without a cgroup (bwrap on a host without one: its PID namespace holds the
    tree) the group alone. True when nothing of it is left."""
    hierarchy = cgroup.detect()
    name = cgroup_name or ""
    path = hierarchy.path(name)
    if path is None:
        return alive and terminate_group(pgid, grace=grace)
    if alive and grace > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while cgroup.populated(path) and time.monotonic() < deadline:
            time.sleep(0.02)
    if not cgroup.kill_tree(path):
        return False
    cgroup.remove(hierarchy, name)
    return True


def kill_unrecorded(sid: str) -> list[str]:
    """Kill every command tree of session ``sid`` still in a cgroup after its
    recorded commands were ended: a ``kbd exec`` SIGKILLed between starting its
    command and recording it leaves such a tree. Returns the cgroups that held
    processes."""
    hierarchy = cgroup.detect()
    killed = []
    for name in cgroup.of_session(hierarchy, sid):
        path = hierarchy.path(name)
        if path is not None and cgroup.populated(path):
            cgroup.kill_tree(path)
            killed.append(name)
        cgroup.remove(hierarchy, name)
    return killed


def terminate_group(pgid: int, *, grace: float) -> bool:
    """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL.
    True when the group is gone afterwards."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.02)
    return False


def tree_left(cgroup_name: str) -> bool:
    """Processes remain in the command's cgroup."""
    path = cgroup.detect().path(cgroup_name)
    return path is not None and cgroup.populated(path)


def drop_tree(cgroup_name: str) -> None:
    """Remove the cgroup a killed ``kbd exec`` left behind (its tree is gone)."""
    cgroup.remove(cgroup.detect(), cgroup_name)
