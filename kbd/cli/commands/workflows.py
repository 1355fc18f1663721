"""``kbd workflows``: list, create, show."""

from __future__ import annotations

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    attachment_line,
    complete_workflows,
    json_option,
    main,
    pass_ctx,
)
from kbd.core.identifiers import one_line

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
    if (result := c.shown(ops.WorkflowsList(), as_, as_json)) is None:
        return
    if not result.workflows:
        click.echo("no workflows you may see under this root's workflow_roots")
    for r in result.workflows:
        status = "" if r.status == "ok" else f"  [{r.status}]"
        if r.nested_in:
            status += f" inside workflow folder {one_line(r.nested_in)}"
        if r.contains:
            status += f" contains workflow folder {', '.join(one_line(p) for p in r.contains)}"
        click.echo(
            f"{one_line(r.id or '?'):<24} {one_line(r.label or '', limit=40):<28} {one_line(r.path)}{status}"
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
    """Create workflow folder WF for its owner (owner's uid, the host's grant group).

    \b
    EXAMPLES
      kbd workflows create research --label "Research"
    """
    if (made := c.shown(ops.WorkflowCreate(wf, label, owner), as_, as_json)) is None:
        return
    owners = _ids(made.owners)
    click.echo(f"created workflow {one_line(made.workflow_id)} for {owners} at {one_line(made.path)}")


def _ids(ids: list[str] | tuple[str, ...]) -> str:
    """A list of workflow or principal IDs on one line, each escaped."""
    return ", ".join(one_line(i) for i in ids)


@workflows.command("show")
@click.argument("wf", shell_complete=complete_workflows)
@as_option
@json_option
@pass_ctx
def workflows_show(c: Ctx, wf: str, as_: str | None, as_json: bool) -> None:
    """Everything a builder needs: attachments, write grants, candidates."""
    if (d := c.shown(ops.WorkflowShow(wf), as_, as_json)) is None:
        return
    click.echo(f"{one_line(d.workflow_id)}  {one_line(d.label)}  ({one_line(d.path)})")
    owners = _ids(d.owners) or "none (legacy, account-visible)"
    click.echo(f"  owners: {owners}; editors: {_ids(d.editors) or '-'}; readers: {_ids(d.readers) or '-'}")
    click.echo("attached knowledge bases:")
    for a in d.sources:
        click.echo(attachment_line(a))
    if not d.sources:
        click.echo("  (none)")
    click.echo(f"writes into: {_ids(d.writes_into) or '-'}")
    click.echo(f"workflows allowed to write into this KB's notes/: {_ids(d.allowed_kb_writers) or '-'}")
    could = ", ".join(f"{one_line(x.workflow_id)} ({one_line(x.label, limit=40)})" for x in d.candidates)
    click.echo(f"could attach now: {could or '-'}")
