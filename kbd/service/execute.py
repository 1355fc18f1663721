"""``kbd exec``: run one command under the session's *current* plan (DESIGN §5).

Every command gets a fresh lookup and a new sandbox. Backends, in order of
preference (``kbd.yaml`` ``sandbox.backend``):

* ``bwrap`` — bubblewrap with explicit fd binds (:mod:`kbd.sandbox.bwrap`), plus
  the inner Landlock helper when the plan writes into a source's notes/;
* ``landlock`` — Landlock alone, for hosts without user namespaces. It cannot
  keep a file read-only inside a writable folder nor hide a folder, so plans
  that need overlays are refused unless ``unsafe_landlock_writes`` is set (which
  warns on every use);
* nothing usable → exit 69, unless ``unsafe_no_sandbox`` (warns every time).

The command's environment is built, never inherited: the plan's variables,
``KBD_SESSION``, and the allow-list ``PATH`` (fixed), ``HOME`` and ``TMPDIR``
(the sandbox's private /tmp), ``LANG`` and ``TERM`` (copied from the caller).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

from kbd.core.config import LimitsConfig
from kbd.core.plan import Plan
from kbd.core.principals import LocalOperator
from kbd.errors import ContainmentUnavailable, InvalidInput, Unavailable
from kbd.fs.confined import pin_dir
from kbd.sandbox import bwrap, cgroup, reaper, seccomp, spec
from kbd.sandbox import limits as rlimits
from kbd.sandbox.landlock import LANDLOCK_ALL, landlock_abi, system_rules
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
INHERITED = ("LANG", "TERM")


def warn(message: str) -> None:
    print(f"kbd: WARNING: {message}", file=sys.stderr, flush=True)


def session_env(plan: Plan, sid: str, caller: dict[str, str] | None = None) -> dict[str, str]:
    caller = dict(os.environ) if caller is None else caller
    env = {"PATH": SAFE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp"}  # noqa: S108 - the sandbox's private /tmp
    for name in INHERITED:
        if name in caller:
            env[name] = caller[name]
    env.update(plan.env)
    env["KBD_SESSION"] = sid
    return env


def resolve_cwd(plan: Plan, cwd: str | None) -> Path:
    """The workflow folder, or ``cwd`` when it names a real folder inside it."""
    if cwd is None:
        return plan.workflow_folder
    pure = PurePosixPath(cwd if cwd.startswith("/") else str(plan.workflow_folder / cwd))
    if ".." in pure.parts:
        raise InvalidInput("--cwd must not contain '..'")
    target = Path(pure)
    if target != plan.workflow_folder and plan.workflow_folder not in target.parents:
        raise InvalidInput("--cwd must name a folder inside the session's workflow folder")
    with pin_dir(target):  # exists, is a folder, no link on the way
        pass
    return target


def choose_backend(host: Root) -> str:
    sb = host.config.sandbox
    if sb.backend in ("auto", "bwrap") and bwrap.bwrap_path() is not None:
        return "bwrap"
    if sb.backend == "bwrap":
        raise Unavailable(
            "sandbox.backend is bwrap but bubblewrap is not installed", hint="apt-get install bubblewrap"
        )
    if landlock_abi() > 0:
        return "landlock"
    if sb.unsafe_no_sandbox:
        return "none"
    raise Unavailable("no sandbox layer is usable on this host (no bubblewrap, no Landlock)")


def private_tmp(host: Root, sid: str) -> Path:
    """Landlock-only sandboxes have no mount namespace: a kbd-owned scratch folder
    per session stands in for the private /tmp."""
    path = host.config.state_dir / "tmp" / sid
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _landlock_argv(host: Root, plan: Plan, command: list[str], *, scratch: Path) -> list[str]:
    overlays = plan.overlays()
    if overlays:
        if not host.config.sandbox.unsafe_landlock_writes:
            raise Unavailable(
                "this plan needs read-only or hidden paths inside writable folders "
                f"({', '.join(sorted({str(g.origin) for g in overlays}))}), which Landlock alone cannot enforce",
                hint="install bubblewrap, use a read-only session kind, or set sandbox.unsafe_landlock_writes",
            )
        warn("unsafe_landlock_writes: read-only overlays inside writable folders are NOT enforced")
    rules = system_rules()
    rules.append({"path": str(scratch), "access": list(LANDLOCK_ALL)})
    read = ["read_file", "read_dir", "execute"]
    for g in plan.grants:
        if g.mode == "read":
            rules.append({"path": str(g.path), "access": read})
        elif g.mode == "write":
            rules.append({"path": str(g.path), "access": list(LANDLOCK_ALL)})
    helper_spec = {
        "handled": list(LANDLOCK_ALL),
        "rules": rules,
        "min_abi": 1,
        # No bubblewrap here: the helper drops capabilities, confines signals and
        # abstract sockets, denies TCP, and installs the seccomp filter itself.
        "drop_caps": True,
        "scope": True,
        "deny_tcp": host.config.sandbox.network == "none",
        "seccomp": seccomp.program(
            block_network=host.config.sandbox.network != "host", block_metadata=True, host_namespaces=True
        ).hex(),
    }
    return [bwrap.PYTHON, "-I", "-S", str(bwrap.HELPER_SOURCE), json.dumps(helper_spec), "--", *command]


class _Forward:
    """Forward SIGINT/SIGTERM/SIGHUP from ``kbd exec`` to the command's process group
    while its leader is ours and unreaped (see :func:`wait_child`). A signal that
    arrives before the command starts (say, while a notes lock is awaited) is
    kept and delivered the moment it starts: never swallowed, so the command
    does not run in full after the caller asked it to stop."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pending: int | None = None
        self.finished = False
        self.previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }

    def _handle(self, signum: int, frame: object) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signum)
        elif not self.finished:
            self.pending = signum

    def arm(self, pgid: int) -> None:
        """The command's leader ``pgid`` is started (and ours, unreaped)."""
        self.pgid = pgid
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, pending)

    def disarm(self) -> None:
        self.finished = True
        self.pgid = None

    def restore(self) -> None:
        self.disarm()
        for s, h in self.previous.items():
            signal.signal(s, h)


def wait_child(proc: subprocess.Popen[bytes], forward: _Forward) -> int:
    """Wait for the command, disarm the forwarder, and only then reap it.

    ``waitid(WNOWAIT)`` leaves the exited leader a zombie: until it is reaped its
    PID — the process group's number — cannot be reused, so a signal forwarded
    before the disarm can only reach the command's own group, never a stranger
    that later got the same number."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    forward.disarm()
    return proc.wait()


def contain(prepared: cgroup.Preparation, backend: str, limits: LimitsConfig) -> cgroup.Box | None:
    """The command's cgroup (its whole tree, its limits), or None where this host
    has none and the backend still holds the tree (bubblewrap's PID namespace)."""
    box, error = prepared.result()
    if box is not None:
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
    hierarchy = cgroup.detect()
    if hierarchy.v2 is not None:
        raise ContainmentUnavailable(f"cannot create the command's cgroup under {hierarchy.v2}: {error}")
    if backend != "bwrap":  # bubblewrap's PID namespace already holds the tree
        reaper.become_subreaper()
    problem = cgroup.uncontained_problem(backend, hierarchy.problem, subreaper=reaper.active())
    if problem is not None:
        raise ContainmentUnavailable(problem)
    if backend == "none" and not reaper.active():
        warn(f"no per-command cgroup ({hierarchy.problem}): background processes may outlive the command")
    return None


def _end_tree(box: cgroup.Box | None) -> None:
    """Kill whatever the command left running (setsid'd background loops too),
    before the post-command audit reads what it wrote and before the locks go."""
    if box is not None:
        box.settle()  # out of the cgroup first: cgroup.kill must not take kbd exec along
        if not box.kill():
            warn(
                f"processes of this command are still alive in cgroup {box.path}; revoke it with --immediate"
            )
    if box is None and reaper.active() and not reaper.kill_descendants():
        warn("processes of this command are still alive after SIGKILL")


def spawn(argv: list[str], box: cgroup.Box | None, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, inside ``box``: ``kbd exec`` is in the
    cgroup when it forks (the child inherits it: nothing runs outside, not even
    for an instant), then steps back out on a helper thread while the command
    runs (the move waits for an RCU grace period); ``_end_tree`` waits for that
    before it kills the cgroup."""
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


def run(
    root: Path,
    sid: str,
    command: list[str],
    *,
    actor: LocalOperator | str,
    cwd: str | None = None,
    prepared: cgroup.Preparation | None = None,
) -> int:
    """Run ``command`` in session ``sid``; return its exit status (69 when the
    sandbox could not be set up, 77 when the session is closed). ``actor`` is the
    trusted local operator, or the ID of the principal named with ``--as``
    (resolved against the current principals; an empty ID is a usage error).
    ``prepared``: the command's cgroup, when the caller started preparing it
    even earlier."""
    if not command:
        raise InvalidInput("no command given", hint="kbd exec SID -- CMD [ARG...]")
    if prepared is None:
        prepared = cgroup.Preparation.start_for(sid)
    box: cgroup.Box | None = None
    forward: _Forward | None = None
    try:
        host = Root(root)
        sessions = RootSessions(host)
        plan = sessions.plan(sid, actor=actor if isinstance(actor, LocalOperator) else host.actor(actor))
        workdir = resolve_cwd(plan, cwd)
        env = session_env(plan, sid)
        backend = choose_backend(host)
        box = contain(prepared, backend, host.config.limits)
        forward = _Forward()
        with contextlib.ExitStack() as stack:
            writes = bool(spec.contributed_notes(plan))
            if writes:
                from kbd.service.command_notes import command_locks  # filelock only for write plans

                # Two workflows' write turns into one notes/ never interleave,
                # whatever the backend.
                who = {"session": sid, "workflow": plan.workflow_id}
                stack.enter_context(command_locks(host, plan, who=who))
            started = time.time_ns()
            if backend == "bwrap":
                rc = _run_bwrap(host, sessions, plan, sid, command, workdir, env, forward, box)
            else:
                rc = _run_direct(host, sessions, plan, sid, command, workdir, env, forward, backend, box)
            if writes:
                from kbd.service.command_notes import scan_command_changes

                # Only the bounded walk under the mutexes; reading and gating the
                # changed files waits until they are released (below).
                changes = scan_command_changes(host, plan, since_ns=started)
        if writes:
            from kbd.service.command_notes import audit_command_changes

            audit_command_changes(host, plan, sid, changes)
        return 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell says (DESIGN §8)
    finally:
        if forward is not None:
            forward.restore()
        if box is None:  # refused before the command ran: undo the preparation
            box = prepared.result()[0]
        if box is not None:
            with contextlib.suppress(OSError):  # a failed leave was already reported
                box.settle()
                if box.inside:
                    box.leave()
            box.remove()


def _finish(
    proc: subprocess.Popen[bytes], forward: _Forward, box: cgroup.Box | None, sessions: RootSessions, sid: str
) -> None:
    """After the command (or a failure to record it): never let it run on
    unrecorded, kill what it left behind, and drop its record."""
    if proc.returncode is None:  # recording failed: the command must not run on
        forward.disarm()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _end_tree(box)
    sessions.commands.remove(sid, proc.pid)


def _run_direct(
    host: Root, sessions: RootSessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], forward: _Forward, backend: str, box: cgroup.Box | None,
) -> int:  # fmt: skip
    if backend == "landlock":
        scratch = private_tmp(host, sid)
        env.update(HOME=str(scratch), TMPDIR=str(scratch))
        argv = _landlock_argv(host, plan, command, scratch=scratch)
    else:
        warn("unsafe_no_sandbox: running WITHOUT any sandbox; the plan is not enforced")
        argv = command
    proc = spawn([*rlimits.shell_prefix(host.config.limits), *argv], box, env=env, cwd=workdir)
    forward.arm(proc.pid)
    try:
        sessions.commands.add(
            sid, pid=proc.pid, generation=plan.generation, argv=command, cgroup=box.name if box else None
        )
        return wait_child(proc, forward)
    finally:
        _finish(proc, forward, box, sessions, sid)


def _run_bwrap(
    host: Root, sessions: RootSessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], forward: _Forward, box: cgroup.Box | None,
) -> int:  # fmt: skip
    bwrap.prepare(plan)
    fds = bwrap.Fds()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    try:
        argv = bwrap.build_argv(plan, command, cwd=workdir, network=host.config.sandbox.network,
                                status_fd=status_w, fds=fds, limits=host.config.limits)  # fmt: skip
        proc = spawn(argv, box, env=env, pass_fds=[*fds.handed, status_w])
    finally:
        os.close(status_w)
        fds.close()
    forward.arm(proc.pid)
    started = time.time()
    try:
        sessions.commands.add(sid, pid=proc.pid, generation=plan.generation, argv=command,
                                   started_at=started, cgroup=box.name if box else None)  # fmt: skip
        child, code = bwrap.read_status(status_r)
        rc = wait_child(proc, forward)
    finally:
        os.close(status_r)
        _finish(proc, forward, box, sessions, sid)
    if child is None:
        raise Unavailable(
            f"bubblewrap could not set up the sandbox (exit {rc}); nothing was run",
            hint="run `kbd doctor` to check user namespaces and bubblewrap",
        )
    return code if code is not None else rc
