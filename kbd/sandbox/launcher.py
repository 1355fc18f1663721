"""The daemon's pre-forked launcher (docs/daemon.md "The exec broker").

Run by the daemon as ``python3 -I -S launcher.py CONFIG`` with its end of a
``SOCK_SEQPACKET`` socket pair (CONFIG names its number and the daemon's pid). Standard library only and
single-threaded: it forks.

Why it exists: moving a process into a cgroup waits for an RCU grace period
(5-15 ms here), and the multi-threaded daemon must never enter a command's
cgroup itself (a ``cgroup.kill`` would take it along). So the launcher keeps
*stubs*: forked children that already sit in fresh per-command cgroups (v2
and each v1 hierarchy this host needs, limits written), each blocked on its
own socket. The daemon takes a stub, records the command under the stub's
pid and cgroup, and sends it the command; the stub execs it at once.

Messages (JSON, one per packet). Daemon → launcher:
``{"op": "spawn", "tag": T, "dirs": [[subtree, [[file, value, optional], ...]], ...]}``
(make one stub; the first subtree is the v2 one; ``tag`` comes back with the
answer, as stubs get ready in any order) and
``{"op": "reap", "pid": N}`` (the daemon has disarmed its signal forwarding:
the exited process may now be reaped and its pid reused). Launcher → daemon:
``{"op": "stub", "pid": N, "cgroup": NAME, "tag": T}`` with the stub's socket as
``SCM_RIGHTS``, ``{"op": "failed", "tag": T, "error": TEXT}`` (a stub could not be
made) and ``{"op": "exited", "pid": N, "rc": RC}`` (``rc`` as
``subprocess.Popen.returncode``: -N for signal N).

Stub ← daemon, on the stub's socket: ``{"argv", "env", "targets", "uid",
"gid", "groups", "umask", "rlimits", "cwd", "attach"}`` with the descriptors as
``SCM_RIGHTS`` (descriptor i becomes number ``targets[i]`` in the command;
``attach``: the staging overlays to attach first, :func:`attach_overlays`).
Stubs wait in a user namespace owned by root (config ``"userns"``:
:func:`own_userns`, docs/multi-user.md "The permission model"). ``launcher.py --gate SPEC
-- CMD…`` (:func:`gate`) does a stub's work for one command started without one.
The socket is close-on-exec: end of file tells the daemon the exec happened;
a ``{"error", "where", "errno"}`` packet tells it why not.

Death: the launcher asks for ``SIGKILL`` when the daemon's spawning thread
dies (``PR_SET_PDEATHSIG``; the daemon spawns it from its main thread), and so
does every stub when the launcher dies, again after it takes the caller's
identity (the kernel clears the setting on a uid change). bubblewrap's
``--die-with-parent`` then ends every running sandbox with the launcher. On
end of file from the daemon the launcher kills its children, removes the
cgroups it made and exits.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from typing import Any

PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
SYS_MOVE_MOUNT = 429  # the same number on every architecture
MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
# Every id mapped to itself: the namespace changes who *owns* the command's
# namespaces (root), not who the command is.
IDENTITY_MAP = "0 0 4294967295\n"
MAX_FDS = 253  # SCM_MAX_FD
MAX_PACKET = 256 << 10  # above the daemon's bound on one request (kbd.sandbox.spawn.MAX_REQUEST)
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent (thread) dies; exit now if it already has."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(70)
    if os.getppid() != parent:
        os._exit(70)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _rmdir(path: str, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)  # noqa: PTH106 - cgroupfs paths stay plain strings
        except OSError as exc:
            if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
        return


def make_cgroups(dirs: list[Any], name: str) -> list[str]:
    """Create ``name`` under every subtree and write its limit files; the
    created folders (all removed again on failure)."""
    made: list[str] = []
    try:
        for subtree, files in dirs:
            path = f"{subtree}/{name}"
            os.mkdir(path, 0o755)
            made.append(path)
            for fname, value, optional in files:
                if optional and not os.path.exists(f"{path}/{fname}"):
                    continue
                _write(f"{path}/{fname}", str(value))
    except BaseException:
        for path in reversed(made):
            _rmdir(path)
        raise
    return made


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def own_userns() -> None:
    """Enter a new user namespace owned by root, every id mapped to itself
    (docs/multi-user.md "The permission model"). bubblewrap, run as the caller inside it,
    makes the sandbox's own namespaces as its children: a user namespace's
    owner has every capability in it only from the namespace's *parent*, so the
    caller's other processes (outside, in the host's namespace) have none in
    this one or any below it, and cannot ``setns`` into, remount or graft onto
    the command's mounts. Only a process in the parent namespace with
    CAP_SETUID may write a map of other ids, so a forked child (still here,
    still root) writes it once this process has moved. Single-threaded callers
    only (``unshare(CLONE_NEWUSER)`` refuses a threaded process)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(w)
            if os.read(r, 1) == b"u":
                parent = os.getppid()
                for name in ("uid_map", "gid_map"):
                    _write(f"/proc/{parent}/{name}", IDENTITY_MAP)
                code = 0
        finally:
            os._exit(code)
    os.close(r)
    try:
        _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        os.write(w, b"u")
    finally:
        os.close(w)
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(errno.EPERM, "cannot map the command's user namespace")


def pin_path(path: str) -> int:
    """An ``O_PATH`` descriptor of the folder at absolute ``path``, walked from
    ``/`` one component at a time without following any link."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in path.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                raise OSError(errno.EINVAL, f"{path!r} has a '..' component")
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def attach_overlays(items: list[dict[str, Any]]) -> None:
    """Attach each staged ``notes/`` overlay (docs/notes.md "Staged contributions"; a
    detached mount the daemon made, already at descriptor ``fd``) over its real
    folder at ``path``, in a private mount namespace of this process's own.
    bubblewrap binds by path, so its bind of ``fd`` then finds the overlay.
    The folder must still be the one kbd pinned (``dev``, ``ino``): a source
    that swapped a link into the path gets a refusal, never a redirect."""
    if not items:
        return
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making the mounts private")
    for item in items:
        target = pin_path(str(item["path"]))
        try:
            st = os.fstat(target)
            if (st.st_dev, st.st_ino) != (int(item["dev"]), int(item["ino"])):
                raise OSError(errno.ESTALE, f"{item['path']} is no longer the folder kbd pinned")
            flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
            _check(_libc.syscall(SYS_MOVE_MOUNT, int(item["fd"]), b"", target, b"", flags), "move_mount")
        finally:
            os.close(target)


# -- the stub (a forked child) --------------------------------------------------------
def renumber(fds: list[int], targets: list[int], keep: int) -> int:
    """Give descriptor ``fds[i]`` the number ``targets[i]`` and close every other
    descriptor but ``keep`` (returned under its new number, close-on-exec).
    First everything moves above every target (``F_DUPFD_CLOEXEC``), so no
    ``dup2`` can overwrite a descriptor still to be placed; the targets are
    then the only inheritable descriptors."""

    floor = max([*targets, 2]) + 1
    keep = fcntl.fcntl(keep, fcntl.F_DUPFD_CLOEXEC, floor)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    wanted = {keep, *high}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in wanted:
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone already
                os.close(fd)
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
    for fd in high:
        os.close(fd)
    return keep


def _lower(a: int, b: int) -> int:

    inf = resource.RLIM_INFINITY
    if a == inf:
        return b
    if b == inf:
        return a
    return min(a, b)


def take_identity(spec: dict[str, Any], launcher: int | None) -> None:
    """Exactly the caller's groups, gid, uid, rlimits (never above this
    process's own: only lowered) and umask, and an empty signal mask (every
    disposition is the default already: :func:`default_signals`)."""

    uid, gid = int(spec["uid"]), int(spec["gid"])
    groups = [int(g) for g in spec["groups"]]
    # Only a change needs privilege: a daemon that runs as its one user (no
    # root) serves only that user, whose identity the stub already has.
    current = (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups()))
    if current != (uid, uid, gid, gid, sorted(groups)):
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    # A uid change cleared PR_SET_PDEATHSIG: ask again (and stop if the
    # launcher died meanwhile), so the command can never outlive it unseen.
    if launcher is not None:
        die_with_parent(launcher)
    for res, soft, hard in spec["rlimits"]:
        own_soft, own_hard = resource.getrlimit(res)
        new_hard = _lower(hard, own_hard)
        new_soft = _lower(_lower(soft, own_soft), new_hard)
        if (new_soft, new_hard) != (own_soft, own_hard):
            resource.setrlimit(res, (new_soft, new_hard))
    os.umask(int(spec["umask"]))
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def default_signals() -> None:
    """Every signal to its default disposition, once, in the launcher: Python
    ignores SIGPIPE and SIGXFSZ (and the daemon may have inherited more
    ignored ones, nohup's SIGHUP say); ``execve`` keeps what is ignored, and a
    command must not inherit that. The stubs inherit the defaults from here.
    (The launcher's own writes use MSG_NOSIGNAL instead.)"""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    # Python (and glibc's sigaction) refuse the C library's own signals, 32 and
    # 33, yet an ignored one is inherited too (GNU make ignores both, say): the
    # kernel's rt_sigaction sets them to the default as well.
    for number in set(range(1, int(signal.SIGRTMIN))) - {int(v) for v in signal.valid_signals()}:
        _sig_default(number)


# rt_sigaction's number and the kernel's struct sigaction (handler, flags,
# restorer, mask: four words on x86_64 and aarch64).
SYS_RT_SIGACTION = {"x86_64": 13, "aarch64": 134}.get(os.uname().machine)


def _sig_default(sig: int) -> None:
    if SYS_RT_SIGACTION is None:
        return
    action = (ctypes.c_ulong * 4)(0, 0, 0, 0)  # SIG_DFL, no flags, no restorer, empty mask
    _libc.syscall(SYS_RT_SIGACTION, sig, ctypes.byref(action), None, 8)


def _report(sock: int, where: str, exc: BaseException) -> None:
    code = exc.errno if isinstance(exc, OSError) and exc.errno else 0
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    with contextlib.suppress(OSError):
        os.write(sock, json.dumps({"where": where, "errno": code, "error": text}).encode())


def warm_up(fd: int) -> None:
    """Run, while nobody waits, what the stub runs once the request came: a
    forked child copies each page its first touch writes (reference counts,
    allocator state), and those copies would otherwise land between the
    daemon's request and the exec (measured ~0.15 ms)."""
    sample = {"argv": ["/usr/bin/true"], "env": {"PATH": "/usr/bin"}, "targets": [0, 1, 2], "uid": 0,
              "gid": 0, "groups": [0], "umask": 18, "rlimits": [[7, 1024, 1024]], "cwd": None}  # fmt: skip
    spec = json.loads(json.dumps(sample).encode())
    spare = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    names = [int(n) for n in os.listdir("/proc/self/fd")]
    os.close(spare)
    _ = (
        [os.fsencode(a) for a in spec["argv"]],
        {os.fsencode(k): os.fsencode(v) for k, v in spec["env"].items()},
    )
    _ = (names, resource.getrlimit(resource.RLIMIT_NOFILE), os.getgroups(), _lower(1, 2), array.array("i"))


def run_stub(sock: socket.socket, cgroups: list[str], launcher: int, userns: bool) -> None:
    """In the forked child: enter the cgroups (the grace period is paid here,
    before anyone waits) and, with ``userns``, a root-owned user namespace
    (:func:`own_userns`), say ready, wait for the command, exec it."""
    try:
        os.setsid()
        die_with_parent(launcher)
        me = str(os.getpid())
        for path in cgroups:
            _write(f"{path}/cgroup.procs", me)
        if userns:
            own_userns()
        gc.disable()  # nothing to collect before the exec: no pages touched for it
        warm_up(sock.fileno())
        sock.send(b"ready", socket.MSG_NOSIGNAL)
        data, anc, flags, _ = sock.recvmsg(MAX_PACKET, socket.CMSG_SPACE(MAX_FDS * 4))
    except BaseException:
        os._exit(71)
    fds: list[int] = []
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
            fds.extend(got)
    if not data:  # the daemon let this stub go
        os._exit(0)
    where = "request"
    keep = sock.detach()
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise OSError(errno.EMSGSIZE, "the launch request was truncated")
        spec = json.loads(data)
        targets = [int(t) for t in spec["targets"]]
        if len(targets) != len(fds):
            raise OSError(errno.EINVAL, f"{len(fds)} descriptors for {len(targets)} targets")
        where = "descriptors"
        keep = renumber(fds, targets, keep)
        where = "staging"
        attach_overlays(spec.get("attach") or [])
        where = "identity"
        take_identity(spec, launcher)
        argv = [os.fsencode(a) for a in spec["argv"]]
        env = {os.fsencode(k): os.fsencode(v) for k, v in spec["env"].items()}
        if spec.get("cwd") is not None:
            where = "cwd"
            os.chdir(os.fsencode(spec["cwd"]))  # as the caller: its own traversal rights
        where = "exec"
        os.execve(argv[0], argv, env)  # noqa: S606 - the daemon's own argv (bwrap, sh, python)
    except BaseException as exc:  # reported to the daemon, then gone
        _report(keep, where, exc)
    os._exit(127)


# -- the launcher ------------------------------------------------------------------------
class Launcher:
    def __init__(self, control: socket.socket, parent: int, userns: bool = False) -> None:
        self.control = control
        self.parent = parent
        self.userns = userns
        self.poll = select.poll()
        self.poll.register(control, select.POLLIN)
        # socket fd → (socket, pid, cgroup name, the daemon's request tag)
        self.pending: dict[int, tuple[socket.socket, int, str, object]] = {}
        self.pidfds: dict[int, int] = {}  # pidfd → pid (running or waiting)
        self.zombies: dict[int, int] = {}  # pid → pidfd (exit reported, reap on request)
        self.cgroups: dict[int, list[str]] = {}  # pid → the cgroups made for it
        self.handed: set[int] = set()  # stubs given to the daemon (it removes their cgroups)

    def send(self, message: dict[str, object], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        with contextlib.suppress(OSError):  # the daemon is gone: the next read says so
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                self.control.sendmsg([data], rights, socket.MSG_NOSIGNAL)
            else:
                self.control.send(data, socket.MSG_NOSIGNAL)

    def spawn(self, dirs: list[Any], tag: object) -> None:
        name = f"b_{os.urandom(10).hex()}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            made = make_cgroups(dirs, name)
        except OSError as exc:
            self.send({"op": "failed", "tag": tag, "error": f"cannot make a stub cgroup: {exc}"})
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:  # the stub
            ours.close()
            self.control.close()
            for fd in [*self.pidfds, *self.zombies.values()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for sock, _, _, _ in self.pending.values():
                sock.close()
            run_stub(theirs, made, me, self.userns)
            os._exit(71)
        theirs.close()
        self.cgroups[pid] = made
        pidfd = os.pidfd_open(pid)
        self.pidfds[pidfd] = pid
        self.poll.register(pidfd, select.POLLIN)
        self.pending[ours.fileno()] = (ours, pid, name, tag)
        self.poll.register(ours, select.POLLIN)

    def ready(self, fd: int) -> None:
        sock, pid, name, tag = self.pending.pop(fd)
        self.poll.unregister(fd)
        try:
            ok = sock.recv(16) == b"ready"
        except OSError:
            ok = False
        if ok:
            self.handed.add(pid)
            self.send({"op": "stub", "pid": pid, "cgroup": name, "tag": tag}, [sock.fileno()])
        else:  # its exit is reported as well, and its cgroups go at the reap
            self.send({"op": "failed", "tag": tag, "error": f"stub {pid} died before it was ready"})
        sock.close()  # the daemon holds it now (or the stub is dying: its exit is reported)

    def exited(self, pidfd: int) -> None:
        pid = self.pidfds.pop(pidfd)
        self.poll.unregister(pidfd)
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
        rc = -1
        if info is not None:
            rc = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self.zombies[pid] = pidfd
        self.send({"op": "exited", "pid": pid, "rc": rc})

    def reap(self, pid: int) -> None:
        pidfd = self.zombies.pop(pid, None)
        if pidfd is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
            os.close(pidfd)
        made = self.cgroups.pop(pid, [])
        if pid not in self.handed:  # never given out: nobody else knows its cgroups
            for path in reversed(made):
                _rmdir(path)
        self.handed.discard(pid)

    def request(self) -> bool:
        try:
            data = self.control.recv(MAX_PACKET)
        except OSError:
            data = b""
        if not data:
            return False
        message = json.loads(data)
        if message.get("op") == "spawn":
            self.spawn(message["dirs"], message.get("tag"))
        elif message.get("op") == "reap":
            self.reap(int(message["pid"]))
        return True

    def run(self) -> None:
        while True:
            for fd, _ in self.poll.poll():
                if fd == self.control.fileno():
                    if not self.request():
                        return
                elif fd in self.pending:
                    self.ready(fd)
                elif fd in self.pidfds:
                    self.exited(fd)

    def shutdown(self) -> None:
        """The daemon is gone or stopping: kill every child's process group,
        reap them, remove the cgroups made for stubs never used."""
        for pid in [*self.pidfds.values(), *self.zombies]:
            for kill in (os.killpg, os.kill):  # the group (setsid'd stub), or the process
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)
        for pidfd in [*self.pidfds, *self.zombies.values()]:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        for made in self.cgroups.values():
            for path in reversed(made):
                _rmdir(path)


def gate(argv: list[str]) -> int:
    """``launcher.py --gate SPEC -- CMD…``: one command's start without a stub
    (the daemon's slower path, and an in-process ``kbd exec`` whose command
    writes a staged ``notes/``), started as root and doing what a stub does:
    stop until the daemon has placed it in its cgroup (``stop``), enter a
    root-owned user namespace (``userns``), attach the staging overlays
    (``attach``), take the caller's identity (``identity``: the stub's fields),
    change folder as the caller (``cwd``) and exec CMD with exactly ``env``.
    Any failure exits 69 before CMD runs."""
    spec = json.loads(argv[2])
    command = [os.fsencode(a) for a in argv[4:]]
    where = "request"
    try:
        if argv[3] != "--" or not command:
            raise OSError(errno.EINVAL, "usage: --gate SPEC -- CMD...")
        default_signals()
        if spec.get("stop"):
            os.kill(os.getpid(), signal.SIGSTOP)  # the daemon continues it once it is in its cgroup
        if spec.get("userns"):
            where = "user namespace"
            own_userns()
        where = "staging"
        attach_overlays(spec.get("attach") or [])
        if spec.get("identity") is not None:
            where = "identity"
            take_identity(spec["identity"], None)
        if spec.get("cwd") is not None:
            where = "cwd"
            os.chdir(os.fsencode(spec["cwd"]))
        where = "exec"
        env = {os.fsencode(k): os.fsencode(v) for k, v in spec["env"].items()}
        os.execve(command[0], command, env)  # noqa: S606 - the daemon's own argv (bwrap, sh, python)
    except BaseException as exc:
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        with contextlib.suppress(OSError):
            os.write(2, f"kbd: cannot start the command ({where}: {text}); nothing was run\n".encode())
    os._exit(69)


def main(argv: list[str]) -> int:
    if len(argv) > 1 and argv[1] == "--gate":
        return gate(argv)
    config = json.loads(argv[1])
    die_with_parent(int(config["parent"]))
    default_signals()
    control = socket.socket(fileno=int(config["control"]))
    launcher = Launcher(control, int(config["parent"]), bool(config.get("userns")))
    try:
        launcher.run()
    finally:
        launcher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
