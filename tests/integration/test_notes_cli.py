"""The note-write entry point through real processes: ``kbd notes write``,
``kbd ls`` and ``kbd read`` as `python -m kbd` children, and a real ``kbd mcp``
server (tests/interfaces.py). The same world, refusal tables and checks as the
in-process tests of tests/unit/test_notes.py, which this module shares."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from kbd.errors import KbdError
from kbd.service import browse
from tests.interfaces import INTERFACES, interface
from tests.unit.test_notes import (  # noqa: F401 - world is the shared fixture
    INDEX_BYTES,
    INDEX_LOOKALIKES,
    INJECTIONS,
    PATH_REFUSALS,
    World,
    _close,
    _pinned_read_index,
    split_note,
    tree,
    world,
)


@pytest.mark.parametrize("via", INTERFACES)
def test_path_and_index_refusals_are_the_same_through_each_interface(world: World, via: str) -> None:  # noqa: F811
    """PATH_REFUSALS and INDEX_LOOKALIKES through `kbd notes write` and MCP's
    kb_write_note (docs/mcp.md): the same code for every case, nothing written."""
    before = tree(world.kb.root)
    cases = {**{c: PATH_REFUSALS[c][:2] for c in PATH_REFUSALS},
             **{f"index:{r}": (r, "permission-denied") for r in INDEX_LOOKALIKES}}  # fmt: skip
    with interface(via, world.kb, "con", world.sid) as i:
        got = {case: i.write_note("src", relpath, "a note\n").error for case, (relpath, _) in cases.items()}
    assert got == {case: code for case, (_, code) in cases.items()}
    assert tree(world.kb.root) == before


def test_closed_session_is_refused_with_exit_77_and_nothing_written(world: World) -> None:  # noqa: F811
    _close(world)
    before = tree(world.kb.root)
    with pytest.raises(KbdError) as info:
        world.write("new.md", b"x\n")
    assert (info.value.code, info.value.exit_code) == ("session-closed", 77)
    r = world.kb.cli("notes", "write", world.sid, "src", "new.md", input=b"x\n")
    assert r.code == 77, r.err
    assert "error[session-closed]" in r.err
    assert tree(world.kb.root) == before


def test_cli_refusals_use_the_contract_exit_codes(world: World) -> None:  # noqa: F811
    before = tree(world.kb.root)
    for relpath, data, code, exit_code in [
        ("_index.json", b"{}\n", "permission-denied", 77),
        ("../context/x.md", b"x\n", "invalid-path", 65),
        ("evil/x.md", b"x\n", "path-refused", 77),
        ("x.sh", b"x\n", "invalid-input", 65),
        ("x.md", b"\xff\xfe\n", "invalid-input", 65),
    ]:
        r = world.kb.cli("notes", "write", world.sid, "src", relpath, input=data)
        assert r.code == exit_code, (relpath, r.err)
        assert f"error[{code}]" in r.err, r.err
        assert r.out == ""
    assert tree(world.kb.root) == before
    codes = [e["code"] for e in world.events() if e["event"] == "note_refused"]
    assert codes == ["permission-denied", "invalid-path", "path-refused", "invalid-input", "invalid-input"]
    # The audit is visible through the CLI as well.
    r = world.kb.cli("audit", "--json")
    assert r.code == 0, r.err
    assert [e["code"] for e in r.json()["events"] if e["event"] == "note_refused"] == codes


def test_cli_write_then_ls_shows_who_contributed(world: World) -> None:  # noqa: F811
    r = world.kb.cli("notes", "write", world.sid, "src", "notes/contrib.md", "--json", input=b"via the CLI\n")
    assert r.code == 0, r.err
    assert r.json() == {
        "workflow_id": "src",
        "alias": "src",
        "path": "notes/contrib.md",
        "bytes": r.json()["bytes"],
        "version": r.json()["version"],  # docs/notes.md "Note history": a new field
    }
    assert (
        r.json()["version"]
        == "sha256:" + hashlib.sha256((world.notes / "contrib.md").read_bytes()).hexdigest()
    )
    note = world.kb.root / "cli-note.md"
    note.write_bytes(b"from a file\n")
    r = world.kb.cli("notes", "write", world.sid, "src", "deep/from-file.md", "--file", str(note))
    assert r.code == 0, r.err
    _, body = split_note((world.notes / "deep" / "from-file.md").read_text())
    assert body == "from a file\n"

    r = world.kb.cli("ls", "con", "src", "notes", "--as", "alice", "--json")
    assert r.code == 0, r.err
    entries = {e["name"]: e for e in r.json()["entries"]}
    assert entries["contrib.md"]["contributed_by"] == "con"
    assert entries["fact.md"]["contributed_by"] is None  # the source's own note
    assert entries["deep"]["type"] == "dir"
    r = world.kb.cli("ls", "con", "src", "notes/deep", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert [(e["name"], e["contributed_by"]) for e in r.json()["entries"]] == [("from-file.md", "con")]
    # The same view in process, and through a reader's eyes (the source's owner).
    by_name = {
        e["name"]: e
        for e in browse.ls(world.host, "con", "src", "notes", actor=world.host.actor("alice")).entries
    }
    assert by_name["contrib.md"]["contributed_by"] == "con"
    assert "contributed_by" not in by_name["_index.json"]


def test_cli_injection_refusal_names_the_rule(world: World) -> None:  # noqa: F811
    r = world.kb.cli(
        "notes", "write", world.sid, "src", "advice.md", input=INJECTIONS["conceal-from-user"].encode()
    )
    assert r.code == 65, r.err
    assert "error[injection-refused]" in r.err and "conceal-from-user" in r.err
    assert not (world.notes / "advice.md").exists()


def test_a_valid_index_is_returned_as_is(world: World) -> None:  # noqa: F811
    assert _pinned_read_index(world) == INDEX_BYTES
    r = world.kb.cli("read", "con", "src", "notes/_index.json", "--as", "alice")
    assert (r.code, r.out) == (0, INDEX_BYTES.decode()), r.err
    r = world.kb.cli("read", "con", "src", "./notes//_index.json", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert orjson.loads(r.json()["content"]) == {"notes": ["fact.md"]}
