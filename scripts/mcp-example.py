"""`make mcp-example`: an agent's side of `kbd mcp`, runnable.

Builds a demo root in a temporary folder (or uses --root ROOT), opens an
execution session of wf_perf for alice, then does what an MCP-capable agent
does with the registration in docs/mcp.md: starts `kbd mcp SID --as alice` over stdio
with the official MCP SDK client, lists the tools, and calls each of them,
printing what an agent would see. A refusal is shown as the agent sees it: a
tool error starting with kbd's `error[<code>]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


def kbd(root: Path, *args: str) -> str:
    """One `kbd` command on ROOT (it must succeed); its stdout."""
    cmd = [sys.executable, "-m", "kbd", "--root", str(root), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout  # noqa: S603 (our own argv)


def registration(root: Path, sid: str) -> dict[str, Any]:
    """The `mcpServers` entry of docs/mcp.md, filled in (the interpreter stands in for
    `kbd` so the example runs from a checkout without an installed command)."""
    return {"mcpServers": {"kbd": {"command": sys.executable, "args": ["-m", "kbd", "mcp", sid, "--as", "alice"],
                                   "env": {"KBD_ROOT": str(root)}}}}  # fmt: skip


def show(title: str, result: types.CallToolResult) -> None:
    block = result.content[0]
    text = block.text if isinstance(block, types.TextContent) else repr(block)
    print(f"\n## {title}{'   (a tool error)' if result.is_error else ''}\n{text}")


async def agent(config: dict[str, Any], root: Path) -> None:
    server = config["mcpServers"]["kbd"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KBD_")}, **server["env"]}
    params = StdioServerParameters(command=server["command"], args=server["args"], env=env)
    security = root / "workflows" / "wf_security" / "knowledgebase"
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = (await session.list_tools()).tools
        print("## tools/list\n" + "\n".join(f"- {t.name}: {t.description}" for t in tools))
        show("kb_sources", await session.call_tool("kb_sources", {}))
        show("kb_search router", await session.call_tool("kb_search", {"query": "router", "limit": 2}))
        show("kb_list rts notes", await session.call_tool("kb_list", {"alias": "rts", "reldir": "notes"}))
        show("kb_read rts notes/services.md",
             await session.call_tool("kb_read", {"alias": "rts", "relpath": "notes/services.md"}))  # fmt: skip
        note = {"alias": "security", "relpath": "notes/from-agent.md", "content": "# Join time\np99 840 ms.\n"}
        show("kb_write_note security notes/from-agent.md", await session.call_tool("kb_write_note", note))
        show("kb_check the source's context/ for write",
             await session.call_tool("kb_check", {"path": str(security / "context" / "x.md"), "mode": "write"}))  # fmt: skip
        show("kb_read a path out of the KB",
             await session.call_tool("kb_read", {"alias": "rts", "relpath": "../credentials/token"}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, help="an existing demo root (default: a new one in a temporary folder)"
    )
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kbd-mcp-example-") as tmp:
        root = options.root or Path(tmp) / "root"
        if options.root is None:
            kbd(root, "init", "--demo", "--host", "demo-host")
            kbd(root, "writers", "grant", "wf_security", "wf_perf", "--as", "bob")
        opened = kbd(root, "session", "open", "wf_perf", "--kind", "execution", "--kb-access", "read-write",
                     "--as", "alice", "--json")  # fmt: skip
        sid = json.loads(opened)["session_id"]
        config = registration(root, sid)
        print("# the agent's MCP registration (docs/mcp.md: Registration)")
        print(json.dumps(config, indent=2))
        anyio.run(agent, config, root)
        kbd(root, "session", "close", sid, "--as", "alice")


if __name__ == "__main__":
    main()
