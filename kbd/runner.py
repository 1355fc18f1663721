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

from kbd.errors import InvalidInput, Unavailable
from kbd.ops import Host
from kbd.plan import Plan
from kbd.principals import LocalOperator
from kbd.safepath import pin_dir
from kbd.sandbox import bwrap, seccomp, spec
from kbd.sandbox.landlock import LANDLOCK_ALL, landlock_abi, system_rules
from kbd.session_ops import Sessions

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


def choose_backend(host: Host) -> str:
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


def private_tmp(host: Host, sid: str) -> Path:
    """Landlock-only sandboxes have no mount namespace: a kbd-owned scratch folder
    per session stands in for the private /tmp."""
    path = host.config.state_dir / "tmp" / sid
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _landlock_argv(host: Host, plan: Plan, command: list[str], *, scratch: Path) -> list[str]:
    overlays = plan.overlays()
    if overlays:
        if not host.config.sandbox.unsafe_landlock_writes:
            raise Unavailable(
                "this plan needs read-only or hidden paths inside writable folders "
                f"({', '.join(sorted({g.origin for g in overlays}))}), which Landlock alone cannot enforce",
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
            block_network=host.config.sandbox.network != "host", block_metadata=True
        ).hex(),
    }
    return [bwrap.PYTHON, "-I", "-S", str(bwrap.HELPER_SOURCE), json.dumps(helper_spec), "--", *command]


class _Forward:
    """Forward SIGINT/SIGTERM/SIGHUP from ``kbd exec`` to the command's process group."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }

    def _handle(self, signum: int, frame: object) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signum)

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def run(
    root: Path, sid: str, command: list[str], *, actor: LocalOperator | str, cwd: str | None = None
) -> int:
    """Run ``command`` in session ``sid``; return its exit status (69 when the
    sandbox could not be set up, 77 when the session is closed). ``actor`` is the
    trusted local operator, or the ID of the principal named with ``--as``
    (resolved against the current principals; an empty ID is a usage error)."""
    if not command:
        raise InvalidInput("no command given", hint="kbd exec SID -- CMD [ARG...]")
    host = Host(root)
    sessions = Sessions(host)
    plan = sessions.plan(sid, actor=actor if isinstance(actor, LocalOperator) else host.actor(actor))
    workdir = resolve_cwd(plan, cwd)
    env = session_env(plan, sid)
    backend = choose_backend(host)
    forward = _Forward()
    try:
        with contextlib.ExitStack() as stack:
            writes = bool(spec.contributed_notes(plan))
            if writes:
                from kbd.notes import command_locks  # filelock only for write plans

                # Two workflows' write turns into one notes/ never interleave,
                # whatever the backend.
                who = {"session": sid, "workflow": plan.workflow_id}
                timeout = host.config.lock_timeout
                stack.enter_context(
                    command_locks(host.config.state_dir, plan, timeout=timeout, who=who, host=host)
                )
            started = time.time_ns()
            if backend == "bwrap":
                rc = _run_bwrap(host, sessions, plan, sid, command, workdir, env, forward)
            else:
                rc = _run_direct(host, sessions, plan, sid, command, workdir, env, forward, backend)
            if writes:
                from kbd.notes import scan_command_changes

                # Only the bounded walk under the mutexes; reading and gating the
                # changed files waits until they are released (below).
                changes = scan_command_changes(host, plan, since_ns=started)
        if writes:
            from kbd.notes import audit_command_changes

            audit_command_changes(host, plan, sid, changes)
        return rc
    finally:
        forward.restore()


def _run_direct(
    host: Host, sessions: Sessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], forward: _Forward, backend: str,
) -> int:  # fmt: skip
    if backend == "landlock":
        scratch = private_tmp(host, sid)
        env.update(HOME=str(scratch), TMPDIR=str(scratch))
        argv = _landlock_argv(host, plan, command, scratch=scratch)
    else:
        warn("unsafe_no_sandbox: running WITHOUT any sandbox; the plan is not enforced")
        argv = command
    proc = subprocess.Popen(argv, env=env, cwd=workdir, start_new_session=True)  # noqa: S603
    forward.pgid = proc.pid
    sessions.store.add_process(sid, pid=proc.pid, generation=plan.generation, argv=command)
    try:
        return proc.wait()
    finally:
        sessions.store.remove_process(sid, proc.pid)


def _run_bwrap(
    host: Host, sessions: Sessions, plan: Plan, sid: str, command: list[str], workdir: Path,
    env: dict[str, str], forward: _Forward,
) -> int:  # fmt: skip
    bwrap.prepare(plan)
    fds = bwrap.Fds()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    try:
        argv = bwrap.build_argv(
            plan, command, cwd=workdir, network=host.config.sandbox.network, status_fd=status_w, fds=fds
        )
        proc = subprocess.Popen(argv, env=env, pass_fds=[*fds.handed, status_w], start_new_session=True)  # noqa: S603
    finally:
        os.close(status_w)
        fds.close()
    forward.pgid = proc.pid
    started = time.time()
    sessions.store.add_process(
        sid, pid=proc.pid, generation=plan.generation, argv=command, started_at=started
    )
    try:
        child, code = bwrap.read_status(status_r)
        rc = proc.wait()
    finally:
        os.close(status_r)
        sessions.store.remove_process(sid, proc.pid)
    if child is None:
        raise Unavailable(
            f"bubblewrap could not set up the sandbox (exit {rc}); nothing was run",
            hint="run `kbd doctor` to check user namespaces and bubblewrap",
        )
    return code if code is not None else rc
