"""The ``kbd`` command line (docs/cli.md).

A thin layer: parse arguments, call the operations layer (:mod:`kbd.service`),
print its result (text for people, ``to_json()`` for ``--json``). Errors reach the
user here and only here: ``error[<code>]: <message>`` and ``hint: …`` on
stderr, and the error's exit code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import click
import orjson
from click.shell_completion import CompletionItem

from kbd import ops
from kbd.cli.boundary import die_of_sigpipe, guarded
from kbd.cli.exec_grammar import parse_exec
from kbd.core.config import default_root
from kbd.core.identifiers import one_line
from kbd.core.records import Record
from kbd.errors import (
    UsageError,
)
from kbd.errors.render import internal_error
from kbd.service import JsonObject

if TYPE_CHECKING:
    from kbd.core.resolve import Attachment
    from kbd.service.root import Root

# The operations layer and the root are imported where a command uses them on
# the root itself: through the daemon, a command loads neither (a third of
# the CLI's start-up).

F = TypeVar("F", bound=Callable[..., object])
# click >= 8.2 raises this UsageError for a group given no subcommand; older ones print the help themselves.
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (click.UsageError,), {})
)
SYSTEM_ROOT = ops.SYSTEM_ROOT


def run(args: Sequence[str] | None = None) -> NoReturn:
    """The click CLI (``args``, default ``sys.argv[1:]``), every error turned into
    the contract's output by the one boundary (:func:`kbd.cli.boundary.guarded`,
    shared with the lean exec path)."""

    def body() -> int:
        try:
            rv = main.main(args, prog_name="kbd", standalone_mode=False)
        except _NO_ARGS_IS_HELP as exc:
            # A command group named alone (`kbd session`): its help, as `kbd` alone prints kbd's, not an error.
            assert exc.ctx is not None
            click.echo(exc.ctx.get_help())
            return 0
        except click.UsageError as exc:
            cmd = exc.ctx.command_path if exc.ctx is not None else "kbd"
            raise UsageError(exc.format_message(), hint=f"see `{cmd} --help`") from None
        except click.Abort:
            click.echo("aborted", err=True)
            return 130
        except click.ClickException as exc:
            raise UsageError(exc.format_message()) from None
        return rv if isinstance(rv, int) else 0

    sys.exit(guarded(body))


class KbdGroup(click.Group):
    """A closed stdout ends kbd by SIGPIPE, and an OSError a command let out
    reaches the boundary as an internal error (click would swallow some).
    Subgroups are KbdGroups too."""

    group_class = type

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        obj = ctx.find_object(Ctx)
        if obj is not None and cmd is not None and not ctx.resilient_parsing:
            _refuse_global_json(ctx, cmd, obj)
        return name, cmd, rest

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            die_of_sigpipe()  # before click's own EPIPE handling (exit 1) sees it
        except OSError as exc:
            # Not an OSError any more: click would otherwise swallow some of them.
            raise internal_error(exc) from exc


def emit(data: JsonObject | Record) -> None:
    """``--json``: a result's JSON (docs/cli.md "JSON shapes"), indented."""
    if isinstance(data, Record):
        data = data.to_json()
    write_stdout(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


def write_stdout(data: bytes) -> None:
    """All of ``data`` to stdout, or BrokenPipeError. Python's buffered streams
    drop the rest of a large write the pipe only partly took (the reader left)
    without an error; writing the descriptor directly sees EPIPE."""
    sys.stdout.flush()
    view = memoryview(data)
    while view:
        view = view[os.write(sys.stdout.fileno(), view) :]


def _json_wanted(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """A command's --json, or the global one given before the command (``kbd --json …``)."""
    obj = ctx.find_object(Ctx)
    return value or (obj is not None and obj.json)


def manifest_version_option(f: F) -> F:
    """``--expected-version VERSION``: change the manifest only if it is still at
    VERSION (exit 75 otherwise), so a builder never overwrites a change made meanwhile."""
    return click.option(
        "--expected-version",
        metavar="VERSION",
        help="Refuse (exit 75) unless the manifest is at this version.",
    )(f)


def json_option(f: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, callback=_json_wanted, help="Print JSON (the contract's shapes)."
    )(f)


def dry_run_option(f: F) -> F:
    return click.option(
        "--dry-run",
        is_flag=True,
        help="Show what would change (sessions, running commands, consumers); change nothing.",
    )(f)


def as_option(f: F) -> F:
    return click.option(
        "--as",
        "as_",
        metavar="PRINCIPAL",
        shell_complete=complete_principals,
        help="Act as PRINCIPAL, a name in principals.yaml (`kbd principals list`): you see and may change what "
        "it may (default: $KBD_AS, else the principal mapped to your uid; session commands on the root: the "
        "trusted local operator; through the daemon only the principal you connect as).",
    )(f)


class Ctx:
    def __init__(self, root: Path, *, as_json: bool = False) -> None:
        self.root = root
        self.root_named = True  # False: kbd chose the root (no --root, no KBD_ROOT)
        self.json = as_json  # the global --json (before the command)
        self.socket: str | None = None  # the global --socket
        self.token_file: str | None = None  # the global --token-file
        self._host: Root | None = None
        self._backend: ops.Backend | None = None

    @property
    def host(self) -> Root:
        """The root itself, for the commands that only work on it (init, doctor's
        root checks, serve)."""
        if self._host is None:
            from kbd.service.root import Root

            self._host = Root(self.root)
        return self._host

    @property
    def via(self) -> ops.Backend:
        """Where the command runs (docs/multi-user.md, :func:`kbd.ops.choose`): on the
        root, or through its daemon. Without --as the root's operator acts on the
        root (session and principal commands; management commands: your uid's
        principal), and through the daemon the principal your uid or token is."""
        if self._backend is None:
            named = self.socket or os.environ.get("KBD_SOCKET") or None
            usable = ops.root_usable(self.root)
            mode = ops.choose(
                socket_named=named is not None or self.token_file is not None,
                root_usable=usable,
                daemon_reachable=lambda: ops.reachable(ops.socket_of(self.root)),
            )
            if mode == "direct":
                # On a root it may not change (and no daemon): reads still work, changes are refused.
                refusal = None if usable else ops.not_usable(self.root, ops.socket_of(self.root))
                self._backend = ops.Direct(lambda: self.host, refusal=refusal)
            else:
                where = Path(named) if named is not None else ops.socket_of(self.root)
                token = ops.read_token_file(self.token_file) if self.token_file is not None else None
                if named is None and (token is not None or os.environ.get("KBD_TOKEN")):
                    # A socket a root's kbd.yaml chose: only root's or yours gets your token.
                    ops.check_socket_owner(where)
                self._backend = ops.open_remote(where, token=token)
        return self._backend

    def result(self, op: ops.Op[ops.R], as_: str | None = None) -> ops.R:
        """``op``'s typed result, the same value in both modes."""
        return self.via.run(op, as_=as_)

    def shown(self, op: ops.Op[ops.R], as_: str | None, as_json: bool) -> ops.R | None:
        """``op``'s typed result for the command to print as text, or None once
        ``--json`` printed it (docs/cli.md "JSON shapes")."""
        result = self.result(op, as_)
        if as_json:
            emit(result)
            return None
        return result

    def previewed(self, op: ops.Op[Record], dry_run: bool, as_: str | None, as_json: bool) -> bool:
        """With ``--dry-run``: print what ``op`` would change (docs/access.md "Previews") and say
        True, so the command stops; else False."""
        if not dry_run:
            return False
        preview = self.result(ops.DryRun(op), as_)
        if as_json:
            emit(preview)
        else:
            from kbd.cli.preview_text import preview_lines

            for line in preview_lines(preview):
                click.echo(line)
        return True

    def close(self) -> None:
        if isinstance(self._backend, ops.Remote):
            self._backend.client.close()


pass_ctx = click.make_pass_decorator(Ctx)


# -- shell completion ------------------------------------------------------------------
# Called by the shell on every TAB (`kbd completion SHELL` prints the script):
# each answers from the root's own indexes (the registry and its cache, the
# session store), never walks what it need not, and never fails loudly: a
# root that cannot be read completes nothing.

MAX_COMPLETIONS = 500


def _completion_root(ctx: click.Context) -> Path:
    given = ctx.meta.get(_LATE_ROOT) or ctx.find_root().params.get("root")
    return Path(given) if given is not None else _default_root(None)


def _quietly(
    find: Callable[[click.Context], list[tuple[str, str | None]]],
) -> Callable[..., list[CompletionItem]]:
    """A completion callback from ``find`` (candidates and their help), filtered
    by what was typed; any error completes nothing."""

    def complete(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        try:
            found = find(ctx)
        except Exception:  # a completion never prints a traceback into a shell prompt
            return []
        items = sorted({v: h for v, h in found if v.startswith(incomplete)}.items())[:MAX_COMPLETIONS]
        return [CompletionItem(v, help=one_line(h, limit=80) if h else None) for v, h in items]

    return complete


def _completion_host(ctx: click.Context) -> Root:
    from kbd.service.root import Root

    return Root(_completion_root(ctx))


def _workflow_ids(ctx: click.Context) -> list[tuple[str, str | None]]:
    return [(wid, None) for wid in _completion_host(ctx).registry.known_ids()]


def _session_ids(ctx: click.Context) -> list[tuple[str, str | None]]:
    from kbd.service.sessions import RootSessions

    host = _completion_host(ctx)
    if not (host.config.state_dir / "sessions.db").is_file():
        return []  # never create the store just to complete nothing
    return [(r.id, f"{r.workflow_id} {r.kind}") for r in RootSessions(host).store.rows()]


def _aliases(ctx: click.Context) -> list[tuple[str, str | None]]:
    """The aliases of the workflow named before (WF), or of the session's workflow (SID)."""
    from kbd.service.sessions import RootSessions

    host = _completion_host(ctx)
    wid = ctx.params.get("wf")
    if wid is None and isinstance(ctx.params.get("sid"), str):
        wid = RootSessions(host).store.get(ctx.params["sid"]).workflow_id
    if not isinstance(wid, str):
        return []
    return [(e.alias, e.workflow_id) for e in host.workflow(wid).manifest.entries if e.alias]


def _principal_ids(ctx: click.Context) -> list[tuple[str, str | None]]:
    return [(p.id, p.label) for p in _completion_host(ctx).principals]


complete_workflows = _quietly(_workflow_ids)
complete_sessions = _quietly(_session_ids)
complete_aliases = _quietly(_aliases)
complete_principals = _quietly(_principal_ids)

# -- global options after the command ------------------------------------------------------

_LATE_ROOT = "kbd.root"


# Not checked for readability: a service root is not readable by its users,
# whose commands then go through its daemon (docs/multi-user.md).
ROOT_TYPE = click.Path(path_type=Path, file_okay=False, readable=False)


def _late_root(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    """``--root`` after the command: as if it had been given before it."""
    if value is None:
        return
    ctx.meta[_LATE_ROOT] = value
    obj = ctx.find_object(Ctx)
    if obj is not None:
        obj.root, obj.root_named = value, True


def _late_client_option(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """``--socket`` / ``--token-file`` after the command: as if given before it."""
    obj = ctx.find_object(Ctx)
    if value is not None and obj is not None:
        _set_client_option(obj, str(param.name), value)


def _set_client_option(obj: Ctx, name: str, value: str) -> None:
    if not value:
        raise click.UsageError(f"--{name.replace('_', '-')} was given an empty path")
    setattr(obj, name, value)


SOCKET_HELP = ("Go through the kbd daemon listening at PATH (default: $KBD_SOCKET; else the root itself when you "
               "may use it, else its daemon's socket).")  # fmt: skip
CREDENTIAL_FILE_HELP = ("Authenticate to the daemon with the token in F (mode without o+r; default: $KBD_TOKEN, else "
                   "your uid). Implies going through the daemon. Never pass a token itself on the command line.")  # fmt: skip


def accept_global_options(group: click.Group) -> None:
    """Let every command of ``group`` take ``--root`` after its name too (hidden:
    the main help shows it once). Not ``exec``: everything after its session is
    the sandboxed command's, parsed by the one exec grammar."""
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            accept_global_options(cmd)
        elif not isinstance(cmd, ExecCommand):
            cmd.params.append(
                click.Option(
                    ["--root", "late_root"],
                    type=ROOT_TYPE,
                    expose_value=False,
                    hidden=True,
                    callback=_late_root,
                    help=ROOT_HELP,
                )
            )
            if cmd.name in _LOCAL_ONLY or any(p.name == "socket" for p in cmd.params):
                continue
            for flag, name, meta, text in (("--socket", "socket", "PATH", SOCKET_HELP),
                                           ("--token-file", "token_file", "F", CREDENTIAL_FILE_HELP)):  # fmt: skip
                cmd.params.append(click.Option([flag, name], metavar=meta, expose_value=False, hidden=True,
                                               callback=_late_client_option, help=text))  # fmt: skip


# Commands that only ever work on the root itself (or, for events, only through the daemon).
_LOCAL_ONLY = ("init", "validate", "serve", "completion")


ROOT_HELP = (
    "kbd root (default: $KBD_ROOT, else $XDG_DATA_HOME/kbd, else ~/.local/share/kbd; when that does "
    f"not exist, the system root {SYSTEM_ROOT} if it does, except for init)."
)


def _refuse_global_json(ctx: click.Context, cmd: click.Command, obj: Ctx) -> None:
    """``kbd --json CMD`` for a command that prints no JSON is a usage error,
    never silently text."""
    if obj.json and not isinstance(cmd, click.Group) and not any(p.name == "as_json" for p in cmd.params):
        raise click.UsageError(f"`{ctx.command_path} {cmd.name}` has no --json output", ctx=ctx)


@click.group(
    cls=KbdGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.option("--root", type=ROOT_TYPE, envvar="KBD_ROOT", help=ROOT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (as each command's own --json).")
@click.option("--socket", metavar="PATH", help=SOCKET_HELP)
@click.option("--token-file", metavar="F", help=CREDENTIAL_FILE_HELP)
@click.version_option(package_name="kbd")
@click.pass_context
def main(
    ctx: click.Context, root: Path | None, as_json: bool, socket: str | None, token_file: str | None
) -> None:
    """kbd: attach workflow knowledge bases to each other, under kernel-enforced grants.

    Global options (--root, --json, --socket, --token-file) may also follow the command:
    `kbd sources list WF --root DIR`. When you cannot use the root yourself (a service
    host's /var/lib/kbd), commands go through its daemon as your uid's principal."""
    ctx.obj = Ctx(root if root is not None else _default_root(ctx.invoked_subcommand), as_json=as_json)
    ctx.obj.root_named = root is not None
    ctx.call_on_close(ctx.obj.close)
    for name, value in (("socket", socket), ("token_file", token_file)):
        if value is not None:
            _set_client_option(ctx.obj, name, value)
    if ctx.invoked_subcommand is None:
        # Bare `kbd` asks what there is: the help, on stdout, and success.
        click.echo(ctx.get_help())
        ctx.exit(0)
    sub = main.commands.get(ctx.invoked_subcommand)
    if sub is not None:
        _refuse_global_json(ctx, sub, ctx.obj)


def _default_root(subcommand: str | None) -> Path:
    personal = default_root()
    return choose_root(
        personal,
        creating=subcommand == "init",
        personal_exists=os.path.lexists(personal),
        system_exists=os.path.isdir(SYSTEM_ROOT),
    )


def choose_root(personal: Path, *, creating: bool, personal_exists: bool, system_exists: bool) -> Path:
    """The root when neither --root nor $KBD_ROOT names one (docs/cli.md "Global options"):
    the caller's own (``$XDG_DATA_HOME/kbd``, else ``~/.local/share/kbd``) when
    it exists, else the system service's root when that exists (it may be
    unreadable to the caller: the daemon then serves them), else the caller's
    own again, so a missing root gets the usual error. ``init`` always means the
    caller's own: the system root is created only when named."""
    if creating or personal_exists or not system_exists:
        return personal
    return SYSTEM_ROOT


def attachment_line(a: Attachment) -> str:
    """One attachment for people."""
    if a.available:
        state = "available"
        if a.write is not None:
            state += ", writable" if a.write.available else f", write pending ({a.write.reason})"
        where = f"${a.env} = {a.path}"
    else:
        state = f"UNAVAILABLE {a.reason}"
        where = one_line(a.message or "", limit=200)
    return f"  {one_line(a.alias or '?'):<14} {one_line(a.workflow_id or '?'):<16} {a.access:<5}  {state}\n      {where}"


class ExecCommand(click.Command):
    """``kbd exec``: its help text comes from the declared parameters, but its
    arguments are parsed by the one exec grammar (:func:`kbd.cli.exec_grammar.parse_exec`)
    that the lean path uses too, so both give the same answer to every argv."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if ctx.resilient_parsing:
            # Shell completion of a half-typed line: click's own lenient parse
            # of the declared parameters (nothing runs).
            return super().parse_args(ctx, args)
        request = parse_exec(args)
        if request is None:
            click.echo(ctx.get_help(), color=ctx.color)  # as click's own --help does
            ctx.exit()
        ctx.params = {"request": request}
        return []
