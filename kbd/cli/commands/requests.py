"""``kbd request`` and ``kbd requests``: ask a source's owners for access, and decide what was
asked (docs/access.md "Access requests")."""

from __future__ import annotations

import click

from kbd import ops
from kbd.cli.app import Ctx, as_option, complete_workflows, json_option, main, pass_ctx
from kbd.core.identifiers import one_line
from kbd.service.requests import AccessRequest

_MESSAGE = click.option(
    "--message", metavar="TEXT", help="One line for the other side (at most 500 characters)."
)


@main.command("request")
@click.argument("kind", type=click.Choice(["read", "write"]))
@click.argument("source", shell_complete=complete_workflows)
@click.option("--for", "consumer", required=True, metavar="WF", shell_complete=complete_workflows,
              help="The workflow that would read (its whole audience) or write.")  # fmt: skip
@_MESSAGE
@as_option
@json_option
@pass_ctx
def request_cmd(c: Ctx, kind: str, source: str, consumer: str, message: str | None, as_: str | None,
                as_json: bool) -> None:  # fmt: skip
    """Ask SOURCE's owners to let WF read (admit WF's whole audience) or write into its notes/.

    \b
    EXAMPLES
      kbd request write cost --for research --message "we record join costs here"
    """
    if (r := c.shown(ops.RequestOpen(kind, source, consumer, message), as_, as_json)) is not None:
        click.echo(f"request {r.request_id}: asked {one_line(r.source)} to let {one_line(r.consumer)} {r.kind} "
                   f"(pending until {r.expires_at})")  # fmt: skip


@main.group()
def requests() -> None:
    """Access requests you made or may decide."""


@requests.command("list")
@as_option
@json_option
@pass_ctx
def requests_list(c: Ctx, as_: str | None, as_json: bool) -> None:
    """The requests you made and those you may decide (a source's owners, admins), newest first."""
    if (listing := c.shown(ops.RequestsList(), as_, as_json)) is None:
        return
    if not listing.requests:
        click.echo("no access requests")
    for r in listing.requests:
        click.echo(_line(r))


def _line(r: AccessRequest) -> str:
    decided = f" by {one_line(r.decided_by)}" if r.decided_by else ""
    note = f": {one_line(r.decision_message, limit=200)}" if r.decision_message else ""
    said = f' "{one_line(r.message, limit=200)}"' if r.message else ""
    mark = "  (you may decide)" if r.can_decide else ""
    return (f"{r.request_id}  {r.state}{decided}{note}  {r.kind} {one_line(r.source)} for {one_line(r.consumer)}"
            f"  asked by {one_line(r.requested_by)}{said}{mark}")  # fmt: skip


def _decide(c: Ctx, rid: int, decision: str, message: str | None, as_: str | None, as_json: bool) -> None:
    if (r := c.shown(ops.RequestDecide(rid, decision, message), as_, as_json)) is not None:  # type: ignore[arg-type]
        click.echo(_line(r))


@requests.command("approve")
@click.argument("rid", metavar="ID", type=click.IntRange(min=1))
@_MESSAGE
@as_option
@json_option
@pass_ctx
def requests_approve(c: Ctx, rid: int, message: str | None, as_: str | None, as_json: bool) -> None:
    """Approve request ID: make the grant it asks for (source owners and admins).

    \b
    EXAMPLES
      kbd requests approve 3
    """
    _decide(c, rid, "approve", message, as_, as_json)


@requests.command("decline")
@click.argument("rid", metavar="ID", type=click.IntRange(min=1))
@_MESSAGE
@as_option
@json_option
@pass_ctx
def requests_decline(c: Ctx, rid: int, message: str | None, as_: str | None, as_json: bool) -> None:
    """Decline request ID, with a message for the one who asked."""
    _decide(c, rid, "decline", message, as_, as_json)
