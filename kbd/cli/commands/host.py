"""Host commands: ``init``, ``doctor``, ``validate``, ``serve``, ``audit``, ``events``, ``completion``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import orjson

from kbd import ops
from kbd.cli.app import (
    Ctx,
    complete_workflows,
    emit,
    json_option,
    main,
    pass_ctx,
    write_stdout,
)
from kbd.core.identifiers import one_line
from kbd.errors import (
    InvalidInput,
    KbdError,
    UsageError,
)
from kbd.service import JsonObject

if TYPE_CHECKING:
    from kbd.service import admin

# -- init / doctor / validate ---------------------------------------------------


@main.command()
@click.option("--demo", is_flag=True, help="Add example principals and workflows with KB content.")
@click.option("--host", "host_name", metavar="NAME", help="This execution host's name (default: hostname).")
@click.option("--force", is_flag=True, help="Rewrite kbd.yaml and principals.yaml of an existing root.")
@click.option("--system", is_flag=True, help="A service host's root: groups, owners, modes, the grant group.")
@click.option(
    "--group", default="kbd", show_default=True, help="With --system: the group that may reach the socket."
)
@click.option("--grant-group", default="kbd-grant", show_default=True,
              help="With --system: the member-less group sandboxed commands get.")  # fmt: skip
@json_option
@pass_ctx
def init(
    c: Ctx, demo: bool, host_name: str | None, force: bool, system: bool, group: str, grant_group: str,
    as_json: bool,
) -> None:  # fmt: skip
    """Create a kbd root (kbd.yaml, principals.yaml, workflows/, state/).

    \b
    EXAMPLES
      kbd init --demo
      kbd --root /var/lib/kbd init --system --host "$(hostname)"
    """
    from kbd.service import admin

    layout = admin.SystemLayout(group, grant_group) if system else None
    result = admin.init(c.root, host=host_name, force=force, demo=demo, system=layout)
    for name in result.groups_created or ():
        click.echo(f"kbd: created group {name} (groupadd --system)", err=True)
    if result.layout_only:
        click.echo(
            f"kbd: {c.root} is already a kbd root: kept its config, applied groups, owners and modes",
            err=True,
        )
    if as_json:
        emit(result.to_json())
        return
    if result.replaced:
        click.echo(
            "kbd: WARNING: --force rewrote kbd.yaml and principals.yaml; earlier principals, tokens and "
            "uid mappings are gone",
            err=True,
        )
    click.echo(f"initialised kbd root {result.root} (host {result.host})")
    for wid in result.demo_workflows:
        click.echo(f"  demo workflow {wid}")


@main.command()
@click.option(
    "--workflow",
    "workflow_id",
    metavar="WF",
    shell_complete=complete_workflows,
    help="also check the KBs WF's sessions can read (its own and its sources') for multi-link files",
)
@json_option
@pass_ctx
def doctor(c: Ctx, as_json: bool, workflow_id: str | None) -> None:
    """Check the root, its config, principals and registry health.

    Through the daemon (a root you cannot use yourself): whether you reach it
    and as whom, and for admins the daemon's own checks of its root.

    \b
    EXAMPLES
      kbd doctor
      kbd doctor --workflow research --json
    """
    from kbd.service import admin

    b = c.via
    if isinstance(b, ops.Remote):
        report = ops.remote_doctor(b, workflow_id)
    else:
        report = admin.doctor(c.root, workflow_id=workflow_id)
    if as_json:
        emit(report)
    else:
        for ch in report.checks:
            click.echo(f"{'ok  ' if ch.ok else 'FAIL'} {ch.check}: {one_line(ch.detail, limit=10_000)}")
    if not report.ok:
        sys.exit(65)


@main.command()
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False), required=False)
@click.option(
    "--schema",
    is_flag=True,
    help="Print workflow.json's JSON Schema (the rules an editor can check) instead.",
)
@json_option
def validate(file: Path | None, schema: bool, as_json: bool) -> None:
    """Validate a workflow.json file (syntax and field rules, not reachability).

    Every problem of every entry is listed, one per line (``FILE: where: problem``)
    on stdout; with --json the answer is always JSON, errors included. --schema
    prints the JSON Schema (docs/workflow.schema.json): it refuses nothing this
    command accepts, and this command checks a few rules more.

    \b
    EXAMPLES
      kbd validate workflows/research/workflow.json
      kbd validate ./workflow.json --json
      kbd validate --schema > workflow.schema.json
    """
    from kbd.service import admin

    if schema:
        if file is not None:
            raise UsageError("--schema takes no FILE")
        from kbd.core.manifest_schema import schema_text

        write_stdout(schema_text().encode())
        return
    if file is None:
        raise UsageError("missing argument FILE (a workflow.json), or --schema")

    try:
        result = admin.validate(file)
    except KbdError as err:
        if as_json:
            emit(admin.unreadable_json(file, err))
        raise
    if as_json:
        emit(result.to_json())
    else:
        for p in result.problems:
            click.echo(f"{file}: {one_line(p, limit=1000)}")
    if result.problems:
        raise InvalidInput(
            f"{file}: {len(result.problems)} problem(s)" + ("" if as_json else ", one per line above"),
            hint="each problem names the entry and the field",
        )
    if not as_json:
        click.echo(f"{file}: valid ({result.entries} sources)")


# -- daemon ------------------------------------------------------------------------------


@main.command("serve")
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    help="Default: kbd.yaml socket, else state/run/kbd.sock.",
)
@click.option(
    "--fd", type=int, help="Serve on an inherited listening socket (systemd passes LISTEN_FDS itself)."
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    envvar="KBD_LOG_LEVEL",
    help="Least severe records logged (info: one access line per request). $KBD_LOG_LEVEL.",
)
@pass_ctx
def serve_cmd(c: Ctx, socket_path: Path | None, fd: int | None, log_level: str) -> None:
    """Run the daemon: the HTTP API on a Unix socket (0660, group kbd if it exists).
    Logs go to journald when systemd runs it, else to stderr.

    \b
    EXAMPLES
      kbd serve --socket /tmp/kbd.sock
      kbd serve --fd 3   # under systemd socket activation
    """
    from kbd.daemon.journal import parse_level
    from kbd.daemon.server import serve  # the API stack is imported only by the daemon
    from kbd.service.root import Root

    serve(Root(c.root, sweep_interval=1.0), socket_path=socket_path, fd=fd, log_level=parse_level(log_level))


# -- audit ------------------------------------------------------------------------------


@main.command("audit")
@click.option(
    "--since",
    metavar="WHEN",
    help="Only records from WHEN on: a duration back from now (10m, 2h, 7d) or an ISO time (UTC if no zone).",
)
@click.option(
    "--workflow",
    "wf",
    metavar="WF",
    shell_complete=complete_workflows,
    help="Only records touching WF (or one of its sessions).",
)
@click.option("--actor", metavar="P", help="Only records of actions by P (a principal, or local:USER).")
@click.option("--event", "events", metavar="E", multiple=True,
              help="Only records of event E (repeatable; a shell pattern such as 'note_*').")  # fmt: skip
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records until Ctrl-C or SIGTERM.")
@json_option
@pass_ctx
def audit_cmd(
    c: Ctx, since: str | None, wf: str | None, actor: str | None, events: tuple[str, ...], follow: bool,
    as_json: bool,
) -> None:  # fmt: skip
    """Show the audit log (grants, revokes, refusals, session and note events).

    Admins read all of it; a workflow's owners read its records with --workflow
    WF. Torn lines (a crash mid-write, a hand edit) are skipped and counted on
    stderr. With --follow and --json: one JSON object a line.

    \b
    EXAMPLES
      kbd audit --since 1h --event 'note_*'
      kbd audit --workflow research --follow
      kbd audit --actor alice --json | jq '.events[].event'
    """
    from kbd.service import admin
    from kbd.state import audit as audit_log

    try:
        since_at = audit_log.parse_since(since) if since is not None else None
    except ValueError as exc:
        raise UsageError(f"--since: {exc}", hint="e.g. --since 10m or --since 2026-12-01T14:00:00Z") from None
    feed = admin.AuditFeed(lambda offset: c.result(ops.AuditChunk(offset, wf)), since=since_at, workflow=wf,
                           actor=actor, events=events)  # fmt: skip
    if as_json and not follow:
        emit(feed.records().to_json())
    else:
        _print_audit(feed.poll(), as_json)
    if follow:
        _follow_audit(feed, as_json)
    if feed.skipped_lines:
        click.echo(
            f"kbd audit: skipped {feed.skipped_lines} torn line(s) that are not a JSON record", err=True
        )


@main.command("events")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C or SIGTERM.")
@click.option("--since", metavar="ID", help="Only events after this id (the last one you saw); "
              "without it: the recent events, or with --follow the new ones.")  # fmt: skip
@json_option
@pass_ctx
def events_cmd(c: Ctx, follow: bool, since: str | None, as_json: bool) -> None:
    """Show the change feed of the running daemon (docs/daemon.md): content-free
    notices of what changed (workflows, sources, writers, sessions, notes).

    Needs `kbd serve` ($KBD_SOCKET, else the root's socket); authenticated as
    your uid's principal, or by the token in $KBD_TOKEN. Shows only events
    about workflows you may see. A `resync` event means continuity was lost:
    reload what you keep. With --json: one JSON object a line.

    \b
    EXAMPLES
      kbd events --follow
      kbd events --since ID --json
    """
    import signal

    from kbd.client import Client

    class _Stop(Exception):
        pass

    def stop(*_: object) -> None:
        raise _Stop

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)} if follow else {}
    try:
        token = ops.read_token_file(c.token_file) if c.token_file is not None else None
        with Client(c.socket, token=token, root=c.root) as client:
            for event in client.events(since=since, follow=follow):
                line = orjson.dumps(event).decode() if as_json else _event_line(event)
                write_stdout(line.encode() + b"\n")
    except _Stop:
        return  # stopping a follow is how it is meant to end
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _event_line(event: JsonObject) -> str:
    fields = " ".join(f"{k}={one_line(str(v))}" for k, v in event.items() if k not in ("id", "type", "at"))
    return f"{event['at']} {event['id']} {event['type']}" + (f" {fields}" if fields else "")


def _print_audit(events: list[JsonObject], as_json: bool) -> None:
    from kbd.state.audit import format_record

    for e in events:
        click.echo(orjson.dumps(e).decode() if as_json else format_record(e))


def _follow_audit(feed: admin.AuditFeed, as_json: bool) -> None:
    """Poll for appended records until SIGINT or SIGTERM asks to stop (then return
    normally: stopping a follow is how it is meant to end)."""
    import signal
    import threading

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.2):
            _print_audit(feed.poll(), as_json)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# -- shell completion ----------------------------------------------------------------------


@main.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion_cmd(shell: str) -> None:
    """Print the completion script for SHELL: commands, options, workflow IDs,
    aliases, session IDs and principals complete on TAB.

    \b
    bash: eval "$(kbd completion bash)"        (e.g. in ~/.bashrc)
    zsh:  eval "$(kbd completion zsh)"         (e.g. in ~/.zshrc)
    fish: kbd completion fish | source         (or save it in ~/.config/fish/completions/kbd.fish)"""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # every choice is one of click's shells
    write_stdout(cls(main, {}, "kbd", "_KBD_COMPLETE").source().encode())


# -- help --------------------------------------------------------------------------------------


@main.command("help")
@click.argument("command", nargs=-1, metavar="[COMMAND]...")
@click.pass_context
def help_cmd(ctx: click.Context, command: tuple[str, ...]) -> None:
    """Print the help of COMMAND (`kbd help notes write`), or of kbd.

    The same text as `kbd COMMAND --help`; `make man` turns it into man pages
    (docs/cli.md "Man pages")."""
    cmd: click.Command = main
    parent = ctx.find_root()
    path = ["kbd"]
    for name in command:
        if not isinstance(cmd, click.Group) or name not in cmd.commands:
            where = " ".join(path)
            choices = ", ".join(sorted(cmd.commands)) if isinstance(cmd, click.Group) else "none"
            raise UsageError(f"{where} has no command {name!r}", hint=f"its commands: {choices}")
        cmd = cmd.commands[name]
        path.append(name)
        parent = click.Context(cmd, info_name=name, parent=parent)
    sub = parent if command else ctx.find_root()
    click.echo(cmd.get_help(sub))
