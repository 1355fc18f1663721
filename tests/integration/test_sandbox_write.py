"""Write sessions under the real sandbox (docs/access.md, docs/sessions.md, docs/sandbox.md): contributions into a
source's ``notes/`` with the owner's consent, and everything around them that
must stay untouchable — real shells, real kernel, real bubblewrap and Landlock.

Source ``src`` is owned by bob, readable by alice, and lets workflow ``con``
write (``allowed_kb_writers: ["con"]``); alice's ``con`` attaches it with access
``write`` and runs ``execution`` sessions with kb_access ``read-write``. Every
refused write also proves the host is unchanged (names, types, modes, mtimes,
bytes).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kbd.core.knowledge import body_of, provenance_fields
from tests.helpers import CliResult, Entry, KbRoot, exec_mode_for, snapshot

# Real commands under bubblewrap with the inner Landlock helper.
# Every test runs on both exec paths: in-process and through the daemon's broker.
pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_landlock(abi=2),
    pytest.mark.usefixtures("exec_mode"),
]

KERNEL_REFUSALS = (
    "Read-only file system",
    "Permission denied",
    "Operation not permitted",
    "Device or resource busy",
    "Invalid cross-device link",
    "No such file or directory",
    "Directory nonexistent",
)
INDEX_BYTES = b'{"notes": ["fact.md"]}\n'


# -- helpers ------------------------------------------------------------------------------


def open_session(
    kb: KbRoot, wid: str, kind: str = "execution", kb_access: str = "read-write"
) -> dict[str, Any]:
    r = kb.call("session", "open", wid, "--kind", kind, "--kb-access", kb_access, "--as", "alice", "--json")
    assert r.code == 0, r.err
    doc: dict[str, Any] = r.json()
    return doc


def sh(kb: KbRoot, sid: str, script: str) -> CliResult:
    return kb.cli("exec", sid, "--", "sh", "-c", script)


def assert_kernel_refused(r: CliResult) -> None:
    """The command ran (kbd did not refuse it) and the kernel refused the operation."""
    assert r.code != 0, f"expected a refusal, got exit 0: {r.out!r}"
    assert "error[" not in r.err, f"kbd itself refused instead of the sandbox: {r.err}"
    assert any(m in r.err for m in KERNEL_REFUSALS), r.err


def build(kb: KbRoot, *, grant: bool = True) -> tuple[Path, Path]:
    access: dict[str, Any] = {"owners": ["bob"], "readers": ["alice"]}
    if grant:
        access["allowed_kb_writers"] = ["con"]
    src = kb.workflow("src", access=access)
    con = kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    return src, con


@dataclass(frozen=True)
class WriteWorld:
    kb: KbRoot
    src: Path
    con: Path
    sid: str

    @property
    def notes(self) -> Path:
        return self.src / "knowledgebase" / "notes"

    def watched(self) -> dict[str, dict[str, Entry]]:
        """Host state, after checking that what the fixture planted is still there
        (so an earlier leak cannot make a later refusal pass vacuously)."""
        assert (self.notes / "_index.json").read_bytes() == INDEX_BYTES
        assert (self.notes / "fact.md").read_bytes() == b"src\n"
        assert (self.notes / "x").read_bytes() == b"x\n"
        assert (self.notes / "deep").is_dir() and not (self.notes / "deep").is_symlink()
        assert os.readlink(self.notes / "evil") == "../../soul"
        assert os.readlink(self.notes / "ctx") == "../context"
        assert (self.src / "knowledgebase" / "context" / "about.md").read_bytes() == b"about src\n"
        assert (self.src / "soul" / "secret.md").read_bytes() == b"soul-secret\n"
        return {"src": snapshot(self.src), "con": snapshot(self.con)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, exec_mode: str) -> Iterator[WriteWorld]:
    """One granted write session for the refusal checks. Each test compares the host
    before and after its own command, so nothing one test does can hide in another."""
    kb = KbRoot.create(tmp_path_factory.mktemp("sandbox-write") / "root")
    src, con = build(kb)
    notes = src / "knowledgebase" / "notes"
    (src / "soul" / "secret.md").write_text("soul-secret\n")
    # Links planted on the host (by the source's own agents, or anyone with host access).
    (notes / "evil").symlink_to("../../soul")
    (notes / "evil_abs").symlink_to(src / "soul")
    (notes / "ctx").symlink_to("../context")
    (notes / "x").write_text("x\n")
    (notes / "deep").mkdir()
    (con / "learnings" / "a.md").write_text("a\n")
    doc = open_session(kb, "con")
    assert doc["env"]["WORKFLOW_KB_SRC"] == str((src / "knowledgebase").resolve())
    assert str((notes / "_index.json").resolve()) in doc["read_only"]
    with exec_mode_for(kb, exec_mode):
        yield WriteWorld(kb, src, con, doc["session_id"])


# -- contributions land on the host -------------------------------------------------------


def test_new_notes_subfolders_and_edits_reach_the_host(kb: KbRoot) -> None:
    src, _ = build(kb)
    notes = src / "knowledgebase" / "notes"
    sid = open_session(kb, "con")["session_id"]

    r = sh(kb, sid, 'echo "new note" > "$WORKFLOW_KB_SRC/notes/new.md"')
    assert r.code == 0, r.err
    # Committed through the write path at exit: the body as written, under
    # kbd's provenance (docs/notes.md "Staged contributions").
    new = (notes / "new.md").read_text()
    assert body_of(new) == "new note\n"
    assert provenance_fields(new)["contributed_by_workflow"] == "con"

    r = sh(kb, sid, 'cd "$WORKFLOW_KB_SRC" && mkdir -p notes/sub && echo deep > notes/sub/x.md')
    assert r.code == 0, r.err
    assert (notes / "sub").is_dir() and not (notes / "sub").is_symlink()
    assert body_of((notes / "sub" / "x.md").read_text()) == "deep\n"

    r = sh(
        kb,
        sid,
        'echo "edited" > "$WORKFLOW_KB_SRC/notes/fact.md" && echo more >> "$WORKFLOW_KB_SRC/notes/fact.md"',
    )
    assert r.code == 0, r.err
    assert body_of((notes / "fact.md").read_text()) == "edited\nmore\n"

    # The contributor never touched the index, context/ or anything private.
    assert (notes / "_index.json").read_bytes() == INDEX_BYTES
    assert (src / "knowledgebase" / "context" / "about.md").read_text() == "about src\n"
    assert (src / "credentials" / "token").read_text() == "secret-src\n"


# -- context/ and the KB root stay read-only ----------------------------------------------------


OUTSIDE_NOTES = {
    "context-overwrite": 'echo x > "$WORKFLOW_KB_SRC/context/about.md"',
    "context-new": 'echo x > "$WORKFLOW_KB_SRC/context/new.md"',
    "context-rm": 'rm -f "$WORKFLOW_KB_SRC/context/about.md"',
    "context-mkdir": 'mkdir "$WORKFLOW_KB_SRC/context/sub"',
    "root-new": 'echo x > "$WORKFLOW_KB_SRC/new.md"',
    "root-mkdir": 'mkdir "$WORKFLOW_KB_SRC/newdir"',
    "root-mv-notes": 'mv "$WORKFLOW_KB_SRC/notes" "$WORKFLOW_KB_SRC/notes2"',
    "root-rm-context": 'rm -rf "$WORKFLOW_KB_SRC/context"',
    "notes-to-context": 'mv "$WORKFLOW_KB_SRC/notes/fact.md" "$WORKFLOW_KB_SRC/context/fact.md"',
}


@pytest.mark.parametrize("case", sorted(OUTSIDE_NOTES))
def test_context_and_kb_root_are_read_only(world: WriteWorld, case: str) -> None:
    before = world.watched()
    r = sh(world.kb, world.sid, OUTSIDE_NOTES[case])
    assert_kernel_refused(r)
    assert world.watched() == before


# -- notes/_index.json stays the owner's ------------------------------------------------------


INDEX_WRITES = {
    "append": 'cd "$WORKFLOW_KB_SRC/notes" && echo x >> _index.json',
    "truncate": 'cd "$WORKFLOW_KB_SRC/notes" && : > _index.json',
    "rm": 'cd "$WORKFLOW_KB_SRC/notes" && rm -f _index.json',
    "mv-over": 'cd "$WORKFLOW_KB_SRC/notes" && mv x _index.json',
    "mv-away": 'cd "$WORKFLOW_KB_SRC/notes" && mv _index.json y',
    "hardlink": 'cd "$WORKFLOW_KB_SRC/notes" && ln _index.json z',
    "chmod": 'cd "$WORKFLOW_KB_SRC/notes" && chmod 666 _index.json',
    "python-replace": 'cd "$WORKFLOW_KB_SRC/notes" && python3 -c \'import os; os.replace("x", "_index.json")\'',
}


@pytest.mark.parametrize("case", sorted(INDEX_WRITES))
def test_index_json_cannot_be_changed_replaced_or_linked(world: WriteWorld, case: str) -> None:
    index = world.notes / "_index.json"
    assert index.read_bytes() == INDEX_BYTES
    before = world.watched()
    r = sh(world.kb, world.sid, INDEX_WRITES[case])
    assert_kernel_refused(r)
    assert index.read_bytes() == INDEX_BYTES
    assert not (world.notes / "y").exists() and not (world.notes / "z").exists()
    assert (world.notes / "x").read_bytes() == b"x\n"
    assert world.watched() == before


# -- links planted on the host in notes/ ---------------------------------------------------------


PLANTED = {
    "cat-glob": 'cat "$WORKFLOW_KB_SRC"/notes/evil/*',
    "cat-file": 'cat "$WORKFLOW_KB_SRC/notes/evil/secret.md"',
    "ls": 'ls -A "$WORKFLOW_KB_SRC/notes/evil/"',
    "write": 'echo > "$WORKFLOW_KB_SRC/notes/evil/x"',
    "overwrite": 'echo pwned > "$WORKFLOW_KB_SRC/notes/evil/secret.md"',
    "abs-cat": 'cat "$WORKFLOW_KB_SRC/notes/evil_abs/secret.md"',
    "abs-write": 'echo > "$WORKFLOW_KB_SRC/notes/evil_abs/x"',
    "ctx-write": 'echo pwned > "$WORKFLOW_KB_SRC/notes/ctx/about.md"',
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_link_in_notes_leads_nowhere(world: WriteWorld, case: str) -> None:
    before = world.watched()
    r = sh(world.kb, world.sid, PLANTED[case])
    assert_kernel_refused(r)
    assert "soul-secret" not in r.out and "secret.md" not in r.out
    assert sorted(os.listdir(world.src / "soul")) == ["secret.md"]
    assert (world.src / "soul" / "secret.md").read_text() == "soul-secret\n"
    assert world.watched() == before


# -- links and FIFOs: refused in a source's notes/, fine in the consumer's workspace --------------


NODES = {
    "symlink": "ln -s ../../soul {dest}",
    "fifo": "mkfifo {dest}",
    "hardlink": "ln learnings/a.md {dest}",
}


@pytest.mark.parametrize("where", ["notes", "notes/deep"])
@pytest.mark.parametrize("node", sorted(NODES))
def test_links_and_fifos_cannot_be_made_in_source_notes(world: WriteWorld, node: str, where: str) -> None:
    before = world.watched()
    dest = f'"$WORKFLOW_KB_SRC/{where}/planted-{node}"'
    r = sh(world.kb, world.sid, NODES[node].format(dest=dest))
    assert_kernel_refused(r)
    assert not os.path.lexists(world.src / "knowledgebase" / where / f"planted-{node}")
    assert world.watched() == before


@pytest.mark.parametrize("node", sorted(NODES))
def test_links_and_fifos_can_be_made_in_own_workspace(world: WriteWorld, node: str) -> None:
    src_before = snapshot(world.src)
    dest = world.con / "runs" / f"own-{node}"
    r = sh(world.kb, world.sid, NODES[node].format(dest=f"runs/own-{node}"))
    assert r.code == 0, r.err
    st = os.lstat(dest)
    if node == "symlink":
        assert stat.S_ISLNK(st.st_mode) and os.readlink(dest) == "../../soul"
    elif node == "fifo":
        assert stat.S_ISFIFO(st.st_mode)
    else:
        assert dest.samefile(world.con / "learnings" / "a.md")
    assert snapshot(world.src) == src_before


# -- no grant, or a revoked grant: notes/ is read-only -------------------------------------------


NOTE_WRITES = [
    'echo x > "$WORKFLOW_KB_SRC/notes/new.md"',
    'echo x >> "$WORKFLOW_KB_SRC/notes/fact.md"',
    'mkdir -p "$WORKFLOW_KB_SRC/notes/sub"',
]


def test_write_attachment_without_the_owners_grant_fails_like_a_read_source(kb: KbRoot) -> None:
    src, _ = build(kb, grant=False)
    # A second consumer with a plain read attachment, same alias: the same KB path.
    kb.workflow("reader", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
    ungranted = open_session(kb, "con")
    read_only = open_session(kb, "reader")
    (att,) = ungranted["sources"]
    assert att["available"] is True
    assert (att["write"]["available"], att["write"]["reason"]) == (False, "write_not_granted")
    assert not any(p.startswith(str(src)) for p in ungranted["write"])
    assert ungranted["env"]["WORKFLOW_KB_SRC"] == read_only["env"]["WORKFLOW_KB_SRC"]

    for script in NOTE_WRITES:
        before = snapshot(src)
        w = sh(kb, ungranted["session_id"], script)
        r = sh(kb, read_only["session_id"], script)
        assert_kernel_refused(w)
        assert (w.code, w.out, w.err) == (r.code, r.out, r.err)
        assert snapshot(src) == before
    # Reading still works.
    r = sh(kb, ungranted["session_id"], 'cat "$WORKFLOW_KB_SRC/notes/fact.md"')
    assert (r.code, r.out) == (0, "src\n"), r.err


def test_revoking_the_grant_stops_writes_at_the_next_exec(kb: KbRoot) -> None:
    src, _ = build(kb)
    notes = src / "knowledgebase" / "notes"
    sid = open_session(kb, "con")["session_id"]
    r = sh(kb, sid, 'echo before > "$WORKFLOW_KB_SRC/notes/a.md"')
    assert r.code == 0, r.err
    committed = (notes / "a.md").read_text()
    assert body_of(committed) == "before\n"

    revoke = kb.cli("writers", "revoke", "src", "con", "--as", "bob")
    assert revoke.code == 0, revoke.err
    assert "con" not in kb.read_manifest(src)["access"].get("allowed_kb_writers", [])

    for script in [*NOTE_WRITES, 'echo after > "$WORKFLOW_KB_SRC/notes/a.md"']:
        before = snapshot(src)
        r = sh(kb, sid, script)
        assert_kernel_refused(r)
        assert snapshot(src) == before
    assert (notes / "a.md").read_text() == committed
    assert not (notes / "new.md").exists()
    # The read attachment survives the revocation.
    r = sh(kb, sid, 'cat "$WORKFLOW_KB_SRC/notes/a.md"')
    assert (r.code, r.out) == (0, committed), r.err
