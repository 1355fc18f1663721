"""``kbd mcp`` made for agents (docs/mcp.md), through the MCP SDK's own stdio
client and a real ``kbd mcp`` process: the server says who it is and how to use
it, annotates which tools only read (so a client may run them without asking),
lists a source's root without arguments, makes the safe write the easy one
(``kb_read`` gives the version ``kb_write_note`` checks), and says why a write is
refused with hints an agent can act on, never a ``kbd`` command it cannot run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import kbd
from tests.helpers import KbRoot
from tests.integration.test_mcp import TEAM, _call, _text

READ_TOOLS = {"kb_sources", "kb_list", "kb_read", "kb_search", "kb_check", "kb_why"}


def _world(tmp_path: Path) -> tuple[KbRoot, str]:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={**TEAM, "allowed_kb_writers": ["con"]})
    kb.workflow("plain", access=TEAM)  # grants no writer
    kb.workflow("plain2", access=TEAM)  # grants no writer either
    kb.workflow("con", access=TEAM, sources=[
        {"workflow_id": "src", "alias": "rts", "access": "write"},
        {"workflow_id": "plain", "alias": "ro", "access": "read"},
        {"workflow_id": "plain2", "alias": "ng", "access": "write"},
    ])  # fmt: skip
    (kb.workflows / "src" / "knowledgebase" / "notes" / "plan.md").write_text("# Plan\nv1\n")
    return kb, kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")


def test_the_server_serves_agents(tmp_path: Path) -> None:
    kb, sid = _world(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KBD_")}, "KBD_DEBUG": "1"}
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "kbd", "--root", str(kb.root), "mcp", sid, "--as", "alice"],
        env=env,
    )
    notes = kb.workflows / "src" / "knowledgebase" / "notes"

    async def steps(client: ClientSession, init: types.InitializeResult) -> None:
        assert init.server_info.name == "kbd" and init.server_info.version == kbd.__version__
        assert init.instructions is not None and "kb_sources" in init.instructions
        assert "expected_version" in init.instructions and "never instructions" in init.instructions
        tools = {t.name: t for t in (await client.list_tools()).tools}
        for name, tool in tools.items():
            assert tool.annotations is not None, name
            assert tool.annotations.read_only_hint is (name in READ_TOOLS), name
            assert tool.annotations.destructive_hint is (name not in READ_TOOLS), name
            assert tool.annotations.open_world_hint is False, name
        # The root of a source without naming it.
        root = await _call(client, "kb_list", {"alias": "rts"})
        assert not root.is_error and root.structured_content is not None, _text(root)
        assert {e["name"] for e in root.structured_content["entries"]} >= {"context", "notes"}
        # The safe write is the easy one: kb_read's version is what kb_write_note checks.
        read = await _call(client, "kb_read", {"alias": "rts", "relpath": "notes/plan.md"})
        assert read.structured_content is not None, _text(read)
        version = read.structured_content["version"]
        assert version.startswith("sha256:") and len(version) == 71
        (notes / "plan.md").write_text("# Plan\nv2, by someone else\n")
        stale = await _call(client, "kb_write_note",
                            {"alias": "rts", "relpath": "notes/plan.md", "content": "# Plan\nmine\n",
                             "expected_version": version})  # fmt: skip
        assert stale.is_error and _text(stale).startswith("error[note-version-conflict]"), _text(stale)
        assert (notes / "plan.md").read_text() == "# Plan\nv2, by someone else\n"
        again = await _call(client, "kb_read", {"alias": "rts", "relpath": "notes/plan.md"})
        assert again.structured_content is not None
        ok = await _call(client, "kb_write_note",
                         {"alias": "rts", "relpath": "notes/plan.md", "content": "# Plan\nmine\n",
                          "expected_version": again.structured_content["version"]})  # fmt: skip
        assert not ok.is_error, _text(ok)
        # Why a write is refused: the one reason that applies, and a hint with the agent's own tools.
        for alias, says in (
            ("ro", "is attached read-only (access read)"),
            ("ng", "is not writable: write_not_granted"),
        ):
            refused = await _call(
                client, "kb_write_note", {"alias": alias, "relpath": "notes/x.md", "content": "x\n"}
            )
            text = _text(refused)
            assert refused.is_error and text.startswith("error[permission-denied]: ") and says in text, text
            hint = text.split("\nhint: ", 1)[1]
            assert hint.startswith("kb_sources") and "kbd " not in hint, text

    async def main() -> None:
        with anyio.fail_after(90):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
                await steps(client, await client.initialize())

    anyio.run(main)
