"""``kbd mcp`` as the MCP specification's "Tools" section asks, through the
real SDK client and a real server process (docs/mcp.md): every tool declares an ``outputSchema`` and every result's
``structuredContent`` conforms to it (checked here with ``jsonschema``, not only
by the SDK), its text is that content's JSON (retrieved text excepted: it is
fenced data), an unknown tool is the protocol error ``-32602`` and a ``null``
argument is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from jsonschema import Draft202012Validator
from mcp import MCPError
from mcp.client.session import ClientSession

from kbd.mcp.server import OUTPUTS, TOOLS
from tests.integration.daemon import issue_tokens, serving
from tests.integration.test_mcp import ALL_TOOLS, _call, _drive, _text, _world

#: Tools whose text is fenced data for the model, not the JSON of their content (docs/mcp.md "Rules").
FENCED = {"kb_read", "kb_search"}


def test_every_declared_output_schema_is_a_valid_json_schema() -> None:
    assert {t.name for t in TOOLS} == set(OUTPUTS) == ALL_TOOLS
    for tool in TOOLS:
        Draft202012Validator.check_schema(tool.output)
        assert tool.output["type"] == "object", tool.name  # structuredContent is an object


def _calls(src_kb: Path) -> list[tuple[str, dict[str, Any]]]:
    """Each tool, successfully, in as many shapes as the world offers."""
    return [
        ("kb_sources", {}),
        ("kb_list", {"alias": "rts", "reldir": "."}),
        ("kb_list", {"alias": "rts", "reldir": "notes"}),
        ("kb_list", {"alias": "rts", "reldir": "context", "after": "a"}),
        ("kb_read", {"alias": "rts", "relpath": "context/retry.md"}),
        ("kb_read", {"alias": "rts", "relpath": "context/blob.bin"}),
        ("kb_search", {"query": "zanzibar"}),
        ("kb_search", {"query": "zanzibar", "alias": "rts", "limit": 1}),
        ("kb_search", {"query": "nothingmatchesthis"}),
        ("kb_check", {"path": str(src_kb / "notes" / "a.md"), "mode": "write"}),
        ("kb_check", {"path": "/etc/passwd", "mode": "read"}),
        ("kb_why", {"path": "rts:notes/a.md", "mode": "write"}),
        ("kb_why", {"path": "rts:context/retry.md", "mode": "write"}),
        ("kb_why", {"path": "/etc/passwd"}),
        ("kb_write_note", {"alias": "rts", "relpath": "schema.md", "content": "# S\nchecked\n"}),
        ("kb_write_note", {"alias": "rts", "relpath": "schema.md", "content": "# S\nagain\n"}),
    ]


def _check_results(kb_root: Any, sid: str, *, env: dict[str, str] | None = None) -> dict[str, int]:
    """Call every tool; validate every result against the schema the server listed."""
    src_kb = kb_root.workflows / "src" / "knowledgebase"
    (src_kb / "context" / "blob.bin").write_bytes(b"\xff\x00binary")
    seen: dict[str, int] = {}

    async def steps(client: ClientSession) -> None:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert set(listed) == ALL_TOOLS
        for name, tool in listed.items():
            assert tool.output_schema == OUTPUTS[name], name  # what the client is told is what is checked
        for name, args in _calls(src_kb):
            result = await _call(client, name, args)
            assert not result.is_error, (name, _text(result))
            content = result.structured_content
            schema = listed[name].output_schema
            assert schema is not None, name
            errors = sorted(Draft202012Validator(schema).iter_errors(content), key=str)
            assert not errors, (name, args, [e.message for e in errors])
            texts = [b.text for b in result.content if isinstance(b, types.TextContent)]
            if name in FENCED:
                assert len(texts) == 1 and texts[0].startswith(("kbd file ", "kbd search ")), (name, texts)
            else:
                assert len(texts) == 1 and json.loads(texts[0]) == content, (name, texts)
            seen[name] = seen.get(name, 0) + 1

    _drive(kb_root, sid, steps, env=env)
    return seen


def test_every_tool_result_conforms_to_its_output_schema(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    seen = _check_results(kb, sid)
    assert set(seen) == ALL_TOOLS


def test_every_tool_result_conforms_through_the_daemon(tmp_path: Path) -> None:
    """The same through the daemon (each call one API request): the same JSON, the same schemas."""
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    tokens = issue_tokens(kb.root, ["alice"])
    with serving(kb.root, sock=tmp_path / "kbd.sock", home=tmp_path / "home") as daemon:
        seen = _check_results(kb, sid, env={"KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": tokens["alice"]})
    assert set(seen) == ALL_TOOLS


def test_an_unknown_tool_is_a_protocol_error_and_null_is_refused(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")

    async def steps(client: ClientSession) -> None:
        for name in ("kb_nope", "", "kb_sources\n"):
            with pytest.raises(MCPError) as caught:
                await client.call_tool(name, {})
            assert caught.value.code == types.INVALID_PARAMS == -32602, caught.value
            assert "Unknown tool" in caught.value.message
        for name, args, field, want in [
            ("kb_search", {"query": "zanzibar", "limit": None}, "limit", "an integer"),
            ("kb_search", {"query": "zanzibar", "alias": None}, "alias", "a string"),
            ("kb_list", {"alias": "rts", "reldir": ".", "after": None}, "after", "a string"),
            ("kb_write_note", {"alias": "rts", "relpath": "n.md", "content": "x", "expected_version": None},
             "expected_version", "a string"),
        ]:  # fmt: skip
            result = await _call(client, name, args)
            assert result.is_error, (name, _text(result))
            assert _text(result).startswith(
                f"error[invalid-input]: {name}: argument {field!r} must be {want}, got null\n"
            ), _text(result)
        # A required argument given as null is still "required", as before.
        result = await _call(client, "kb_read", {"alias": "rts", "relpath": None})
        assert result.is_error and "argument 'relpath' is required" in _text(result), _text(result)
        # Still serving after all of that.
        assert "kb_sources" in {t.name for t in (await client.list_tools()).tools}

    _drive(kb, sid, steps)
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "n.md").exists()
