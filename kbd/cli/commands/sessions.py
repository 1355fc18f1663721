"""``kbd session`` (open, show, revoke, env, list, close), ``kbd exec`` and ``kbd check``."""

from __future__ import annotations

import shlex
import sys

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    ExecCommand,
    as_option,
    complete_sessions,
    complete_workflows,
    emit,
    json_option,
    main,
    pass_ctx,
)
from kbd.cli.exec_grammar import ExecArgs
from kbd.cli.exec_run import run_exec
from kbd.core.identifiers import one_line
from kbd.core.pathguard import PathCheck
from kbd.core.plan import Plan
from kbd.core.policy import KB_ACCESS, KINDS
from kbd.errors import (
    SessionClosed,
)

# -- sessions ----------------------------------------------------------------------------


def _print_plan(d: Plan) -> None:
    click.echo(
        f"session {d.session_id}  workflow {one_line(d.workflow_id)}  kind {d.kind}  "
        f"kb_access {d.kb_access} (effective {d.effective})  generation {d.generation}"
    )
    click.echo("environment:")
    for k, v in sorted(d.env.items()):
        click.echo(f"  {k}={v}")
    for label, paths in (
        ("read", d.read),
        ("write", d.write),
        ("read-only inside writable", d.read_only),
        ("hidden", d.hidden),
    ):
        click.echo(f"{label}:")
        for p in paths:
            click.echo(f"  {p}")
        if not paths:
            click.echo("  -")
    click.echo("context block:")
    for line in d.context.splitlines():
        click.echo(f"  | {line}")


@main.group()
def session() -> None:
    """Shell/agent sessions and their plans."""


@session.command("open")
@click.argument("wf", shell_complete=complete_workflows)
@click.option(
    "--kind", type=click.Choice(KINDS), help="Required unless --parent (default: the parent's kind)."
)
@click.option(
    "--kb-access", type=click.Choice(KB_ACCESS), default=None, help="Default: read (a child: its parent's)."
)
@click.option(
    "--item-kb-write", is_flag=True, default=None, help="message_sequence: the item asks for KB write."
)
@click.option(
    "--parent", metavar="SID", shell_complete=complete_sessions, help="Open a copied child of this session."
)
@as_option
@json_option
@pass_ctx
def session_open(
    c: Ctx,
    wf: str,
    kind: str | None,
    kb_access: str | None,
    item_kb_write: bool | None,
    parent: str | None,
    as_: str | None,
    as_json: bool,
) -> None:
    """Open a session for WF and print its plan.

    \b
    EXAMPLES
      kbd session open research --kind builder
      kbd session open research --kind execution --kb-access read-write --json
    """
    if kind is None and parent is None:
        # Exactly click's answer for a required option: only a child may leave it out.
        ctx = click.get_current_context()
        raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == "kind"))
    op = ops.SessionOpen(wf, kind, kb_access, item_kb_write or None, parent)
    if (plan := c.shown(op, as_, as_json)) is not None:
        _print_plan(plan)


@session.command("show")
@click.argument("sid", shell_complete=complete_sessions)
@as_option
@json_option
@pass_ctx
def session_show(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """The session's plan, rebuilt from saved configuration now."""
    if (view := c.shown(ops.SessionShow(sid), as_, as_json)) is None:
        return
    _print_plan(view.plan)
    for r in view.running:
        p = r.process
        mark = f"  STALE: started under generation {p.generation}, grants since changed" if r.stale else ""
        click.echo(f"running: pid {p.pid} {' '.join(p.argv)[:60]}{mark}")


@session.command("revoke")
@click.argument("sid", shell_complete=complete_sessions)
@click.option(
    "--immediate",
    is_flag=True,
    help="Terminate commands running under an older plan (SIGTERM, grace, SIGKILL).",
)
@as_option
@json_option
@pass_ctx
def session_revoke(c: Ctx, sid: str, immediate: bool, as_: str | None, as_json: bool) -> None:
    """Handle commands still running with grants the session no longer has."""
    if (result := c.shown(ops.SessionRevoke(sid, immediate), as_, as_json)) is None:
        return
    for pid in result.terminated:
        click.echo(f"terminated process group {pid}")
    for pid in result.still_running:
        click.echo(f"STILL RUNNING with old grants: process group {pid} (use --immediate to terminate it)")
    if not result.terminated and not result.still_running:
        click.echo("no command is running under an older plan")


@session.command("env")
@click.argument("sid", shell_complete=complete_sessions)
@as_option
@json_option
@pass_ctx
def session_env(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """The session's environment, as `export` lines (eval-able) or JSON."""
    if (result := c.shown(ops.SessionEnv(sid), as_, as_json)) is None:
        return
    for k, v in sorted(result.env.items()):
        click.echo(f"export {k}={shlex.quote(v)}")


@session.command("list")
@click.option("--workflow", "wf", metavar="WF", shell_complete=complete_workflows)
@click.option("--all", "include_closed", is_flag=True, help="Include closed sessions.")
@as_option
@json_option
@pass_ctx
def session_list(c: Ctx, wf: str | None, include_closed: bool, as_: str | None, as_json: bool) -> None:
    """Sessions (with --as: only those that principal may use)."""
    if (result := c.shown(ops.SessionList(wf, include_closed), as_, as_json)) is None:
        return
    if not result.sessions:
        click.echo("no sessions" if include_closed else "no open sessions (--all shows closed ones too)")
    for r in result.sessions:
        click.echo(
            f"{r.id}  {one_line(r.workflow_id):<20} {r.kind:<22} {r.kb_access:<10} "
            f"gen {r.generation}{'  closed' if r.closed_at is not None else ''}"
        )


@session.command("close")
@click.argument("sid", shell_complete=complete_sessions)
@as_option
@json_option
@pass_ctx
def session_close(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """Close SID (and its child sessions): they grant nothing afterwards."""
    if (result := c.shown(ops.SessionClose(sid), as_, as_json)) is not None:
        click.echo(f"closed {', '.join(result.closed) or 'nothing (already closed)'}")


@main.command("exec", cls=ExecCommand)
@click.argument("sid", shell_complete=complete_sessions)
@click.option("--cwd", metavar="DIR", help="Run in DIR (inside the session's workflow folder).")
@as_option
@click.option(
    "--socket",
    metavar="PATH",
    help="Run it through the kbd daemon at PATH (default: $KBD_SOCKET, else the root's socket when a daemon "
    "listens there; KBD_NO_DAEMON=1 runs in-process).",
)
@click.option(
    "--strict-contributions",
    is_flag=True,
    help="Exit 65 when a change the command made to a source's notes/ is refused at commit.",
)
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help="Also print, on stderr, the contributions report and the sandbox's refusals as JSON lines.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctx
def exec_cmd(c: Ctx, request: ExecArgs) -> None:
    """Run COMMAND under SID's current plan in a fresh sandbox; exit with its status.

    \b
    EXAMPLES
      kbd exec SID -- sh -c 'ls "$WORKFLOW_KB_RTS"/notes'
      kbd exec SID --cwd knowledgebase -- grep -r latency .
    """
    if request.socket is None and c.socket is not None:
        request = request.with_socket(c.socket)
    token = ops.read_token_file(c.token_file) if c.token_file is not None else None
    if token is not None and request.socket is None:
        # A token is for the daemon: never fall back to running in-process.
        request = request.with_socket(str(ops.socket_of(c.root)))
    sys.exit(run_exec(c.root, request, token=token, root_named=c.root_named))


@main.command("check")
@click.argument("sid", shell_complete=complete_sessions)
@click.argument("path")
@click.option("--mode", type=click.Choice(["read", "write"]), required=True)
@as_option
@json_option
@pass_ctx
def check_cmd(c: Ctx, sid: str, path: str, mode: str, as_: str | None, as_json: bool) -> None:
    """May session SID read/write PATH? Exit 0 when allowed, 77 when not.

    \b
    EXAMPLES
      kbd check SID "$WORKFLOW_KB_RTS/notes/x.md" --mode write
    """
    try:
        result = c.result(ops.Check(sid, path, mode), as_)
    except SessionClosed as err:
        # Still the contract's answer on stdout: a closed session grants nothing.
        result = PathCheck(allowed=False, reason=err.message)
    if as_json:
        emit(result)
    else:
        click.echo(f"{'allowed' if result.allowed else 'denied'}: {result.reason}")
    if not result.allowed:
        sys.exit(77)
