"""Landlock-only mode (sandbox.backend: landlock), forced by config: the read
matrix holds with real shells, and write grants are refused (fail closed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import KbRoot

# Real commands under the Landlock-only backend.
pytestmark = pytest.mark.requires_landlock


def landlock_root(kb: KbRoot, *, unsafe: bool = False) -> KbRoot:
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text().replace("backend: auto", "backend: landlock")
    if unsafe:
        text = text.replace("unsafe_landlock_writes: false", "unsafe_landlock_writes: true")
    cfg.write_text(text)
    return kb


def open_session(kb: KbRoot, kind: str, mode: str = "read") -> str:
    r = kb.call("session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("other", access={"owners": ["alice"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    return landlock_root(kb)


def test_read_matrix_under_landlock_alone(world: KbRoot) -> None:
    sid = open_session(world, "reviewer_strategic")
    src = world.workflows / "src"
    before = (src / "knowledgebase" / "notes" / "fact.md").read_bytes()
    ok = world.cli("exec", sid, "--", "sh", "-c", 'cat "$WORKFLOW_KB_SRC/notes/fact.md"')
    assert (ok.code, ok.out) == (0, "src\n"), ok.err
    for cmd in (
        'echo x > "$WORKFLOW_KB_SRC/notes/fact.md"',
        'echo x > "$WORKFLOW_KB_SRC/notes/new.md"',
        f"cat {src}/workflow.json",
        f"cat {src}/credentials/token",
        f"ls {src}/soul",
        f"cat {world.workflows}/other/knowledgebase/notes/fact.md",
        f"echo x > {world.workflows}/con/workflow.json",
        f"cat {world.root}/principals.yaml",
    ):
        r = world.cli("exec", sid, "--", "sh", "-c", cmd)
        assert r.code != 0, cmd
        assert "secret" not in r.out and "alice" not in r.out
    assert (src / "knowledgebase" / "notes" / "fact.md").read_bytes() == before
    assert not (src / "knowledgebase" / "notes" / "new.md").exists()
    # Scratch space is private to the session, not the host's /tmp.
    tmp = world.cli("exec", sid, "--", "sh", "-c", 'echo hi > "$TMPDIR/x" && cat "$TMPDIR/x" && ls /tmp')
    assert tmp.out.startswith("hi\n") and tmp.code != 0


def test_write_plans_are_refused_without_the_unsafe_switch(world: KbRoot) -> None:
    sid = open_session(world, "execution", "read-write")
    r = world.cli("exec", sid, "--", "sh", "-c", 'echo x > "$WORKFLOW_KB_SRC/notes/new.md"')
    assert r.code == 69
    assert "Landlock alone cannot enforce" in r.err
    assert not (world.workflows / "src" / "knowledgebase" / "notes" / "new.md").exists()


def test_unsafe_switch_warns_on_every_use(world: KbRoot) -> None:
    landlock_root(world, unsafe=True)
    sid = open_session(world, "execution", "read-write")
    for _ in range(2):
        r = world.cli("exec", sid, "--", "sh", "-c", 'echo x > "$WORKFLOW_KB_SRC/notes/new.md"')
        assert r.code == 0, r.err
        assert "WARNING: unsafe_landlock_writes" in r.err
    assert Path(world.workflows / "src" / "knowledgebase" / "notes" / "new.md").read_text() == "x\n"
