"""Consumer-scoped browsing through the real CLI and a real ``kbd mcp`` (docs/cli.md "Browsing" and
docs/mcp.md: the same cases through both interfaces)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import KbRoot
from tests.interfaces import INTERFACES, interface


@pytest.fixture
def attached(kb: KbRoot) -> tuple[KbRoot, Path]:
    src = kb.workflow("src", access={"owners": ["alice"]}, sources=[{"workflow_id": "other", "alias": "o"}])
    kb.workflow("other", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "rts"}])
    return kb, src


def test_read_and_list(attached: tuple[KbRoot, Path]) -> None:
    kb, src = attached
    r = kb.cli("read", "con", "rts", "notes/fact.md", "--as", "alice")
    assert (r.code, r.out) == (0, "src\n")
    r = kb.cli("ls", "con", "rts", "--as", "alice", "--json")
    assert r.code == 0 and r.json()["entries"] == [
        {"name": "context", "type": "dir"},
        {"name": "notes", "type": "dir"},
    ]
    # Live: the next read sees the source's update.
    (src / "knowledgebase" / "notes" / "fact.md").write_text("updated\n")
    assert kb.cli("read", "con", "rts", "notes/fact.md", "--as", "alice").out == "updated\n"


ODD_PATHS: list[tuple[str, int, str]] = [
    ("../workflow.json", 65, "invalid-path"),
    ("../credentials/token", 65, "invalid-path"),
    ("notes/../../soul", 65, "invalid-path"),
    ("/etc/passwd", 65, "invalid-path"),
    ("notes", 77, "path-refused"),
    ("notes/missing.md", 66, "path-not-found"),
    ("notes/fact.md/x", 66, "path-not-found"),
    ("..%2fworkflow.json", 66, "path-not-found"),
    # docs/access.md "Names": a backslash is refused by name (it was
    # read literally and not found).
    ("..\\workflow.json", 65, "invalid-path"),
    ("notes\\fact.md", 65, "invalid-path"),
    ("notes/evil\nWORKFLOW_KB_X=1.md", 65, "invalid-path"),
    ("notes/a\x1b[31m.md", 65, "invalid-path"),
    ("notes/a\x7f.md", 65, "invalid-path"),
    ("notes/a\u0085.md", 65, "invalid-path"),
    ("notes/a\u009b.md", 65, "invalid-path"),
    ("notes/fact.md/", 66, "path-not-found"),
    ("notes/fact.md/.", 66, "path-not-found"),
]


@pytest.mark.parametrize("via", INTERFACES)
def test_paths_outside_or_odd_are_refused(attached: tuple[KbRoot, Path], via: str) -> None:
    """Every ODD_PATHS case through one interface (one MCP server for all of them)."""
    kb, _ = attached
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    with interface(via, kb, "con", sid) as i:
        for relpath, code, error in ODD_PATHS:
            got = i.read("rts", relpath)
            assert got.error == error, (relpath, got.text)
            assert got.exit in (code, None), (relpath, got.exit)  # None: MCP has no exit codes
            assert str(kb.root) not in got.text and "/workflows/" not in got.text, relpath  # no host paths


@pytest.mark.parametrize("via", INTERFACES)
def test_links_special_files_and_size(attached: tuple[KbRoot, Path], via: str) -> None:
    kb, src = attached
    notes = src / "knowledgebase" / "notes"
    (notes / "leak.md").symlink_to("../../credentials/token")
    (notes / "inside.md").symlink_to("fact.md")
    (notes / "sub").symlink_to("../../soul")
    os.link(src / "credentials" / "token", notes / "hard.md")
    os.mkfifo(notes / "pipe")
    (notes / "big.md").write_bytes(b"x" * (2 * 1024 * 1024 + 1))
    (notes / "max.md").write_bytes(b"y" * (2 * 1024 * 1024))
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    with interface(via, kb, "con", sid) as i:
        for name, why in [
            ("leak.md", "symbolic link"),
            ("inside.md", "symbolic link"),
            ("sub/persona.md", "symbolic link"),
            ("hard.md", "hard links"),
            ("pipe", "not a regular file"),
            ("big.md", "larger than"),
        ]:
            got = i.read("rts", f"notes/{name}")
            assert got.error == "path-refused" and got.exit in (77, None), (name, got.text)
            assert why in got.text, (name, got.text)
            assert "secret" not in got.text
        assert "y" * (2 * 1024 * 1024) in i.read("rts", "notes/max.md").text
        listed = i.ls("rts", "notes")
        assert listed.data is not None, listed.text
        listing = {e["name"]: e["type"] for e in listed.data["entries"]}
        assert listing["leak.md"] == "symlink" and listing["sub"] == "symlink" and listing["pipe"] == "other"
        got = i.ls("rts", "notes/sub")
        assert got.error == "path-refused" and got.exit in (77, None) and "persona" not in got.text


def test_alias_rules(attached: tuple[KbRoot, Path]) -> None:
    kb, src = attached
    # Not attached to the consumer (it is the source's own attachment: not transitive).
    r = kb.cli("read", "con", "o", "notes/fact.md", "--as", "alice")
    assert r.code == 66 and "no attachment with alias 'o'" in r.err
    # A caller who may not see the consumer learns nothing.
    r = kb.cli("read", "con", "rts", "notes/fact.md", "--as", "bob")
    assert r.code == 66 and "src" not in r.out
    # Unavailable now: answered with its reason, re-resolved at every call.
    kb.edit(src, access={"owners": ["carol"]})
    r = kb.cli("read", "con", "rts", "notes/fact.md", "--as", "alice")
    assert r.code == 77 and "audience_denied" in r.err
    kb.edit(src, access={"owners": ["alice"]})
    assert kb.cli("read", "con", "rts", "notes/fact.md", "--as", "alice").code == 0
    (src / "knowledgebase").rename(src / "kb_old")
    (src / "knowledgebase").symlink_to("kb_old")
    r = kb.cli("read", "con", "rts", "notes/fact.md", "--as", "alice")
    assert r.code == 69 and "kb_symlinked" in r.err
