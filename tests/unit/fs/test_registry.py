"""Registry discovery and its cache (docs/on-disk.md "Registry")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kbd.core import layout
from kbd.fs import lint
from kbd.fs.registry import Ambiguous, Found, Missing, Registry, Unreadable
from kbd.service import workflows
from kbd.service.root import Root
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
    monkeypatch.setattr(layout, "RACY_NS", 0)  # read by layout.racy, the one racy rule


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


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_long_lived_registry_answers_a_miss_as_it_stands_until_the_next_sweep(
    kb: KbRoot, no_racy: None
) -> None:
    # Contract (docs/on-disk.md "Registry"): a miss used to force a full re-check of
    # every folder and manifest; it is now answered from the index as it stands,
    # and the re-check happens at most once per sweep interval.
    b = kb.workflow("b")
    clock = Clock()
    r = Registry(
        [kb.workflows.resolve()],
        cache_path=kb.root / "state" / "cache" / "registry.json",
        sweep_interval=1.0,
        clock=clock,
    )
    assert isinstance(r.find("b"), Found)
    kb.edit(b, id="b2")
    assert isinstance(r.find("b2"), Missing)  # within the interval: the index as it stands
    assert isinstance(r.find("b"), Missing)  # a hit is always verified: b no longer holds "b"
    clock.now += 1.0
    assert isinstance(r.find("b2"), Found)
    assert isinstance(r.find("b"), Missing)


class LstatCounter:
    """Counts os.lstat calls (and passes them through): the registry's unit of work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = os.lstat

        def counting(path: object, *args: object, **kwargs: object) -> os.stat_result:
            self.calls += 1
            return real(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "lstat", counting)


def test_misses_never_walk_the_registry(kb: KbRoot, no_racy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/on-disk.md "Registry": N misses within the sweep interval cost no lstat at all
    (main re-verified every folder and manifest once per miss)."""
    for i in range(200):
        kb.workflow(f"w{i}", folder=f"team{i % 10}/w{i}", kb=False)
    r = reg(kb, sweep=3600)
    assert isinstance(r.find("w7"), Found)
    counter = LstatCounter(monkeypatch)
    for i in range(16):
        assert isinstance(r.find(f"missing{i}"), Missing)
    assert counter.calls == 0
    assert isinstance(r.find("w8"), Found)
    assert counter.calls == 1  # a hit: its own manifest, verified now


def test_reverification_happens_at_most_once_per_interval(
    kb: KbRoot, no_racy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(200):
        kb.workflow(f"w{i}", folder=f"team{i % 10}/w{i}", kb=False)
    clock = Clock()
    r = Registry([kb.workflows.resolve()], cache_path=None, sweep_interval=1.0, clock=clock)
    assert isinstance(r.find("w7"), Found)
    verifications, scans = r.verifications, r.scans
    for i in range(16):
        assert isinstance(r.find(f"missing{i}"), Missing)
    assert (r.verifications, r.scans) == (verifications, scans)
    # Once the interval has passed, the next lookup (hit or miss) re-checks, once.
    clock.now += 1.0
    counter = LstatCounter(monkeypatch)
    for i in range(16):
        assert isinstance(r.find(f"missing{i}"), Missing)
    assert (r.verifications, r.scans) == (verifications + 1, scans)
    assert counter.calls <= 200 + 10 + 1  # each manifest, each walked folder, the root: once


def test_plan_with_16_missing_sources_costs_no_walk(
    kb: KbRoot, no_racy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer whose owner hand-edited 16 missing sources in: resolving its
    plan verifies the present sources' manifests only, never the registry."""
    for i in range(200):
        kb.workflow(f"w{i}", folder=f"team{i % 10}/w{i}", kb=True)
    present = [{"workflow_id": f"w{i}", "alias": f"p{i}"} for i in range(4)]
    missing = [{"workflow_id": f"gone{i}", "alias": f"m{i}"} for i in range(16)]
    kb.workflow("consumer", sources=present + missing)
    h = Root(kb.root, sweep_interval=3600)
    alice = h.actor("ops")
    first = workflows.sources(h, "consumer", actor=alice).sources
    assert [a.reason for a in first] == [None] * 4 + ["not_found"] * 16
    counter = LstatCounter(monkeypatch)
    scans = h.registry.scans
    for _ in range(3):
        again = workflows.sources(h, "consumer", actor=alice).sources
        assert [a.reason for a in again] == [None] * 4 + ["not_found"] * 16
    assert counter.calls <= 3 * (1 + 4)  # the consumer's and each present source's manifest
    assert h.registry.scans == scans


def test_a_new_process_sees_a_workflow_created_a_moment_ago(kb: KbRoot) -> None:
    """The CLI is a new process per call: it loads the cache and revalidates it at
    its first lookup, so a workflow created just now is found (racy window kept)."""
    kb.workflow("a", folder="team/a")
    assert isinstance(reg(kb, sweep=1.0).find("a"), Found)
    kb.workflow("b", folder="team/b")
    assert isinstance(reg(kb, sweep=1.0).find("b"), Found)
    kb.workflow("c", folder="other/deep/c")
    fresh = reg(kb, sweep=1.0)
    assert isinstance(fresh.find("nope"), Missing)
    assert isinstance(fresh.find("c"), Found)


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
    rows = workflows.list_workflows(h, actor=h.actor("ops")).to_json()["workflows"]
    by_path = {Path(r["path"]).name: r["status"] for r in rows}
    assert by_path == {"a": "ambiguous_id", "copy": "ambiguous_id", "bad": "manifest_unreadable"}
    # Users who are neither admins nor services see no unreadable rows (nothing to inspect).
    assert all(
        r["status"] != "manifest_unreadable"
        for r in workflows.list_workflows(h, actor=h.actor("alice")).to_json()["workflows"]
    )


# -- nesting (docs/on-disk.md "Registry") ------------------------------------------------------


def test_a_manifest_above_a_known_workflow_never_redirects_its_id(kb: KbRoot) -> None:
    rts = kb.workflow("wf_rts", folder="team/rts", access={"owners": ["alice"]})
    assert isinstance(reg(kb).find("wf_rts"), Found)  # known, and in the cache file
    team = kb.workflows / "team"
    KbRoot.write_manifest(team, KbRoot.read_manifest(rts))  # the forged copy, same ID
    for r in (reg(kb), reg(kb, sweep=3600)):  # a new process, loading the cache
        found = r.find("wf_rts")
        assert isinstance(found, Ambiguous) and found.nested
        assert {f.path for f in found.folders} == {team.resolve(), rts.resolve()}
        statuses = {f.path.name: r.status_of(f) for f in r.folders()}
        assert statuses == {"team": "ambiguous_id", "rts": "ambiguous_id"}


def test_a_nested_workflow_fails_closed_until_the_operator_resolves_it(kb: KbRoot) -> None:
    rts = kb.workflow("wf_rts", folder="team/rts")
    r = reg(kb)
    assert isinstance(r.find("wf_rts"), Found)
    team = kb.workflows / "team"
    KbRoot.write_manifest(team, {"id": "wf_team"})  # no forged ID: still no silent answer
    for one in (r, reg(kb)):
        for wid in ("wf_rts", "wf_team"):
            found = one.find(wid)
            assert isinstance(found, Ambiguous) and found.nested, (wid, found)
    rows = {f.path.name: f for f in r.folders()}
    assert rows["rts"].nested_in == team.resolve()
    assert r.contained(rows["team"]) == [rts.resolve()]
    # It stays so across later walks (the hidden folder is remembered in the cache).
    (kb.workflows / "unrelated").mkdir()
    assert isinstance(reg(kb).find("wf_rts"), Ambiguous)
    # The operator removes the manifest that does not belong: both answers come back.
    (team / "workflow.json").unlink()
    for one in (r, reg(kb)):
        assert isinstance(one.find("wf_rts"), Found)
        assert isinstance(one.find("wf_team"), Missing)


def test_moving_the_nested_workflow_out_resolves_it(kb: KbRoot) -> None:
    rts = kb.workflow("wf_rts", folder="team/rts")
    assert isinstance(reg(kb).find("wf_rts"), Found)
    team = kb.workflows / "team"
    KbRoot.write_manifest(team, {"id": "wf_team"})
    assert isinstance(reg(kb).find("wf_team"), Ambiguous)
    rts.rename(kb.workflows / "rts")
    r = reg(kb)
    found = r.find("wf_rts")
    assert isinstance(found, Found) and found.folder.path == (kb.workflows / "rts").resolve()
    assert isinstance(r.find("wf_team"), Found)
    assert all(r.status_of(f) == "ok" for f in r.folders())


def test_a_never_discovered_nested_manifest_is_reported_by_the_lint(kb: KbRoot) -> None:
    outer = kb.workflow("outer", folder="team/outer")
    (outer / "sub" / "inner").mkdir(parents=True)
    KbRoot.write_manifest(outer / "sub" / "inner", {"id": "inner"})
    kb.workflow("plain")
    r = reg(kb)
    assert isinstance(r.find("outer"), Found)  # never known: discovery stops at outer
    check = lint.nesting_check(r, r.folders())
    assert not check.ok
    assert "sub/inner/workflow.json" in check.detail and "never discovered" in check.detail
    (outer / "sub" / "inner" / "workflow.json").unlink()
    assert lint.nesting_check(r, r.folders()).ok
