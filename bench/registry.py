"""Registry scan and lookup cost over 10,000 workflows (docs/performance.md).

Builds a throw-away kbd root with 10,000 generated workflows spread over nested
folders (``workflows/team_NN/wf_NNNNN/`` with ``knowledgebase/notes/``), then
prints, each beside its budget (docs/performance.md):

* cold registry scan: a new :class:`kbd.fs.registry.Registry` with no cache file,
  first ``find`` (walk, read and parse every manifest, write the cache);
* warm lookup in process: the same Registry, ``find`` of random IDs, timed one
  by one, default ``sweep_interval`` (1 s), so the periodic sweeps are included
  in the mean and p99 but not, typically, in the median;
* CLI-like warm start: a new Registry that loads ``state/cache/registry.json``
  (as every CLI call does), first ``find``;
* plan-ish lookup: ``workflows.sources()`` for a consumer with 20 attached sources
  (resolution of all 20: registry lookups, audience checks, KB probes);
* the same for a consumer with 20 sources of which 16 name IDs that exist
  nowhere (docs/on-disk.md: a miss must not cost a registry walk), beside it;
* a single lookup of an ID that does not exist (what any reader's
  ``GET /v1/workflows/<no-such-id>`` costs the daemon);
* one manifest change absorbed by the same 10,000-workflow registry through
  ``Registry.apply`` (what the daemon does per watcher event: docs/daemon.md), one new
  workflow folder absorbed likewise, printed beside a full rescan of the same
  registry (the floor apply avoids) and a ``verify_now()`` with nothing changed
  (the verifier's periodic pass);
* the same edit end to end through the watcher (:class:`kbd.fs.watch.Watcher`
  over ``Registry.watch_paths()``, about 10,100 inotify watches, released at the
  end): from the manifest's rename on disk to ``apply`` done, beside the
  watcher's own debounce (its floor), and what building the watches costs.

OS caches are not dropped: "cold" means no kbd cache, not a cold page cache.
The temporary root is removed at the end, also on error.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import yaml

from kbd.core.layout import RACY_NS
from kbd.core.watching import PathChange, WatchBatch
from kbd.fs.registry import Found, Registry
from kbd.fs.rootconfig import load_config
from kbd.fs.rootinit import init_root
from kbd.fs.watch import Watcher
from kbd.service import workflows
from kbd.service.root import Root

WORKFLOWS = 10_000
TEAMS = 100
USERS = ("alice", "bob", "carol", "dave", "erin")
CONSUMER = "wf_00000"
SOURCES = 20
MISSING_CONSUMER = "wf_00001"  # 4 present sources + 16 that exist nowhere
MISSING_SOURCES = 16
MISS_LOOKUPS = 2_000
MISSING_PLAN_SECONDS = 3.0  # long enough for the 1 s sweeps to show in the mean
WRITE_SOURCES = 4  # of the 20, attached with access "write" and granted by their owner
COLD_RUNS = 5
WARM_LOOKUPS = 20_000
WARM_START_RUNS = 5
PLAN_RUNS = 500
APPLY_RUNS = 50
WATCHED_EDITS = 30
DEBOUNCE_MS, STEP_MS = 100, 25  # the Watcher's defaults
RESCAN_RUNS = 3
SEED = 20261130


def wid(i: int) -> str:
    return f"wf_{i:05d}"


def source_indexes() -> list[int]:
    """20 workflows owned by alice (i % 5 == 0), spread over the teams."""
    step = WORKFLOWS // SOURCES
    return [k * step + 5 for k in range(SOURCES)]


def manifest(i: int, sources: list[int]) -> dict[str, Any]:
    owner = USERS[i % len(USERS)]
    doc: dict[str, Any] = {
        "id": wid(i),
        "label": f"Workflow {i} of team {i % TEAMS:02d}",
        "created_by": owner,
        "access": {"owners": [owner], "readers": [USERS[(i + 1) % len(USERS)]]},
        "schedule": {"cron": f"{i % 60} * * * *"},
        "model": {"name": "generic", "temperature": 0.2},
    }
    if i == 0:
        doc["access"] = {"owners": ["alice"]}
        doc["knowledgebase_sources"] = [
            {"workflow_id": wid(j), "alias": f"src_{j}", "access": "write" if k < WRITE_SOURCES else "read"}
            for k, j in enumerate(sources)
        ]
    elif i == 1:
        doc["access"] = {"owners": ["alice"]}
        present = [{"workflow_id": wid(j), "alias": f"src_{j}"} for j in sources[: SOURCES - MISSING_SOURCES]]
        missing = [{"workflow_id": f"wf_gone_{k:02d}", "alias": f"gone_{k}"} for k in range(MISSING_SOURCES)]
        doc["knowledgebase_sources"] = present + missing
    elif i in sources[:WRITE_SOURCES]:
        doc["access"]["allowed_kb_writers"] = [CONSUMER]
    return doc


def build(root: Path) -> None:
    init_root(root, host="bench-host", force=False, demo=False)
    principals = [{"id": u} for u in USERS] + [{"id": "ops", "admin": True}]
    (root / "principals.yaml").write_text(yaml.safe_dump({"principals": principals}))
    sources = source_indexes()
    for i in range(WORKFLOWS):
        folder = root / "workflows" / f"team_{i % TEAMS:02d}" / wid(i)
        os.makedirs(folder / "knowledgebase" / "notes")
        (folder / "knowledgebase" / "notes" / "_index.json").write_bytes(b'{"notes": []}\n')
        (folder / "workflow.json").write_bytes(orjson.dumps(manifest(i, sources), option=orjson.OPT_INDENT_2))


def median_ms(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def timed(fn: Callable[[], object]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kbd-bench-registry-"))
    try:
        run(tmp / "root")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            print(f"warning: could not remove {tmp}", file=sys.stderr)


def run(root: Path) -> None:
    t0 = time.perf_counter()
    build(root)
    built_s = time.perf_counter() - t0
    # Folders and manifests changed within RACY_NS are never trusted from cache
    # (registry.py); measuring earlier would time re-walks forced by the build.
    time.sleep(RACY_NS / 1e9 * 1.5)

    config = load_config(root)
    roots = [r.resolve() for r in config.workflow_roots]
    cache = config.state_dir / "cache" / "registry.json"
    rng = random.Random(SEED)
    target = wid(rng.randrange(WORKFLOWS))

    # -- cold scan: fresh Registry, no cache file ----------------------------------
    cold: list[int] = []
    registry = Registry(roots, cache_path=cache)
    for _ in range(COLD_RUNS):
        cache.unlink(missing_ok=True)
        registry = Registry(roots, cache_path=cache)
        cold.append(timed(partial(registry.find, target)))
        assert isinstance(registry.find(target), Found)
    assert cache.exists(), "the cold scan should have written the registry cache"

    # -- warm lookups in the same process (default sweep_interval=1.0) ----------------
    ids = [wid(rng.randrange(WORKFLOWS)) for _ in range(WARM_LOOKUPS)]
    scans_before = registry.scans
    warm: list[int] = []
    started = time.perf_counter()
    for one in ids:
        t = time.perf_counter_ns()
        found = registry.find(one)
        warm.append(time.perf_counter_ns() - t)
        if not isinstance(found, Found):
            raise SystemExit(f"lookup of {one} gave {found!r}")
    warm_wall = time.perf_counter() - started
    warm_sorted = sorted(warm)
    warm_p99_us = warm_sorted[int(len(warm_sorted) * 0.99)] / 1e3
    warm_mean_us = statistics.fmean(warm) / 1e3
    rescans = registry.scans - scans_before

    # -- CLI-like warm start: new Registry loading state/cache/registry.json ------------
    warm_start: list[int] = []
    for _ in range(WARM_START_RUNS):
        fresh = Registry(roots, cache_path=cache)
        warm_start.append(timed(partial(fresh.find, target)))
        assert fresh.scans == 0, "a valid cache must not cause a full walk"

    # -- plan-ish: workflows.sources() for a consumer with 20 sources ----------------------
    host = Root(root)  # default sweep_interval=1.0, as the daemon would use
    alice = host.actor("alice")
    attachments = workflows.sources(host, CONSUMER, actor=alice).sources  # warm-up (also loads the cache)
    available = sum(a.available for a in attachments)
    writable = sum(a.writable for a in attachments)
    if len(attachments) != SOURCES or available != SOURCES or writable != WRITE_SOURCES:
        raise SystemExit(f"unexpected resolution: {[a.to_json() for a in attachments]}")
    plan: list[int] = [
        timed(lambda: workflows.sources(host, CONSUMER, actor=alice)) for _ in range(PLAN_RUNS)
    ]
    with_missing = workflows.sources(host, MISSING_CONSUMER, actor=alice).sources
    reasons = [a.reason for a in with_missing]
    if reasons != [None] * (SOURCES - MISSING_SOURCES) + ["not_found"] * MISSING_SOURCES:
        raise SystemExit(f"unexpected resolution: {reasons}")
    verifications_before = host.registry.verifications
    missing_started = time.perf_counter()
    plan_missing: list[int] = []
    while time.perf_counter() - missing_started < MISSING_PLAN_SECONDS:
        plan_missing.append(timed(lambda: workflows.sources(host, MISSING_CONSUMER, actor=alice)))
    missing_wall = time.perf_counter() - missing_started
    verifications = host.registry.verifications - verifications_before
    miss: list[int] = [timed(partial(registry.find, f"wf_nothing_{k}")) for k in range(MISS_LOOKUPS)]
    applied, added, full_rescans, verifies = incremental(root, roots, rng)
    watch_build, watches, pushed = through_watcher(root, roots, rng)

    rows: list[tuple[str, str, str, str]] = [
        (
            f"cold registry scan, {WORKFLOWS:,} workflows (no cache file)",
            f"{median_ms(cold):,.1f} ms",
            "<= 1,500 ms",
            "ok" if median_ms(cold) <= 1500 else "OVER",
        ),
        (
            "warm lookup in process, median",
            f"{statistics.median(warm) / 1e3:,.1f} us",
            "<= 50 us",
            "ok" if statistics.median(warm) / 1e3 <= 50 else "OVER",
        ),
        ("warm lookup in process, mean (sweeps included)", f"{warm_mean_us:,.1f} us", "", ""),
        ("warm lookup in process, p99", f"{warm_p99_us:,.1f} us", "", ""),
        (
            "CLI-like warm start (load registry.json, first find)",
            f"{median_ms(warm_start):,.1f} ms",
            "(none; cold <= 1,500 ms)",
            "",
        ),
        (
            f"workflows.sources(), consumer with {SOURCES} sources (plan-ish)",
            f"{median_ms(plan):,.3f} ms",
            "plan lookup <= 0.5 ms",
            "ok" if median_ms(plan) <= 0.5 else "OVER",
        ),
        (
            f"workflows.sources(), {SOURCES} sources, {MISSING_SOURCES} of them not_found",
            f"{median_ms(plan_missing):,.3f} ms",
            "plan lookup <= 0.5 ms",
            "ok" if median_ms(plan_missing) <= 0.5 else "OVER",
        ),
        (
            "  same, mean (periodic sweeps included)",
            f"{statistics.fmean(plan_missing) / 1e6:,.3f} ms",
            "",
            "",
        ),
        (
            "lookup of an ID that exists nowhere (warm)",
            f"{statistics.median(miss) / 1e3:,.1f} us",
            "<= 50 us (as a warm lookup)",
            "ok" if statistics.median(miss) / 1e3 <= 50 else "OVER",
        ),
        (
            "one manifest change absorbed (Registry.apply)",
            f"{median_ms(applied):,.3f} ms",
            "<= 10 ms",
            "ok" if median_ms(applied) <= 10 else "OVER",
        ),
        ("  same, max", f"{max(applied) / 1e6:,.3f} ms", "", ""),
        ("one new workflow folder absorbed (Registry.apply)", f"{median_ms(added):,.3f} ms", "<= 10 ms", ""),
        ("  floor: full rescan of the same registry", f"{median_ms(full_rescans):,.1f} ms", "", ""),
        ("  verify_now(), nothing changed", f"{median_ms(verifies):,.1f} ms", "", ""),
        (
            "edit on disk -> applied, through the watcher, median",
            f"{median_ms(pushed):,.1f} ms",
            "event p99 <= 1 s",
            "ok" if max(pushed) / 1e9 <= 1 else "OVER",
        ),
        ("  same, max", f"{max(pushed) / 1e6:,.1f} ms", "", ""),
        ("  floor: watcher step (quiet period before a batch)", f"{STEP_MS} ms", "", ""),
        (f"  building the watches ({watches:,} folders)", f"{watch_build / 1e6:,.1f} ms", "", ""),
    ]
    print(
        f"registry bench: {WORKFLOWS:,} workflows in {TEAMS} team folders, built in {built_s:.1f} s; "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    print(
        f"cold: median of {COLD_RUNS} runs (each {', '.join(f'{ns / 1e6:,.0f}' for ns in cold)} ms); "
        f"warm: {WARM_LOOKUPS:,} random lookups in {warm_wall:.2f} s, {rescans} full re-walks; "
        f"CLI-like: median of {WARM_START_RUNS}; workflows.sources(): median of {PLAN_RUNS} "
        f"({available} available, {writable} writable); with {MISSING_SOURCES} missing: median of "
        f"{len(plan_missing):,} in {missing_wall:.2f} s, {verifications} full re-checks (sweep interval 1 s); "
        f"missing ID: median of {MISS_LOOKUPS:,}; apply: median of {APPLY_RUNS} edits of random manifests "
        f"(written like an editor: temporary file + rename) and of {APPLY_RUNS} new folders; rescan and "
        f"verify_now: median of {RESCAN_RUNS}; through the watcher: {WATCHED_EDITS} edits, one at a time "
        f"(debounce {DEBOUNCE_MS} ms, step {STEP_MS} ms)"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'median':>12}  {'budget':<24}  status")
    print(f"{'-' * width}  {'-' * 12}  {'-' * 24}  ------")
    for name, value, budget, status in rows:
        print(f"{name:<{width}}  {value:>12}  {budget:<24}  {status}")


def incremental(
    root: Path, roots: list[Path], rng: random.Random
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Registry.apply of one reported change at a time, on the 10k registry."""
    reg = Registry(roots, cache_path=None, sweep_interval=3600)
    reg.rescan()
    reg.apply([])  # the children index apply() keeps is built once, at the first call
    sources = source_indexes()
    applied: list[int] = []
    for k in range(APPLY_RUNS):
        i = rng.randrange(2, WORKFLOWS)
        folder = root / "workflows" / f"team_{i % TEAMS:02d}" / wid(i)
        doc = manifest(i, sources)
        doc["label"] = f"edited {k}"
        tmp = folder / ".workflow.json.tmp"
        tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        os.rename(tmp, folder / "workflow.json")
        change = PathChange("modified", str(folder / "workflow.json"))
        applied.append(timed(partial(reg.apply, [change])))
        found = reg.find(wid(i))
        if not isinstance(found, Found) or found.manifest.label != f"edited {k}":
            raise SystemExit(f"apply did not absorb the edit of {wid(i)}: {found!r}")
    added: list[int] = []
    for k in range(APPLY_RUNS):
        folder = root / "workflows" / f"team_{k % TEAMS:02d}" / f"new_{k}"
        folder.mkdir()
        (folder / "workflow.json").write_bytes(orjson.dumps({"id": f"new_{k}", "created_by": "alice"}))
        added.append(timed(partial(reg.apply, [PathChange("added", str(folder))])))
        if not isinstance(reg.find(f"new_{k}"), Found):
            raise SystemExit(f"apply did not absorb the new folder new_{k}")
    time.sleep(RACY_NS / 1e9 * 1.5)  # as above: no re-read forced by timestamps of the edits
    rescans = [timed(reg.rescan) for _ in range(RESCAN_RUNS)]
    verifies = [timed(reg.verify_now) for _ in range(RESCAN_RUNS)]
    return applied, added, rescans, verifies


def through_watcher(root: Path, roots: list[Path], rng: random.Random) -> tuple[int, int, list[int]]:
    """Edit manifests one at a time and time each until the watcher's batch has
    been applied to the registry (the daemon's path, minus its event loop hop)."""
    reg = Registry(roots, cache_path=None, sweep_interval=3600)
    lock = threading.Lock()
    applied_ids: set[str] = set()
    done = threading.Condition()

    def on_batch(batch: WatchBatch) -> None:
        with lock:
            delta = reg.apply(batch.changes)
        with done:
            applied_ids.update(delta.changed)
            done.notify_all()

    watcher = Watcher(
        on_batch=on_batch, on_health=lambda health: None, debounce_ms=DEBOUNCE_MS, step_ms=STEP_MS
    )
    with lock:
        segments = reg.watch_paths()
    t0 = time.perf_counter_ns()
    for name, paths in segments.items():
        watcher.set_segment(name, paths)
    watcher.start()
    build = time.perf_counter_ns() - t0
    health = watcher.check()
    if not health.ok:
        watcher.stop()
        raise SystemExit(f"the watcher is not healthy: {health}")
    sources = source_indexes()
    latencies: list[int] = []
    try:
        for k in range(WATCHED_EDITS):
            i = rng.randrange(2, WORKFLOWS)
            folder = root / "workflows" / f"team_{i % TEAMS:02d}" / wid(i)
            doc = manifest(i, sources)
            doc["id"] = f"{wid(i)}_renamed_{k}"
            tmp = folder / ".workflow.json.tmp"
            tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            started = time.perf_counter_ns()
            os.rename(tmp, folder / "workflow.json")
            new_id: str = doc["id"]
            with done:
                if not done.wait_for(partial(applied_ids.__contains__, new_id), timeout=10):
                    raise SystemExit(f"the edit of {wid(i)} was not pushed within 10 s")
            latencies.append(time.perf_counter_ns() - started)
    finally:
        watcher.stop()
    return build, health.expected, latencies


if __name__ == "__main__":
    main()
