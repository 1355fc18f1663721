"""``kbd readers``: who may read a workflow as a source (its ``access.readers``), the change that
admits a consumer's whole audience (docs/access.md "Access rules")."""

from __future__ import annotations

from dataclasses import replace

import click

from kbd import ops
from kbd.cli.app import Ctx, as_option, complete_workflows, emit, json_option, main, pass_ctx
from kbd.core.identifiers import one_line


@main.group()
def readers() -> None:
    """Which principals may read a workflow's outputs and knowledge base (access.readers)."""


@readers.command("grant")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("principals", nargs=-1, required=True)
@as_option
@json_option
@pass_ctx
def readers_grant(c: Ctx, wf: str, principals: tuple[str, ...], as_: str | None, as_json: bool) -> None:
    """Add PRINCIPALS to WF's readers (its owners and admins only).

    \b
    EXAMPLES
      kbd readers grant cost bob carl
    """
    if (result := c.shown(ops.ReadersGrant(wf, principals), as_, as_json)) is not None:
        names = ", ".join(one_line(p) for p in result.principals)
        click.echo(f"{names} may read {one_line(wf)}" + ("" if result.changed else " (already readers)"))


@readers.command("revoke")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("principals", nargs=-1, required=True)
@as_option
@json_option
@pass_ctx
def readers_revoke(c: Ctx, wf: str, principals: tuple[str, ...], as_: str | None, as_json: bool) -> None:
    """Remove PRINCIPALS from WF's readers (owners and editors keep reading)."""
    results = [c.result(ops.ReadersRevoke(wf, p), as_) for p in principals]
    if as_json:
        # One answer for the whole command, as a grant of several gives: the readers as saved last.
        last = results[-1]
        emit(replace(last, principals=tuple(p for r in results for p in r.principals),
                     changed=any(r.changed for r in results)))  # fmt: skip
        return
    for p, result in zip(principals, results, strict=True):
        click.echo(
            f"{one_line(p)} is no longer a reader of {one_line(wf)}"
            + ("" if result.changed else " (was not)")
        )
