"""The interfaces kbd opens for an agent or a person: ``kbd mcp``, ``kbd ui``."""

from __future__ import annotations

import os

import click

from kbd.cli.app import (
    Ctx,
    as_option,
    complete_sessions,
    complete_workflows,
    main,
    pass_ctx,
)


@main.command("mcp")
@click.argument("sid", shell_complete=complete_sessions)
@as_option
@pass_ctx
def mcp_cmd(c: Ctx, sid: str, as_: str | None) -> None:
    """Serve session SID's knowledge tools over MCP on stdin/stdout (docs/mcp.md).

    \b
    EXAMPLES
      kbd mcp SID   # in an MCP client's server command (docs/mcp.md)
    """
    from kbd.core.principals import named_principal
    from kbd.mcp import server as mcp_server

    # An empty --as/KBD_AS is a usage error (exit 2) here too, before serving: not
    # a server that starts and then refuses every call.
    named_principal(as_, os.environ.get("KBD_AS"))
    mcp_server.serve(c.via, sid, as_)


@main.command("ui")
@click.argument("wf", required=False, default=None, shell_complete=complete_workflows)
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
    cannot use the root yourself), and every action is re-checked there.

    \b
    EXAMPLES
      kbd ui research
      kbd ui --no-browser --port 8765
    """
    from kbd.ui import server

    server.serve(c.via, root=c.root, workflow=wf, port=port, as_=as_, open_browser=not no_browser)
