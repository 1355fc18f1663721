"""The search query language end to end (docs/search.md "Queries"): ``kbd search``
and MCP's ``kb_search`` (the SDK client, a real ``kbd mcp``) find with OR,
phrases, prefixes and exclusions, say what to try when nothing matched, and
show snippets and labels as text a person or a model reads (no ``# `` marks,
no ``None``)."""

from __future__ import annotations

from pathlib import Path

from mcp.client.session import ClientSession

from tests.helpers import KbRoot
from tests.integration.test_mcp import _call, _drive, _text, _world


def _search(kb: KbRoot, sid: str, query: str) -> tuple[list[str], str]:
    r = kb.cli("search", sid, query, "--as", "alice", "--json")
    assert r.code == 0, r.err
    data = r.json()
    return sorted(h["relpath"] for h in data["hits"]), data.get("hint") or ""


def test_kbd_search_speaks_the_query_language(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    ctx = kb.workflows / "src" / "knowledgebase" / "context"
    (ctx / "egress.md").write_text("# SFU egress\nEgress is 62% of the budget.\n")
    (ctx / "router.md").write_text("# Router\nThe router keeps p99 latency under budget.\n")
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    assert _search(kb, sid, "egress router")[0] == []
    assert _search(kb, sid, "egress OR router")[0] == ["context/egress.md", "context/router.md"]
    assert _search(kb, sid, '"p99 latency"')[0] == ["context/router.md"]
    assert _search(kb, sid, "rout*")[0] == ["context/router.md"]
    assert _search(kb, sid, "budget -egress")[0] == ["context/router.md"]
    # Nothing found for several words: the answer says what to try, in --json and on stderr.
    hits, hint = _search(kb, sid, "egress router")
    assert hits == [] and "egress OR router finds any of them" in hint
    text = kb.cli("search", sid, "egress router", "--as", "alice")
    assert (
        text.code == 0 and text.out.strip() == "no hits" and "hint: no text holds all of 2 words" in text.err
    )
    shown = kb.cli("search", sid, "egress", "--as", "alice")
    assert "    SFU egress Egress is 62%" in shown.out and "# SFU" not in shown.out, shown.out
    only_excludes = kb.cli(
        "search", sid, "--as", "alice", "--", "-egress"
    )  # -- before a query that starts with -
    assert only_excludes.code == 2 and "only excludes words" in only_excludes.err


def test_kb_search_labels_read_as_text(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")

    async def steps(client: ClientSession) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert '"a phrase"' in (tools["kb_search"].description or "")
        found = await _call(client, "kb_search", {"query": "zanzibar OR nosuchword"})
        text = _text(found)
        assert not found.is_error and "rts:context/retry.md trust=source modified_at=" in text, text
        assert "None" not in text and "review=" not in text, text
        empty = await _call(client, "kb_search", {"query": "zanzibar nosuchword"})
        assert empty.structured_content is not None and empty.structured_content["hits"] == []
        assert "zanzibar OR nosuchword" in empty.structured_content["hint"]
        assert "hint: no text holds all of 2 words" in _text(empty)

    _drive(kb, sid, steps)
