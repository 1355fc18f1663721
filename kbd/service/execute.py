"""``kbd exec``: run one command under the session's *current* plan (docs/sandbox.md).

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
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from kbd.core.config import LimitsConfig
from kbd.core.plan import Plan
from kbd.core.principals import Actor, LocalOperator
from kbd.errors import ContainmentUnavailable, InvalidInput, Unavailable
from kbd.fs.confined import pin_dir
from kbd.sandbox import bwrap, cgroup, seccomp, spec
from kbd.sandbox import limits as rlimits
from kbd.sandbox.landlock import LANDLOCK_ALL, landlock_abi, system_rules
from kbd.sandbox.relay import OwnStdio
from kbd.sandbox.start import (
    SAFE_PATH,
    Caller,
    Child,
    Forwarder,
    ForwardOwnSignals,
    check_exec,
    contain,
    contain_brokered,
    grant_gid,
    kill_leftovers,
    ready_pipe,
    release,
    sandbox_was_set_up,
    spawn,
    spawn_as,
    start_in_stub,
    userns_usable,
    wait_child,
    warn,
    with_group,
)
from kbd.service.denials import Teller, Watch
from kbd.service.denials import finish as finish_watch
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

if TYPE_CHECKING:
    from kbd.sandbox.spawn import Launcher, Stub
    from kbd.sandbox.staging import Staging

INHERITED = ("LANG", "TERM")


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


def _landlock_spec(host: Root, plan: Plan, *, scratch: Path, notice: Callable[[str], None]) -> dict[str, Any]:
    """The helper's spec for the Landlock-only backend (its one layer)."""
    overlays = plan.overlays()
    if overlays:
        if not host.config.sandbox.unsafe_landlock_writes:
            raise Unavailable(
                "this plan needs read-only or hidden paths inside writable folders "
                f"({', '.join(sorted({str(g.origin) for g in overlays}))}), which Landlock alone cannot enforce",
                hint="install bubblewrap, use a read-only session kind, or set sandbox.unsafe_landlock_writes",
            )
        notice("unsafe_landlock_writes: read-only overlays inside writable folders are NOT enforced")
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
    return helper_spec


@dataclass
class Launch:
    """How one command is started and reported, by ``kbd exec`` itself
    (``caller`` None: this process's identity, stdio and signals) or by the
    daemon's broker for a client (``caller`` set: that client's identity and
    stdio; its warnings go back as NOTICE lines; ``lock`` guards the daemon's
    shared root while the plan is looked up)."""

    forward: Forwarder
    caller: Caller | None = None
    notice: Callable[[str], None] = warn
    started: Callable[[int, int], None] | None = None
    lock: contextlib.AbstractContextManager[Any] = field(default_factory=contextlib.nullcontext)
    # Who the command is authorized as, once :func:`execute` looked it up (None:
    # the local operator); recorded so that disabling that principal ends it.
    principal: str | None = None
    # The daemon's pre-forked launcher (kbd.sandbox.spawn): a brokered command
    # starts in one of its stubs when it has one, else through spawn_as.
    launcher: Launcher | None = None
    # Where a brokered command's bookkeeping goes that may wait until its exit
    # status is sent (the removal of its emptied cgroups); None: done at once.
    later: list[Callable[[], None]] | None = None
    # --strict-contributions: a refused staged contribution makes the exit 65;
    # --json: the contributions report as one JSON line (docs/notes.md "Staged contributions").
    strict: bool = False
    report_json: bool = False
    # Where a line goes as it is (the JSON report): stderr, or the broker's client.
    say: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))


def _hard_limits(launch: Launch) -> dict[int, int] | None:
    """The hard rlimits a brokered command starts with (its caller's, never
    above the daemon's: :func:`_place`); None in-process (this process's)."""
    if launch.caller is None:
        return None
    return {
        res: rlimits.lower(hard, resource.getrlimit(res)[1])
        for res, (_, hard) in launch.caller.rlimits.items()
    }


def _start(
    argv: list[str], box: cgroup.Box | None, launch: Launch, *, env: dict[str, str], record: _Record,
    pass_fds: list[int] | tuple[int, ...] = (), cwd: Path | None = None, stub: Stub | None = None,
    attach: list[dict[str, object]] | None = None, userns: bool = False,
) -> Child:  # fmt: skip
    if launch.caller is None:
        return spawn(argv, box, attach=attach, env=env, pass_fds=pass_fds, cwd=cwd)
    if stub is not None:
        from kbd.sandbox.spawn import Unusable  # the daemon has it loaded already

        try:
            return start_in_stub(
                stub, argv, launch.caller, env=env, pass_fds=pass_fds, cwd=cwd, record=record, attach=attach
            )
        except Unusable:
            pass  # the stub let go: the command goes into its cgroup the slow way
    return spawn_as(
        argv, box, launch.caller, env=env, pass_fds=pass_fds, cwd=cwd, attach=attach, userns=userns
    )


def _stub_for(launch: Launch, backend: str, limits: LimitsConfig) -> Stub | None:
    """A launcher stub for a brokered command, or None (then
    :func:`contain_brokered` makes its cgroup and :func:`spawn_as` starts it)."""
    if launch.launcher is None or launch.caller is None:
        return None
    problem = cgroup.v1_problem(limits, launch.launcher.hierarchy)
    if problem is not None:  # the controller is there but unusable: fail closed
        raise ContainmentUnavailable(problem)
    # The stub's replacement is asked for once the stub has its command
    # (Stub.launch), not before it; after the answer too, should the command
    # be refused before it ran (a no-op when the pool is full).
    if launch.later is not None:
        launch.later.append(functools.partial(launch.launcher.refill, limits))
    return launch.launcher.take(limits, refill=False)


def run(
    root: Path,
    sid: str,
    command: list[str],
    *,
    actor: LocalOperator | str,
    cwd: str | None = None,
    prepared: cgroup.Preparation | None = None,
    strict: bool = False,
    report_json: bool = False,
) -> int:
    """Run ``command`` in session ``sid`` as ``kbd exec`` itself (this process's
    identity, stdio and signals); return its exit status (69 when the sandbox
    could not be set up, 77 when the session is closed). ``actor`` is the
    trusted local operator, or the ID of the principal named with ``--as``
    (resolved against the current principals; an empty ID is a usage error).
    ``prepared``: the command's cgroup, when the caller started preparing it
    even earlier."""
    if not command:
        raise InvalidInput("no command given", hint="kbd exec SID -- CMD [ARG...]")
    if prepared is None:
        prepared = cgroup.Preparation.start_for(sid)
    forward: ForwardOwnSignals | None = None
    own: OwnStdio | None = None
    try:
        # A socket among fd 0-2 reaches the command as a relayed pipe (docs/multi-user.md "Threat model").
        own = OwnStdio.swap()
        host = Root(root)
        sessions = RootSessions(host)
        forward = ForwardOwnSignals()
        launch = Launch(forward, strict=strict, report_json=report_json)
        return execute(host, sessions, sid, command, actor=actor, cwd=cwd, launch=launch, prepared=prepared)
    finally:
        if own is not None:
            own.restore()  # the tree is dead: the rest of its output, then the caller's own fds back
        if forward is not None:
            forward.restore()
        release(prepared.result()[0])  # refused or done: undo the preparation


def execute(
    host: Root,
    sessions: RootSessions,
    sid: str,
    command: list[str],
    *,
    actor: Actor | str,
    cwd: str | None,
    launch: Launch,
    prepared: cgroup.Preparation | None = None,
) -> int:
    """The one path of ``kbd exec``, in-process and brokered alike: a fresh plan
    lookup as ``actor``, the backend, the cgroup, the notes locks of a write
    plan, the sandboxed command (started as ``launch`` says), then the
    post-command scan and audit and the release of everything. ``prepared``:
    the in-process cgroup preparation (None for a brokered command, whose
    cgroup :func:`contain_brokered` makes). The command's exit status (128+N
    for signal N), or a KbdError before it ran."""
    if not command:
        raise InvalidInput("no command given", hint="kbd exec SID -- CMD [ARG...]")
    box: cgroup.Box | None = None
    stub: Stub | None = None
    staging: Staging | None = None
    refusals: Watch | None = None
    try:
        with launch.lock:  # the daemon's root and registry are shared by its threads
            who = host.actor(actor) if isinstance(actor, str) else actor
            launch.principal = None if isinstance(who, LocalOperator) else who.id
            plan = sessions.plan(sid, actor=who)
            workdir = resolve_cwd(plan, cwd)
            env = session_env(plan, sid, dict(launch.caller.env) if launch.caller is not None else None)
            backend = choose_backend(host)
            limits = host.config.limits
            granted = grant_gid(host.config.sandbox.grant_group, backend, launch.caller is not None)
        if granted is not None and launch.caller is not None:
            launch.caller = with_group(launch.caller, granted)
        # Contributions to a source's notes/ are staged under bubblewrap (docs/notes.md "Staged
        # contributions"): nothing of the real notes/ is writable in the
        # sandbox, and no notes mutex is held while the command runs.
        staged = backend == "bwrap" and bool(spec.contributed_notes(plan))
        if staged:
            from kbd.sandbox import staging as staging_layers

            bwrap.prepare(plan)  # the lower layer has its _index.json before the overlay is made
            staging = staging_layers.create(host.config.state_dir, plan, label=sid)
        if prepared is not None:
            box = contain(prepared, backend, limits, launch.notice)
        else:
            stub = _stub_for(launch, backend, limits)
            box = stub.box() if stub is not None else contain_brokered(sid, backend, limits)
        launch.forward.box = box
        refusals = Watch(host.config.sandbox, backend)
        with contextlib.ExitStack() as stack:
            writes = bool(spec.contributed_notes(plan)) and not staged
            if writes:
                from kbd.service.command_notes import command_locks  # filelock only for write plans

                # Two workflows' write turns into one notes/ never interleave,
                # whatever the backend.
                holder = {"session": sid, "workflow": plan.workflow_id}
                stack.enter_context(command_locks(host, plan, who=holder))
            started = time.time_ns()
            if backend == "bwrap":
                rc = _run_bwrap(host, sessions, plan, sid, command, workdir, env, launch, box, stub,
                                confine=granted is not None, staging=staging, refusals=refusals)  # fmt: skip
            else:
                rc = _run_direct(host, sessions, plan, sid, command, workdir, env, launch, backend, box, stub,
                                 refusals=refusals)  # fmt: skip
            if writes:
                from kbd.service.command_notes import scan_command_changes

                # Only the bounded walk under the mutexes; reading and gating the
                # changed files waits until they are released (below).
                changes = scan_command_changes(host, plan, since_ns=started)
        if writes:
            from kbd.service.command_notes import audit_command_changes

            with launch.lock:
                audit_command_changes(host, plan, sid, changes, principal=launch.principal)
        if plan_writes_own_notes(plan):
            from kbd.service.command_notes import record_own_changes

            with launch.lock:
                record_own_changes(host, plan, sid, since_ns=started, principal=launch.principal)
        status = 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell says (docs/daemon.md)
        if staging is not None:
            status = _commit_staged(sessions, sid, plan, staging, who, launch, status)
        finish_watch(
            refusals, host, sessions, plan, sid, who, Teller(launch.say, launch.report_json, launch.lock)
        )
        return status
    finally:
        if refusals is not None:
            refusals.close()
        if staging is not None:
            staging.remove()
        if stub is not None:
            stub.close()  # unused (refused before it ran): the stub goes; a used one is gone
        if stub is not None and launch.later is not None:
            # The next command's record file, made where its cost does not count.
            launch.later.append(sessions.commands.make_spare)
        if prepared is None and launch.later is not None and box is not None:
            # The tree is dead already (kill_leftovers waited for the cgroup to empty):
            # removing the empty folders need not delay the exit status.
            launch.later.append(functools.partial(release, box))
        elif prepared is None:
            release(box)


def plan_writes_own_notes(plan: Plan) -> bool:
    """The session may write its own KB's ``notes/`` (then a command's edits
    there are versioned: docs/notes.md "Note history")."""
    from kbd.core.layout import KB_DIR, NOTES_DIR
    from kbd.core.pathguard import LinkCheckNeeded, decide

    notes = plan.workflow_folder / KB_DIR / NOTES_DIR
    return isinstance(decide(plan, str(notes / "x.md"), "write"), LinkCheckNeeded)


def _commit_staged(
    sessions: RootSessions, sid: str, plan: Plan, staging: Staging, who: Actor, launch: Launch, status: int
) -> int:
    """Commit the command's staged contributions (its tree is dead: nothing
    writes the upper layers any more), report them, and the exit status:
    the command's own, or 65 with ``--strict-contributions`` and a refusal."""
    from kbd.service.contributions import commit

    report = commit(sessions, sid, plan, staging, actor=who, lock=launch.lock)
    for line in report.lines():
        launch.notice(line)
    if launch.report_json:
        launch.say(json.dumps(report.to_json(), ensure_ascii=False))
    if report.refused and launch.strict:
        return 65
    return status


def _finish(proc: Child, launch: Launch, box: cgroup.Box | None, sessions: RootSessions, sid: str) -> None:
    """After the command (or a failure to record it): never let it run on
    unrecorded, kill what it left behind, and drop its record."""
    if proc.returncode is None:  # recording failed: the command must not run on
        launch.forward.disarm()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kill_leftovers(box, launch.notice)
    sessions.commands.remove(sid, proc.pid)


@dataclass
class _Record:
    """The process record of one command (:mod:`kbd.state.processes`), written
    once: before the command may run when a stub starts it, else right after."""

    sessions: RootSessions
    sid: str
    plan: Plan
    command: list[str]
    box: cgroup.Box | None
    principal: str | None  # who it is authorized as (Launch.principal; None: the local operator)
    pid: int | None = None

    def add(self, pid: int) -> None:
        if self.pid is None:
            name = self.box.name if self.box else None
            self.sessions.commands.add(
                self.sid, pid=pid, generation=self.plan.generation, argv=self.command, started_at=time.time(),
                cgroup=name, broker=name is not None and name.startswith("b_"), principal=self.principal,
            )  # fmt: skip
            self.pid = pid

    def drop(self) -> None:
        if self.pid is not None:
            self.sessions.commands.remove(self.sid, self.pid)
            self.pid = None


def _record(record: _Record, proc: Child, launch: Launch) -> None:
    record.add(proc.pid)
    if launch.started is not None:
        launch.started(proc.pid, record.plan.generation)


def _run_direct(
    host: Root, sessions: RootSessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], launch: Launch, backend: str, box: cgroup.Box | None, stub: Stub | None = None,
    *, refusals: Watch | None = None,
) -> int:  # fmt: skip
    report_fd = None
    if backend == "landlock":
        scratch = private_tmp(host, sid)
        env.update(HOME=str(scratch), TMPDIR=str(scratch))
        helper_spec = _landlock_spec(host, plan, scratch=scratch, notice=launch.notice)
        report_fd = refusals.handed([helper_spec]) if refusals is not None else None
        if report_fd is not None:
            helper_spec.update(log=True, report_fd=report_fd)
        argv = [bwrap.PYTHON, "-I", "-S", str(bwrap.HELPER_SOURCE), json.dumps(helper_spec), "--", *command]
    else:
        launch.notice("unsafe_no_sandbox: running WITHOUT any sandbox; the plan is not enforced")
        argv = command
    prefix = rlimits.shell_prefix(host.config.limits, _hard_limits(launch))
    record = _Record(sessions, sid, plan, command, box, principal=launch.principal)
    try:
        proc = _start([*prefix, *argv], box, launch, env=env, cwd=workdir, record=record, stub=stub,
                      pass_fds=[report_fd] if report_fd is not None else [])  # fmt: skip
    finally:
        if refusals is not None:
            refusals.close_fd()
    launch.forward.arm(proc.pid)
    try:
        _record(record, proc, launch)
        rc = wait_child(proc, launch.forward)
    finally:
        _finish(proc, launch, box, sessions, sid)
    check_exec(proc)
    return rc


def _run_bwrap(
    host: Root, sessions: RootSessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], launch: Launch, box: cgroup.Box | None, stub: Stub | None = None,
    *, confine: bool = False, staging: Staging | None = None, refusals: Watch | None = None,
) -> int:  # fmt: skip
    bwrap.prepare(plan)
    report_fd = refusals.handed(bwrap.helper_layers(plan, confine=confine)) if refusals is not None else None
    fds = bwrap.Fds()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    ready_r = ready_pipe()
    try:
        argv = bwrap.build_argv(plan, command, cwd=workdir, network=host.config.sandbox.network,
                                status_fd=status_w, fds=fds, limits=host.config.limits,
                                hard=_hard_limits(launch), ready_fd=ready_r, confine=confine,
                                staging=staging, report_fd=report_fd)  # fmt: skip
        record = _Record(sessions, sid, plan, command, box, principal=launch.principal)
        # A root-owned user namespace for every brokered command of another user
        # (docs/multi-user.md "The permission model"); the pool's stubs are in one already.
        userns = launch.caller is not None and launch.caller.uid != 0 and userns_usable()
        handed = [*fds.handed, status_w, ready_r, *([report_fd] if report_fd is not None else [])]
        proc = _start(argv, box, launch, env=env, pass_fds=handed, record=record,
                      stub=stub, attach=list(fds.attach), userns=userns)  # fmt: skip
        if staging is not None:
            staging.close_fds()  # the sandbox's launcher step holds its own
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(status_w)
        fds.close()
        if refusals is not None:
            refusals.close_fd()
    launch.forward.arm(proc.pid)
    try:
        _record(record, proc, launch)
        child, code = bwrap.read_status(status_r)
        if code is not None and not isinstance(proc, subprocess.Popen):
            # bubblewrap reported the command's status as it exited: no wait for
            # the launcher's word. _finish's cgroup wait proves the tree dead.
            launch.forward.disarm()
            proc.release(code)  # type: ignore[attr-defined]
            rc = code
        else:
            rc = wait_child(proc, launch.forward)
    finally:
        os.close(status_r)
        _finish(proc, launch, box, sessions, sid)
        ready = sandbox_was_set_up(ready_r)
    check_exec(proc)
    if child is None or not ready:
        # No child, or a child that died before the first step inside the
        # sandbox ran (a mount refused, a bind source changed under bwrap):
        # bwrap's exit status is not the command's, and nothing was run.
        raise Unavailable(
            f"bubblewrap could not set up the sandbox (exit {code if code is not None else rc}); nothing was run",
            hint="run `kbd doctor` to check user namespaces and bubblewrap",
        )
    return code if code is not None else rc
