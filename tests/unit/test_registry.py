"""Registry discovery and its cache (DESIGN §2; upstream weak points 3, 11, 14)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kbd import registry
from kbd.registry import Ambiguous, Found, Missing, Registry, Unreadable
from tests.helpers import KbRoot


def reg(kb: KbRoot, *, sweep: float = 0.0) -> Registry:
    return Registry(
        [kb.workflows.resolve()],
        cache_path=kb.root / "state" / "cache" / "registry.json",
        sweep_interval=sweep,
    )


@pytest.fixture
def no_racy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trust fresh timestamps, so cache hits can be observed without waiting."""
    monkeypatch.setattr(registry, "RACY_NS", 0)


def test_discovery_stops_at_first_manifest_and_ignores_symlinked_folders(kb: KbRoot, tmp_path: Path) -> None:
    outer = kb.workflow("outer", folder="team/outer")
    (outer / "nested").mkdir()
    kb.write_manifest(outer / "nested", {"id": "nested"})
    kb.workflow("deep", folder="a/b/c/d/deep")
    elsewhere = tmp_path / "elsewhere" / "wf"
    elsewhere.mkdir(parents=True)
    KbRoot.write_manifest(elsewhere, {"id": "linked"})
    (kb.workflows / "link").symlink_to(elsewhere.parent)
    (kb.workflows / "link2").symlink_to(elsewhere)
    r = reg(kb)
    assert isinstance(r.find("outer"), Found)
    assert isinstance(r.find("deep"), Found)
    assert isinstance(r.find("nested"), Missing)
    assert isinstance(r.find("linked"), Missing)


def test_cache_is_reused_across_processes_until_a_folder_changes(kb: KbRoot, no_racy: None) -> None:
    kb.workflow("a")
    kb.workflow("b", folder="team/b")
    first = reg(kb)
    assert isinstance(first.find("b"), Found) and first.scans == 1
    second = reg(kb)  # a new process: loads state/cache/registry.json
    assert isinstance(second.find("b"), Found)
    assert isinstance(second.find("a"), Found)
    assert second.scans == 0
    kb.workflow("c", folder="team/c")
    third = reg(kb)
    assert isinstance(third.find("c"), Found) and third.scans == 1


def test_racy_timestamps_are_never_trusted(kb: KbRoot) -> None:
    kb.workflow("a")
    r = reg(kb)
    r.find("a")
    again = reg(kb)
    again.find("a")
    # Everything was modified just now, within the racy window: the walk is redone.
    assert again.scans == 1


def test_in_place_id_change_is_seen(kb: KbRoot, no_racy: None) -> None:
    a = kb.workflow("a")
    b = kb.workflow("b")
    r = reg(kb)
    assert isinstance(r.find("a"), Found)
    kb.edit(b, id="a")  # b now claims a's ID, with no folder added or removed
    # Same size as before; with the racy window disabled, make the mtime differ for sure.
    os.utime(b / "workflow.json", ns=(1, 1))
    found = r.find("a")
    assert isinstance(found, Ambiguous) and {f.path for f in found.folders} == {a.resolve(), b.resolve()}
    assert isinstance(reg(kb).find("b"), Missing)
    kb.edit(a, id="renamed")
    assert isinstance(reg(kb).find("renamed"), Found)


def test_long_lived_registry_sweeps_on_a_miss(kb: KbRoot, no_racy: None) -> None:
    b = kb.workflow("b")
    r = reg(kb, sweep=3600)
    assert isinstance(r.find("b"), Found)
    kb.edit(b, id="b2")
    assert isinstance(r.find("b2"), Found)
    assert isinstance(r.find("b"), Missing)


def test_unreadable_manifest_keeps_its_last_known_id(kb: KbRoot) -> None:
    b = kb.workflow("b")
    assert isinstance(reg(kb).find("b"), Found)
    (b / "workflow.json").write_text("{not json")
    found = reg(kb).find("b")  # a new process knows the ID from the cache
    assert isinstance(found, Unreadable)
    assert "not valid JSON" in (found.folder.problem or "")


def test_corrupt_or_foreign_cache_is_ignored(kb: KbRoot) -> None:
    kb.workflow("a")
    reg(kb).find("a")
    cache = kb.root / "state" / "cache" / "registry.json"
    for junk in (b"\x00garbage", b"[]", b'{"format": 1, "roots": "x"}', b'{"format": 99}'):
        cache.write_bytes(junk)
        assert isinstance(reg(kb).find("a"), Found)


def test_cache_from_other_roots_is_not_used(kb: KbRoot, tmp_path: Path) -> None:
    kb.workflow("a")
    reg(kb).find("a")
    other = Registry([tmp_path / "nowhere"], cache_path=kb.root / "state" / "cache" / "registry.json")
    assert isinstance(other.find("a"), Missing)


def test_missing_root_then_created(kb: KbRoot, tmp_path: Path) -> None:
    root = tmp_path / "late"
    r = Registry([root], cache_path=None, sweep_interval=0)
    assert isinstance(r.find("x"), Missing)
    root.mkdir()
    (root / "x").mkdir()
    KbRoot.write_manifest(root / "x", {"id": "x"})
    assert isinstance(r.find("x"), Found)


def test_workflows_list_reports_problems(kb: KbRoot) -> None:
    kb.workflow("a")
    kb.workflow("a", folder="copy")
    bad = kb.workflows / "bad"
    bad.mkdir()
    (bad / "workflow.json").write_text("[1, 2]")
    h = kb.host()
    rows = h.list_workflows(h.actor("ops"))
    by_path = {Path(r["path"]).name: r["status"] for r in rows}
    assert by_path == {"a": "ambiguous_id", "copy": "ambiguous_id", "bad": "manifest_unreadable"}
    # Users who are neither admins nor services see no unreadable rows (nothing to inspect).
    assert all(r["status"] != "manifest_unreadable" for r in h.list_workflows(h.actor("alice")))
