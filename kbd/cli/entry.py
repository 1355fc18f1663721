"""The ``kbd`` console script. ``kbd exec`` takes a lean path that never imports
click, YAML parsing of unchanged config, pydantic or the API stack: it runs
before every agent shell command (docs/performance.md budgets its wall time). Everything
else goes to the click CLI in :mod:`kbd.cli.commands`. The exec grammar is
:mod:`kbd.cli.exec_grammar`, its runner :mod:`kbd.cli.exec_run`.
"""

from __future__ import annotations

import os
import sys

from kbd.cli.exec_grammar import parse_exec, wants_help
from kbd.cli.exec_run import run_exec, through_daemon
from kbd.errors import UsageError

# Not ``typing.TYPE_CHECKING``: nothing else on the brokered path loads
# ``typing``, and it costs ≈7 ms (re, enum, collections) per command. mypy
# treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

# Through the daemon, ``kbd exec`` is a thin client whose start-up is most of
# its cost: dataclasses, pathlib and the boundary's signal module (≈ 20 ms
# under load) are imported only on the paths that need them.


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
            code = through_daemon(root, request)
        except BaseException as exc:  # answered by the boundary, as every error is
            from kbd.cli.boundary import guarded

            error = exc

            def reraise() -> int:
                raise error

            return guarded(reraise)
        if code is not None:
            end_brokered(code)
    from kbd.cli.boundary import guarded

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
    from kbd.cli.commands import run

    run()
