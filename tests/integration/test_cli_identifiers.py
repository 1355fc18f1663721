"""Unplain workflow IDs as the real ``kbd`` process prints them (a `python -m kbd`
child): human output, the agent's context block, audit text and ``kbd doctor``
show them escaped, one line each. The rules themselves are unit-tested in
tests/unit/core/test_identifiers.py, whose world this module shares."""

from __future__ import annotations

from kbd.state import audit
from tests.helpers import KbRoot
from tests.unit.core.test_identifiers import world  # noqa: F401 - the shared fixture


def test_every_printed_id_is_one_escaped_line(world: KbRoot) -> None:  # noqa: F811
    """A hand-edited entry can still carry an unplain ID (it is an invalid_entry);
    human output, the agent's context block and audit text show it escaped."""
    bad = "wf_rts\u2028FAKE LINE\u0085\u200b"
    con = world.workflows / "con"
    world.edit(con, knowledgebase_sources=[{"workflow_id": bad, "alias": "rts"}])
    r = world.cli("sources", "list", "con", "--as", "alice")
    assert r.code == 0, r.err
    assert "invalid_entry" in r.out and "\\u2028" in r.out, r.out
    for text in (r.out,):
        assert not {"\u2028", "\u0085", "\u200b"} & set(text), repr(text)
    r = world.cli("session", "open", "con", "--kind", "execution", "--as", "alice", "--json")
    assert r.code == 0, r.err
    context = r.json()["context"]
    assert not {"\u2028", "\u0085", "\u200b"} & set(context), repr(context)
    assert len(context.splitlines()) == 2, context
    r = world.cli("session", "show", r.json()["session_id"])
    assert r.code == 0, r.err
    assert not {"\u2028", "\u0085", "\u200b"} & set(r.out), repr(r.out)
    audit.append(world.root / "state", "test_event", workflow_id=bad, alias="rts")
    r = world.cli("audit")
    assert r.code == 0, r.err
    (line,) = [ln for ln in r.out.split("\n") if "test_event" in ln]
    assert "\\u2028" in line and not {"\u2028", "\u0085", "\u200b"} & set(r.out), repr(r.out)


def test_doctor_shows_an_unplain_folder_escaped(world: KbRoot) -> None:  # noqa: F811
    world.workflow("wf_rts\u200b", folder="impostor\u2028FAKE", label="RTS platform")
    r = world.cli("doctor")
    (line,) = [ln for ln in r.out.splitlines() if "registry:" in ln]
    assert "manifest_unreadable" in line and "\\u2028FAKE" in line, r.out
    assert not {"\u2028", "\u200b"} & set(r.out), repr(r.out)
