"""How a command's process starts, whoever asked for it: the caller's identity
(:class:`Caller`, with the grant group as its gid: :func:`with_group`), the
command's cgroup and limits (:func:`contain`, :func:`contain_brokered`), the
start itself — in ``kbd exec``'s own session (:func:`spawn`), as a broker
client through a stopped gate step (:func:`spawn_as`), or in a launcher stub
(:func:`start_in_stub`) — signals forwarded to its process group
(:class:`Forwarder`), the wait that never lets a signal reach a stranger
(:func:`wait_child`), and killing what it left behind (:func:`kill_leftovers`).

Plain values in, processes out: nothing here knows a root, a session store or
a plan (docs/architecture.md: the sandbox tier sits below the service)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kbd.errors import ContainmentUnavailable, GrantGroupMissing, Unavailable
from kbd.sandbox import cgroup, reaper
from kbd.sandbox import limits as rlimits

if TYPE_CHECKING:
    from kbd.core.config import LimitsConfig
    from kbd.sandbox.spawn import Stub


class Recording(Protocol):
    """The process record of one command (kept by the service layer): written
    once, dropped again when the command could not start."""

    def add(self, pid: int) -> None: ...

    def drop(self) -> None: ...


SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


# What a forwarded signal may be: the ones a terminal or a supervisor sends to
# stop, hang up or resize a command (docs/daemon.md "The exec broker"), on both paths alike.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH)


def warning_line(message: str) -> str:
    return f"kbd: WARNING: {message}"


def warn(message: str) -> None:
    print(warning_line(message), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Caller:
    """Who a brokered command runs as, and with what: the identity comes from
    the kernel (``SO_PEERCRED``/``SO_PEERGROUPS`` and the peer's /proc entry),
    never from the client; ``stdio`` are the client's own fds 0-2 (received
    with ``SCM_RIGHTS``); ``env`` holds only what the client may pass (LANG,
    TERM)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    umask: int
    rlimits: Mapping[int, tuple[int, int]]
    env: Mapping[str, str]
    stdio: tuple[int, int, int]


class Forwarder:
    """Deliver signals to the command's process group while its leader is ours
    and unreaped (see :func:`wait_child`). A signal that arrives before the
    command starts (say, while a notes lock is awaited) is kept and delivered
    the moment it starts: never swallowed, so the command does not run in full
    after the caller asked it to stop. Thread-safe: the broker delivers from
    the connection's reader thread while the command's thread arms and
    disarms (a re-entrant lock, since a signal handler may run inside
    :meth:`arm` on the same thread)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.finished = False
        self.aborted = False
        self.box: cgroup.Box | None = None

    def deliver(self, signum: int) -> None:
        with self._lock:
            if self.pgid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signum)
            elif not self.finished:
                self.pending.append(signum)

    def arm(self, pgid: int) -> None:
        """The command's leader ``pgid`` is started (and ours, unreaped)."""
        with self._lock:
            self.pgid = pgid
            pending, self.pending = self.pending, []
            if self.aborted:
                pending.append(signal.SIGKILL)
            for signum in pending:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signum)

    def disarm(self) -> None:
        with self._lock:
            self.finished = True
            self.pgid = None

    def abort(self) -> None:
        """The caller is gone (the broker's client died): kill the command's
        whole tree now — its cgroup, setsid'd processes included — or the
        moment it starts."""
        with self._lock:
            self.aborted = True
            box = self.box
            if self.pgid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGKILL)
        if box is not None:
            with contextlib.suppress(OSError):
                box.kill(timeout=1.0)


class ForwardOwnSignals(Forwarder):
    """The in-process forwarder: ``kbd exec``'s own INT, TERM, HUP, QUIT and
    WINCH go to the command (the broker forwards the same signals from its
    client's SIGNAL frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.previous = {s: signal.signal(s, self._handle) for s in FORWARDED}

    def _handle(self, signum: int, frame: object) -> None:
        self.deliver(signum)

    def restore(self) -> None:
        self.disarm()
        for s, h in self.previous.items():
            signal.signal(s, h)


class Child(Protocol):
    """What the exec path needs of a started command: a ``subprocess.Popen``,
    or a launcher stub's :class:`kbd.sandbox.spawn.Child`."""

    pid: int
    returncode: int | None

    def wait(self) -> int: ...


def wait_child(proc: Child, forward: Forwarder) -> int:
    """Wait for the command, disarm the forwarder, and only then reap it.

    ``waitid(WNOWAIT)`` leaves the exited leader a zombie: until it is reaped its
    PID — the process group's number — cannot be reused, so a signal forwarded
    before the disarm can only reach the command's own group, never a stranger
    that later got the same number. (A stub's command is the launcher's child:
    the launcher keeps the zombie until :meth:`~kbd.sandbox.spawn.Child.wait`.)"""
    if isinstance(proc, subprocess.Popen):
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    else:
        proc.exited()  # type: ignore[attr-defined]
    forward.disarm()
    return proc.wait()


def _limited(box: cgroup.Box, limits: LimitsConfig) -> cgroup.Box:
    problem = cgroup.v1_problem(limits, box.hierarchy)
    if problem is not None:  # the controller is there but unusable: fail closed
        raise ContainmentUnavailable(problem)
    try:
        box.limit(limits)
    except OSError as exc:
        where = exc.filename or box.path
        raise ContainmentUnavailable(
            f"cannot set the limits of the command's cgroup ({where}): {exc.strerror or exc}"
        ) from None
    return box


def contain(
    prepared: cgroup.Preparation, backend: str, limits: LimitsConfig, notice: Callable[[str], None] = warn
) -> cgroup.Box | None:
    """The command's cgroup (its whole tree, its limits), or None where this host
    has none and the backend still holds the tree (bubblewrap's PID namespace)."""
    box, error = prepared.result()
    if box is not None:
        return _limited(box, limits)
    hierarchy = cgroup.detect()
    if hierarchy.v2 is not None:
        raise ContainmentUnavailable(f"cannot create the command's cgroup under {hierarchy.v2}: {error}")
    if backend != "bwrap":  # bubblewrap's PID namespace already holds the tree
        reaper.become_subreaper()
    problem = cgroup.uncontained_problem(backend, hierarchy.problem, subreaper=reaper.active())
    if problem is not None:
        raise ContainmentUnavailable(problem)
    if backend == "none" and not reaper.active():
        notice(f"no per-command cgroup ({hierarchy.problem}): background processes may outlive the command")
    return None


def contain_brokered(sid: str, backend: str, limits: LimitsConfig) -> cgroup.Box | None:
    """The cgroup of a command the daemon runs for a client. The daemon never
    enters it (a ``cgroup.kill`` would take the daemon along): the command is
    moved in before it may run (:func:`spawn_as`). Without cgroups only
    bubblewrap's PID namespace (``--die-with-parent``) can hold a tree: other
    backends are refused here (``KBD_NO_DAEMON=1`` runs them in-process)."""
    hierarchy = cgroup.detect()
    if hierarchy.v2 is None:
        if backend == "bwrap":
            return None
        raise ContainmentUnavailable(
            f"the daemon cannot hold a {backend} command's process tree without a cgroup ({hierarchy.problem})",
            hint="run it in-process with KBD_NO_DAEMON=1, or give the daemon a writable cgroup v2 subtree",
        )
    try:
        box = cgroup.Box.create(hierarchy, sid)
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ContainmentUnavailable(
            f"cannot create the command's cgroup under {hierarchy.v2}: {why}"
        ) from None
    try:
        return _limited(box, limits)
    except BaseException:
        box.remove()
        raise


def kill_leftovers(box: cgroup.Box | None, notice: Callable[[str], None] = warn) -> None:
    """Kill whatever the command left running (setsid'd background loops too),
    before the post-command audit reads what it wrote and before the locks go."""
    if box is not None:
        box.settle()  # out of the cgroup first: cgroup.kill must not take kbd exec along
        if not box.kill():
            notice(
                f"processes of this command are still alive in cgroup {box.path}; revoke it with --immediate"
            )
    if box is None and reaper.active() and not reaper.kill_descendants():
        notice("processes of this command are still alive after SIGKILL")


def gate_argv(argv: list[str], spec: dict[str, Any]) -> list[str]:
    """``argv`` behind the launcher's gate step (kbd.sandbox.launcher.gate),
    which does, as root, what a stub does before it execs: user namespace,
    staging overlays, identity."""
    from kbd.sandbox.spawn import SOURCE

    return [sys.executable, "-I", "-S", str(SOURCE), "--gate", json.dumps(spec), "--", *argv]


def spawn(
    argv: list[str], box: cgroup.Box | None, *, attach: list[dict[str, object]] | None = None, **popen: Any
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, inside ``box``: ``kbd exec`` is in the
    cgroup when it forks (the child inherits it: nothing runs outside, not even
    for an instant), then steps back out on a helper thread while the command
    runs (the move waits for an RCU grace period); ``kill_leftovers`` waits for that
    before it kills the cgroup. ``attach``: staging overlays to attach first
    (through the gate step)."""
    if attach:
        argv = gate_argv(argv, {"attach": attach, "env": popen.get("env") or {}})
    if box is None:
        return subprocess.Popen(argv, start_new_session=True, **popen)  # noqa: S603
    if not box.inside:
        box.enter()
    try:
        proc = subprocess.Popen(argv, start_new_session=True, **popen)  # noqa: S603
    except BaseException:
        box.leave()
        raise
    box.leave_soon()
    return proc


# The brokered command's first step, already as the caller: stop until the
# daemon has moved it into its cgroup, lower its rlimits to the caller's, then
# exec. (A folder to enter is entered here *as the caller*: Popen's cwd= would
# chdir while still root. bubblewrap changes folder itself, so its gate has no
# cd, which would leave OLDPWD behind in the command's environment.)
GATE = 'kill -STOP $$ || exit 69; {limits}exec "$@"'
GATE_CD = 'kill -STOP $$ || exit 69; {limits}cd -- "$1" || exit 69; unset OLDPWD; shift; exec "$@"'
_LIMITS_FAILED = '|| { echo "kbd: cannot set resource limits" >&2; exit 69; }; '


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"T"


def _place(pid: int, box: cgroup.Box | None) -> None:
    """Move the stopped command into ``box``; refuse if it was continued by
    someone else before that (it must never run outside its cgroup)."""
    if box is not None:
        box.adopt(pid)
    if not _stopped(pid):
        raise ContainmentUnavailable("the command was continued before the daemon placed it in its cgroup")


def _gate_identity(caller: Caller) -> dict[str, Any]:
    """The caller's identity as the gate step (and a stub) takes it: rlimits
    only where they differ from this process's, never above them."""
    limits = []
    for res, (soft, hard) in sorted(caller.rlimits.items()):
        own = resource.getrlimit(res)
        new_hard = rlimits.lower(hard, own[1])
        new = (rlimits.lower(rlimits.lower(soft, own[0]), new_hard), new_hard)
        if new != own:
            limits.append([res, *new])
    return {"uid": caller.uid, "gid": caller.gid, "groups": list(caller.groups), "umask": caller.umask,
            "rlimits": limits}  # fmt: skip


def spawn_as(
    argv: list[str], box: cgroup.Box | None, caller: Caller, *, env: dict[str, str],
    pass_fds: list[int] | tuple[int, ...] = (), cwd: Path | None = None,
    attach: list[dict[str, object]] | None = None, userns: bool = False,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """Start ``argv`` for a broker client: exactly the caller's uid, gid,
    supplementary groups and umask (from the kernel, set by Popen between fork
    and exec: no capability survives setuid to a non-root uid), its rlimits
    (lowered by the gate), its own stdio, a new session; stopped until
    :func:`_place` put it in ``box``. With ``userns`` or ``attach`` the gate is
    the launcher's (started as root: a root-owned user namespace, the staging
    overlays, then the identity), else a shell step started as the caller."""
    if userns or attach:
        spec = {"stop": True, "userns": userns, "attach": attach or [], "identity": _gate_identity(caller),
                "cwd": None if cwd is None else str(cwd), "env": env}  # fmt: skip
        proc = subprocess.Popen(  # noqa: S603
            gate_argv(argv, spec), start_new_session=True, stdin=caller.stdio[0], stdout=caller.stdio[1],
            stderr=caller.stdio[2], env={"PATH": SAFE_PATH}, cwd="/", pass_fds=pass_fds,
        )  # fmt: skip
        return _placed(proc, box)
    steps = rlimits.lowering_steps(caller.rlimits)
    limits = " && ".join(steps) + " " + _LIMITS_FAILED if steps else ""
    gate = [rlimits.SHELL, "-c", GATE.format(limits=limits), "kbd-broker"]
    if cwd is not None:
        gate = [rlimits.SHELL, "-c", GATE_CD.format(limits=limits), "kbd-broker", str(cwd)]
    proc = subprocess.Popen(  # noqa: S603
        [*gate, *argv], start_new_session=True, stdin=caller.stdio[0], stdout=caller.stdio[1],
        stderr=caller.stdio[2], user=caller.uid, group=caller.gid, extra_groups=list(caller.groups),
        umask=caller.umask, env=env, cwd="/", pass_fds=pass_fds,
    )  # fmt: skip
    return _placed(proc, box)


def _placed(proc: subprocess.Popen[bytes], box: cgroup.Box | None) -> subprocess.Popen[bytes]:
    """Wait until the gate stopped itself, move it into ``box``, continue it."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
        if info is not None and info.si_code == os.CLD_STOPPED:
            _place(proc.pid, box)
            os.kill(proc.pid, signal.SIGCONT)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


def start_in_stub(
    stub: Stub, argv: list[str], caller: Caller, *, env: dict[str, str], record: Recording,
    pass_fds: list[int] | tuple[int, ...], cwd: Path | None, attach: list[dict[str, object]] | None = None,
) -> Child:  # fmt: skip
    """Start ``argv`` in a launcher stub (already in its cgroup): recorded
    under the stub's pid *before* it may run, so close and revoke find it
    from the first instant; the record goes again if the exec fails."""
    record.add(stub.pid)
    try:
        return stub.launch(
            argv, env=env, fds=[*caller.stdio, *pass_fds], targets=[0, 1, 2, *pass_fds], uid=caller.uid,
            gid=caller.gid, groups=caller.groups, umask=caller.umask, rlimits=caller.rlimits,
            cwd=None if cwd is None else str(cwd), attach=attach or (),
        )  # fmt: skip
    except BaseException as exc:
        record.drop()
        if isinstance(exc, OSError):
            raise Unavailable(f"cannot start the command ({exc.strerror or exc}); nothing was run") from None
        raise


def check_exec(proc: Child) -> None:
    """A stub that could not exec its command said why (it exited 127)."""
    why = None if isinstance(proc, subprocess.Popen) else proc.failure()  # type: ignore[attr-defined]
    if why is not None:
        raise Unavailable(f"cannot start the command ({why}); nothing was run")


def grant_gid(name: str | None, backend: str, brokered: bool) -> int | None:
    """The gid of the host's grant group (``sandbox.grant_group``) a command
    gets as one more supplementary group: only a brokered command (the daemon
    sets its groups; an in-process caller cannot add one) that runs sandboxed
    (never ``unsafe_no_sandbox``: outside a sandbox the group would open every
    workflow folder). Looked up at every command; a name this host does not
    know fails closed."""
    if name is None or not brokered or backend == "none":
        return None
    import grp  # only on hosts with a grant group: the exec path pays for every import

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise GrantGroupMissing(
            f"sandbox.grant_group {name!r} in kbd.yaml is not a group on this host; nothing was run"
        ) from None


def with_group(caller: Caller, gid: int) -> Caller:
    """The caller's identity with the grant group as its real, effective and
    saved gid (docs/multi-user.md "The permission model"): the kernel lets a process trace,
    ``pidfd_getfd``, read the memory of or open ``/proc/PID/{fd,root,cwd,mem}``
    of another without a capability only when uid *and* gid match, so none of
    the caller's other processes (her own gid) can reach into the command. Her
    own gid stays among the supplementary groups: file access is unchanged."""
    groups = tuple(dict.fromkeys((*caller.groups, caller.gid, gid)))
    return dataclasses.replace(caller, gid=gid, groups=groups)


def release(box: cgroup.Box | None) -> None:
    if box is not None:
        with contextlib.suppress(OSError):  # a failed leave was already reported
            box.settle()
            if box.inside:
                box.leave()
        box.remove()


def userns_usable() -> bool:
    """This daemon can give a brokered command a root-owned user namespace
    (docs/multi-user.md "The permission model"); imported late: an in-process ``kbd exec``
    never needs the launcher's module."""
    from kbd.sandbox.spawn import own_userns_usable

    return own_userns_usable()


def ready_pipe() -> int:
    """The read end of a pipe holding one byte, for bwrap's ``--block-fd``."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(w, b".")
    finally:
        os.close(w)
    return r


def sandbox_was_set_up(ready_r: int) -> bool:
    """Whether bwrap consumed the byte on ``ready_r`` (``--block-fd``), which it
    does only once the sandbox is set up, right before it execs the command's
    first step; closes ``ready_r``. The one way to tell bwrap's own setup
    failures (exit 1) from a command that exited 1."""
    try:
        os.set_blocking(ready_r, False)
        return os.read(ready_r, 1) == b""  # consumed, and no writer left: EOF
    except BlockingIOError:  # cannot happen (no writer): say no rather than guess
        return False
    finally:
        os.close(ready_r)
