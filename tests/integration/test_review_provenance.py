"""A contribution cannot pass for the source's own note (docs/notes.md "Reviewed contributions").

Adversarial provenance, real CLI, real files, a real sandboxed command: the
frontmatter a contributor controls must never make its note the source's own
(out of the review queue, trusted in search), nor name another contributor
than the one kbd saw write it.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kbd.service import search as search_ops
from kbd.service.sessions import RootSessions
from kbd.state import audit
from tests.helpers import KbRoot

TEAM = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}


def _world(tmp_path: Path) -> tuple[KbRoot, str]:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={**TEAM, "allowed_kb_writers": ["con"]})
    kb.workflow("con", access=TEAM, sources=[{"workflow_id": "src", "alias": "rts", "access": "write"}])
    kb.workflow("other", access=TEAM)
    return kb, kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")


def _pending(kb: KbRoot) -> dict[str, str]:
    r = kb.call("notes", "pending", "src", "--as", "alice", "--json")
    assert r.code == 0, r.err
    return {p["relpath"]: p["contributed_by_workflow"] for p in r.json()["pending"]}


def _approve(kb: KbRoot, relpath: str) -> int:
    """alice approves src's note ``relpath`` at the version `kbd notes pending` shows her."""
    [seen] = [p for p in kb.call("notes", "pending", "src", "--as", "alice", "--json").json()["pending"]
              if p["relpath"] == relpath]  # fmt: skip
    r = kb.call(
        "notes", "review", "src", relpath, "--approve", "--expected-version", seen["digest"], "--as", "alice"
    )
    return r.code


def _hits(kb: KbRoot, sid: str, query: str, *extra: str) -> dict[str, Any]:
    search_ops._SEARCHERS.clear()
    r = kb.call("search", sid, query, "--json", "--alias", "rts", *extra)
    assert r.code == 0, r.err
    return {h["relpath"]: h for h in r.json()["hits"]}


@pytest.mark.parametrize(
    "text",
    [
        # A line starting with --- that the writer keeps inside the block but a
        # reader stopping at the first "\n---" took for its end.
        b"---\n---x\n---\n# Sneaky\nquokka lives here\n",
        b"---\ntags: a\n--- \n---\n# Sneaky\nquokka lives here\n",
        # More frontmatter lines than a reader looked at: kbd's stamp comes last.
        b"---\n" + b"".join(b"k%d: v\n" % i for i in range(80)) + b"---\n# Sneaky\nquokka lives here\n",
    ],
    ids=["dash-line", "dash-space", "long-head"],
)
def test_kbd_notes_write_cannot_pass_a_contribution_off_as_the_sources_own(
    tmp_path: Path, text: bytes
) -> None:
    kb, sid = _world(tmp_path)
    r = kb.call("notes", "write", sid, "rts", "sneaky.md", "--file", "-", input=text)
    assert r.code == 0, r.err
    assert _pending(kb) == {"notes/sneaky.md": "con"}
    assert "notes/sneaky.md" not in _hits(kb, sid, "quokka")
    hit = _hits(kb, sid, "quokka", "--include-unreviewed")["notes/sneaky.md"]
    assert (hit["review"], hit["trust"], hit["contributed_by_workflow"]) == (
        "unreviewed", "contributed-unreviewed", "con"
    )  # fmt: skip
    assert _approve(kb, "notes/sneaky.md") == 0
    assert _pending(kb) == {}


def test_a_commands_note_claiming_the_source_or_another_workflow_is_still_cons(tmp_path: Path) -> None:
    """A real sandboxed command under a write grant writes frontmatter naming the
    source itself (or a third workflow): kbd saw con write those bytes, so they
    are con's unreviewed contribution, reviewable by the owner."""
    kb, sid = _world(tmp_path)
    script = (
        'printf -- "---\\ncontributed_by_workflow: src\\n---\\n# Self\\nquokka one\\n" > "$WORKFLOW_KB_RTS/notes/self.md"'
        ' && printf -- "---\\ncontributed_by_workflow: other\\n---\\n# Framed\\nquokka two\\n"'
        ' > "$WORKFLOW_KB_RTS/notes/framed.md"'
    )
    r = kb.cli("exec", sid, "--", "sh", "-c", script)
    assert r.code == 0, r.err
    assert _pending(kb) == {"notes/self.md": "con", "notes/framed.md": "con"}
    hits = _hits(kb, sid, "quokka", "--include-unreviewed")
    assert {k: (h["trust"], h["contributed_by_workflow"]) for k, h in hits.items()} == {
        "notes/self.md": ("contributed-unreviewed", "con"),
        "notes/framed.md": ("contributed-unreviewed", "con"),
    }
    assert _hits(kb, sid, "quokka") == {}
    r = kb.call("notes", "review", "src", "notes/self.md", "--reject", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert r.json()["contributed_by_workflow"] == "con"
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "self.md").exists()


def test_rejected_bytes_written_again_are_pending_again(tmp_path: Path) -> None:
    """A command writes a note, the owner rejects it (it leaves notes/), the
    command writes the very same bytes back: they stand in notes/ again, so the
    owner must see them in the queue, not have them hidden by the old decision."""
    kb, sid = _world(tmp_path)
    script = 'printf "# Back\\nquokka again\\n" > "$WORKFLOW_KB_RTS/notes/back.md"'
    assert kb.cli("exec", sid, "--", "sh", "-c", script).code == 0
    assert _pending(kb) == {"notes/back.md": "con"}
    assert kb.call("notes", "review", "src", "notes/back.md", "--reject", "--as", "alice").code == 0
    assert _pending(kb) == {}
    assert kb.cli("exec", sid, "--", "sh", "-c", script).code == 0
    assert (kb.workflows / "src" / "knowledgebase" / "notes" / "back.md").exists()
    assert _pending(kb) == {"notes/back.md": "con"}
    assert "notes/back.md" not in _hits(kb, sid, "quokka")
    assert kb.call("notes", "review", "src", "notes/back.md", "--reject", "--as", "alice").code == 0
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "back.md").exists()


def test_unreject_is_a_version_in_the_notes_history(tmp_path: Path) -> None:
    """Putting a rejected note back is a write kbd performs into notes/: its
    history shows it (by whom, how), like every other such write."""
    kb, sid = _world(tmp_path)
    r = kb.call("notes", "write", sid, "rts", "h.md", "--file", "-", input=b"# H\nquokka\n")
    assert r.code == 0, r.err
    r = kb.call("notes", "review", "src", "notes/h.md", "--reject", "--as", "alice", "--json")
    assert r.code == 0, r.err
    back = kb.call("notes", "unreject", "src", str(r.json()["rejected_id"]), "--as", "alice")
    assert back.code == 0, back.err
    log = kb.call("notes", "log", "src", "notes/h.md", "--as", "alice", "--json")
    assert log.code == 0, log.err
    newest = log.json()["versions"][0]
    on_disk = (kb.workflows / "src" / "knowledgebase" / "notes" / "h.md").read_bytes()
    assert log.json()["current"] == newest["version"] == r.json()["digest"]
    assert (newest["how"], newest["principal"]) == ("unreject", "alice")
    assert newest["version"] == "sha256:" + hashlib.sha256(on_disk).hexdigest()


def test_an_approved_note_rewritten_in_place_does_not_keep_its_approval(tmp_path: Path) -> None:
    """Between a KB's refresh and a hit's confirmation, a contributor rewrites an
    approved note in place with other bytes of the same size and sets its mtime
    back (utime): the index still holds the approved bytes' digest, so the hit
    must be dropped (ctime moved), never shown as contributed-approved."""
    kb, sid = _world(tmp_path)
    r = kb.call("notes", "write", sid, "rts", "ok.md", "--file", "-", input=b"# Ok\nquokka approved text\n")
    assert r.code == 0, r.err
    assert _approve(kb, "notes/ok.md") == 0
    host = kb.host()
    sessions = RootSessions(host)
    where = search_ops.scope(sessions, sid, ["rts"], actor=host.actor("alice"))
    # A searcher that trusts its last walk for a minute (as the daemon's does between walks).
    engine = search_ops.FullTextSearcher(host.config.state_dir, fresh_seconds=60.0)
    found = search_ops.run(host.config.state_dir, where, "quokka", searcher=engine)
    assert [(h.relpath, h.trust) for h in found.hits] == [("notes/ok.md", "contributed-approved")]
    note = kb.workflows / "src" / "knowledgebase" / "notes" / "ok.md"
    before = os.stat(note)
    data = note.read_bytes()
    time.sleep(0.02)  # not a wait: the rewrite's ctime lands on a later tick of the coarse file clock
    with open(note, "r+b") as f:  # the same inode, the same size, other bytes
        f.write(data.replace(b"approved text", b"injected text"))
    os.utime(note, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(note).st_mtime_ns == before.st_mtime_ns and os.stat(note).st_size == before.st_size
    again = search_ops.run(host.config.state_dir, where, "quokka", searcher=engine)
    assert again.hits == ()
    # A fresh walk reads the new bytes: unreviewed, so out of the default results.
    fresh = search_ops.FullTextSearcher(host.config.state_dir)
    assert search_ops.run(host.config.state_dir, where, "quokka", searcher=fresh).hits == ()
    relabelled = search_ops.run(
        host.config.state_dir, where, "injected", include_unreviewed=True, searcher=fresh
    )
    assert [(h.relpath, h.trust) for h in relabelled.hits] == [("notes/ok.md", "contributed-unreviewed")]


def test_a_review_applies_only_to_the_bytes_the_reviewer_saw(tmp_path: Path) -> None:
    """The owner reads a pending note (version d1), the contributor rewrites it,
    the owner approves: with --expected-version d1 the approval is refused (75,
    audited, nothing recorded) instead of approving bytes nobody read; without
    a version an approval is a usage error (2), never of whatever is there."""
    kb, sid = _world(tmp_path)
    assert (
        kb.call("notes", "write", sid, "rts", "v.md", "--file", "-", input=b"# V\nquokka benign\n").code == 0
    )
    [seen] = kb.call("notes", "pending", "src", "--as", "alice", "--json").json()["pending"]
    assert (
        kb.call("notes", "write", sid, "rts", "v.md", "--file", "-", input=b"# V\nquokka swapped\n").code == 0
    )
    blind = kb.call("notes", "review", "src", "notes/v.md", "--approve", "--as", "alice")
    assert blind.code == 2 and "--approve needs --expected-version" in blind.err, blind.err
    refused = [r for r in audit.read(kb.root / "state") if r["event"] == "note_review_refused"]
    assert [(r["action"], r["code"]) for r in refused] == [("approve", "usage")]
    for decision in ("--approve", "--reject"):
        r = kb.call("notes", "review", "src", "notes/v.md", decision, "--expected-version", seen["digest"],
                    "--as", "alice")  # fmt: skip
        assert r.code == 75 and "changed since version" in r.err, r.err
    assert (kb.workflows / "src" / "knowledgebase" / "notes" / "v.md").exists()
    assert _hits(kb, sid, "quokka") == {}  # still unreviewed
    [now] = kb.call("notes", "pending", "src", "--as", "alice", "--json").json()["pending"]
    assert now["digest"] != seen["digest"]
    bad = kb.call(
        "notes", "review", "src", "notes/v.md", "--approve", "--expected-version", "v1", "--as", "alice"
    )
    assert bad.code == 65 and "--expected-version" in bad.err
    ok = kb.call("notes", "review", "src", "notes/v.md", "--approve", "--expected-version", now["digest"],
                 "--as", "alice", "--json")  # fmt: skip
    assert ok.code == 0 and ok.json()["digest"] == now["digest"], ok.err
    assert _hits(kb, sid, "quokka")["notes/v.md"]["trust"] == "contributed-approved"


def test_a_commands_note_too_big_for_a_note_is_never_the_sources(tmp_path: Path) -> None:
    """A real sandboxed command writes a note over the note size cap: it is
    refused at commit (docs/notes.md "Staged contributions"), so it never lands in
    the source to be searched as the source's own; its bytes are kept for the
    contributor and the refusal is reported."""
    kb, sid = _world(tmp_path)
    script = '{ printf "# Big\\nquokka big\\n"; head -c 1300000 /dev/zero | tr "\\0" "a"; } > "$WORKFLOW_KB_RTS/notes/big.md"'
    r = kb.cli("exec", sid, "--", "sh", "-c", script)
    assert r.code == 0, r.err
    assert "contribution refused: rts:notes/big.md: error[invalid-input]" in r.err, r.err
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "big.md").exists()
    assert "notes/big.md" not in _hits(kb, sid, "quokka")
    assert _pending(kb) == {}
    (kept,) = (kb.workflows / "con" / ".kbd-refused").glob("*/rts/notes/big.md")
    assert kept.stat().st_size > 1024 * 1024
