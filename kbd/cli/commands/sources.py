"""``kbd sources``: a consumer's attachments (list, attach, detach, access, set, candidates)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    attachment_line,
    complete_aliases,
    complete_workflows,
    dry_run_option,
    json_option,
    main,
    manifest_version_option,
    pass_ctx,
)
from kbd.core.identifiers import alias_problem, one_line
from kbd.core.strict import load_json_strict
from kbd.errors import (
    InvalidInput,
    NotFound,
)

# -- sources ------------------------------------------------------------------------


@main.group()
def sources() -> None:
    """A workflow's attached knowledge bases."""


@sources.command("list")
@click.argument("wf", shell_complete=complete_workflows)
@as_option
@json_option
@pass_ctx
def sources_list(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Each attachment with its status and reason."""
    if (view := c.shown(ops.SourcesList(wf), as_, as_json)) is None:
        return
    if not view.sources:
        click.echo(f"{one_line(wf)} has no attached sources")
    for a in view.sources:
        click.echo(attachment_line(a))


@sources.command("attach")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("source_id", shell_complete=complete_workflows)
@click.option("--alias", required=True, help="Local name: ^[a-z][a-z0-9_]{0,47}$, not 'access'.")
@click.option("--access", type=click.Choice(["read", "write"]), default="read", show_default=True)
@dry_run_option
@as_option
@json_option
@pass_ctx
def sources_attach(
    c: Ctx, wf: str, source_id: str, alias: str, access: str, dry_run: bool, as_: str | None, as_json: bool
) -> None:
    """Attach SOURCE_ID's knowledge base to WF under ALIAS.

    \b
    EXAMPLES
      kbd sources attach research routing-team --alias rts
      kbd sources attach research cost --alias cost --access write
    """
    if (problem := alias_problem(alias)) is not None:
        # Name the flag the user typed, not the manifest entry it would become.
        raise InvalidInput(f"--alias {alias!r} {problem}", hint="e.g. --alias rts")
    if c.previewed(ops.Attach(wf, source_id, alias, access), dry_run, as_, as_json):
        return
    if (a := c.shown(ops.Attach(wf, source_id, alias, access), as_, as_json)) is None:
        return
    click.echo(f"attached {source_id} to {wf} as {alias}")
    click.echo(attachment_line(a))


@sources.command("detach")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("alias", shell_complete=complete_aliases)
@dry_run_option
@as_option
@json_option
@pass_ctx
def sources_detach(c: Ctx, wf: str, alias: str, dry_run: bool, as_: str | None, as_json: bool) -> None:
    """Remove the attachment ALIAS from WF.

    \b
    EXAMPLES
      kbd sources detach research rts --dry-run
    """
    if c.previewed(ops.Detach(wf, alias), dry_run, as_, as_json):
        return
    if c.shown(ops.Detach(wf, alias), as_, as_json) is not None:
        click.echo(f"detached {alias} from {wf}")


@sources.command("access")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("alias", shell_complete=complete_aliases)
@click.argument("access", type=click.Choice(["read", "write"]))
@manifest_version_option
@dry_run_option
@as_option
@json_option
@pass_ctx
def sources_access(
    c: Ctx, wf: str, alias: str, access: str, expected_version: str | None, dry_run: bool, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Change the access of WF's attachment ALIAS (read or write), nothing else.

    \b
    EXAMPLES
      kbd sources access research cost read
    """
    if c.previewed(ops.SetAccess(wf, alias, access, expected_version), dry_run, as_, as_json):
        return
    if (a := c.shown(ops.SetAccess(wf, alias, access, expected_version), as_, as_json)) is None:
        return
    click.echo(f"{wf}: {alias} is now attached with {access} access")
    click.echo(attachment_line(a))


@sources.command("set")
@click.argument("wf", shell_complete=complete_workflows)
@click.option(
    "--file",
    "file",
    required=True,
    metavar="F|-",
    help="JSON array of entries; - reads stdin; [] detaches all.",
)
@manifest_version_option
@dry_run_option
@as_option
@json_option
@pass_ctx
def sources_set(
    c: Ctx, wf: str, file: str, expected_version: str | None, dry_run: bool, as_: str | None, as_json: bool
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
    if c.previewed(ops.SetSources(wf, raw, expected_version), dry_run, as_, as_json):
        return
    if (view := c.shown(ops.SetSources(wf, raw, expected_version), as_, as_json)) is None:
        return
    click.echo(f"{wf}: {len(view.sources)} sources saved")
    for a in view.sources:
        click.echo(attachment_line(a))


@sources.command("candidates")
@click.argument("wf", shell_complete=complete_workflows)
@as_option
@json_option
@pass_ctx
def sources_candidates(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Workflow IDs WF could attach right now."""
    if (result := c.shown(ops.Candidates(wf), as_, as_json)) is None:
        return
    if not result.candidates:
        click.echo(f"no workflow {one_line(wf)} could attach now")
    for r in result.candidates:
        granted = "  (write granted)" if r.write_granted else ""
        click.echo(f"{one_line(r.workflow_id):<24} {one_line(r.label, limit=60)}{granted}")
