"""The caller owns nothing of her sandbox (docs/multi-user.md "The permission model").

On an ``init --system`` host with real users (the host of
tests/integration/test_host_permissions.py), ``ann`` runs a brokered command
and then attacks it from a plain process of her own uid *outside* the
sandbox: every way in that the kernel offers a same-uid process — ``setns``
into its user and mount namespaces, remounting or unmounting its mounts,
grafting a clone of the host's ``workflows/`` into it, ``PTRACE_SEIZE``,
``pidfd_getfd``, reopening ``/proc/PID/fd/N``, ``/proc/PID/{mem,root,cwd,environ}``
and ``process_vm_readv`` — is refused, because the command's namespaces are
owned by a user namespace that root made, and its gid is the grant group's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_host_permissions import Host, as_user, host  # noqa: F401 - the module's fixture
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_userns,
    pytest.mark.requires_reachable_checkout,
]

# Run as the caller, outside the sandbox: each attack, and what the kernel said.
ATTACKS = r"""
import ctypes, errno, json, os, sys
pid, target = int(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def err():
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

def try_open(name, path, flags=os.O_RDONLY):
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        return None
    out[name] = "OPENED"
    return fd

for ns in ("user", "mnt"):
    fd = try_open(f"open ns/{ns}", f"/proc/{pid}/ns/{ns}")
    if fd is not None:
        out[f"setns {ns}"] = "JOINED" if libc.setns(fd, 0) == 0 else err()
inside = f"/proc/{pid}/root{target}"
MS_REMOUNT, MS_BIND = 0x20, 0x1000
r = libc.mount(None, inside.encode(), None, MS_REMOUNT | MS_BIND, None)
out["remount rw"] = "REMOUNTED" if r == 0 else err()
r = libc.umount2(inside.encode(), 2)
out["umount2"] = "UNMOUNTED" if r == 0 else err()
OPEN_TREE_CLONE, AT_RECURSIVE = 1, 0x8000
tree = libc.syscall(428, -100, sys.argv[3].encode(), OPEN_TREE_CLONE | AT_RECURSIVE)
if tree < 0:
    out["open_tree"] = err()
else:
    r = libc.syscall(429, tree, b"", -100, f"/proc/{pid}/root/tmp".encode(), 4)
    out["move_mount"] = "GRAFTED" if r == 0 else err()
r = libc.ptrace(0x4206, pid, 0, 0)
out["PTRACE_SEIZE"] = "ATTACHED" if r == 0 else err()
try:
    pidfd = os.pidfd_open(pid)
    r = libc.syscall(438, pidfd, 0, 0)
    out["pidfd_getfd"] = "STOLEN" if r >= 0 else err()
except OSError as exc:
    out["pidfd_getfd"] = errno.errorcode.get(exc.errno)
for what in ("fd/0", "fd/3", "mem", "environ", "root", "cwd"):
    fd = try_open(f"/proc/PID/{what}", f"/proc/{pid}/{what}", os.O_RDONLY | (os.O_DIRECTORY if what in ("root", "cwd") else 0))
buf = ctypes.create_string_buffer(16)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
local = iovec(ctypes.addressof(buf), 16)
remote = iovec(0x400000, 16)
r = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
out["process_vm_readv"] = "READ" if r >= 0 else err()
print(json.dumps(out))
"""

# What each attack must get: refused, never the verb in capitals.
REFUSED = {"EACCES", "EPERM", "ENOENT", "EINVAL"}


def _command_pid(uid: int, marker: str, timeout: float = 30.0) -> int:
    """The pid (in the host's namespace) of the sandboxed process whose argv holds ``marker``."""

    def found() -> int | None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                status = Path(f"/proc/{name}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
            if (
                # The marker as a whole argument: the python3 the shell execs into,
                # after it opened fd 3 (the shell before it carries the marker only
                # inside its script argument).
                marker.encode() in cmdline.split(b"\0")
                and len(nspid) > 1
                and int(uids[0]) == uid
                and b"bwrap" not in cmdline
            ):
                return int(name)
        return None

    # Polling /proc: the sandboxed process has no other way to announce its host pid.
    return wait_for(found, timeout, f"a sandboxed process with {marker!r}")


@pytest.fixture
def running(host: Host) -> Iterator[tuple[int, subprocess.Popen[str]]]:  # noqa: F811
    """A brokered command of ann's, holding a source note open (fd 3) and sleeping."""
    marker = f"kbd-victim-{os.getpid()}-{time.monotonic_ns()}"
    script = (
        f'exec 3<"$WORKFLOW_KB_SRC/context/info.md"; exec python3 -c "import time; time.sleep(60)" {marker}'
    )
    pw = host.users["ann"]
    env = {"HOME": "/", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2]),
           "KBD_SOCKET": str(host.served.sock), "LANG": "C.UTF-8"}  # fmt: skip
    proc = subprocess.Popen(
        ["setpriv", "--reuid", str(pw.pw_uid), "--regid", str(pw.pw_gid), "--init-groups", sys.executable, "-m",
         "kbd", "--root", str(host.root), "exec", host.sid, "--", "sh", "-c", script],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield _command_pid(pw.pw_uid, marker), proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_the_callers_own_processes_cannot_reach_into_her_command(
    host: Host,  # noqa: F811
    running: tuple[int, subprocess.Popen[str]],
) -> None:
    pid, _ = running
    status = Path(f"/proc/{pid}/status").read_text()
    gids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Gid:"))
    ann = host.users["ann"]
    # The command is ann's uid, with the grant group as its real, effective and saved gid.
    assert {int(g) for g in gids[:3]} != {ann.pw_gid}
    target = str(host.wf("src") / "knowledgebase/context")
    r = as_user(host, "ann", [sys.executable, "-c", ATTACKS, str(pid), target, str(host.root / "workflows")])
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    assert results, r.stdout
    for attack, answer in results.items():
        assert answer in REFUSED, (attack, answer, results)
    # Nothing was grafted into the command's /tmp, and its source is as it was.
    assert not (host.wf("src") / "knowledgebase/notes/planted.md").exists()


def test_root_still_reaches_a_command(running: tuple[int, subprocess.Popen[str]]) -> None:
    """The control: the same attacks from root succeed where root may (so the
    test above fails for the reason it names, not for a broken probe)."""
    pid, _ = running
    assert os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY) >= 0
    fd = os.open(f"/proc/{pid}/fd/3", os.O_RDONLY)
    try:
        assert os.read(fd, 100) == b"src context\n"
    finally:
        os.close(fd)


def test_the_slow_path_gives_the_command_a_root_owned_user_namespace_too() -> None:
    """Without a pooled stub the daemon starts a command through the launcher's
    gate step (kbd.sandbox.launcher.gate): the same root-owned namespace, the
    caller's identity, no capability."""
    from kbd.sandbox.start import Caller, spawn_as

    r, w = os.pipe()
    try:
        caller = Caller(
            uid=65534, gid=65534, groups=(65534,), umask=0o22, rlimits={}, env={}, stdio=(0, w, 2)
        )
        script = "cat /proc/self/uid_map; readlink /proc/self/ns/user; id -u; grep CapEff /proc/self/status"
        proc = spawn_as(["/bin/sh", "-c", script], None, caller, env={"PATH": "/usr/bin:/bin"}, userns=True)
        assert proc.wait() == 0
    finally:
        os.close(w)
    with os.fdopen(r) as fh:
        out = fh.read().split("\n")
    assert out[0].split() == ["0", "0", "4294967295"]
    assert out[1] != os.readlink("/proc/self/ns/user")
    assert out[2] == "65534" and out[3].split() == ["CapEff:", "0000000000000000"]
