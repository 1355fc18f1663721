"""The ``kbd`` console script. ``kbd exec`` takes a lean path that never imports
click, YAML parsing of unchanged config, pydantic or the API stack: it runs
before every agent shell command (DESIGN §8 budgets its wall time). Everything
else goes to the click CLI in :mod:`kbd.cli`.

The grammar of ``kbd exec`` is here, once (:func:`parse_exec`): the lean path
and the click command both parse with it and run with :func:`run_exec`, so a
malformed invocation gets the same error and exit code whichever path sees it.
"""

from __future__ import annotations

import os
import sys

from kbd.errors import UsageError

# Not ``typing.TYPE_CHECKING``: nothing else on the brokered path loads
# ``typing``, and it costs ≈7 ms (re, enum, collections) per command. mypy
# treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path
    from typing import NoReturn

# Through the daemon, ``kbd exec`` is a thin client whose start-up is most of
# its cost: dataclasses, pathlib and the boundary's signal module (≈ 20 ms
# under load) are imported only on the paths that need them.

EXEC_USAGE = "kbd exec SID [--cwd DIR] [--as P] [--strict-contributions] [--json] -- CMD [ARG...]"
HELP_FLAGS = ("-h", "--help")
# exec's own options; each takes a value (``--cwd DIR`` or ``--cwd=DIR``).
EXEC_OPTIONS = ("--cwd", "--as", "--socket")
#: exec's options that take no value (README "Staged contributions").
EXEC_FLAGS = ("--strict-contributions", "--json")
_SEE_HELP = "see `kbd exec --help`"


class ExecArgs:
    """One ``kbd exec`` invocation: the session, the command and exec's options
    (plain data, compared by value; not a dataclass, for import time)."""

    __slots__ = ("as_", "command", "cwd", "json", "sid", "socket", "strict")

    def __init__(
        self,
        sid: str,
        command: tuple[str, ...],
        cwd: str | None = None,
        as_: str | None = None,
        socket: str | None = None,  # the daemon to run it through (else KBD_SOCKET, else the root's socket)
        strict: bool = False,  # --strict-contributions
        json: bool = False,  # --json: the contributions report as a JSON line on stderr
    ) -> None:
        self.sid, self.command, self.cwd, self.as_, self.socket = sid, command, cwd, as_, socket
        self.strict, self.json = strict, json

    def with_socket(self, socket: str | None) -> ExecArgs:
        return ExecArgs(self.sid, self.command, cwd=self.cwd, as_=self.as_, socket=socket, strict=self.strict,
                        json=self.json)  # fmt: skip

    @property
    def flags(self) -> int:
        """The wire's flags byte (kbd.core.wire FLAG_STRICT, FLAG_JSON)."""
        return (1 if self.strict else 0) | (2 if self.json else 0)

    def _key(self) -> tuple[object, ...]:
        return (self.sid, self.command, self.cwd, self.as_, self.socket, self.strict, self.json)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExecArgs) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"ExecArgs(sid={self.sid!r}, command={self.command!r}, cwd={self.cwd!r}, as_={self.as_!r}, "
                f"socket={self.socket!r}, strict={self.strict!r}, json={self.json!r})")  # fmt: skip


def _take_options(args: Sequence[str], i: int, values: dict[str, str]) -> int | None:
    """Read exec's options from ``args[i:]`` into ``values`` (a later one wins);
    the index of the first word after them (past a ``--``, which ends them), or
    None when help is asked for."""
    while i < len(args):
        word = args[i]
        if word == "--":
            return i + 1
        if word in HELP_FLAGS:
            return None
        if word == "-" or not word.startswith("-"):
            return i
        if word in EXEC_FLAGS:
            values[word] = "1"
            i += 1
            continue
        name, has_value, value = word.partition("=")
        if name in EXEC_FLAGS:
            raise UsageError(f"Option '{name}' does not take a value.", hint=_SEE_HELP)
        if name not in EXEC_OPTIONS:
            # Never a command: `kbd exec SID --bogus` must not run `--bogus`.
            raise UsageError(
                f"No such option '{name}'.", hint=f"{EXEC_USAGE} (the command's own options go after --)"
            )
        if not has_value:
            if i + 1 >= len(args) or args[i + 1] == "--":
                raise UsageError(f"Option '{name}' requires an argument.", hint=_SEE_HELP)
            value, i = args[i + 1], i + 1
        values[name] = value
        i += 1
    return i


def parse_exec(args: Sequence[str]) -> ExecArgs | None:
    """Parse what follows ``exec``: ``[OPTIONS] SID [OPTIONS] [--] CMD [ARG...]``.

    None when the invocation asks for help (``-h``/``--help`` where an option
    may stand: the click command prints it). A malformed invocation is a
    UsageError (exit 2) naming what is wrong; its messages for a missing SID or
    command are click's, as they always were."""
    values: dict[str, str] = {}
    i = _take_options(args, 0, values)
    if i is None:
        return None
    if i >= len(args):
        raise UsageError("Missing argument 'SID'.", hint=_SEE_HELP)
    sid = args[i]
    if i + 1 >= len(args):
        raise UsageError("Missing argument 'COMMAND...'.", hint=_SEE_HELP)
    j = _take_options(args, i + 1, values)
    if j is None:
        return None
    if j >= len(args):
        raise UsageError("no command given", hint=EXEC_USAGE)
    if values.get("--socket") == "":
        raise UsageError("--socket was given an empty path", hint="pass --socket PATH, or leave --socket out")
    return ExecArgs(
        sid,
        tuple(args[j:]),
        cwd=values.get("--cwd"),
        as_=values.get("--as"),
        socket=values.get("--socket"),
        strict="--strict-contributions" in values,
        json="--json" in values,
    )


def wants_help(args: Sequence[str]) -> bool:
    try:
        return parse_exec(args) is None
    except UsageError:
        return False


def run_exec(
    root: Path | str | None,
    request: ExecArgs,
    *,
    daemon: bool = True,
    token: str | None = None,
    root_named: bool = True,
) -> int:
    """Run a parsed ``kbd exec`` in ``root`` (None: the default root); the
    command's exit status. Through the daemon when one is reachable (DESIGN
    §9; ``daemon=False``: already found unreachable), else in this process.
    ``root_named``: ``root`` came from ``--root``/``KBD_ROOT``, not a guess."""
    if daemon:
        code = _through_daemon(root if root_named else None, request, token=token, where=root)
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


def _through_daemon(
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
    serves its own (README "The CLI through the daemon": a service root
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
    from kbd import thin

    explicit = request.socket if request.socket is not None else os.environ.get("KBD_SOCKET") or None
    named = str(root) if root is not None else os.environ.get("KBD_ROOT") or None
    if where is None:
        where = named if named is not None else thin.chosen_root(os.environ)
    env = {name: os.environ[name] for name in ("LANG", "TERM") if name in os.environ}
    return thin.run(explicit or thin.default_socket(str(where)), request.sid, request.command,
                    explicit=explicit is not None, cwd=request.cwd, as_principal=as_,
                    root=os.path.abspath(named) if named is not None else None, env=env,
                    token=token or os.environ.get("KBD_TOKEN") or None, flags=request.flags)  # fmt: skip


def _split_root(argv: list[str]) -> tuple[str | None, list[str]] | None:
    """``[--root DIR] exec ARGS`` → (the root, ARGS); None when argv is another
    command, or a root click refuses (empty, or not a folder: its answer is the
    one both paths give)."""
    root: str | None = None
    i = 0
    if argv[:1] == ["--root"] and len(argv) >= 2:
        root, i = argv[1], 2
    elif argv[:1] and argv[0].startswith("--root="):
        root, i = argv[0].split("=", 1)[1], 1
    if argv[i : i + 1] != ["exec"]:
        return None
    given = root if root is not None else os.environ.get("KBD_ROOT") or None
    if given is not None and (given == "" or (os.path.exists(given) and not os.path.isdir(given))):
        return None
    return (root or None), argv[i + 1 :]


def _lean_exec(argv: list[str]) -> int | None:
    """Handle ``[--root DIR] exec ...``; None when argv is anything else (or asks
    for help, which click renders from the exec command's parameters). A
    reachable daemon runs it before the boundary (and its imports) is loaded;
    the thin client prints its own errors exactly as the boundary would, and
    the process ends here with the command's status (:func:`end_brokered`)."""
    split = _split_root(argv)
    if split is None or wants_help(split[1]):
        return None
    root, args = split
    try:
        request = parse_exec(args)
    except UsageError:
        request = None  # the boundary below prints it
    if request is not None:
        try:
            code = _through_daemon(root, request)
        except BaseException as exc:  # answered by the boundary, as every error is
            from kbd.boundary import guarded

            error = exc

            def reraise() -> int:
                raise error

            return guarded(reraise)
        if code is not None:
            end_brokered(code)
    from kbd.boundary import guarded

    return guarded(lambda: _parse_and_run(root, args))


def end_brokered(code: int) -> NoReturn:
    """Exit with a brokered command's status, skipping the interpreter's
    teardown (≈1-3 ms of freeing modules, paid after the command ended). Safe
    here only: the thin client starts no thread and registers nothing to run
    at exit, and its only buffered output is stderr (kbd's notices and error
    lines), flushed first. The in-process path keeps ``sys.exit``: its helper
    threads and locks must be wound down."""
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib is one more import on this path
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)


def _parse_and_run(root: str | None, args: list[str]) -> int:
    request = parse_exec(args)
    assert request is not None  # help never comes here (see _lean_exec)
    return run_exec(root, request, daemon=False)


def main() -> None:
    code = _lean_exec(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from kbd.cli import run

    run()
