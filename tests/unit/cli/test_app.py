"""The EXAMPLES in `kbd CMD --help` (docs/cli.md): the commands a newcomer looks
for carry some, and every example parses as the command it shows (no option that
does not exist, no missing argument), so help never teaches a broken line."""

from __future__ import annotations

import shlex

import click
import pytest

from kbd.cli.commands import main

FIRST_DAY = [
    "init", "doctor", "validate", "search", "read", "ls", "mcp", "ui", "serve", "events", "exec", "check", "audit",
    "notes write", "notes review", "session open", "sources attach", "sources access", "writers grant",
    "workflows create", "principals add", "principals token", "units show", "units install",
]  # fmt: skip


def _command(path: str) -> click.Command:
    cmd: click.Command = main
    for name in path.split():
        assert isinstance(cmd, click.Group), path
        cmd = cmd.commands[name]
    return cmd


def _examples(cmd: click.Command) -> list[str]:
    text = cmd.help or ""
    assert "EXAMPLES" in text, f"{cmd.name}: no EXAMPLES in its help"
    block = text.split("EXAMPLES", 1)[1]
    return [line.strip() for line in block.splitlines() if line.strip().startswith(("kbd ", "echo "))]


@pytest.mark.parametrize("path", FIRST_DAY)
def test_each_example_parses_as_its_command(path: str) -> None:
    examples = _examples(_command(path))
    assert examples, path
    for example in examples:
        words = shlex.split(example, comments=True)  # examples space their pipes and redirections
        # The `kbd …` part of a pipeline or redirection.
        start = words.index("kbd")
        end = next(
            (i for i in range(start, len(words)) if words[i] in ("|", ">", "<", ";", "&&")), len(words)
        )
        args = words[start + 1 : end]
        while args[0] in ("--root", "--socket", "--token-file"):  # global options before the command
            args = args[2:]
        cmd: click.Command = main
        while isinstance(cmd, click.Group):
            cmd = cmd.commands[args.pop(0)]
        assert cmd is _command(path), (path, example)
        with cmd.make_context(path, args, resilient_parsing=False) as ctx:
            assert ctx.params is not None, example


def _kbd(*args: str) -> tuple[int, str, str]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    r = subprocess.run([sys.executable, "-m", "kbd", *args], capture_output=True, text=True, timeout=60,
                       env={**env, "KBD_NO_DAEMON": "1", "COLUMNS": "100"}, check=False)  # fmt: skip
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("args", [("notes", "write"), ("session",), ("units", "install"), ()])
def test_kbd_help_prints_what_dash_dash_help_prints(args: tuple[str, ...]) -> None:
    assert _kbd("help", *args) == _kbd(*args, "--help")
    code, out, err = _kbd("help", *args)
    assert code == 0 and out.startswith(f"Usage: {' '.join(('kbd', *args))} ") and err == ""


def test_a_group_named_alone_prints_its_help_not_an_error() -> None:
    code, out, err = _kbd("session")
    assert (code, err) == (0, "") and out == _kbd("session", "--help")[1]


def test_kbd_help_of_a_command_that_does_not_exist_says_which_there_are() -> None:
    code, out, err = _kbd("help", "notes", "nope")
    assert code == 2 and out == "" and "kbd notes has no command 'nope'" in err and "write" in err
