"""Resolver scenarios (docs/access.md "Statuses and reason codes"), through
the library against real folders on disk. Every lookup uses a fresh resolution."""

from __future__ import annotations

import shutil
from pathlib import Path

from kbd.core.resolve import Attachment
from kbd.service import workflows
from tests.helpers import KbRoot


def statuses(kb: KbRoot, wid: str, actor: str = "alice") -> dict[str, Attachment]:
    h = kb.host()
    atts = workflows.sources(h, wid, actor=h.actor(actor)).sources
    return {a.alias: a for a in atts}


def reason(kb: KbRoot, wid: str, alias: str) -> str | None:
    return statuses(kb, wid)[alias].reason


def test_several_direct_sources_available_and_not_transitive(kb: KbRoot) -> None:
    kb.workflow("d", access={"owners": ["alice"]})
    kb.workflow(
        "b", folder="rts", access={"owners": ["alice"]}, sources=[{"workflow_id": "d", "alias": "deep"}]
    )
    kb.workflow("c", folder="security", access={"owners": ["alice"]})
    kb.workflow(
        "a",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "b", "alias": "rts"}, {"workflow_id": "c", "alias": "security"}],
    )
    atts = statuses(kb, "a")
    assert sorted(atts) == ["rts", "security"]
    assert all(a.available and a.reason is None for a in atts.values())
    assert atts["rts"].path == kb.workflows.resolve() / "rts" / "knowledgebase"
    assert atts["rts"].env == "WORKFLOW_KB_RTS"
    # Live file access: an update saved by the source is what the next read sees.
    note = atts["rts"].path / "notes" / "fact.md"
    assert note.read_text() == "b\n"
    (kb.workflows / "rts" / "knowledgebase" / "notes" / "fact.md").write_text("updated\n")
    assert (statuses(kb, "a")["rts"].path or Path("/nonexistent")).joinpath(
        "notes", "fact.md"
    ).read_text() == "updated\n"


def test_mutual_attachments_do_not_expand(kb: KbRoot) -> None:
    kb.workflow("x", access={"owners": ["alice"]}, sources=[{"workflow_id": "y", "alias": "y"}])
    kb.workflow("y", access={"owners": ["alice"]}, sources=[{"workflow_id": "x", "alias": "x"}])
    kb.workflow("z", access={"owners": ["alice"]}, sources=[{"workflow_id": "x", "alias": "x"}])
    assert list(statuses(kb, "x")) == ["y"]
    assert list(statuses(kb, "z")) == ["x"]
    assert statuses(kb, "z")["x"].path == kb.workflows.resolve() / "x" / "knowledgebase"


def test_renamed_and_moved_source_found_by_id(kb: KbRoot) -> None:
    kb.workflow("b", folder="rts", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "rts"}])
    assert statuses(kb, "a")["rts"].available
    (kb.workflows / "rts").rename(kb.workflows / "renamed")
    att = statuses(kb, "a")["rts"]
    assert att.available and att.path == kb.workflows.resolve() / "renamed" / "knowledgebase"
    (kb.workflows / "team").mkdir()
    (kb.workflows / "renamed").rename(kb.workflows / "team" / "moved")
    att = statuses(kb, "a")["rts"]
    assert att.available and att.path == kb.workflows.resolve() / "team" / "moved" / "knowledgebase"


def test_copied_folder_makes_id_ambiguous_until_removed(kb: KbRoot) -> None:
    src = kb.workflow("b", folder="rts", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "rts"}])
    assert statuses(kb, "a")["rts"].available
    shutil.copytree(src, kb.workflows / "clone")
    att = statuses(kb, "a")["rts"]
    assert (att.available, att.reason, att.path) == (False, "ambiguous_id", None)
    assert "2 workflow folders" in (att.message or "")
    shutil.rmtree(kb.workflows / "clone")
    assert statuses(kb, "a")["rts"].available


def test_private_source_audience_denied_then_granted_then_revoked(kb: KbRoot) -> None:
    src = kb.workflow("b", created_by="bob")
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "rts"}])
    att = statuses(kb, "a")["rts"]
    assert (att.available, att.reason, att.path, att.label) == (False, "audience_denied", None, None)
    kb.edit(src, access={"owners": ["bob"], "readers": ["alice"]})
    assert statuses(kb, "a")["rts"].available
    kb.edit(src, access={"owners": ["bob"]})
    assert reason(kb, "a", "rts") == "audience_denied"


def test_whole_audience_counts_including_editors(kb: KbRoot) -> None:
    kb.workflow("b", access={"owners": ["alice"], "readers": ["bob"]})
    con = kb.workflow(
        "a",
        access={"owners": ["alice"], "editors": ["carol"]},
        sources=[{"workflow_id": "b", "alias": "rts"}],
    )
    # carol edits the consumer but may not read the source: denied for the whole consumer.
    assert reason(kb, "a", "rts") == "audience_denied"
    kb.edit(con, access={"owners": ["alice"], "readers": ["bob"]})
    assert statuses(kb, "a")["rts"].available
    kb.edit(con, access={"owners": ["alice"], "readers": ["bob", "dave"]})
    assert reason(kb, "a", "rts") == "audience_denied"


def test_broad_consumer_cannot_attach_private_source_its_owner_owns(kb: KbRoot) -> None:
    kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow(
        "a", access={"owners": ["alice"], "readers": ["bob"]}, sources=[{"workflow_id": "b", "alias": "s"}]
    )
    assert reason(kb, "a", "s") == "audience_denied"


def test_enabled_admin_does_not_narrow_but_disabled_admin_does(kb: KbRoot) -> None:
    kb.workflow("b", access={"owners": ["alice"]})
    con = kb.workflow(
        "a", access={"owners": ["alice"], "readers": ["ops"]}, sources=[{"workflow_id": "b", "alias": "s"}]
    )
    assert statuses(kb, "a")["s"].available
    kb.edit(con, access={"owners": ["alice"], "readers": ["exadmin"]})
    assert reason(kb, "a", "s") == "audience_denied"


def test_unknown_principal_in_consumer_audience_still_counts(kb: KbRoot) -> None:
    kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow(
        "a", access={"owners": ["alice"], "readers": ["ghost"]}, sources=[{"workflow_id": "b", "alias": "s"}]
    )
    assert reason(kb, "a", "s") == "audience_denied"


def test_legacy_rules(kb: KbRoot) -> None:
    kb.workflow("legacy_src")
    kb.workflow("owned_src", access={"owners": ["alice"]})
    kb.workflow(
        "legacy_con",
        sources=[{"workflow_id": "legacy_src", "alias": "l"}, {"workflow_id": "owned_src", "alias": "o"}],
    )
    kb.workflow(
        "owned_con",
        access={"owners": ["alice"], "readers": ["bob"]},
        sources=[{"workflow_id": "legacy_src", "alias": "l"}],
    )
    legacy = statuses(kb, "legacy_con")
    assert legacy["l"].available
    assert legacy["o"].reason == "audience_denied"
    assert "account-visible" in (legacy["o"].message or "")
    assert statuses(kb, "owned_con")["l"].available


def test_created_by_is_the_fallback_owner(kb: KbRoot) -> None:
    kb.workflow("b", created_by="alice")
    kb.workflow("a", created_by="alice", sources=[{"workflow_id": "b", "alias": "s"}])
    assert statuses(kb, "a")["s"].available
    kb.workflow("c", created_by="bob", sources=[{"workflow_id": "b", "alias": "s"}])
    assert statuses(kb, "c", actor="bob")["s"].reason == "audience_denied"


def test_deleted_source_is_not_found_but_listed(kb: KbRoot) -> None:
    src = kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "rts"}])
    shutil.rmtree(src)
    att = statuses(kb, "a")["rts"]
    assert (att.alias, att.workflow_id, att.available, att.reason, att.path) == (
        "rts",
        "b",
        False,
        "not_found",
        None,
    )


def test_kb_folder_problems_each_have_their_reason(kb: KbRoot) -> None:
    src = kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "s"}])
    kbdir = src / "knowledgebase"
    shutil.move(kbdir, src / "kb_real")
    assert reason(kb, "a", "s") == "kb_missing"
    kbdir.write_text("not a folder")
    assert reason(kb, "a", "s") == "kb_not_dir"
    kbdir.unlink()
    # A symlink is refused even when it points inside the same workflow.
    kbdir.symlink_to("kb_real")
    assert reason(kb, "a", "s") == "kb_symlinked"
    kbdir.unlink()
    kbdir.symlink_to(src / "credentials")
    assert reason(kb, "a", "s") == "kb_symlinked"
    kbdir.unlink()
    shutil.move(src / "kb_real", kbdir)
    assert statuses(kb, "a")["s"].available


def test_other_host_and_unreadable_manifest(kb: KbRoot) -> None:
    src = kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "s"}])
    kb.edit(src, host="elsewhere")
    assert reason(kb, "a", "s") == "other_host"
    kb.edit(src, host="test-host")
    assert statuses(kb, "a")["s"].available
    # A broken manifest is reported against the ID it had, not as "not found".
    (src / "workflow.json").write_text('{"id": "b", "access": {"owners": ["alice"]')
    att = statuses(kb, "a")["s"]
    assert (att.reason, att.path) == ("manifest_unreadable", None)
    # A malformed access block never reads as legacy (which would widen access).
    kb.write_manifest(src, {"id": "b", "access": {"owners": "alice"}})
    assert reason(kb, "a", "s") == "manifest_unreadable"
    kb.write_manifest(src, {"id": "b", "id2": 1, "access": {"owners": ["alice"]}})
    assert statuses(kb, "a")["s"].available
    (src / "workflow.json").write_text('{"id": "b", "access": {"owners": ["alice"]}, "access": {}}')
    assert reason(kb, "a", "s") == "manifest_unreadable"


def test_symlinked_manifest_is_unreadable_not_followed(kb: KbRoot) -> None:
    real = kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "s"}])
    fake = kb.workflows / "fake"
    (fake / "knowledgebase").mkdir(parents=True)
    (fake / "workflow.json").symlink_to(real / "workflow.json")
    # The symlinked manifest is not a second claim to "b": it is unreadable.
    assert statuses(kb, "a")["s"].available
    h = kb.host()
    rows = {r["path"]: r for r in workflows.list_workflows(h, actor=h.actor("ops")).to_json()["workflows"]}
    assert rows[str(fake.resolve())]["status"] == "manifest_unreadable"


def test_hand_edited_invalid_entries_stay_visible(kb: KbRoot) -> None:
    kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow(
        "a",
        access={"owners": ["alice"]},
        sources=[
            {"workflow_id": "b", "alias": "good"},
            {"workflow_id": "b", "alias": "dup_id"},
            {"workflow_id": "../b", "alias": "pathy"},
            {"workflow_id": "a", "alias": "self"},
            {"workflow_id": "b", "alias": "Bad"},
            {"workflow_id": "b", "alias": "x", "path": "/etc"},
        ],
    )
    h = kb.host()
    atts = workflows.sources(h, "a", actor=h.actor("alice")).sources
    assert len(atts) == 6
    assert all(a.reason == "invalid_entry" and a.path is None for a in atts)
    assert "more than once" in (atts[0].message or "")
    assert "path" in (atts[2].message or "")
    assert "itself" in (atts[3].message or "")


def test_hand_edited_write_grant_never_grants_more(kb: KbRoot) -> None:
    src = kb.workflow("b", access={"owners": ["bob"], "allowed_kb_writers": ["a"]})
    kb.workflow(
        "a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "s", "access": "write"}]
    )
    att = statuses(kb, "a")["s"]
    # The grant exists but alice may not read bob's KB: read fails, and write says why (not "not granted").
    assert (att.available, att.reason) == (False, "audience_denied")
    assert att.write is not None and (att.write.available, att.write.reason) == (False, "audience_denied")
    kb.edit(src, access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": [" a "]})
    att = statuses(kb, "a")["s"]
    assert att.available and att.write is not None and att.write.reason == "write_not_granted"
    kb.edit(src, access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["a"]})
    assert statuses(kb, "a")["s"].writable
    # Revocation by hand-edit is honoured on the next lookup.
    kb.edit(src, access={"owners": ["bob"], "readers": ["alice"]})
    assert not statuses(kb, "a")["s"].writable


def test_source_owner_change_revokes_on_next_lookup(kb: KbRoot) -> None:
    src = kb.workflow("b", created_by="alice")
    kb.workflow("a", created_by="alice", sources=[{"workflow_id": "b", "alias": "rts"}])
    assert statuses(kb, "a")["rts"].available
    kb.edit(src, created_by="bob")
    att = statuses(kb, "a")["rts"]
    assert (att.available, att.path) == (False, None)
