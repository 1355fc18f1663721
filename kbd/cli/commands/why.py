"""``kbd why`` and ``kbd preview``: why a session may or may not touch a path, or why an attachment would not be
usable, and the smallest change that would allow it (docs/access.md "Why: explaining a decision")."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    complete_sessions,
    complete_workflows,
    emit,
    json_option,
    main,
    pass_ctx,
)
from kbd.core.identifiers import one_line
from kbd.core.why import Why
from kbd.errors import InvalidInput, NotFound


class _WhyGroup(click.Group):
    """``kbd why SID PATH`` is ``kbd why path SID PATH``: a first word that is not a
    subcommand (a session ID never is) names the session."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["path", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_WhyGroup)
def why() -> None:
    """Why a session may or may not read/write a path, and what would allow it.

    \b
    kbd why SID PATH [--mode read|write]     (the same as: kbd why path SID PATH)
    kbd why attach WF SOURCE [--access read|write]
    Exit 0 when allowed, 77 when refused.

    \b
    EXAMPLES
      kbd why s_0123456789abcdef0123.1.deadbeef cost:notes/x.md --mode write
      kbd why attach research cost --access write
    """


@why.command("path")
@click.argument("sid", shell_complete=complete_sessions)
@click.argument("path")
@click.option("--mode", type=click.Choice(["read", "write"]), default="read", show_default=True)
@as_option
@json_option
@pass_ctx
def why_path(c: Ctx, sid: str, path: str, mode: str, as_: str | None, as_json: bool) -> None:
    """Why session SID may or may not MODE PATH.

    PATH: a host path, a path as the sandbox sees it (relative: to the workflow folder),
    $WORKFLOW_KB_<ALIAS>/RELPATH, or ALIAS:RELPATH.

    \b
    EXAMPLES
      kbd why path s_0123456789abcdef0123.1.deadbeef '$WORKFLOW_KB_COST/context/a.md' --mode write
    """
    _answer(c.result(ops.Why(sid, path, mode), as_), as_json)


@why.command("attach")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("source", shell_complete=complete_workflows)
@click.option("--access", type=click.Choice(["read", "write"]), default="read", show_default=True)
@as_option
@json_option
@pass_ctx
def why_attach(c: Ctx, wf: str, source: str, access: str, as_: str | None, as_json: bool) -> None:
    """Would SOURCE attached to WF with ACCESS be usable? Asked before attaching.

    \b
    EXAMPLES
      kbd why attach research cost --access write
    """
    _answer(c.result(ops.WhyAttach(wf, source, access), as_), as_json, attach=(wf, source))


def _answer(answer: Why, as_json: bool, *, attach: tuple[str, str] | None = None) -> None:
    """Print ``answer`` (as text or ``--json``); exit 77 when refused, as ``kbd check`` does."""
    if as_json:
        emit(answer)
    else:
        _print(answer, attach)
    if not answer.allowed:
        sys.exit(77)


def _print(answer: Why, attach: tuple[str, str] | None) -> None:
    what = (
        f"{attach[1]} attached to {attach[0]} ({answer.mode})" if attach else f"{answer.mode} {answer.path}"
    )
    if answer.allowed:
        by = answer.granted_by
        where = "" if by is None else f" (granted by {by.kind}" + (f" {by.alias}" if by.alias else "") + (
            f", {by.workflow_id}" if by.workflow_id and by.kind != "own" else "") + ")"  # fmt: skip
        click.echo(f"allowed: {one_line(what, limit=300)}{where}")
        return
    click.echo(f"refused: {one_line(what, limit=300)}")
    for r in answer.reasons:
        click.echo(f"  - {r.code}: {one_line(r.message, limit=400)}")
    if answer.fix is not None:
        for i, step in enumerate(answer.fix.steps):
            who = f"   (by {', '.join(step.by)})" if step.by else ""
            click.echo(f"{'fix' if i == 0 else '  then'}: {one_line(step.command, limit=400)}{who}")
    elif answer.no_fix:
        click.echo(f"fix: {one_line(answer.no_fix, limit=300)}")


@main.command("preview")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@as_option
@json_option
@pass_ctx
def preview_cmd(c: Ctx, file: str, as_: str | None, as_json: bool) -> None:
    """What saving FILE (a hand-edited workflow.json) would change: the sessions that would gain
    or lose grants, the running commands that would be ended or marked stale, and the attachments
    that would change. Nothing is changed.

    \b
    EXAMPLES
      kbd preview ~/edits/research.workflow.json
    """
    from kbd.cli.preview_text import preview_lines

    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise NotFound(f"{file} does not exist", hint="name a workflow.json, or - for stdin") from None
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{file} is not UTF-8 text", hint="a workflow.json is JSON text") from None
    preview = c.result(ops.PreviewManifest(text), as_)
    if as_json:
        emit(preview)
        return
    for line in preview_lines(preview):
        click.echo(line)
