"""``kbd readers``: who may read a workflow as a source (its ``access.readers``), the change that
admits a consumer's whole audience (docs/access.md "Access rules")."""

from __future__ import annotations

import click

from kbd import ops
from kbd.cli.app import Ctx, as_option, complete_workflows, dry_run_option, json_option, main, pass_ctx
from kbd.core.identifiers import one_line


@main.group()
def readers() -> None:
    """Which principals may read a workflow's outputs and knowledge base (access.readers)."""


@readers.command("grant")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("principals", nargs=-1, required=True)
@dry_run_option
@as_option
@json_option
@pass_ctx
def readers_grant(
    c: Ctx, wf: str, principals: tuple[str, ...], dry_run: bool, as_: str | None, as_json: bool
) -> None:
    """Add PRINCIPALS to WF's readers (its owners and admins only).

    \b
    EXAMPLES
      kbd readers grant cost bob carl
    """
    if c.previewed(ops.ReadersGrant(wf, principals), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.ReadersGrant(wf, principals), as_, as_json)) is not None:
        names = ", ".join(one_line(p) for p in result.principals)
        click.echo(f"{names} may read {one_line(wf)}" + ("" if result.changed else " (already readers)"))
        if result.unknown:
            click.echo(f"kbd: note: no principal is named {', '.join(map(one_line, result.unknown))} "
                       "(principals.yaml); the grant waits for one", err=True)  # fmt: skip


@readers.command("revoke")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("principals", nargs=-1, required=True)
@dry_run_option
@as_option
@json_option
@pass_ctx
def readers_revoke(
    c: Ctx, wf: str, principals: tuple[str, ...], dry_run: bool, as_: str | None, as_json: bool
) -> None:
    """Remove PRINCIPALS from WF's readers (owners and editors keep reading).

    \b
    EXAMPLES
      kbd readers revoke cost dave --dry-run
    """
    if c.previewed(ops.ReadersRevoke(wf, principals), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.ReadersRevoke(wf, principals), as_, as_json)) is not None:
        names = ", ".join(one_line(p) for p in result.principals)
        click.echo(
            f"{names}: no longer readers of {one_line(wf)}" + ("" if result.changed else " (were not)")
        )
