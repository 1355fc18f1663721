"""The ``kbd`` console script. ``kbd exec`` takes a lean path that never imports
click, YAML parsing of unchanged config, pydantic or the API stack: it runs
before every agent shell command (DESIGN §8 budgets its wall time). Everything
else goes to the click CLI in :mod:`kbd.cli`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kbd.boundary import guarded

USAGE = "usage: kbd [--root DIR] exec SID [--cwd DIR] -- CMD [ARG...]"


def _lean_exec(argv: list[str]) -> int | None:
    """Handle ``[--root DIR] exec ...``; None when argv is anything else."""
    root: str | None = None
    i = 0
    if i < len(argv) and argv[i].startswith("--root"):
        if argv[i] == "--root" and i + 1 < len(argv):
            root, i = argv[i + 1], i + 2
        elif argv[i].startswith("--root="):
            root, i = argv[i].split("=", 1)[1], i + 1
        else:
            return None
    if i >= len(argv) or argv[i] != "exec":
        return None
    rest = argv[i + 1 :]
    if not rest or rest[0].startswith("-"):
        return None  # help and usage errors: let click explain
    sid, rest = rest[0], rest[1:]
    cwd = None
    if rest[:1] == ["--cwd"] and len(rest) >= 2:
        cwd, rest = rest[1], rest[2:]
    elif rest[:1] and rest[0].startswith("--cwd="):
        cwd, rest = rest[0].split("=", 1)[1], rest[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    elif rest[:1] and rest[0].startswith("-"):
        return None  # any other option (--as, --help): the full CLI parses it
    if not rest:
        return None
    return guarded(lambda: _run_exec(root, sid, rest, cwd))


def _run_exec(root: str | None, sid: str, command: list[str], cwd: str | None) -> int:
    from kbd.core.principals import LocalOperator, named_principal

    # An empty KBD_AS is a usage error before anything starts.
    named = named_principal(None, os.environ.get("KBD_AS"))
    # Then the command's cgroup, which takes an RCU grace period to enter: a
    # helper thread pays it while the imports, config load and plan lookup below
    # run (run() undoes it when the command is refused).
    from kbd.sandbox.cgroup import Preparation

    prepared = Preparation.start_for(sid)
    from kbd.core.config import default_root
    from kbd.service.execute import run

    # Without --as / KBD_AS the caller is the trusted local operator of the root.
    actor = named if named is not None else LocalOperator.current()
    return run(Path(root) if root else default_root(), sid, command, actor=actor, cwd=cwd, prepared=prepared)


def main() -> None:
    code = _lean_exec(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from kbd.cli import main as cli_main

    cli_main(prog_name="kbd")
