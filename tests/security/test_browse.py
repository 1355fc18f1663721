"""Consumer-scoped browsing through the real CLI (upstream T1e, T7c-e, T11c)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import KbRoot


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


@pytest.mark.parametrize(
    ("relpath", "code", "error"),
    [
        ("../workflow.json", 65, "invalid-path"),
        ("../credentials/token", 65, "invalid-path"),
        ("notes/../../soul", 65, "invalid-path"),
        ("/etc/passwd", 65, "invalid-path"),
        ("notes", 77, "path-refused"),
        ("notes/missing.md", 66, "path-not-found"),
        ("notes/fact.md/x", 66, "path-not-found"),
        ("..%2fworkflow.json", 66, "path-not-found"),
        # Issue 9 item 9 (contract change): a backslash is refused by name (it was
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
    ],
)
def test_paths_outside_or_odd_are_refused(
    attached: tuple[KbRoot, Path], relpath: str, code: int, error: str
) -> None:
    kb, _ = attached
    r = kb.call("read", "con", "rts", relpath, "--as", "alice")
    assert r.code == code, r.err
    assert r.err.startswith(f"error[{error}]")
    assert str(kb.root) not in r.err and "/workflows/" not in r.err  # no host paths in errors


def test_links_special_files_and_size(attached: tuple[KbRoot, Path]) -> None:
    kb, src = attached
    notes = src / "knowledgebase" / "notes"
    (notes / "leak.md").symlink_to("../../credentials/token")
    (notes / "inside.md").symlink_to("fact.md")
    (notes / "sub").symlink_to("../../soul")
    os.link(src / "credentials" / "token", notes / "hard.md")
    os.mkfifo(notes / "pipe")
    (notes / "big.md").write_bytes(b"x" * (2 * 1024 * 1024 + 1))
    (notes / "max.md").write_bytes(b"y" * (2 * 1024 * 1024))
    for name, why in [
        ("leak.md", "symbolic link"),
        ("inside.md", "symbolic link"),
        ("sub/persona.md", "symbolic link"),
        ("hard.md", "hard links"),
        ("pipe", "not a regular file"),
        ("big.md", "larger than"),
    ]:
        r = kb.cli("read", "con", "rts", f"notes/{name}", "--as", "alice")
        assert r.code == 77, (name, r.err)
        assert why in r.err, (name, r.err)
        assert "secret" not in r.out
    assert len(kb.cli("read", "con", "rts", "notes/max.md", "--as", "alice").out) == 2 * 1024 * 1024
    listing = {
        e["name"]: e["type"]
        for e in kb.cli("ls", "con", "rts", "notes", "--as", "alice", "--json").json()["entries"]
    }
    assert listing["leak.md"] == "symlink" and listing["sub"] == "symlink" and listing["pipe"] == "other"
    r = kb.cli("ls", "con", "rts", "notes/sub", "--as", "alice")
    assert r.code == 77 and "persona" not in r.out


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
