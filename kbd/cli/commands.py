"""The ``kbd`` command line (DESIGN §6).

A thin layer: parse arguments, call the operations layer (:mod:`kbd.service`),
print its result (text for people, ``to_json()`` for ``--json``). Errors reach the
user here and only here: ``error[<code>]: <message>`` and ``hint: …`` on
stderr, and the error's exit code.
"""

from __future__ import annotations

import base64
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import click
import orjson
from click.shell_completion import CompletionItem

from kbd import ops
from kbd.cli.boundary import die_of_sigpipe, guarded
from kbd.cli.exec_grammar import ExecArgs, parse_exec
from kbd.cli.exec_run import run_exec
from kbd.core.config import default_root
from kbd.core.identifiers import alias_problem, one_line
from kbd.core.notes import MAX_NOTE_BYTES
from kbd.core.pathguard import PathCheck
from kbd.core.policy import KB_ACCESS, KINDS
from kbd.core.relpaths import DEFAULT_LS_LIMIT, MAX_LS_LIMIT
from kbd.core.strict import load_json_strict
from kbd.errors import (
    InvalidInput,
    KbdError,
    NotFound,
    SessionClosed,
    UsageError,
)
from kbd.errors.render import internal_error
from kbd.service import JsonObject

if TYPE_CHECKING:
    from kbd.service import admin
    from kbd.service.root import Root

# The operations layer and the root are imported where a command uses them on
# the root itself: through the daemon, a command loads neither (a third of
# the CLI's start-up).

F = TypeVar("F", bound=Callable[..., object])
SYSTEM_ROOT = ops.SYSTEM_ROOT


def run(args: Sequence[str] | None = None) -> NoReturn:
    """The click CLI (``args``, default ``sys.argv[1:]``), every error turned into
    the contract's output by the one boundary (:func:`kbd.cli.boundary.guarded`,
    shared with the lean exec path)."""

    def body() -> int:
        try:
            rv = main.main(args, prog_name="kbd", standalone_mode=False)
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


def _emit(data: JsonObject) -> None:
    _write_stdout(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


def _write_stdout(data: bytes) -> None:
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


def as_option(f: F) -> F:
    return click.option(
        "--as",
        "as_",
        metavar="PRINCIPAL",
        shell_complete=_complete_principals,
        help="Principal acting (default: $KBD_AS, else the principal mapped to your uid; session commands: "
        "the trusted local operator). An empty value is a usage error.",
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
        """Where the command runs (DESIGN §10, :func:`kbd.ops.choose`): on the
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

    def run(self, op: ops.Op, as_: str | None = None) -> JsonObject:
        return self.via.run(op, as_=as_)

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


_complete_workflows = _quietly(_workflow_ids)
_complete_sessions = _quietly(_session_ids)
_complete_aliases = _quietly(_aliases)
_complete_principals = _quietly(_principal_ids)

# -- global options after the command ------------------------------------------------------

_LATE_ROOT = "kbd.root"


# Not checked for readability: a service root is not readable by its users,
# whose commands then go through its daemon (DESIGN §10).
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


def _accept_global_options(group: click.Group) -> None:
    """Let every command of ``group`` take ``--root`` after its name too (hidden:
    the main help shows it once). Not ``exec``: everything after its session is
    the sandboxed command's, parsed by the one exec grammar."""
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            _accept_global_options(cmd)
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
    """The root when neither --root nor $KBD_ROOT names one (DESIGN §2, §10):
    the caller's own (``$XDG_DATA_HOME/kbd``, else ``~/.local/share/kbd``) when
    it exists, else the system service's root when that exists (it may be
    unreadable to the caller: the daemon then serves them), else the caller's
    own again, so a missing root gets the usual error. ``init`` always means the
    caller's own: the system root is created only when named."""
    if creating or personal_exists or not system_exists:
        return personal
    return SYSTEM_ROOT


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
    """Create a kbd root (kbd.yaml, principals.yaml, workflows/, state/)."""
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
        _emit(result.to_json())
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
    shell_complete=_complete_workflows,
    help="also check the KBs WF's sessions can read (its own and its sources') for multi-link files",
)
@json_option
@pass_ctx
def doctor(c: Ctx, as_json: bool, workflow_id: str | None) -> None:
    """Check the root, its config, principals and registry health.

    Through the daemon (a root you cannot use yourself): whether you reach it
    and as whom, and for admins the daemon's own checks of its root."""
    from kbd.service import admin

    b = c.via
    if isinstance(b, ops.Remote):
        report = ops.remote_doctor(b, workflow_id)
    else:
        report = admin.doctor(c.root, workflow_id=workflow_id).to_json()
    if as_json:
        _emit(report)
    else:
        for ch in report["checks"]:
            click.echo(
                f"{'ok  ' if ch['ok'] else 'FAIL'} {ch['check']}: {one_line(ch['detail'], limit=10_000)}"
            )
    if not report["ok"]:
        sys.exit(65)


@main.command()
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@json_option
def validate(file: Path, as_json: bool) -> None:
    """Validate a workflow.json file (syntax and field rules, not reachability).

    Every problem of every entry is listed, one per line (``FILE: where: problem``)
    on stdout; with --json the answer is always JSON, errors included."""
    from kbd.service import admin

    try:
        result = admin.validate(file)
    except KbdError as err:
        if as_json:
            _emit(admin.unreadable_json(file, err))
        raise
    if as_json:
        _emit(result.to_json())
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


# -- workflows ----------------------------------------------------------------------


@main.group()
def workflows() -> None:
    """Discovered workflows."""


@workflows.command("list")
@as_option
@json_option
@pass_ctx
def workflows_list(c: Ctx, as_: str | None, as_json: bool) -> None:
    """List workflows (with registry problems: ambiguous IDs, unreadable manifests)."""
    result = c.run(ops.WorkflowsList(), as_)
    if as_json:
        _emit(result)
        return
    for r in result["workflows"]:
        status = "" if r["status"] == "ok" else f"  [{r['status']}]"
        if r["nested_in"]:
            status += f" inside workflow folder {one_line(r['nested_in'])}"
        if r["contains"]:
            status += f" contains workflow folder {', '.join(one_line(p) for p in r['contains'])}"
        click.echo(
            f"{one_line(r['id'] or '?'):<24} {one_line(r['label'] or '', limit=40):<28} {one_line(r['path'])}{status}"
        )


@workflows.command("create")
@click.argument("wf")
@click.option("--label", default=None, help="Display name (default: the ID).")
@click.option("--owner", default=None, help="Owning principal (default: you; another one: admins only).")
@as_option
@json_option
@pass_ctx
def workflows_create(
    c: Ctx, wf: str, label: str | None, owner: str | None, as_: str | None, as_json: bool
) -> None:
    """Create workflow folder WF for its owner (owner's uid, the host's grant group)."""
    made = c.run(ops.WorkflowCreate(wf, label, owner), as_)
    if as_json:
        _emit(made)
        return
    owners = _ids(made["owners"])
    click.echo(f"created workflow {one_line(made['workflow_id'])} for {owners} at {one_line(made['path'])}")


def _ids(ids: list[str] | tuple[str, ...]) -> str:
    """A list of workflow or principal IDs on one line, each escaped."""
    return ", ".join(one_line(i) for i in ids)


def _attachment_line(a: JsonObject) -> str:
    """One attachment for people, from its JSON (the contract's spelling of each field)."""
    if a["available"]:
        state = "available"
        if a["write"] is not None:
            state += ", writable" if a["write"]["available"] else f", write pending ({a['write']['reason']})"
        where = f"${a['env']} = {a['path']}"
    else:
        state = f"UNAVAILABLE {a['reason']}"
        where = one_line(a["message"] or "", limit=200)
    return f"  {one_line(a['alias'] or '?'):<14} {one_line(a['workflow_id'] or '?'):<16} {a['access']:<5}  {state}\n      {where}"


@workflows.command("show")
@click.argument("wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def workflows_show(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Everything a builder needs: attachments, write grants, candidates."""
    d = c.run(ops.WorkflowShow(wf), as_)
    if as_json:
        _emit(d)
        return
    click.echo(f"{one_line(d['workflow_id'])}  {one_line(d['label'])}  ({one_line(d['path'])})")
    owners = _ids(d["owners"]) or "none (legacy, account-visible)"
    click.echo(
        f"  owners: {owners}; editors: {_ids(d['editors']) or '-'}; readers: {_ids(d['readers']) or '-'}"
    )
    click.echo("attached knowledge bases:")
    for a in d["sources"]:
        click.echo(_attachment_line(a))
    if not d["sources"]:
        click.echo("  (none)")
    click.echo(f"writes into: {_ids(d['writes_into']) or '-'}")
    click.echo(f"workflows allowed to write into this KB's notes/: {_ids(d['allowed_kb_writers']) or '-'}")
    could = ", ".join(
        f"{one_line(x['workflow_id'])} ({one_line(x['label'], limit=40)})" for x in d["candidates"]
    )
    click.echo(f"could attach now: {could or '-'}")


# -- sources ------------------------------------------------------------------------


@main.group()
def sources() -> None:
    """A workflow's attached knowledge bases."""


@sources.command("list")
@click.argument("wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def sources_list(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Each attachment with its status and reason."""
    view = c.run(ops.SourcesList(wf), as_)
    if as_json:
        _emit(view)
        return
    for a in view["sources"]:
        click.echo(_attachment_line(a))


@sources.command("attach")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("source_id", shell_complete=_complete_workflows)
@click.option("--alias", required=True, help="Local name: ^[a-z][a-z0-9_]{0,47}$, not 'access'.")
@click.option("--access", type=click.Choice(["read", "write"]), default="read", show_default=True)
@as_option
@json_option
@pass_ctx
def sources_attach(
    c: Ctx, wf: str, source_id: str, alias: str, access: str, as_: str | None, as_json: bool
) -> None:
    """Attach SOURCE_ID's knowledge base to WF under ALIAS."""
    if (problem := alias_problem(alias)) is not None:
        # Name the flag the user typed, not the manifest entry it would become.
        raise InvalidInput(f"--alias {alias!r} {problem}", hint="e.g. --alias rts")
    a = c.run(ops.Attach(wf, source_id, alias, access), as_)
    if as_json:
        _emit(a)
        return
    click.echo(f"attached {source_id} to {wf} as {alias}")
    click.echo(_attachment_line(a))


@sources.command("detach")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("alias", shell_complete=_complete_aliases)
@as_option
@json_option
@pass_ctx
def sources_detach(c: Ctx, wf: str, alias: str, as_: str | None, as_json: bool) -> None:
    """Remove the attachment ALIAS from WF."""
    result = c.run(ops.Detach(wf, alias), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(f"detached {alias} from {wf}")


@sources.command("access")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("alias", shell_complete=_complete_aliases)
@click.argument("access", type=click.Choice(["read", "write"]))
@manifest_version_option
@as_option
@json_option
@pass_ctx
def sources_access(
    c: Ctx, wf: str, alias: str, access: str, expected_version: str | None, as_: str | None, as_json: bool
) -> None:
    """Change the access of WF's attachment ALIAS (read or write), nothing else."""
    a = c.run(ops.SetAccess(wf, alias, access, expected_version), as_)
    if as_json:
        _emit(a)
        return
    click.echo(f"{wf}: {alias} is now attached with {access} access")
    click.echo(_attachment_line(a))


@sources.command("set")
@click.argument("wf", shell_complete=_complete_workflows)
@click.option(
    "--file",
    "file",
    required=True,
    metavar="F|-",
    help="JSON array of entries; - reads stdin; [] detaches all.",
)
@manifest_version_option
@as_option
@json_option
@pass_ctx
def sources_set(
    c: Ctx, wf: str, file: str, expected_version: str | None, as_: str | None, as_json: bool
) -> None:
    """Replace WF's whole attachment list."""
    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except FileNotFoundError as exc:
        raise NotFound(f"{file} does not exist", hint="pass an existing file, or - for stdin") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror}") from exc
    try:
        raw = load_json_strict(data)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"{'stdin' if file == '-' else file} is not valid JSON: {exc}") from exc
    view = c.run(ops.SetSources(wf, raw, expected_version), as_)
    if as_json:
        _emit(view)
        return
    click.echo(f"{wf}: {len(view['sources'])} sources saved")
    for a in view["sources"]:
        click.echo(_attachment_line(a))


@sources.command("candidates")
@click.argument("wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def sources_candidates(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Workflow IDs WF could attach right now."""
    result = c.run(ops.Candidates(wf), as_)
    if as_json:
        _emit(result)
        return
    for r in result["candidates"]:
        granted = "  (write granted)" if r["write_granted"] else ""
        click.echo(f"{one_line(r['workflow_id']):<24} {one_line(r['label'], limit=60)}{granted}")


# -- writers ---------------------------------------------------------------------------


@main.group()
def writers() -> None:
    """Which consumer workflows may write into a source's notes/."""


@writers.command("list")
@click.argument("source_wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def writers_list(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Consumer workflows SOURCE_WF's owner lets write into its notes/."""
    view = c.run(ops.WritersList(source_wf), as_)
    if as_json:
        _emit(view)
        return
    for w in view["writers"]:
        click.echo(f"{one_line(w['workflow_id'])}{'' if w['exists'] else '  (no such workflow now)'}")


@writers.command("grant")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("consumer_wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def writers_grant(c: Ctx, source_wf: str, consumer_wf: str, as_: str | None, as_json: bool) -> None:
    """Let CONSUMER_WF write into SOURCE_WF's notes/ (source owners and admins only)."""
    result = c.run(ops.Grant(source_wf, consumer_wf), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(
            f"{result['consumer']} may write into {source_wf}'s notes/"
            + ("" if result["changed"] else " (already granted)")
        )


@writers.command("revoke")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("consumer_wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def writers_revoke(c: Ctx, source_wf: str, consumer_wf: str, as_: str | None, as_json: bool) -> None:
    """Withdraw CONSUMER_WF's write grant on SOURCE_WF."""
    result = c.run(ops.Revoke(source_wf, consumer_wf), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(
            f"{result['consumer']} may no longer write into {source_wf}"
            + ("" if result["changed"] else " (was not granted)")
        )


# -- sessions ----------------------------------------------------------------------------


def _print_plan(d: JsonObject) -> None:
    click.echo(
        f"session {d['session_id']}  workflow {one_line(d['workflow_id'])}  kind {d['kind']}  "
        f"kb_access {d['kb_access']} (effective {d['effective_kb_access']})  generation {d['generation']}"
    )
    click.echo("environment:")
    for k, v in sorted(d["env"].items()):
        click.echo(f"  {k}={v}")
    for label, key in (
        ("read", "read"),
        ("write", "write"),
        ("read-only inside writable", "read_only"),
        ("hidden", "hidden"),
    ):
        click.echo(f"{label}:")
        for p in d[key]:
            click.echo(f"  {p}")
        if not d[key]:
            click.echo("  -")
    click.echo("context block:")
    for line in d["context"].splitlines():
        click.echo(f"  | {line}")


@main.group()
def session() -> None:
    """Shell/agent sessions and their plans."""


@session.command("open")
@click.argument("wf", shell_complete=_complete_workflows)
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
    "--parent", metavar="SID", shell_complete=_complete_sessions, help="Open a copied child of this session."
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
    """Open a session for WF and print its plan."""
    if kind is None and parent is None:
        # Exactly click's answer for a required option: only a child may leave it out.
        ctx = click.get_current_context()
        raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == "kind"))
    plan = c.run(ops.SessionOpen(wf, kind, kb_access, item_kb_write or None, parent), as_)
    if as_json:
        _emit(plan)
    else:
        _print_plan(plan)


@session.command("show")
@click.argument("sid", shell_complete=_complete_sessions)
@as_option
@json_option
@pass_ctx
def session_show(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """The session's plan, rebuilt from saved configuration now."""
    view = c.run(ops.SessionShow(sid), as_)
    if as_json:
        _emit(view)
        return
    _print_plan(view)
    for r in view["running"]:
        mark = (
            f"  STALE: started under generation {r['generation']}, grants since changed" if r["stale"] else ""
        )
        click.echo(f"running: pid {r['pid']} {' '.join(r['argv'])[:60]}{mark}")


@session.command("revoke")
@click.argument("sid", shell_complete=_complete_sessions)
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
    result = c.run(ops.SessionRevoke(sid, immediate), as_)
    if as_json:
        _emit(result)
        return
    for pid in result["terminated"]:
        click.echo(f"terminated process group {pid}")
    for pid in result["still_running"]:
        click.echo(f"STILL RUNNING with old grants: process group {pid} (use --immediate to terminate it)")
    if not result["terminated"] and not result["still_running"]:
        click.echo("no command is running under an older plan")


@session.command("env")
@click.argument("sid", shell_complete=_complete_sessions)
@as_option
@json_option
@pass_ctx
def session_env(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """The session's environment, as `export` lines (eval-able) or JSON."""
    result = c.run(ops.SessionEnv(sid), as_)
    if as_json:
        _emit(result)
        return
    for k, v in sorted(result.items()):
        click.echo(f"export {k}={shlex.quote(v)}")


@session.command("list")
@click.option("--workflow", "wf", metavar="WF", shell_complete=_complete_workflows)
@click.option("--all", "include_closed", is_flag=True, help="Include closed sessions.")
@as_option
@json_option
@pass_ctx
def session_list(c: Ctx, wf: str | None, include_closed: bool, as_: str | None, as_json: bool) -> None:
    """Sessions (with --as: only those that principal may use)."""
    result = c.run(ops.SessionList(wf, include_closed), as_)
    if as_json:
        _emit(result)
        return
    for r in result["sessions"]:
        click.echo(
            f"{r['session_id']}  {one_line(r['workflow_id']):<20} {r['kind']:<22} {r['kb_access']:<10} "
            f"gen {r['generation']}{'  closed' if r['closed'] else ''}"
        )


@session.command("close")
@click.argument("sid", shell_complete=_complete_sessions)
@as_option
@json_option
@pass_ctx
def session_close(c: Ctx, sid: str, as_: str | None, as_json: bool) -> None:
    """Close SID (and its child sessions): they grant nothing afterwards."""
    result = c.run(ops.SessionClose(sid), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(f"closed {', '.join(result['closed']) or 'nothing (already closed)'}")


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


@main.command("exec", cls=ExecCommand)
@click.argument("sid", shell_complete=_complete_sessions)
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
    help="Also print the contributions report as one JSON line on stderr.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctx
def exec_cmd(c: Ctx, request: ExecArgs) -> None:
    """Run COMMAND under SID's current plan in a fresh sandbox; exit with its status."""
    if request.socket is None and c.socket is not None:
        request = request.with_socket(c.socket)
    token = ops.read_token_file(c.token_file) if c.token_file is not None else None
    if token is not None and request.socket is None:
        # A token is for the daemon: never fall back to running in-process.
        request = request.with_socket(str(ops.socket_of(c.root)))
    sys.exit(run_exec(c.root, request, token=token, root_named=c.root_named))


@main.command("check")
@click.argument("sid", shell_complete=_complete_sessions)
@click.argument("path")
@click.option("--mode", type=click.Choice(["read", "write"]), required=True)
@as_option
@json_option
@pass_ctx
def check_cmd(c: Ctx, sid: str, path: str, mode: str, as_: str | None, as_json: bool) -> None:
    """May session SID read/write PATH? Exit 0 when allowed, 77 when not."""
    try:
        result = c.run(ops.Check(sid, path, mode), as_)
    except SessionClosed as err:
        # Still the contract's answer on stdout: a closed session grants nothing.
        result = PathCheck(allowed=False, reason=err.message).to_json()
    if as_json:
        _emit(result)
    else:
        click.echo(f"{'allowed' if result['allowed'] else 'denied'}: {result['reason']}")
    if not result["allowed"]:
        sys.exit(77)


@main.command("mcp")
@click.argument("sid", shell_complete=_complete_sessions)
@as_option
@pass_ctx
def mcp_cmd(c: Ctx, sid: str, as_: str | None) -> None:
    """Serve session SID's knowledge tools over MCP on stdin/stdout (DESIGN §12)."""
    from kbd.core.principals import named_principal
    from kbd.mcp import server as mcp_server

    # An empty --as/KBD_AS is a usage error (exit 2) here too, before serving: not
    # a server that starts and then refuses every call.
    named_principal(as_, os.environ.get("KBD_AS"))
    mcp_server.serve(c.via, sid, as_)


@main.command("ui")
@click.argument("wf", required=False, default=None, shell_complete=_complete_workflows)
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port on 127.0.0.1 (0: a free one).")  # fmt: skip
@click.option("--no-browser", is_flag=True, help="Do not open a browser; just print the URL.")
@as_option
@pass_ctx
def ui_cmd(c: Ctx, wf: str | None, port: int, no_browser: bool, as_: str | None) -> None:
    """Serve the Knowledge page (attach, grant, browse, review) for you on 127.0.0.1.

    Prints a one-time URL as stdout's first line (it logs the browser in once),
    opens a browser unless --no-browser, and runs until Ctrl-C or SIGTERM. The
    page acts as the principal the CLI would (through the daemon when you
    cannot use the root yourself), and every action is re-checked there."""
    from kbd.ui import server

    server.serve(c.via, root=c.root, workflow=wf, port=port, as_=as_, open_browser=not no_browser)


@main.command("search")
@click.argument("sid", shell_complete=_complete_sessions)
@click.argument("query")
@click.option(
    "--alias", "aliases", multiple=True, metavar="A", help="Only this attached source (repeatable)."
)
@click.option("--limit", type=int, default=None, help="At most this many hits (1-100, default 10).")
@click.option(
    "--include-unreviewed", is_flag=True, help="Also contributed notes no owner has reviewed (labelled)."
)
@as_option
@json_option
@pass_ctx
def search_cmd(
    c: Ctx, sid: str, query: str, aliases: tuple[str, ...], limit: int | None, include_unreviewed: bool,
    as_: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Search every KB session SID may read now (its own and each available source)."""
    result = c.run(ops.Search(sid, query, aliases, limit, include_unreviewed), as_)
    if as_json:
        _emit(result)
        return
    for hit in result["hits"]:
        where = one_line(hit["alias"]) if hit["alias"] is not None else "(own)"
        click.echo(f"{where}:{one_line(hit['relpath'])}  {one_line(hit['title'])}  [{hit['trust']}]")
        click.echo(f"    {one_line(hit['snippet'], limit=400)}")
    n = len(result["hits"])
    click.echo(f"{n} hit{'s' if n != 1 else ''}" if n else "no hits")
    if result["dropped_by_gate"]:
        click.echo(f"{result['dropped_by_gate']} left out: their text matches the prompt-injection patterns")


# -- notes ----------------------------------------------------------------------------------


@main.group()
def notes() -> None:
    """Contributed notes in attached sources' notes/ folders."""


@notes.command("write")
@click.argument("sid", shell_complete=_complete_sessions)
@click.argument("alias", shell_complete=_complete_aliases)
@click.argument("relpath")
@click.option("--file", "file", metavar="F|-", help="Note content; - reads stdin (the default when piped).")
@click.option("--expected-version", "expected", metavar="V", default=None,
              help="Write only if the note is at version V now (sha256:..., see `kbd notes log`), or absent "
              "for `none`; otherwise exit 75 naming its current version.")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_write(
    c: Ctx, sid: str, alias: str, relpath: str, file: str | None, expected: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Write RELPATH (relative to the source's notes/) atomically, with provenance."""
    if file is None:
        if sys.stdin.isatty():
            # Reading a terminal would wait silently for input nobody knows to type.
            raise UsageError(
                "no note content: pass --file F, or pipe the content in",
                hint="kbd notes write SID ALIAS RELPATH --file note.md   (or: ... < note.md, or --file - to type it)",
            )
        file = "-"

    try:
        if file == "-":
            data = sys.stdin.buffer.read(MAX_NOTE_BYTES + 1)
        else:
            with open(file, "rb") as fh:
                data = fh.read(MAX_NOTE_BYTES + 1)
    except FileNotFoundError as exc:
        raise NotFound(f"{file} does not exist", hint="pass an existing file, or - for stdin") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror}") from exc
    result = c.run(ops.NoteWrite(sid, alias, relpath, data, expected), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(
            f"wrote {one_line(result['path'])} in {one_line(result['workflow_id'])} ({result['bytes']} bytes)"
        )


# -- import ------------------------------------------------------------------------------


@main.command("import")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("folder", metavar="DIR", type=click.Path(path_type=Path, file_okay=False))
@click.option("--dry-run", is_flag=True, help="Report what would change; write nothing.")
@click.option("--update", is_flag=True, help="Replace documents whose source changed since the last import.")
@as_option
@json_option
@pass_ctx
def import_docs(
    c: Ctx, wf: str, folder: Path, dry_run: bool, update: bool, as_: str | None, as_json: bool
) -> None:
    """Import the Markdown files under DIR into WF's knowledgebase/context/.

    Container = each file's parent folder, title = its `title:` frontmatter or
    first `# H1`; target context/<container>/<title>.md. DIR is read by you, as
    you (links, FIFOs and devices skipped); only the documents travel."""
    from kbd.fs.importing import read_folder

    found = read_folder(folder)
    answers = [c.run(op, as_) for op in ops.import_batches(wf, found.folder, found.docs, found.skipped,
                                                           dry_run=dry_run, update=update)]  # fmt: skip
    result = answers[0]
    for more in answers[1:]:
        for key in ("created", "updated", "unchanged", "skipped"):
            result[key] = result[key] + more[key]
    # Batches report the reader's skips after the documents: one order for the whole import.
    result["skipped"] = sorted(result["skipped"], key=lambda s: str(s["file"]))
    if as_json:
        _emit(result)
        return
    for key in ("created", "updated", "unchanged"):
        for d in result[key]:
            click.echo(f"{key:<9} {one_line(d['path'])}  <- {one_line(d['file'])}")
    for s in result["skipped"]:
        click.echo(f"skipped   {one_line(s['file'])}: {one_line(s['reason'])}")
    counts = ", ".join(f"{len(result[k])} {k}" for k in ("created", "updated", "unchanged", "skipped"))
    tail = " (dry run: nothing written)" if result["dry_run"] else ""
    click.echo(f"import into {one_line(result['workflow_id'])}: {counts}{tail}")


def _version_line(v: JsonObject) -> str:
    """One version per line: a write that named no expected version is marked
    ``unchecked``: if its previous version is not what its writer read, that
    is a lost update (`kbd notes diff --version V` shows what it replaced)."""
    who = v.get("principal") or v.get("workflow") or "-"
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(v["at"])))
    unchecked = "  unchecked" if v["how"] == "write" and v.get("expected") is None else ""
    return f"{v['version']}  {at}  {v['how']:<7}  {one_line(str(who))}  {v['size']} bytes{unchecked}"


@notes.command("log")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("relpath")
@as_option
@json_option
@pass_ctx
def notes_log(c: Ctx, source_wf: str, relpath: str, as_: str | None, as_json: bool) -> None:
    """The kept versions of a note, newest first (RELPATH relative to the KB root: notes/x.md)."""
    result = c.run(ops.NoteLog(source_wf, relpath), as_)
    if as_json:
        _emit(result)
        return
    click.echo(f"{one_line(result['relpath'])} in {one_line(result['workflow_id'])}: "
               f"now {result['current'] or 'absent'}")  # fmt: skip
    for v in result["versions"]:
        click.echo(_version_line(v))


@notes.command("show")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("relpath")
@click.option(
    "--version", "version", metavar="V", default=None, help="The version to print (default: newest)."
)
@as_option
@json_option
@pass_ctx
def notes_show(
    c: Ctx, source_wf: str, relpath: str, version: str | None, as_: str | None, as_json: bool
) -> None:
    """Print one kept version of a note (RELPATH relative to the KB root)."""
    result = c.run(ops.NoteShow(source_wf, relpath, version), as_)
    if as_json:
        _emit(result)
        return
    content = result["content"]
    _write_stdout(base64.b64decode(content) if result["encoding"] == "base64" else content.encode())


@notes.command("diff")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("relpath")
@click.option("--version", "version", metavar="V", default=None, help="The newer side (default: newest).")
@click.option("--against", "against", metavar="V", default=None,
              help="The older side (default: the version before --version).")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_diff(
    c: Ctx, source_wf: str, relpath: str, version: str | None, against: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Unified diff of two kept versions of a note (default: previous vs newest)."""
    result = c.run(ops.NoteDiff(source_wf, relpath, version, against), as_)
    if as_json:
        _emit(result)
        return
    _write_stdout(str(result["diff"]).encode())


@notes.command("restore")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("relpath")
@click.option("--version", "version", metavar="V", default=None,
              help="The version to restore (default: the one before the newest).")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_restore(
    c: Ctx, source_wf: str, relpath: str, version: str | None, as_: str | None, as_json: bool
) -> None:
    """Make a kept version the note's content again (source owners and admins; audited)."""
    result = c.run(ops.NoteRestore(source_wf, relpath, version), as_)
    if as_json:
        _emit(result)
        return
    click.echo(f"restored {one_line(result['relpath'])} in {one_line(result['workflow_id'])} to "
               f"{result['version']} ({result['bytes']} bytes)")  # fmt: skip


@notes.command("pending")
@click.argument("source_wf")
@as_option
@json_option
@pass_ctx
def notes_pending(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Contributed notes in SOURCE_WF's notes/ no owner has reviewed (owners and admins)."""
    result = c.run(ops.NotesPending(source_wf), as_)
    if as_json:
        _emit(result)
        return
    if not result["pending"]:
        click.echo(f"no contributions wait for review in {one_line(result['workflow_id'])}")
    for p in result["pending"]:
        when = one_line(p["contributed_at"] or "an unknown time")
        click.echo(f"{one_line(p['relpath'])}  by {one_line(p['contributed_by_workflow'])} at {when}  "
                   f"{p['digest']}  ({p['bytes']} bytes)")  # fmt: skip
    if result["truncated"]:
        click.echo("(more are waiting: review these first)")


@notes.command("review")
@click.argument("source_wf")
@click.argument("relpath")
@click.option("--approve", is_flag=True, help="Approve version V of the note (needs --expected-version).")
@click.option("--reject", is_flag=True, help="Move the note out of notes/ into kbd's state (restorable).")
@click.option(
    "--expected-version",
    "expected",
    metavar="V",
    default=None,
    help="Decide only if the note is still version V (the digest `kbd notes pending` showed); else exit 75. "
    "Required with --approve.",
)
@as_option
@json_option
@pass_ctx
def notes_review(
    c: Ctx, source_wf: str, relpath: str, approve: bool, reject: bool, expected: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Approve or reject the contributed note RELPATH (relative to the KB root: notes/x.md)."""
    if approve == reject:
        raise UsageError(
            "pass exactly one of --approve and --reject",
            hint="kbd notes review SOURCE_WF notes/x.md --approve --expected-version sha256:<hex>",
        )
    result = c.run(ops.NotesReview(source_wf, relpath, approve, expected), as_)
    if as_json:
        _emit(result)
        return
    who = f"contributed by {one_line(result['contributed_by_workflow'])} at {one_line(result['contributed_at'] or '?')}"
    if result["decision"] == "approved":
        click.echo(f"approved {one_line(result['relpath'])} in {one_line(result['workflow_id'])} ({who})")
    else:
        click.echo(f"rejected {one_line(result['relpath'])} in {one_line(result['workflow_id'])} ({who}); "
                   f"moved out of notes/ and kept as rejected #{result['rejected_id']}")  # fmt: skip


@notes.command("rejected")
@click.argument("source_wf", shell_complete=_complete_workflows)
@as_option
@json_option
@pass_ctx
def notes_rejected(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Rejected notes kept for SOURCE_WF (each restorable with `kbd notes unreject`)."""
    result = c.run(ops.NotesRejected(source_wf), as_)
    if as_json:
        _emit(result)
        return
    for r in result["rejected"]:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(r["rejected_at"])))
        click.echo(f"#{r['id']}  {one_line(r['relpath'])}  rejected by {one_line(r['rejected_by'])} at {at}  "
                   f"{r['bytes']} bytes")  # fmt: skip


@notes.command("unreject")
@click.argument("source_wf", shell_complete=_complete_workflows)
@click.argument("rejected_id", type=int, metavar="ID")
@as_option
@json_option
@pass_ctx
def notes_unreject(c: Ctx, source_wf: str, rejected_id: int, as_: str | None, as_json: bool) -> None:
    """Put rejected note ID back where it was, byte for byte (unreviewed again)."""
    result = c.run(ops.NotesUnreject(source_wf, rejected_id), as_)
    if as_json:
        _emit(result)
        return
    click.echo(f"restored rejected #{result['rejected_id']} to {one_line(result['relpath'])} in "
               f"{one_line(result['workflow_id'])} (unreviewed)")  # fmt: skip


# -- principals ----------------------------------------------------------------------------


@main.group()
def principals() -> None:
    """Users and services known to this host."""


@principals.command("list")
@as_option
@json_option
@pass_ctx
def principals_list(c: Ctx, as_: str | None, as_json: bool) -> None:
    """List principals: ID, kind, flags (admin, disabled, token) and label."""
    result = c.run(ops.PrincipalsList(), as_)
    if as_json:
        _emit(result)
        return
    for p in result["principals"]:
        flags = [
            f
            for f, on in (("admin", p["admin"]), ("disabled", p["disabled"]), ("token", p["has_token"]))
            if on
        ]
        label = f"  {one_line(p['label'], limit=200)}" if p["label"] is not None else ""
        click.echo(f"{p['id']:<20} {p['kind']:<8} {' '.join(flags)}{label}")


def _force_option(action: str) -> Callable[[F], F]:
    return click.option(
        "--force", is_flag=True, help=f"{action.capitalize()} even the last enabled admin (then only a hand edit of "
        "principals.yaml, or `kbd principals enable` on the root, brings an admin back)."
    )  # fmt: skip


def _changed_line(result: JsonObject, done: str) -> str:
    pid = one_line(result["principal"]["id"])
    return f"{done} principal {pid}" if result["changed"] else f"principal {pid} was already {done}"


@principals.command("add")
@click.argument("name")
@click.option("--uid", type=int, metavar="N", help="Map the principal to this uid (peer-uid authentication).")
@click.option("--user", "login", metavar="LOGIN", help="Map it to LOGIN's uid on this host.")
@click.option("--admin", is_flag=True, help="An admin: may manage any workflow and read anything.")
@click.option(
    "--service", is_flag=True, help="A service (an execution host): may open sessions for any workflow."
)
@click.option("--label", metavar="TEXT", help="A name for people (one line).")
@as_option
@json_option
@pass_ctx
def principals_add(c: Ctx, name: str, uid: int | None, login: str | None, admin: bool, service: bool,
                   label: str | None, as_: str | None, as_json: bool) -> None:  # fmt: skip
    """Add principal NAME mapped to a uid (--uid N or --user LOGIN).

    principals.yaml is edited in place: its comments, blank lines and order stay."""
    if (uid is None) == (login is None):
        raise UsageError("pass exactly one of --uid N and --user LOGIN",
                         hint="kbd principals add NAME --uid 1000   (or --user alice)")  # fmt: skip
    if admin and service:
        raise UsageError("pass at most one of --admin and --service: a service principal is never an admin",
                         hint="add the service and an admin as two principals")  # fmt: skip
    result = c.run(ops.PrincipalAdd(name, uid, login, "service" if service else "user", admin, label), as_)
    if as_json:
        _emit(result)
        return
    p = result["principal"]
    role = "admin" if p["admin"] else p["kind"]
    user = result["user"]
    click.echo(
        f"added principal {one_line(p['id'])} ({role}, uid {p['uid']}" + (f" = {user})" if user else ")")
    )
    if user is None:
        click.echo(f"kbd: note: uid {p['uid']} has no passwd entry on this host", err=True)


@principals.command("disable")
@click.argument("name", shell_complete=_complete_principals)
@_force_option("disable")
@as_option
@json_option
@pass_ctx
def principals_disable(c: Ctx, name: str, force: bool, as_: str | None, as_json: bool) -> None:
    """Disable NAME: refused everywhere from the daemon's next request on; the
    commands it started are ended (or marked stale) by revocation."""
    result = c.run(ops.PrincipalChange("disable", name, force), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(_changed_line(result, "disabled"))


@principals.command("enable")
@click.argument("name", shell_complete=_complete_principals)
@as_option
@json_option
@pass_ctx
def principals_enable(c: Ctx, name: str, as_: str | None, as_json: bool) -> None:
    """Enable NAME again."""
    result = c.run(ops.PrincipalChange("enable", name), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(_changed_line(result, "enabled"))


@principals.command("remove")
@click.argument("name", shell_complete=_complete_principals)
@_force_option("remove")
@as_option
@json_option
@pass_ctx
def principals_remove(c: Ctx, name: str, force: bool, as_: str | None, as_json: bool) -> None:
    """Remove NAME's entry from principals.yaml (other lines stay as they are)."""
    result = c.run(ops.PrincipalChange("remove", name, force), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(_changed_line(result, "removed"))


@principals.command("token")
@click.argument("name", shell_complete=_complete_principals)
@as_option
@json_option
@pass_ctx
def principals_token(c: Ctx, name: str, as_: str | None, as_json: bool) -> None:
    """Issue a new API token for NAME (printed once; only its hash is stored;
    the old token stops working)."""
    result = c.run(ops.PrincipalToken(name), as_)
    if as_json:
        _emit(result)
    else:
        click.echo(result["token"])


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
    Logs go to journald when systemd runs it, else to stderr."""
    from kbd.daemon.journal import parse_level
    from kbd.daemon.server import serve  # the API stack is imported only by the daemon
    from kbd.service.root import Root

    serve(Root(c.root, sweep_interval=1.0), socket_path=socket_path, fd=fd, log_level=parse_level(log_level))


# -- browsing ---------------------------------------------------------------------------


@main.command("read")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("alias", shell_complete=_complete_aliases)
@click.argument("relpath")
@as_option
@json_option
@pass_ctx
def read_cmd(c: Ctx, wf: str, alias: str, relpath: str, as_: str | None, as_json: bool) -> None:
    """Print a file of WF's attached KB ALIAS (RELPATH relative to the KB root).
    ALIAS `.` is WF's own KB."""
    op = ops.OwnRead(wf, relpath) if alias == ops.OWN_KB else ops.Read(wf, alias, relpath)
    result = c.run(op, as_)
    if as_json:
        _emit(result)
        return
    content = result["content"]
    _write_stdout(base64.b64decode(content) if result["encoding"] == "base64" else content.encode())


@main.command("ls")
@click.argument("wf", shell_complete=_complete_workflows)
@click.argument("alias", shell_complete=_complete_aliases)
@click.argument("reldir", required=False, default="")
@click.option("--limit", type=int, default=None, help=f"At most N entries (default {DEFAULT_LS_LIMIT}, "
              f"at most {MAX_LS_LIMIT}).")  # fmt: skip
@click.option(
    "--after", default=None, metavar="NAME", help="Start after this name (the previous page's next)."
)
@as_option
@json_option
@pass_ctx
def ls_cmd(
    c: Ctx,
    wf: str,
    alias: str,
    reldir: str,
    limit: int | None,
    after: str | None,
    as_: str | None,
    as_json: bool,
) -> None:
    """List a folder of WF's attached KB ALIAS (default: the KB root), in name order, one page at a time.
    ALIAS `.` is WF's own KB."""
    own = alias == ops.OWN_KB
    page = c.run(ops.OwnLs(wf, reldir, limit, after) if own else ops.Ls(wf, alias, reldir, limit, after), as_)
    if as_json:
        _emit(page)
        return
    if page["truncated"] and page["next"] is not None:
        click.echo(
            f"kbd: more entries follow; next page: --after {one_line(page['next'], limit=300)}", err=True
        )
    for e in page["entries"]:
        # Names are the source's: never let one print a fake second entry or control the terminal.
        click.echo(
            one_line(e["name"], limit=300)
            + ("/" if e["type"] == "dir" else "@" if e["type"] == "symlink" else "")
        )


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
    shell_complete=_complete_workflows,
    help="Only records touching WF (or one of its sessions).",
)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records until Ctrl-C or SIGTERM.")
@json_option
@pass_ctx
def audit_cmd(c: Ctx, since: str | None, wf: str | None, follow: bool, as_json: bool) -> None:
    """Show the audit log (grants, revokes, refusals, session and note events).

    Torn lines (a crash mid-write, a hand edit) are skipped and counted on stderr.
    With --follow and --json: one JSON object a line."""
    from kbd.service import admin
    from kbd.state import audit as audit_log

    try:
        since_at = audit_log.parse_since(since) if since is not None else None
    except ValueError as exc:
        raise UsageError(f"--since: {exc}", hint="e.g. --since 10m or --since 2026-12-01T14:00:00Z") from None
    feed = admin.AuditFeed(lambda offset: c.run(ops.AuditChunk(offset)), since=since_at, workflow=wf)
    if as_json and not follow:
        _emit(feed.records().to_json())
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
    """Show the change feed of the running daemon (DESIGN §9): content-free
    notices of what changed (workflows, sources, writers, sessions, notes).

    Needs `kbd serve` ($KBD_SOCKET, else the root's socket); authenticated as
    your uid's principal, or by the token in $KBD_TOKEN. Shows only events
    about workflows you may see. A `resync` event means continuity was lost:
    reload what you keep. With --json: one JSON object a line."""
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
                _write_stdout(line.encode() + b"\n")
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
    _write_stdout(cls(main, {}, "kbd", "_KBD_COMPLETE").source().encode())


_accept_global_options(main)
