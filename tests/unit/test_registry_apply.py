"""Incremental registry maintenance (docs/daemon.md "Watched state"): Registry.apply()
absorbs the changes a watcher reports and Registry.verify_now() absorbs the ones
nobody reported; both must leave exactly the index a full rescan leaves.

The property tests drive real folders: random sequences of creating, editing,
replacing, moving and deleting workflow folders and manifests (nested manifests,
symlinked folders, duplicate IDs and unreadable manifests included), reporting
after each step only what a non-recursive watch of the parent folder would see.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core import layout
from kbd.core.watching import PathChange
from kbd.fs import registry
from kbd.fs.registry import Ambiguous, Found, Missing, Registry

# A small universe, so operations collide: nesting, duplicates, moves onto
# and under each other.
DIRS = ("a", "b", "c", "a/x", "a/y", "b/x", "a/x/z", "a/x/z/q", "c/x/z")
IDS = ("w1", "w2", "w3")
VARIANTS = ("ok", "ok2", "atomic", "bad_json", "bad_id", "bad_schema", "dir", "symlink", "fifo")

Op = tuple[Any, ...]

ops = st.one_of(
    st.tuples(st.just("manifest"), st.sampled_from(DIRS), st.sampled_from(IDS), st.sampled_from(VARIANTS)),
    st.tuples(st.just("unmanifest"), st.sampled_from(DIRS)),
    st.tuples(st.just("mkdir"), st.sampled_from(DIRS)),
    st.tuples(st.just("rmtree"), st.sampled_from(DIRS)),
    st.tuples(st.just("move"), st.sampled_from(DIRS), st.sampled_from((*DIRS, "out/m1", "out/m2"))),
    st.tuples(st.just("move_in"), st.sampled_from(DIRS), st.sampled_from(IDS)),
    st.tuples(st.just("symlink"), st.sampled_from(DIRS), st.sampled_from((*DIRS, "out"))),
    st.tuples(st.just("touch"), st.sampled_from(DIRS)),
)


class World:
    """A real workflow root plus a folder outside it; each operation returns the
    changes a watcher of the affected parent folders reports, or None when the
    operation does not apply to the current tree."""

    def __init__(self, base: Path) -> None:
        self.root = (base / "workflows").resolve()
        self.out = (base / "out").resolve()
        self.root.mkdir()
        self.out.mkdir()
        self.counter = 0

    def p(self, rel: str) -> Path:
        return self.out / rel[4:] if rel.startswith("out/") else self.root / rel

    def plain(self, path: Path) -> bool:
        """No symlink between the root and ``path`` (exclusive): a write there
        would land somewhere else than the path a watcher reports."""
        base = self.root if path.is_relative_to(self.root) else self.out
        for ancestor in reversed(path.relative_to(base).parents):
            if ancestor == Path():
                continue
            here = base / ancestor
            if here.is_symlink() or (os.path.lexists(here) and not here.is_dir()):
                return False
        return True

    @staticmethod
    def not_a_folder(path: Path) -> bool:
        return os.path.lexists(path) and (path.is_symlink() or not path.is_dir())

    def mkdirs(self, path: Path) -> list[PathChange]:
        """mkdir -p, reporting the topmost folder it created (the only one a
        watcher sees: the others appear in folders nobody watches yet)."""
        missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
        if not missing:
            return []
        path.mkdir(parents=True)
        top = missing[-1]
        return [PathChange("added", str(top))] if top.is_relative_to(self.root) else []

    def doc(self, wid: str, variant: str) -> bytes:
        self.counter += 1
        body: dict[str, Any] = {"id": wid, "label": f"{wid} v{self.counter}", "pad": "x" * self.counter}
        if variant == "ok2":
            body["access"] = {"owners": ["alice"], "readers": ["bob"]}
        if variant == "bad_schema":
            body["access"] = 5
        if variant == "bad_id":
            body["id"] = "bad id"
        data = orjson.dumps(body)
        return data[:-1] if variant == "bad_json" else data

    def run(self, op: Op) -> list[PathChange] | None:
        kind = op[0]
        path = self.p(op[1])
        if not self.plain(path):
            return None
        if kind in ("manifest", "unmanifest", "mkdir", "touch") and self.not_a_folder(path):
            return None  # writing "into" a link or a file would land elsewhere
        if kind == "manifest":
            return self.manifest(path, op[2], op[3])
        if kind == "unmanifest":
            target = path / "workflow.json"
            if not path.is_dir() or path.is_symlink() or not os.path.lexists(target):
                return None
            remove(target)
            return [PathChange("deleted", str(target))]
        if kind == "mkdir":
            return self.mkdirs(path) or None
        if kind == "rmtree":
            if not os.path.lexists(path):
                return None
            remove(path)
            return [PathChange("deleted", str(path))]
        if kind == "move":
            return self.move(path, self.p(op[2]))
        if kind == "move_in":
            return self.move_in(path, op[2])
        if kind == "symlink":
            if os.path.lexists(path):
                return None
            changes = self.mkdirs(path.parent)
            path.symlink_to(self.p(op[2]), target_is_directory=True)
            return [*changes, PathChange("added", str(path))]
        if kind == "touch":
            if not path.is_dir() or path.is_symlink():
                return None
            os.utime(path, ns=(1, 1))
            return [PathChange("modified", str(path))]
        raise AssertionError(op)

    def manifest(self, folder: Path, wid: str, variant: str) -> list[PathChange]:
        changes = self.mkdirs(folder)
        target = folder / "workflow.json"
        existed = os.path.lexists(target)
        if existed and (variant in ("dir", "symlink", "fifo") or target.is_symlink() or not target.is_file()):
            remove(target)
        if variant == "dir":
            (target / "sub").mkdir(parents=True)
        elif variant == "symlink":
            target.symlink_to(self.out)
        elif variant == "fifo":
            os.mkfifo(target)
        elif variant == "atomic":
            tmp = folder / ".workflow.json.tmp"
            tmp.write_bytes(self.doc(wid, "ok"))
            os.rename(tmp, target)
            changes += [PathChange("added", str(tmp)), PathChange("deleted", str(tmp))]
        else:
            target.write_bytes(self.doc(wid, variant))
        return [*changes, PathChange("modified" if existed else "added", str(target))]

    def move(self, src: Path, dst: Path) -> list[PathChange] | None:
        if not os.path.lexists(src) or os.path.lexists(dst) or dst == src or dst.is_relative_to(src):
            return None
        if not self.plain(dst):
            return None
        changes = self.mkdirs(dst.parent)
        os.rename(src, dst)
        changes.append(PathChange("deleted", str(src)))
        if dst.is_relative_to(self.root):
            changes.append(PathChange("added", str(dst)))
        return changes

    def move_in(self, dst: Path, wid: str) -> list[PathChange] | None:
        """A whole workflow tree (with a nested manifest inside) built outside the
        root and renamed in: one event for the whole tree."""
        if os.path.lexists(dst):
            return None
        staging = Path(tempfile.mkdtemp(dir=self.out)) / "wf"
        (staging / "inner" / "deeper").mkdir(parents=True)
        (staging / "workflow.json").write_bytes(self.doc(wid, "ok"))
        (staging / "inner" / "deeper" / "workflow.json").write_bytes(self.doc("w1", "ok"))
        changes = self.mkdirs(dst.parent)
        os.rename(staging, dst)
        return [*changes, PathChange("added", str(dst))]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def snapshot(r: Registry) -> dict[str, Any]:
    """Everything the index holds, except stat signatures (a racy or unreadable
    manifest has none; when a manifest was last parsed is not part of the index)."""
    return {
        "folders": {p: (f.known_id, f.manifest, f.problem, f.nested_in) for p, f in r._folders.items()},
        "by_id": {k: sorted(v) for k, v in r._by_id.items() if v},
        "containers": {k: sorted(v) for k, v in r._containers.items() if v},
        "dirs": set(r._dirs),
        "truncated": sorted(r.truncated),
    }


def assert_children_consistent(r: Registry) -> None:
    kept = r._kids
    r._kids = None
    r._ensure_kids()
    assert r._kids == kept


def id_views(r: Registry) -> dict[str, Any]:
    snap = snapshot(r)
    return {
        wid: sorted((p, snap["folders"][p], p in snap["containers"]) for p in paths)
        for wid, paths in snap["by_id"].items()
    }


@pytest.fixture(params=[registry.MAX_DEPTH, 2], ids=["depth32", "depth2"])
def max_depth(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Also run with discovery truncated at depth 2, so the universe reaches below it."""
    depth: int = request.param
    monkeypatch.setattr(registry, "MAX_DEPTH", depth)
    return depth


@pytest.fixture
def bases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Fresh worlds. Every manifest counts as racy (kbd.core.layout.RACY_NS), as
    it does on a quiet host where an example takes well under the 200 ms window:
    on a loaded one (the suite runs in parallel) an example crossed the window
    half-way, and a racy entry re-read later was reported changed (a spurious,
    conservative delta) where the rescan saw no change, so the exact-delta
    assertion failed by timing alone."""
    monkeypatch.setattr(layout, "RACY_NS", 10**18)

    def make() -> Path:
        return Path(tempfile.mkdtemp(dir=tmp_path))

    yield make


@given(steps=st.lists(ops, min_size=1, max_size=25))
def test_apply_and_verify_now_match_a_full_rescan(steps: list[Op], max_depth: int, bases: Any) -> None:
    world = World(bases())
    ref = Registry([world.root], cache_path=None)  # full rescan after every step
    inc = Registry([world.root], cache_path=None, sweep_interval=3600)  # apply() the reported changes
    ver = Registry([world.root], cache_path=None, sweep_interval=3600)  # verify_now(), told nothing
    for r in (ref, inc, ver):
        r.rescan()
    for op in steps:
        changes = world.run(op)
        if changes is None:
            continue
        before = id_views(ref)
        ref.rescan()
        delta = inc.apply(changes)
        assert not delta.full, (op, changes)
        assert snapshot(inc) == snapshot(ref), (op, changes)
        assert_children_consistent(inc)
        after = id_views(ref)
        # The delta names exactly the IDs whose entries changed.
        moved = {wid for wid in before.keys() | after.keys() if before.get(wid) != after.get(wid)}
        assert set(delta.changed) == moved, (op, changes)
        verified = ver.verify_now()
        assert not verified.full, (op, changes)
        assert snapshot(ver) == snapshot(ref), (op, changes)
        assert_children_consistent(ver)
        for wid in IDS:
            got, want = inc.find(wid), ref.find(wid)
            assert type(got) is type(want), (wid, got, want)


@given(steps=st.lists(ops, min_size=1, max_size=25), lost=st.lists(st.booleans(), min_size=25, max_size=25))
def test_lost_events_are_absorbed_by_verify_now(steps: list[Op], lost: list[bool], bases: Any) -> None:
    """A watcher that drops events (overflow, a dead thread): after apply() of
    what did arrive, the verifier's verify_now() ends exactly where a full rescan
    from the same index ends. (Not where a registry that rescanned at every step
    ends: nesting is remembered only for folders the index once knew, so a
    workflow created and hidden between two looks is as unknown as it is today
    between two periodic sweeps.)"""
    world = World(bases())
    inc = Registry([world.root], cache_path=None, sweep_interval=3600)
    inc.rescan()
    for index, (op, drop) in enumerate(zip(steps, lost, strict=False)):
        changes = world.run(op)
        if changes is not None:
            inc.apply([] if drop else changes)
        if drop and index < len(steps) - 1:
            continue  # losses accumulate until the verifier's next pass
        twin = copy.deepcopy(inc)
        twin.rescan()
        inc.verify_now()
        assert snapshot(inc) == snapshot(twin), (op, drop)
        assert_children_consistent(inc)


def test_delta_reports_manifests_before_and_after(tmp_path: Path) -> None:
    world = World(tmp_path)
    inc = Registry([world.root], cache_path=None, sweep_interval=3600)
    inc.rescan()
    delta = inc.apply(world.manifest(world.root / "team" / "a", "w1", "ok"))
    old, new = delta.changed["w1"]
    assert old is None and new is not None and new.id == "w1"
    assert {world.root / "team", world.root / "team" / "a"} <= delta.folders_added
    delta = inc.apply(world.manifest(world.root / "team" / "a", "w2", "ok"))
    assert delta.changed["w1"][1] is None and delta.changed["w2"][1] is not None
    assert not delta.folders_added and not delta.folders_removed
    # A duplicate ID: both sides of the ambiguity report no single manifest.
    delta = inc.apply(world.manifest(world.root / "other", "w2", "ok"))
    assert delta.changed["w2"][0] is not None and delta.changed["w2"][1] is None
    assert isinstance(inc.find("w2"), Ambiguous)
    delta = inc.apply(world.run(("rmtree", "team")) or [])
    assert delta.folders_removed == {world.root / "team", world.root / "team" / "a"}
    assert isinstance(inc.find("w2"), Found)
    assert inc.apply([PathChange("modified", "/etc/passwd")]) == registry.RegistryDelta()


def test_a_root_itself_changing_falls_back_to_a_full_rescan(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.manifest(world.root / "a", "w1", "ok")
    inc = Registry([world.root], cache_path=None, sweep_interval=3600)
    assert isinstance(inc.find("w1"), Found)
    shutil.move(world.root, tmp_path / "old")
    world.root.mkdir()
    world.manifest(world.root / "b", "w2", "ok")
    delta = inc.apply([PathChange("deleted", str(world.root)), PathChange("added", str(world.root))])
    assert delta.full and set(delta.changed) == {"w1", "w2"}
    assert isinstance(inc.find("w1"), Missing) and isinstance(inc.find("w2"), Found)
    assert inc.apply([PathChange("added", "relative/path")]).full
    # A registry that has not verified its index yet has nothing to build on.
    fresh = Registry([world.root], cache_path=None, sweep_interval=3600)
    assert fresh.apply([PathChange("modified", str(world.root / "b" / "workflow.json"))]).full
    assert fresh.scans == 1 and isinstance(fresh.find("w2"), Found)


class SyscallCounter:
    """Counts lstat and scandir calls (passing them through): the registry's unit of work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real_lstat, real_scandir = os.lstat, os.scandir

        def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            self.calls += 1
            return real_lstat(path, *args, **kwargs)

        def scandir(path: Any) -> Any:
            self.calls += 1
            return real_scandir(path)

        monkeypatch.setattr(os, "lstat", lstat)
        monkeypatch.setattr(os, "scandir", scandir)


def test_one_change_costs_work_for_that_change_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O(changes x depth): one manifest edit, one new workflow folder and one
    removed team folder in a 300-workflow registry each cost a handful of
    syscalls, never a walk of every folder (300+ lstats)."""
    world = World(tmp_path)
    for i in range(300):
        folder = world.root / f"team{i % 10}" / f"w{i}"
        folder.mkdir(parents=True)
        (folder / "workflow.json").write_bytes(orjson.dumps({"id": f"w{i}"}))
    inc = Registry([world.root], cache_path=None, sweep_interval=3600)
    inc.rescan()
    inc.apply([])  # builds the children index once
    counter = SyscallCounter(monkeypatch)
    edit = world.manifest(world.root / "team3" / "w3", "w3renamed", "ok")
    counter.calls = 0
    delta = inc.apply(edit)
    assert set(delta.changed) == {"w3", "w3renamed"}
    assert counter.calls <= 10, counter.calls
    created = world.manifest(world.root / "team3" / "new", "wnew", "ok")
    counter.calls = 0
    delta = inc.apply(created)
    assert set(delta.changed) == {"wnew"}
    assert counter.calls <= 12, counter.calls
    removed = world.run(("rmtree", "team4")) or []
    counter.calls = 0
    delta = inc.apply(removed)
    assert len(delta.changed) == 30 and counter.calls <= 10, counter.calls
    assert isinstance(inc.find("w4"), Missing)
    assert inc.scans == 1


def test_watch_paths_name_walked_folders_workflows_and_attached_kbs(tmp_path: Path) -> None:
    world = World(tmp_path)
    for rel, doc in {
        "team/src": {"id": "src"},
        "team/other": {"id": "other"},
        "team/consumer": {"id": "consumer", "knowledgebase_sources": [{"workflow_id": "src", "alias": "s"}]},
        "solo/dup1": {"id": "dup"},
        "solo/dup2": {"id": "dup"},
        "solo/wants_dup": {"id": "wants", "knowledgebase_sources": [{"workflow_id": "dup", "alias": "d"}]},
    }.items():
        (world.root / rel).mkdir(parents=True)
        (world.root / rel / "workflow.json").write_bytes(orjson.dumps(doc))
    paths = Registry([world.root], cache_path=None).watch_paths()
    root = world.root
    assert paths["discovery"] == [root, root / "solo", root / "team"]
    assert paths["workflows"] == sorted(
        root / p
        for p in ("team/src", "team/other", "team/consumer", "solo/dup1", "solo/dup2", "solo/wants_dup")
    )
    # An ambiguous source has no knowledgebase to watch: it resolves to nothing.
    assert paths["kbs"] == [root / "team" / "src" / "knowledgebase"]
