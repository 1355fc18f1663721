"""``--dry-run`` and ``kbd preview`` (docs/access.md "Previews"): nothing changes, and the preview
is what the real change then does.

The oracle is independent of the preview's own code: the path guard (``kbd check``, run before and
after the real change) at a probe inside every grant path of either plan, ``kbd session env`` for
the variables, and ``kbd sources list`` for every consumer's attachments.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import KbRoot, snapshot
from tests.unit.service.test_why import _world

SESSIONS = [
    ("execution", "read-write"),
    ("execution", "read"),
    ("builder", "read"),
    ("kb_maintenance", "write"),
]

# (the change as a CLI command, who runs it); each previewed, then made.
CHANGES: list[tuple[list[str], str]] = [
    (["writers", "revoke", "rts", "perf"], "alice"),
    (["writers", "grant", "cost", "perf"], "alice"),
    (["sources", "detach", "perf", "cost"], "carol"),
    (["sources", "attach", "perf", "other", "--alias", "oth", "--access", "write"], "carol"),
    (["sources", "access", "perf", "rts", "read"], "carol"),
    (["readers", "revoke", "cost", "bob"], "alice"),
    (["readers", "grant", "secret", "bob", "carol", "dave"], "alice"),
    (["principals", "disable", "ops", "--force"], "ops"),
    (["principals", "disable", "carol"], "ops"),
    (["principals", "remove", "carol"], "ops"),
]


def _setup(root: Path) -> tuple[KbRoot, list[str]]:
    kb = _world(root)
    kb.call("writers", "grant", "rts", "perf", "--as", "alice")
    sids = [kb.open_session("perf", kind=k, kb_access=a, actor="carol") for k, a in SESSIONS]
    return kb, sids


def _state(kb: KbRoot) -> dict[str, Any]:
    """Every file of the root byte for byte, but: state/cache, derived data (safe to delete:
    docs/on-disk.md) that every read refreshes; and the session store, compared by its rows, since
    SQLite may move its write-ahead log into the main file whenever a connection closes (so state/'s
    own mtime moves too; its files are compared one by one)."""
    skip = ("state/cache", "state/sessions.db")
    files: dict[str, Any] = {
        k: v for k, v in snapshot(kb.root).items() if k != "state" and not k.startswith(skip)
    }
    with contextlib.closing(sqlite3.connect(kb.root / "state" / "sessions.db")) as con:
        files["sessions rows"] = list(con.iterdump())
    return files


def _probe(path: str) -> str:
    return f"{path}/why-probe.md" if Path(path).is_dir() else path


def _grant_paths(kb: KbRoot, sid: str) -> set[str]:
    r = kb.call("session", "show", sid, "--json")
    return {g["path"] for g in r.json()["grants"]} if r.code == 0 else set()


def _allowed(kb: KbRoot, sid: str, paths: set[str]) -> dict[tuple[str, str], bool]:
    out = {}
    for path in paths:
        for mode in ("read", "write"):
            out[(mode, path)] = kb.call("check", sid, _probe(path), "--mode", mode).code == 0
    return out


def _env(kb: KbRoot, sid: str) -> dict[str, str]:
    r = kb.call("session", "env", sid, "--json")
    return {k: v for k, v in r.json().items() if k != "WORKFLOW_KB_ACCESS"} if r.code == 0 else {}


def _attachments(kb: KbRoot) -> dict[tuple[str, str], tuple[str, bool, bool]]:
    out = {}
    for wid in ("perf", "cost", "rts", "other", "secret", "legacy"):
        r = kb.call("sources", "list", wid, "--as", "svc", "--json")  # a service sees every workflow
        for a in r.json()["sources"]:
            write = a["write"] is not None and a["write"]["available"]
            out[(wid, a["alias"])] = (a["workflow_id"], a["available"], write)
    return out


@pytest.mark.parametrize(("change", "who"), CHANGES, ids=[" ".join(c[:3]) for c, _ in CHANGES])
def test_the_preview_is_what_the_change_then_does(tmp_path: Path, change: list[str], who: str) -> None:
    kb, sids = _setup(tmp_path / "root")
    before_state = _state(kb)
    r = kb.call(*change, "--dry-run", "--as", who, "--json")
    assert r.code == 0, r.err
    preview = r.json()
    assert preview["dry_run"] is True
    assert _state(kb) == before_state, "a dry run changed the root"
    # The operator's view (no --as) names everything: the same preview, nothing unseen.
    full = kb.call(
        *change, "--dry-run", "--json", *(() if change[0] == "principals" else ("--as", "ops"))
    ).json()
    assert full["unseen"] == 0
    paths = {sid: _grant_paths(kb, sid) for sid in sids}
    before = {sid: _allowed(kb, sid, paths[sid]) for sid in sids}
    env_before = {sid: _env(kb, sid) for sid in sids}
    attachments_before = _attachments(kb)

    r = kb.call(*change, "--as", who)
    assert r.code == 0, r.err

    attachments_after = _attachments(kb)
    sessions = {s["session_id"]: s for s in full["sessions"]}
    for sid in sids:
        probes = paths[sid] | _grant_paths(kb, sid)
        now = _allowed(kb, sid, probes)
        # A path only the new plan grants was refused before (it lay outside every grant then).
        was = {**{k: False for k in now}, **before[sid]}
        gained = {f"{m} {p}" for (m, p), ok in now.items() if ok and not was[(m, p)]}
        lost = {f"{m} {p}" for (m, p), ok in was.items() if ok and not now[(m, p)]}
        env_after = _env(kb, sid)
        gained |= {f"variable {k}={v}" for k, v in env_after.items() if env_before[sid].get(k) != v}
        lost |= {f"variable {k}={v}" for k, v in env_before[sid].items() if env_after.get(k) != v}
        shown = sessions.get(sid, {"gained": [], "lost": []})
        assert {f"{c['kind']} {c['target']}" for c in shown["gained"]} == gained, (sid, shown, gained)
        assert {f"{c['kind']} {c['target']}" for c in shown["lost"]} == lost, (sid, shown, lost)
    changed = {k for k in attachments_before.keys() | attachments_after.keys()
               if attachments_before.get(k) != attachments_after.get(k)}  # fmt: skip
    assert {(c["workflow_id"], c["alias"]) for c in full["consumers"]} == changed, full["consumers"]


def test_every_dry_run_leaves_the_root_byte_identical_even_when_refused(tmp_path: Path) -> None:
    kb, _ = _setup(tmp_path / "root")
    before = _state(kb)
    for change, who in [*CHANGES, (["writers", "revoke", "rts", "perf"], "carol"),
                        (["sources", "attach", "perf", "nosuch", "--alias", "x"], "carol"),
                        (["principals", "disable", "ops"], "carol")]:  # fmt: skip
        r = kb.call(*change, "--dry-run", "--as", who)
        assert r.code in (0, 66, 77, 65), (change, r.err)
    assert _state(kb) == before
    assert kb.audit_events("writer_revoked") == [] and kb.audit_events("sources_changed") == []


def test_a_refused_dry_run_is_refused_as_the_change_is(tmp_path: Path) -> None:
    kb, _ = _setup(tmp_path / "root")
    real = kb.call("writers", "revoke", "rts", "perf", "--as", "carol")
    dry = kb.call("writers", "revoke", "rts", "perf", "--as", "carol", "--dry-run")
    assert (dry.code, dry.err) == (real.code, real.err) and real.code == 77
    # alice may not see perf: its sessions are counted, never named.
    r = kb.call("writers", "revoke", "rts", "perf", "--as", "alice", "--dry-run", "--json")
    assert r.code == 0 and r.json()["sessions"] == [] and r.json()["unseen"] > 0, r.out
    assert "perf" not in r.out


def test_preview_of_a_hand_edited_manifest(tmp_path: Path) -> None:
    kb, sids = _setup(tmp_path / "root")
    doc = kb.read_manifest(kb.workflows / "cost")
    doc["access"]["readers"] = ["carol"]  # dave and bob no longer read cost: perf's audience is not admitted
    edited = tmp_path / "cost.json"
    edited.write_text(json.dumps(doc))
    before = _state(kb)
    r = kb.call("preview", str(edited), "--as", "ops", "--json")
    assert r.code == 0, r.err
    assert {(c["workflow_id"], c["alias"], c["status"], c["reason"]) for c in r.json()["consumers"]} == {
        ("perf", "cost", "unavailable", "audience_denied")
    }
    reading = {sid for sid in sids if "WORKFLOW_KB_COST" in _env(kb, sid)}
    assert (
        reading and {s["session_id"] for s in r.json()["sessions"]} == reading
    )  # every session that read cost
    assert _state(kb) == before
    text = kb.call("preview", str(edited), "--as", "ops")
    assert (
        text.out.startswith("dry run: nothing was changed\n")
        and "would be unavailable (audience_denied)" in text.out
    )
    # A file kbd cannot read as a manifest, or one naming no workflow, is refused with its reason.
    edited.write_text('{"id": "cost", "access": {"owners": "alice"}}')
    r = kb.call("preview", str(edited), "--as", "ops")
    assert r.code == 65 and "access.owners must be a list" in r.err, r.err
    edited.write_text('{"id": "nosuch"}')
    assert kb.call("preview", str(edited), "--as", "ops").code == 66
    assert kb.call("preview", str(tmp_path / "missing.json"), "--as", "ops").code == 66
    # carol may not see secret: a hand edit of it is not found for her.
    secret = kb.read_manifest(kb.workflows / "secret")
    edited.write_text(json.dumps(secret))
    assert kb.call("preview", str(edited), "--as", "carol").code == 66
