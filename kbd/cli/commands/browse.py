"""Reading knowledge bases: ``kbd read``, ``kbd ls``, ``kbd search``."""

from __future__ import annotations

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    complete_aliases,
    complete_sessions,
    complete_workflows,
    json_option,
    main,
    pass_ctx,
    write_stdout,
)
from kbd.core.identifiers import one_line
from kbd.core.relpaths import DEFAULT_LS_LIMIT, MAX_LS_LIMIT


@main.command("search")
@click.argument("sid", shell_complete=complete_sessions)
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
    """Search every KB session SID may read now (its own and each available source).

    QUERY: every word must appear; "a phrase" in quotes; a OR b for either;
    word* for a prefix; -word (or NOT word) to exclude (a query that starts
    with - goes after --: kbd search SID -- -draft notes).

    \b
    EXAMPLES
      kbd search SID 'router OR egress'
      kbd search SID '"p99 latency" -draft' --alias rts
    """
    if (result := c.shown(ops.Search(sid, query, aliases, limit, include_unreviewed), as_, as_json)) is None:
        return
    for hit in result.hits:
        where = one_line(hit.alias) if hit.alias is not None else "(own)"
        click.echo(f"{where}:{one_line(hit.relpath)}  {one_line(hit.title)}  [{hit.trust}]")
        click.echo(f"    {one_line(hit.snippet, limit=400)}")
    n = len(result.hits)
    click.echo(f"{n} hit{'s' if n != 1 else ''}" if n else "no hits")
    if result.hint is not None:
        click.echo(f"hint: {result.hint}", err=True)
    if result.dropped_by_gate:
        click.echo(f"{result.dropped_by_gate} left out: their text matches the prompt-injection patterns")


# -- browsing ---------------------------------------------------------------------------


@main.command("read")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("alias", shell_complete=complete_aliases)
@click.argument("relpath")
@as_option
@json_option
@pass_ctx
def read_cmd(c: Ctx, wf: str, alias: str, relpath: str, as_: str | None, as_json: bool) -> None:
    """Print a file of WF's attached KB ALIAS (RELPATH relative to the KB root).
    ALIAS `.` is WF's own KB.

    \b
    EXAMPLES
      kbd read research rts notes/router.md
      kbd read research . context/about.md --json
    """
    op = ops.OwnRead(wf, relpath) if alias == ops.OWN_KB else ops.Read(wf, alias, relpath)
    if (result := c.shown(op, as_, as_json)) is None:
        return
    write_stdout(result.data)


@main.command("ls")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("alias", shell_complete=complete_aliases)
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
    ALIAS `.` is WF's own KB.

    \b
    EXAMPLES
      kbd ls research rts notes
      kbd ls research rts notes --limit 100 --after m.md
    """
    own = alias == ops.OWN_KB
    op = ops.OwnLs(wf, reldir, limit, after) if own else ops.Ls(wf, alias, reldir, limit, after)
    if (page := c.shown(op, as_, as_json)) is None:
        return
    if page.truncated and page.next is not None:
        click.echo(f"kbd: more entries follow; next page: --after {one_line(page.next, limit=300)}", err=True)
    for e in page.entries:
        # Names are the source's: never let one print a fake second entry or control the terminal.
        click.echo(
            one_line(e["name"], limit=300)
            + ("/" if e["type"] == "dir" else "@" if e["type"] == "symlink" else "")
        )
