"""Registry and root hardening through the real CLI on a real root (docs/on-disk.md "Registry" and "Root
layout")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import KbRoot, snapshot

# -- item 17: no silent redirect through a parent manifest -----------------------------


def _rts_layout(kb: KbRoot) -> Path:
    """wf_rts in a nested layout (workflows/team/rts) and a consumer attaching it."""
    rts = kb.workflow("wf_rts", folder="team/rts", label="RTS platform", access={"owners": ["alice"]})
    kb.workflow(
        "wf_perf",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "wf_rts", "alias": "rts", "access": "read"}],
    )
    return rts


def test_a_forged_parent_manifest_is_ambiguous_never_a_redirect(kb: KbRoot) -> None:
    rts = _rts_layout(kb)
    before = kb.cli("sources", "list", "wf_perf", "--as", "alice", "--json")
    assert before.code == 0, before.err
    [att] = before.json()["sources"]
    assert att["available"] and att["path"] == str((rts / "knowledgebase").resolve())

    # The attack: a workflow.json in the shared team folder copying wf_rts's manifest,
    # with a knowledgebase/ of the attacker's choosing beside it.
    team = kb.workflows / "team"
    KbRoot.write_manifest(team, KbRoot.read_manifest(rts))
    (team / "knowledgebase" / "context").mkdir(parents=True)
    (team / "knowledgebase" / "context" / "about.md").write_text("planted by the attacker\n")

    after = kb.cli("sources", "list", "wf_perf", "--as", "alice", "--json")
    assert after.code == 0, after.err
    [att] = after.json()["sources"]
    assert att["available"] is False and att["path"] is None
    assert att["reason"] == "ambiguous_id"
    assert "nested" in att["message"]
    read = kb.cli("read", "wf_perf", "rts", "context/about.md", "--as", "alice")
    assert read.code != 0 and "planted" not in read.out
    show = kb.cli("workflows", "show", "wf_rts", "--as", "alice")
    assert show.code == 65 and "ambiguous-id" in show.err, show.out + show.err

    listing = kb.cli("workflows", "list", "--as", "ops", "--json")
    assert listing.code == 0, listing.err
    rows = {Path(r["path"]).name: r for r in listing.json()["workflows"]}
    assert rows["team"]["status"] == rows["rts"]["status"] == "ambiguous_id"
    assert rows["rts"]["nested_in"] == str(team.resolve())
    assert rows["team"]["contains"] == [str(rts.resolve())]
    text = kb.cli("workflows", "list", "--as", "ops")
    assert "inside workflow folder" in text.out and "contains workflow folder" in text.out

    doctor = kb.cli("doctor", "--json")
    assert doctor.code == 65, doctor.out + doctor.err
    failed = {c["check"]: c["detail"] for c in doctor.json()["checks"] if not c["ok"]}
    assert "registry-nesting" in failed and str(rts.resolve()) in failed["registry-nesting"]
    assert "all ok" not in failed.get("registry", "all ok")


def test_a_parent_manifest_with_its_own_id_fails_closed_until_removed(kb: KbRoot) -> None:
    rts = _rts_layout(kb)
    assert kb.cli("sources", "list", "wf_perf", "--as", "alice", "--json").code == 0
    team = kb.workflows / "team"
    KbRoot.write_manifest(team, {"id": "wf_team", "access": {"owners": ["bob"]}})
    [att] = kb.cli("sources", "list", "wf_perf", "--as", "alice", "--json").json()["sources"]
    assert (att["available"], att["reason"]) == (False, "ambiguous_id")
    # The operator resolves it: the manifest that does not belong goes.
    (team / "workflow.json").unlink()
    [att] = kb.cli("sources", "list", "wf_perf", "--as", "alice", "--json").json()["sources"]
    assert att["available"] and att["path"] == str((rts / "knowledgebase").resolve())
    assert kb.cli("doctor").code == 0


# -- item 16: a miss is cheap, and a new process still sees a new workflow ---------------


def test_the_cli_finds_a_workflow_created_a_moment_ago(kb: KbRoot) -> None:
    kb.workflow("wf_a", folder="team/a", access={"owners": ["alice"]})
    assert kb.cli("workflows", "list", "--as", "ops").code == 0  # writes the registry cache
    assert kb.cli("workflows", "show", "wf_new", "--as", "ops").code == 66
    kb.workflow("wf_new", folder="team/new", access={"owners": ["alice"]})
    r = kb.cli("workflows", "show", "wf_new", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert r.json()["workflow_id"] == "wf_new"


# -- item 15: doctor flags multi-link files in the KBs a workflow's sessions read -----------


def test_doctor_workflow_flags_multi_link_files(kb: KbRoot) -> None:
    src = kb.workflow("wf_src", access={"owners": ["alice"]})
    own = kb.workflow(
        "wf_me", access={"owners": ["alice"]}, sources=[{"workflow_id": "wf_src", "alias": "src"}]
    )
    clean = kb.cli("doctor", "--workflow", "wf_me", "--json")
    assert clean.code == 0, clean.out + clean.err
    links = [c for c in clean.json()["checks"] if c["check"] == "kb-hardlinks"]
    assert len(links) == 2 and all(c["ok"] for c in links)

    os.link(src / "credentials" / "token", src / "knowledgebase" / "notes" / "deep.md")
    (own / "knowledgebase" / "context" / "a" / "b").mkdir(parents=True)
    os.link(own / "credentials" / "token", own / "knowledgebase" / "context" / "a" / "b" / "t")
    r = kb.cli("doctor", "--workflow", "wf_me", "--json")
    assert r.code == 65, r.out + r.err
    failed = [c["detail"] for c in r.json()["checks"] if c["check"] == "kb-hardlinks" and not c["ok"]]
    assert len(failed) == 2
    assert any("source src (wf_src)" in d and "notes/deep.md" in d for d in failed)
    assert any("own KB of wf_me" in d and "context/a/b/t" in d for d in failed)
    # kbd read refuses the file; doctor names what a shell could still read.
    refused = kb.cli("read", "wf_me", "src", "notes/deep.md", "--as", "alice")
    assert refused.code != 0 and "secret" not in refused.out
    text = kb.cli("doctor", "--workflow", "wf_me")
    assert "FAIL kb-hardlinks" in text.out and "a sandboxed shell can still read them" in text.out
    assert kb.cli("doctor", "--workflow", "wf_nope").code == 66


def test_doctor_link_scan_never_follows_links_out_of_a_kb(kb: KbRoot, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("x")
    os.link(outside / "f", outside / "g")
    me = kb.workflow("wf_me", access={"owners": ["alice"]})
    (me / "knowledgebase" / "context" / "out").symlink_to(outside)
    r = kb.cli("doctor", "--workflow", "wf_me", "--json")
    [check] = [c for c in r.json()["checks"] if c["check"] == "kb-hardlinks"]
    assert check["ok"], check


# -- item 21: kbd init never follows pre-placed links ---------------------------------------


@pytest.mark.parametrize("sub", ["state", "workflows", "folders"])
def test_init_refuses_a_preplaced_link(tmp_path: Path, sub: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (root / sub).symlink_to(target)
    before = snapshot(tmp_path)
    # In process (KbRoot.call); the next test runs `kbd init` as a real process.
    r = KbRoot(root).call("init", "--host", "h")
    assert r.code == 65, r.out + r.err
    assert "error[root-error]" in r.err and sub in r.err and "symbolic link" in r.err
    assert snapshot(tmp_path) == before  # nothing written, nothing created behind the link
    assert list(target.iterdir()) == []


def test_init_refuses_a_preplaced_file_for_a_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "state").write_text("not a folder\n")
    r = KbRoot(root).cli("init", "--host", "h")
    assert r.code == 65 and "not a folder" in r.err, r.out + r.err
    assert not (root / "kbd.yaml").exists()
