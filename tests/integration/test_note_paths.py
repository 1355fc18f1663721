"""One path convention for note writes, end to end (docs/notes.md "Paths"):
``kbd notes write`` and the MCP tool ``kb_write_note`` (through the real SDK
client and a real ``kbd mcp`` process) take RELPATH from the source's KB root,
as ``kbd read``, search hits, the audit and the change feed name the note; the
old spelling relative to ``notes/`` still writes the same file for one release,
with a warning, and ``notes/z.md`` never becomes ``notes/notes/z.md``."""

from __future__ import annotations

import json
from pathlib import Path

import mcp_types as types
import orjson
from mcp.client.session import ClientSession

from kbd.core.events import Replay
from kbd.state.events import EventLog
from tests.helpers import KbRoot
from tests.integration.test_mcp import _call, _drive, _text, _world


def _notes(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _feed_relpaths(kb: KbRoot) -> list[str]:
    with EventLog(kb.root / "state", sync_interval=0) as log:
        replay = log.since(f"{log.epoch}-0")
    assert isinstance(replay, Replay), replay
    return [str(e.fields["relpath"]) for e in replay.events if e.type == "note.written"]


def test_kbd_notes_write_names_the_note_from_the_kb_root(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    before = _notes(notes)
    new = kb.cli("notes", "write", sid, "rts", "notes/z.md", "--json", "--as", "alice", input="# Z\nnew\n")
    assert new.code == 0 and new.err == "", new.err
    assert json.loads(new.out)["path"] == "notes/z.md" and "warning" not in json.loads(new.out)
    old = kb.cli("notes", "write", sid, "rts", "y.md", "--as", "alice", input="# Y\nold spelling\n")
    assert old.code == 0 and old.out == "wrote notes/y.md in src (" + old.out.split("(", 1)[1]
    assert "kbd: warning: RELPATH 'y.md' is relative to notes/, which is deprecated" in old.err
    assert "'notes/y.md'" in old.err
    assert _notes(notes) - before == {"y.md", "z.md"}  # never notes/notes/
    # The audit and the feed name each note as the answer did.
    assert [r["path"] for r in kb.audit_events("note_written")] == ["notes/z.md", "notes/y.md"]
    assert _feed_relpaths(kb) == ["notes/z.md", "notes/y.md"]
    # context/ is never a folder beneath notes/: refused, audited, nothing written.
    ctx = kb.cli("notes", "write", sid, "rts", "context/a.md", "--as", "alice", input="# A\nx\n")
    assert ctx.code == 77 and "context/, which only the source workflow writes" in ctx.err, ctx.err
    assert not (notes / "context").exists()
    assert kb.audit_events("note_refused")[-1]["path"] == "context/a.md"
    # A refusal before the name is looked at (no such alias) still names the note from the KB root.
    gone = kb.cli("notes", "write", sid, "nosuch", "y.md", "--as", "alice", input="# Y\n")
    assert gone.code == 66 and kb.audit_events("note_refused")[-1]["path"] == "notes/y.md"


def test_kb_write_note_takes_the_path_kb_read_gives(tmp_path: Path) -> None:
    kb = _world(tmp_path)
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    before = _notes(notes)

    async def steps(client: ClientSession) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert "notes/retry.md" in json.dumps(tools["kb_write_note"].input_schema)
        wrote = await _call(
            client, "kb_write_note", {"alias": "rts", "relpath": "notes/z.md", "content": "# Z\n"}
        )
        assert not wrote.is_error, _text(wrote)
        assert wrote.structured_content is not None
        assert wrote.structured_content["path"] == "notes/z.md" and "warning" not in wrote.structured_content
        read = await _call(client, "kb_read", {"alias": "rts", "relpath": wrote.structured_content["path"]})
        assert not read.is_error and read.structured_content is not None
        assert read.structured_content["content"].endswith("# Z\n")
        old = await _call(client, "kb_write_note", {"alias": "rts", "relpath": "y.md", "content": "# Y\n"})
        assert not old.is_error and old.structured_content is not None
        assert old.structured_content["path"] == "notes/y.md"
        assert "deprecated" in old.structured_content["warning"]
        assert json.loads(_text(old)) == old.structured_content  # the agent reads the warning in the text too
        assert isinstance(old.content[0], types.TextContent)

    _drive(kb, sid, steps)
    assert _notes(notes) - before == {"y.md", "z.md"}  # never notes/notes/
    written = kb.audit_events("note_written")
    assert [r["path"] for r in written] == ["notes/z.md", "notes/y.md"] == _feed_relpaths(kb)
    assert orjson.loads(orjson.dumps(written))  # plain JSON records
