"""Man pages made from the CLI's own definitions (``make man``): one page per
command, its usage, help text and options exactly as ``--help`` states them,
so a page can never drift from the command. Pages are built, never committed."""

from __future__ import annotations

import datetime
import re

import click

from kbd.cli.commands import main

SECTION = "1"


def _escape(text: str) -> str:
    """Text as roff reads it literally: backslashes doubled, a line starting
    with a control character ('.' or "'") guarded."""
    text = text.replace("\\", "\\e")
    return "\n".join(("\\&" + line) if line[:1] in (".", "'") else line for line in text.splitlines())


def _paragraphs(text: str) -> str:
    """click's help text: blank lines part paragraphs; a ``\\b`` block keeps its lines."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        if block.startswith("\b"):
            out.append(".nf\n" + _escape(block.removeprefix("\b").strip("\n")) + "\n.fi")
        else:
            out.append(_escape(" ".join(line.strip() for line in block.splitlines())))
    return "\n.PP\n".join(out)


def commands() -> list[tuple[list[str], click.Command]]:
    """Every command and group under ``kbd``, as (its words, the command)."""
    found: list[tuple[list[str], click.Command]] = []

    def walk(words: list[str], cmd: click.Command) -> None:
        found.append((words, cmd))
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                sub = cmd.commands[name]
                if not sub.hidden:
                    walk([*words, name], sub)

    walk(["kbd"], main)
    return found


def page(words: list[str], cmd: click.Command, *, date: str | None = None) -> str:
    """The roff source of the man page of ``cmd`` (``words``: ``kbd sources attach``)."""
    name = "-".join(words)
    parent = None
    for w in words[:-1]:
        parent = click.Context(main if parent is None else parent.command, info_name=w, parent=parent)
    ctx = click.Context(cmd, info_name=words[-1], parent=parent)
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    when = date or datetime.date.today().isoformat()
    lines = [
        f'.TH "{name.upper()}" "{SECTION}" "{when}" "kbd" "kbd manual"',
        ".SH NAME",
        f"{name} \\- {_escape(cmd.get_short_help_str(limit=200))}",
        ".SH SYNOPSIS",
        f".B {' '.join(words)}\n{_escape(usage)}",
    ]
    if cmd.help:
        lines += [".SH DESCRIPTION", _paragraphs(cmd.help)]
    options = [p.get_help_record(ctx) for p in cmd.get_params(ctx) if isinstance(p, click.Option)]
    records = [r for r in options if r is not None]
    if records:
        lines.append(".SH OPTIONS")
        for term, text in records:
            lines += [".TP", f".B {_escape(term)}", _escape(text) if text else ""]
    if isinstance(cmd, click.Group):
        subs = sorted(n for n, c in cmd.commands.items() if not c.hidden)
        lines += [".SH COMMANDS"]
        for sub in subs:
            lines += [".TP", f".B {sub}", _escape(cmd.commands[sub].get_short_help_str(limit=200))]
        lines += [".SH SEE ALSO", ", ".join(f"\\fB{name}-{s}\\fR({SECTION})" for s in subs)]
    return "\n".join(lines) + "\n"


def pages(*, date: str | None = None) -> dict[str, str]:
    """File name → roff source, for every command."""
    return {f"{'-'.join(words)}.{SECTION}": page(words, cmd, date=date) for words, cmd in commands()}
