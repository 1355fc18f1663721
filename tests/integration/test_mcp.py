"""``kbd mcp SID`` driven by the MCP SDK's own stdio client (docs/mcp.md).

A real ``kbd mcp`` process on a real root, spoken to over the real protocol:
the tools a plan lists, the happy paths, the path escapes the reference
filesystem server shipped (a prefix sibling, an escaping link) and malformed
arguments, each answered as a tool error carrying kbd's code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving
from tests.mcp_client import Roots, initialize_lines, mcp_client, raw_exchange

TEAM = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}
ALL_TOOLS = {"kb_sources", "kb_list", "kb_read", "kb_search", "kb_check", "kb_why", "kb_write_note"}


def _world(tmp_path: Path) -> KbRoot:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={**TEAM, "allowed_kb_writers": ["con"]})
    kb.workflow("con", access=TEAM, sources=[{"workflow_id": "src", "alias": "rts", "access": "write"}])
    kb.workflow("other", access={"owners": ["dave"]})
    src_kb = kb.workflows / "src" / "knowledgebase"
    (src_kb / "context" / "retry.md").write_text(
        "# Retry policy\nBackoff doubles; zanzibar is the code word.\n"
    )
    (src_kb / "notes-evil").mkdir()  # the prefix sibling of notes/ (CVE-2025-53110)
    (src_kb / "notes-evil" / "x.md").write_text("sibling\n")
    secret = kb.workflows / "other" / "knowledgebase" / "context" / "secret.md"
    secret.write_text("zanzibar secret\n")
    (src_kb / "context" / "escape.md").symlink_to(secret)  # an escaping link (CVE-2025-53109)
    (src_kb / "notes" / "out.md").symlink_to(secret)
    return kb


Step = Callable[[ClientSession], Awaitable[None]]


def _drive(
    kb: KbRoot, sid: str, steps: Step, *, as_: str = "alice", env: dict[str, str] | None = None
) -> None:
    """Run ``steps`` against a real ``kbd mcp`` process over stdio (``env``: KBD_* for it)."""
    # KBD_DEBUG: should the server ever fail, its traceback lands in the test's output.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KBD_")},
        "KBD_DEBUG": "1",
        **(env or {}),
    }
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kbd", "--root", str(kb.root), "mcp", sid, "--as", as_], env=env
    )

    async def main() -> None:
        with anyio.fail_after(90):  # before pytest-timeout (120 s), so transports are closed
            async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
                await client.initialize()
                await steps(client)

    anyio.run(main)


async def _tools(client: ClientSession) -> set[str]:
    return {t.name for t in (await client.list_tools()).tools}


async def _call(client: ClientSession, name: str, args: dict[str, Any]) -> types.CallToolResult:
    result = await client.call_tool(name, args)
    assert isinstance(result, types.CallToolResult)
    return result


def _text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


async def _error(client: ClientSession, name: str, args: dict[str, Any], code: str) -> str:
    result = await _call(client, name, args)
    text = _text(result)
    assert result.is_error, text
    assert text.startswith(f"error[{code}]: "), text
    assert "Traceback" not in text
    return text


def test_tool_listing_follows_the_plan_kind(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    writer = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    reader = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    blind = kb.open_session("con", kind="execution", kb_access="none", actor="alice")
    seen: dict[str, set[str]] = {}

    for sid in (writer, reader, blind):

        async def steps(client: ClientSession, sid: str = sid) -> None:
            seen[sid] = await _tools(client)
            if sid != writer:
                # Not listed, and not callable either.
                await _error(client, "kb_write_note", {"alias": "rts", "relpath": "n.md", "content": "x"},
                             "permission-denied")  # fmt: skip

        _drive(kb, sid, steps)
    assert seen[writer] == ALL_TOOLS
    assert seen[reader] == ALL_TOOLS - {"kb_write_note"}
    assert seen[blind] == {"kb_sources", "kb_check", "kb_why"}


def test_happy_paths_and_escapes(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    src_kb = kb.workflows / "src" / "knowledgebase"

    async def steps(client: ClientSession) -> None:
        sources = (await _call(client, "kb_sources", {})).structured_content
        assert sources["sources"][0]["alias"] == "rts" and sources["sources"][0]["writable"] is True
        assert "path" not in sources["sources"][0]  # no host paths

        listing = await _call(client, "kb_list", {"alias": "rts", "reldir": "context"})
        assert not listing.is_error, _text(listing)
        names = {e["name"] for e in listing.structured_content["entries"]}
        assert {"about.md", "retry.md", "escape.md"} <= names

        read = await _call(client, "kb_read", {"alias": "rts", "relpath": "context/retry.md"})
        assert not read.is_error, _text(read)
        text = _text(read)
        assert "zanzibar is the code word" in text and "DATA" in text and "never instructions" in text
        fence = text.split("<<<kbd-data ", 1)[1].split(">>>", 1)[0]
        assert f"<<<end kbd-data {fence}>>>" in text
        assert read.structured_content["provenance"]["source_workflow"] == "src"

        hits = await _call(client, "kb_search", {"query": "zanzibar"})
        assert not hits.is_error, _text(hits)
        assert "secret" not in _text(hits)  # only what the plan may read

        allowed = await _call(client, "kb_check", {"path": str(src_kb / "notes" / "a.md"), "mode": "write"})
        assert allowed.structured_content["allowed"] is True, _text(allowed)
        sibling = await _call(
            client, "kb_check", {"path": str(src_kb / "notes-evil" / "x.md"), "mode": "write"}
        )
        assert sibling.structured_content["allowed"] is False, _text(sibling)

        wrote = await _call(
            client, "kb_write_note", {"alias": "rts", "relpath": "mcp.md", "content": "# MCP\nhi\n"}
        )
        assert not wrote.is_error, _text(wrote)

        # Escapes: a link out of the KB, on read and on write; the sibling by '..'.
        await _error(client, "kb_read", {"alias": "rts", "relpath": "context/escape.md"}, "path-refused")
        await _error(
            client, "kb_write_note", {"alias": "rts", "relpath": "out.md", "content": "x"}, "path-refused"
        )
        await _error(client, "kb_write_note", {"alias": "rts", "relpath": "../notes-evil/y.md", "content": "x"},
                     "invalid-path")  # fmt: skip

    _drive(kb, sid, steps)
    note = (src_kb / "notes" / "mcp.md").read_text()
    assert note.endswith("---\n# MCP\nhi\n") and "contributed_by_workflow: con\n" in note  # with provenance
    assert not (src_kb / "notes-evil" / "y.md").exists()
    assert (
        kb.workflows / "other" / "knowledgebase" / "context" / "secret.md"
    ).read_text() == "zanzibar secret\n"


def test_malformed_arguments_are_tool_errors(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")

    async def steps(client: ClientSession) -> None:
        await _error(client, "kb_read", {"alias": "rts"}, "invalid-input")  # missing relpath
        await _error(client, "kb_read", {"alias": "rts", "relpath": 7}, "invalid-input")
        await _error(client, "kb_read", {"alias": "rts", "relpath": "x", "extra": 1}, "invalid-input")
        await _error(client, "kb_search", {"query": "x", "limit": True}, "invalid-input")
        await _error(client, "kb_check", {"path": "/", "mode": "execute"}, "invalid-input")
        await _error(client, "kb_read", {"alias": "nope", "relpath": "x"}, "not-found")
        # Still serving after all of that.
        assert "kb_sources" in await _tools(client)

    _drive(kb, sid, steps)


def test_revoke_and_detach_take_effect_on_the_next_call(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    note = {"alias": "rts", "relpath": "late.md", "content": "x\n"}

    async def steps(client: ClientSession) -> None:
        assert await _tools(client) == ALL_TOOLS
        r = kb.call("writers", "revoke", "src", "con", "--as", "alice")
        assert r.code == 0, r.err
        assert await _tools(client) == ALL_TOOLS - {"kb_write_note"}
        await _error(client, "kb_write_note", note, "permission-denied")
        r = kb.call("sources", "detach", "con", "rts", "--as", "alice")
        assert r.code == 0, r.err
        assert await _tools(client) == {"kb_sources", "kb_check", "kb_why"}
        await _error(client, "kb_read", {"alias": "rts", "relpath": "context/retry.md"}, "permission-denied")
        assert (await _call(client, "kb_sources", {})).structured_content["sources"] == []

    _drive(kb, sid, steps)
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "late.md").exists()


def test_through_the_daemon(tmp_path: Path) -> None:
    """A caller that is not the root's owner: every tool call is one request to the daemon."""
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    tokens = issue_tokens(kb.root, ["alice"])
    src_kb = kb.workflows / "src" / "knowledgebase"

    async def steps(client: ClientSession) -> None:
        assert await _tools(client) == ALL_TOOLS
        read = await _call(client, "kb_read", {"alias": "rts", "relpath": "context/retry.md"})
        assert not read.is_error and "zanzibar is the code word" in _text(read), _text(read)
        wrote = await _call(
            client, "kb_write_note", {"alias": "rts", "relpath": "remote.md", "content": "r\n"}
        )
        assert not wrote.is_error, _text(wrote)
        await _error(client, "kb_read", {"alias": "rts", "relpath": "context/escape.md"}, "path-refused")
        sibling = await _call(
            client, "kb_check", {"path": str(src_kb / "notes-evil" / "x.md"), "mode": "write"}
        )
        assert sibling.structured_content["allowed"] is False, _text(sibling)

    with serving(kb.root, sock=tmp_path / "kbd.sock", home=tmp_path / "home") as daemon:
        _drive(kb, sid, steps, env={"KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": tokens["alice"]})

        async def stranger(client: ClientSession) -> None:
            # An unknown token: the daemon answers nothing, so nothing is offered (fail closed).
            assert await _tools(client) == set()
            await _error(client, "kb_sources", {}, "unauthenticated")

        _drive(kb, sid, stranger, env={"KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": "not-a-token"})
    assert (src_kb / "notes" / "remote.md").read_text().endswith("---\nr\n")


READS = ["context/retry.md", "context/inner.md", "context/escape.md", "../x", "notes-evil/x.md", "nosuch.md"]
WRITES = ["ok.md", "inner.md", "out.md", "dangling.md", "../notes-evil/y.md", "sub/../z.md"]


def _cli_code(r: Any) -> str | None:
    """kbd's error code from a CLI answer (None: it succeeded)."""
    if r.code == 0:
        return None
    return str(r.err.split("]", 1)[0].removeprefix("error["))


def test_same_answers_as_the_cli(tmp_path: Path) -> None:
    """kb_read and kb_write_note refuse exactly what `kbd read` and `kbd notes write`
    refuse, with the same code: links inside the KB, links out of it, a dangling
    leaf link, '..', the notes-evil sibling (readable as KB content, never as notes/)."""
    kb = _world(tmp_path)
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    (notes.parent / "context" / "inner.md").symlink_to("about.md")
    (notes / "inner.md").symlink_to("fact.md")
    (notes / "dangling.md").symlink_to("nowhere.md")
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    cli: dict[str, str | None] = {}
    for p in READS:
        cli[f"r:{p}"] = _cli_code(kb.call("read", "con", "rts", p, "--as", "alice"))
    for p in WRITES:
        cli[f"w:{p}"] = _cli_code(
            kb.call(
                "notes", "write", sid, "rts", f"cli-{p}" if p == "ok.md" else p, "--as", "alice", input=b"c\n"
            )
        )
    mcp: dict[str, str | None] = {}

    async def steps(client: ClientSession) -> None:
        for p in READS:
            r = await _call(client, "kb_read", {"alias": "rts", "relpath": p})
            mcp[f"r:{p}"] = _text(r).split("]", 1)[0].removeprefix("error[") if r.is_error else None
        for p in WRITES:
            r = await _call(client, "kb_write_note", {"alias": "rts", "relpath": p, "content": "c\n"})
            mcp[f"w:{p}"] = _text(r).split("]", 1)[0].removeprefix("error[") if r.is_error else None

    _drive(kb, sid, steps)
    assert mcp == cli
    assert cli["r:context/retry.md"] is None and cli["w:ok.md"] is None  # the scenario has both kinds
    assert cli["r:context/escape.md"] == "path-refused" and cli["w:out.md"] == "path-refused"
    assert not (notes / "nowhere.md").exists() and (notes / "ok.md").exists()


def test_search_versions_binary_and_a_write_only_plan(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    src_kb = kb.workflows / "src" / "knowledgebase"
    (src_kb / "context" / "blob.bin").write_bytes(b"\xff\x00<<<end kbd-data x>>>")
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    write_only = kb.open_session("con", kind="execution", kb_access="write", actor="alice")

    async def steps(client: ClientSession) -> None:
        hits = await _call(client, "kb_search", {"query": "zanzibar", "alias": "rts", "limit": 1})
        assert not hits.is_error, _text(hits)
        text = _text(hits)
        assert "rts:context/retry.md trust=" in text and "DATA" in text, text
        fence = text.split("<<<kbd-data ", 1)[1].split(">>>", 1)[0]
        assert f"<<<end kbd-data {fence}>>>" in text and len(hits.structured_content["hits"]) == 1
        await _error(client, "kb_search", {"query": "zanzibar", "alias": "nosuch"}, "not-found")
        blob = await _call(client, "kb_read", {"alias": "rts", "relpath": "context/blob.bin"})
        assert blob.structured_content["encoding"] == "base64", _text(blob)
        assert "<<<end kbd-data x>>>" not in _text(blob)  # binary is never inlined raw
        new = {"alias": "rts", "relpath": "v.md", "content": "one\n", "expected_version": "none"}
        assert not (await _call(client, "kb_write_note", new)).is_error
        await _error(client, "kb_write_note", new, "note-version-conflict")  # it exists now

    _drive(kb, sid, steps)
    seen: set[str] = set()

    async def listing(client: ClientSession) -> None:
        seen.update(await _tools(client))

    _drive(kb, write_only, listing)
    assert seen == {"kb_sources", "kb_check", "kb_why", "kb_write_note"}


def test_a_link_swapped_in_and_a_session_closed_between_calls(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    retry = kb.workflows / "src" / "knowledgebase" / "context" / "retry.md"
    secret = kb.workflows / "other" / "knowledgebase" / "context" / "secret.md"
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    args = {"alias": "rts", "relpath": "context/retry.md"}

    async def steps(client: ClientSession) -> None:
        assert not (await _call(client, "kb_read", args)).is_error
        retry.unlink()
        retry.symlink_to(secret)  # the same name, now a link out of the KB
        text = await _error(client, "kb_read", args, "path-refused")
        assert "zanzibar secret" not in text
        r = kb.call("session", "close", sid, "--as", "alice")
        assert r.code == 0, r.err
        assert await _tools(client) == set()
        await _error(client, "kb_sources", {}, "session-closed")

    _drive(kb, sid, steps)


# -- client roots: they narrow, never widen (docs/mcp.md "Rules") -----------------------------------


def _uri(path: Path | str) -> str:
    return Path(path).as_uri()


def test_roots_narrow_what_the_plan_allows(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    src_kb = kb.workflows / "src" / "knowledgebase"
    (src_kb / "notes" / "zz.md").write_text("# Z\nzanzibar in notes\n")
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    roots = Roots([_uri(src_kb / "notes")])
    with mcp_client(kb.root, sid, roots=roots) as c:
        assert c.tools() == ALL_TOOLS  # roots narrow calls, the plan decides the listing
        assert c.call("kb_read", {"alias": "rts", "relpath": "notes/zz.md"}).code is None
        assert c.call("kb_read", {"alias": "rts", "relpath": "context/retry.md"}).code == "permission-denied"
        assert c.call("kb_list", {"alias": "rts", "reldir": "."}).code == "permission-denied"
        assert c.call("kb_list", {"alias": "rts", "reldir": "notes"}).code is None
        # The prefix sibling is not beneath notes/ (CVE-2025-53110), whatever '..' says.
        assert c.call("kb_list", {"alias": "rts", "reldir": "notes-evil"}).code == "permission-denied"
        assert (
            c.call("kb_read", {"alias": "rts", "relpath": "notes/../notes-evil/x.md"}).code
            == "permission-denied"
        )
        checked = c.call("kb_check", {"path": str(src_kb / "context" / "retry.md"), "mode": "read"})
        assert checked.code == "permission-denied", checked.text
        assert c.call("kb_write_note", {"alias": "rts", "relpath": "r.md", "content": "r\n"}).code is None
        hits = c.call("kb_search", {"query": "zanzibar"})
        assert hits.code is None and hits.structured is not None, hits.text
        assert [h["relpath"] for h in hits.structured["hits"]] == ["notes/zz.md"]
        assert hits.structured["dropped_by_roots"] >= 1  # context/retry.md matched and was dropped
        assert "Backoff" not in hits.text

        # Roots change mid-conversation: the client says so, the next call follows.
        roots.uris = [_uri(src_kb / "context")]
        c.roots_changed()
        assert c.call("kb_read", {"alias": "rts", "relpath": "context/retry.md"}).code is None
        assert c.call("kb_write_note", {"alias": "rts", "relpath": "s.md", "content": "s\n"}).code == (
            "permission-denied"
        )
        # No roots at all: nothing path-based is admitted.
        roots.uris = []
        c.roots_changed()
        assert c.call("kb_read", {"alias": "rts", "relpath": "context/retry.md"}).code == "permission-denied"
        assert c.call("kb_sources", {}).code is None  # names and states only: not a path
    assert (src_kb / "notes" / "r.md").exists() and not (src_kb / "notes" / "s.md").exists()


def test_roots_that_try_to_widen_change_nothing(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    src_kb = kb.workflows / "src" / "knowledgebase"
    other = kb.workflows / "other" / "knowledgebase"
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    link = tmp_path / "via-link"
    link.symlink_to(src_kb / "notes")
    roots = Roots([_uri("/"), _uri(other), _uri(src_kb / "notes-evil"), _uri(link)])
    with mcp_client(kb.root, sid, roots=roots) as c:
        assert "kb_write_note" not in c.tools()  # a read plan, whatever the roots
        assert c.call("kb_write_note", {"alias": "rts", "relpath": "w.md", "content": "w\n"}).code == (
            "permission-denied"
        )
        # '/' admits only what the plan already allows.
        assert c.call("kb_read", {"alias": "rts", "relpath": "context/escape.md"}).code == "path-refused"
        for path in ("/etc/passwd", str(other / "context" / "secret.md"), str(src_kb / "notes" / "n.md")):
            answer = c.call("kb_check", {"path": path, "mode": "write"})
            assert answer.code is None and answer.structured is not None, answer.text
            assert answer.structured["allowed"] is False, (path, answer.text)
        assert "zanzibar secret" not in c.call("kb_search", {"query": "zanzibar"}).text
        # Without '/', a root through a link names the folder it points to.
        roots.uris = [_uri(link)]
        c.roots_changed()
        assert c.call("kb_list", {"alias": "rts", "reldir": "notes"}).code is None
        assert c.call("kb_list", {"alias": "rts", "reldir": "context"}).code == "permission-denied"
    assert not (src_kb / "notes" / "w.md").exists()


def test_the_client_is_told_when_the_tool_list_changes(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    with mcp_client(kb.root, sid) as c:
        assert c.tools() == ALL_TOOLS
        assert c.call("kb_sources", {}).code is None
        assert "notifications/tools/list_changed" not in c.notices  # nothing changed yet
        assert kb.call("writers", "revoke", "src", "con", "--as", "alice").code == 0
        assert c.call("kb_sources", {}).code is None
        c.tools()  # a round trip: the notification was sent before the call's answer
        assert c.notices.count("notifications/tools/list_changed") == 1
        assert c.call("kb_sources", {}).code is None  # unchanged since the client listed again
        c.tools()
        assert c.notices.count("notifications/tools/list_changed") == 1


def test_raw_json_rpc_with_a_lone_surrogate_changes_nothing(tmp_path: Path) -> None:
    """A lone surrogate is valid JSON (``"\\ud800"``) but not text; the SDK's own
    client cannot even send it, so this speaks the wire format by hand. The SDK
    drops the line before kbd sees it (or kbd refuses it as invalid-input):
    either way nothing is written and the server goes on."""
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    call = (b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "kb_write_note", '
            b'"arguments": {"alias": "rts", "relpath": "s.md", "content": "a\\ud800b"}}}')  # fmt: skip
    after = b'{"jsonrpc": "2.0", "id": 3, "method": "tools/list"}'
    argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "mcp", sid, "--as", "alice"]
    # The SDK drops a line it cannot decode without an answer, so wait for id 3 only.
    answers = raw_exchange(argv, [*initialize_lines(), call, after], env=env, wait_for={0, 3})
    if 2 in answers:  # answered: then as a refusal, never a success
        result = answers[2].get("result") or {}
        assert "error" in answers[2] or result.get("isError") is True, answers[2]
        if result:
            assert result["content"][0]["text"].startswith("error[invalid-input]: "), result
    assert {t["name"] for t in answers[3]["result"]["tools"]} == ALL_TOOLS  # still serving
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "s.md").exists()


def test_the_readme_registration_and_the_example_run(tmp_path: Path) -> None:
    """The `mcpServers` snippet of docs/mcp.md is valid and, filled in, starts a working
    server; `make mcp-example` (scripts/mcp-example.py) runs end to end."""
    import json
    import re
    import subprocess

    readme = (Path(__file__).parents[2] / "docs" / "mcp.md").read_text()
    block = re.search(r"<!-- mcp-registration -->\n```json\n(.*?)\n```", readme, re.S)
    assert block, "docs/mcp.md lost its MCP registration snippet"
    server = json.loads(block.group(1))["mcpServers"]["kbd"]
    assert server["command"] == "kbd" and server["args"][0] == "mcp" and "KBD_ROOT" in server["env"]
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    args = [sid if a.startswith("s_") else a for a in server["args"]]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KBD_")}, "KBD_ROOT": str(kb.root)}
    params = StdioServerParameters(command=sys.executable, args=["-m", "kbd", *args], env=env)

    async def main() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            assert await _tools(client) == ALL_TOOLS - {"kb_write_note"}

    anyio.run(main)
    example = Path(__file__).parents[2] / "scripts" / "mcp-example.py"
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "## kb_write_note security notes/from-agent.md\n{" in run.stdout  # written
    assert "## kb_read a path out of the KB   (a tool error)\nerror[invalid-path]" in run.stdout


def test_two_agents_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    """Two `kbd mcp` processes (two agents of one session) write notes at the same
    time: every note lands whole, and of two creations of one new note
    (`expected_version: none`) exactly one wins, the other is a version conflict."""
    import threading

    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    outcomes: dict[str, list[str | None]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def agent(name: str) -> None:
        with mcp_client(kb.root, sid) as c:
            start.wait(timeout=60)
            for i in range(15):
                body = f"# {name}{i}\n" + f"{name}{i} " * 200 + "\n"
                got = c.call("kb_write_note", {"alias": "rts", "relpath": f"{name}/{i}.md", "content": body})
                outcomes[name].append(got.code)
            first = c.call("kb_write_note", {"alias": "rts", "relpath": "first.md", "content": f"{name}\n",
                                             "expected_version": "none"})  # fmt: skip
            outcomes[name].append(first.code)

    threads = [threading.Thread(target=agent, args=(n,)) for n in outcomes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert all(code is None for n in outcomes for code in outcomes[n][:15]), outcomes
    for name in outcomes:
        for i in range(15):
            assert (notes / name / f"{i}.md").read_text().endswith(f"{name}{i} " * 200 + "\n")
    assert sorted([outcomes["a"][15], outcomes["b"][15]], key=str) == [None, "note-version-conflict"], (
        outcomes
    )
    assert (notes / "first.md").read_text().split("---\n")[-1] in ("a\n", "b\n")


def test_search_limit_applies_after_the_roots_and_listings_page(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    src_kb = kb.workflows / "src" / "knowledgebase"
    for i in range(12):  # more matches outside the roots than the limit
        (src_kb / "context" / f"c{i:02}.md").write_text(f"# C{i}\nquokka quokka quokka {i}\n")
    for i in range(3):
        (src_kb / "notes" / f"n{i}.md").write_text(f"# N{i}\nquokka {i}\n")
    for i in range(1005):
        (src_kb / "notes-evil" / f"f{i:04}.md").write_text("x\n")
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    with mcp_client(kb.root, sid, roots=Roots([_uri(src_kb / "notes"), _uri(src_kb / "notes-evil")])) as c:
        hits = c.call("kb_search", {"query": "quokka", "limit": 2})
        assert hits.structured is not None, hits.text
        assert [h["relpath"][:7] for h in hits.structured["hits"]] == ["notes/n", "notes/n"]
        assert c.call("kb_search", {"query": "quokka", "limit": 0}).code == "usage"
        first = c.call("kb_list", {"alias": "rts", "reldir": "notes-evil"})
        assert first.structured is not None and first.structured["truncated"] is True, first.text
        rest = c.call("kb_list", {"alias": "rts", "reldir": "notes-evil", "after": first.structured["next"]})
        assert rest.structured is not None, rest.text
        names = [e["name"] for e in first.structured["entries"] + rest.structured["entries"]]
        assert names == sorted(names) and len(names) == 1006  # x.md and f0000..f1004


def test_kb_why_explains_a_refusal_and_names_no_one(tmp_path: Path) -> None:
    """kb_why (docs/mcp.md): the reasons and the fix's commands, but no principal (an agent does not
    run grants, and learns no owner's name) and no workflow its session has not attached."""
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    other = kb.workflows / "other" / "knowledgebase" / "notes" / "fact.md"
    answers: dict[str, Any] = {}

    async def steps(client: ClientSession) -> None:
        for key, args in {
            "write": {"path": "rts:notes/x.md", "mode": "write"},
            "protected": {"path": "$WORKFLOW_KB_RTS/context/retry.md", "mode": "write"},
            "read": {"path": "rts:context/retry.md"},
            "other": {"path": str(other)},
        }.items():
            result = await _call(client, "kb_why", args)
            assert not result.is_error, _text(result)
            answers[key] = result.structured_content
            assert json.loads(_text(result)) == result.structured_content
        await _error(client, "kb_why", {"path": "rts:x", "mode": "exec"}, "invalid-input")

    _drive(kb, sid, steps)
    write = answers["write"]
    assert not write["allowed"] and [r["code"] for r in write["reasons"]] == ["kb_access"], write
    assert write["fix"]["command"] == "kbd session open con --kind execution --kb-access read-write"
    assert write["fix"]["by"] == [] and "alice" not in json.dumps(answers)
    assert [r["code"] for r in answers["protected"]["reasons"]] == ["protected"]
    assert answers["read"]["allowed"] and answers["read"]["granted_by"]["alias"] == "rts"
    # other's owner (dave) and other itself are never named: just outside every grant.
    assert [r["code"] for r in answers["other"]["reasons"]] == ["outside_grants"]
    assert "other" not in json.dumps(answers["other"]["reasons"]) and "dave" not in json.dumps(answers)
