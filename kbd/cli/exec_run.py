"""Running a parsed ``kbd exec``: through the daemon's exec broker when one is
reachable (docs/daemon.md "The exec broker"), else in this process. Shared by the
lean path (:mod:`kbd.cli.entry`) and the click command."""

from __future__ import annotations

import os

# Not ``typing.TYPE_CHECKING``: ``typing`` costs ≈7 ms of imports on the lean path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

    from kbd.cli.exec_grammar import ExecArgs


def run_exec(
    root: Path | str | None,
    request: ExecArgs,
    *,
    daemon: bool = True,
    token: str | None = None,
    root_named: bool = True,
) -> int:
    """Run a parsed ``kbd exec`` in ``root`` (None: the default root); the
    command's exit status. Through the daemon when one is reachable (docs/daemon.md; ``daemon=False``: already
    found unreachable), else in this process.
    ``root_named``: ``root`` came from ``--root``/``KBD_ROOT``, not a guess."""
    if daemon:
        code = through_daemon(root if root_named else None, request, token=token, where=root)
        if code is not None:
            return code
    from pathlib import Path

    from kbd.core.principals import LocalOperator, named_principal

    # An empty --as / KBD_AS is a usage error before anything starts.
    named = named_principal(request.as_, os.environ.get("KBD_AS"))
    # Then the command's cgroup, which takes an RCU grace period to enter: a
    # helper thread pays it while the imports, config load and plan lookup below
    # run (run() undoes it when the command is refused).
    from kbd.sandbox.cgroup import Preparation

    prepared = Preparation.start_for(request.sid)
    from kbd.core.config import default_root
    from kbd.service.execute import run

    # Without --as / KBD_AS the caller is the trusted local operator of the root.
    actor = named if named is not None else LocalOperator.current()
    return run(Path(root) if root is not None else default_root(), request.sid, list(request.command), actor=actor,
               cwd=request.cwd, prepared=prepared, strict=request.strict, report_json=request.json)  # fmt: skip


def through_daemon(
    root: Path | str | None, request: ExecArgs, *, token: str | None = None, where: Path | str | None = None
) -> int | None:
    """Run ``request`` through the daemon's exec broker: the one named by
    ``--socket`` or ``KBD_SOCKET`` (which must answer: else 69, or 77 when it
    refuses this user), else the root's default socket when a daemon listens
    there. None: run in-process (no daemon there, ``KBD_NO_DAEMON=1``, a
    closed stdio descriptor, or an empty ``--as``/``KBD_AS``, which the
    in-process path refuses as a usage error).

    ``root``: the one ``--root`` named (else ``KBD_ROOT``), the only root sent
    to the daemon, which refuses a root it does not serve; with none named it
    serves its own (docs/multi-user.md "The CLI through the daemon": a service root
    elsewhere than /var/lib/kbd is reached through ``KBD_SOCKET``, by users
    who cannot name it). ``where``: the root whose default socket is used
    when no socket is named (default: ``root``, else the one kbd would choose)."""
    if os.environ.get("KBD_NO_DAEMON") == "1":
        return None
    as_ = request.as_ if request.as_ is not None else os.environ.get("KBD_AS")
    if as_ is not None and not as_.strip():
        return None
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return None
    from kbd.client import brokered as thin

    explicit = request.socket if request.socket is not None else os.environ.get("KBD_SOCKET") or None
    named = str(root) if root is not None else os.environ.get("KBD_ROOT") or None
    if where is None:
        where = named if named is not None else thin.chosen_root(os.environ)
    env = {name: os.environ[name] for name in ("LANG", "TERM") if name in os.environ}
    return thin.run(explicit or thin.default_socket(str(where)), request.sid, request.command,
                    explicit=explicit is not None, cwd=request.cwd, as_principal=as_,
                    root=os.path.abspath(named) if named is not None else None, env=env,
                    token=token or os.environ.get("KBD_TOKEN") or None, flags=request.flags)  # fmt: skip
