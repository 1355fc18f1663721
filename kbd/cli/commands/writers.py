"""``kbd writers``: who may write into a source's ``notes/`` (list, grant, revoke)."""

from __future__ import annotations

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    complete_workflows,
    dry_run_option,
    json_option,
    main,
    pass_ctx,
)
from kbd.core.identifiers import one_line

# -- writers ---------------------------------------------------------------------------


@main.group()
def writers() -> None:
    """Which consumer workflows may write into a source's notes/."""


@writers.command("list")
@click.argument("source_wf", shell_complete=complete_workflows)
@as_option
@json_option
@pass_ctx
def writers_list(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Consumer workflows SOURCE_WF's owner lets write into its notes/."""
    if (view := c.shown(ops.WritersList(source_wf), as_, as_json)) is None:
        return
    if not view.writers:
        click.echo(f"no workflow may write into {one_line(source_wf)}'s notes/")
    for w in view.writers:
        click.echo(f"{one_line(w.workflow_id)}{'' if w.exists else '  (no such workflow now)'}")


@writers.command("grant")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("consumer_wf", shell_complete=complete_workflows)
@dry_run_option
@as_option
@json_option
@pass_ctx
def writers_grant(
    c: Ctx, source_wf: str, consumer_wf: str, dry_run: bool, as_: str | None, as_json: bool
) -> None:
    """Let CONSUMER_WF write into SOURCE_WF's notes/ (source owners and admins only).

    \b
    EXAMPLES
      kbd writers grant cost research
    """
    if c.previewed(ops.Grant(source_wf, consumer_wf), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.Grant(source_wf, consumer_wf), as_, as_json)) is not None:
        click.echo(
            f"{result.consumer} may write into {source_wf}'s notes/"
            + ("" if result.changed else " (already granted)")
        )


@writers.command("revoke")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("consumer_wf", shell_complete=complete_workflows)
@dry_run_option
@as_option
@json_option
@pass_ctx
def writers_revoke(
    c: Ctx, source_wf: str, consumer_wf: str, dry_run: bool, as_: str | None, as_json: bool
) -> None:
    """Withdraw CONSUMER_WF's write grant on SOURCE_WF.

    \b
    EXAMPLES
      kbd writers revoke cost research --dry-run
    """
    if c.previewed(ops.Revoke(source_wf, consumer_wf), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.Revoke(source_wf, consumer_wf), as_, as_json)) is not None:
        click.echo(
            f"{result.consumer} may no longer write into {source_wf}"
            + ("" if result.changed else " (was not granted)")
        )
