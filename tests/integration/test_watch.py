"""The watcher's failure modes, each with a real RustNotify on real folders
(docs/daemon.md "Watched state"): a lossy batch after a real kernel queue overflow,
the watch limit (inside a user namespace with its own lowered
``max_inotify_watches``: the host's sysctls are never touched), a watched folder
replaced (by rename, and by a mount that raises no event at all), and the
watcher thread dying (a non-UTF-8 file name poisons RustNotify). Each must be
reported unhealthy with its own reason and come back after a rebuild.

Nothing here sleeps to wait: every wait is on a reported event, with a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kbd.core.watching import (
    FOLDER_REPLACED,
    QUEUE_OVERFLOW,
    STALLED,
    WATCH_LIMIT,
    WATCHER_DIED,
    WatchBatch,
    WatchHealth,
)
from kbd.fs.registry import Found, Missing, Registry, RegistryDelta
from kbd.fs.watch import Watcher

WAIT = 15.0  # generous: the machine is shared and loaded
FAST: dict[str, Any] = {"backoff_initial": 0.05, "backoff_max": 0.2}


class Recorder:
    """Collects batches and health reports from any thread; waits on them."""

    def __init__(self) -> None:
        self.batches: list[WatchBatch] = []
        self.health: list[WatchHealth] = []
        self.cond = threading.Condition()

    def on_batch(self, batch: WatchBatch) -> None:
        with self.cond:
            self.batches.append(batch)
            self.cond.notify_all()

    def on_health(self, health: WatchHealth) -> None:
        with self.cond:
            self.health.append(health)
            self.cond.notify_all()

    def wait_batch(self, pred: Callable[[WatchBatch], bool]) -> WatchBatch:
        with self.cond:

            def hit() -> WatchBatch | None:
                return next((b for b in self.batches if pred(b)), None)

            assert self.cond.wait_for(lambda: hit() is not None, WAIT), f"no matching batch: {self.batches}"
            batch = hit()
            assert batch is not None
            return batch

    def wait_health(self, pred: Callable[[WatchHealth], bool], *, after: int = 0) -> int:
        """Index of the first report (from ``after`` on) matching ``pred``."""
        with self.cond:

            def hit() -> int | None:
                return next((i for i in range(after, len(self.health)) if pred(self.health[i])), None)

            assert self.cond.wait_for(lambda: hit() is not None, WAIT), f"no matching health: {self.health}"
            index = hit()
            assert index is not None
            return index


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def make_watcher(recorder: Recorder) -> Iterator[Callable[..., Watcher]]:
    made: list[Watcher] = []

    def make(**options: Any) -> Watcher:
        watcher = Watcher(on_batch=recorder.on_batch, on_health=recorder.on_health, **options)
        made.append(watcher)
        return watcher

    yield make
    for watcher in made:
        watcher.stop()


def names(batch: WatchBatch) -> set[str]:
    return {c.path for c in batch.changes}


def test_changes_are_pushed_per_segment_and_stop_releases_everything(
    make_watcher: Callable[..., Watcher], recorder: Recorder, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    # Threads other tests left may end meanwhile: what counts is that none the watcher started is left.
    before = set(threading.enumerate())
    watcher = make_watcher()
    watcher.set_segment("one", [a])
    watcher.set_segment("two", [b, tmp_path / "missing"])  # a missing folder is skipped, not fatal
    watcher.start()
    assert watcher.check().ok
    (a / "x").write_text("1")
    (b / "y").write_text("1")
    got = recorder.wait_batch(lambda bt: bt.segment == "one" and str(a / "x") in names(bt))
    assert not got.lossy
    recorder.wait_batch(lambda bt: bt.segment == "two" and str(b / "y") in names(bt))
    health = watcher.check()
    assert health.ok and health.watches == 2 and health.expected == 2
    watcher.stop()
    assert set(threading.enumerate()) - before == set()
    assert all(h.ok for h in recorder.health)


def test_a_poisoned_watcher_dies_is_reported_and_comes_back(
    make_watcher: Callable[..., Watcher], recorder: Recorder, tmp_path: Path
) -> None:
    """A file name that is not UTF-8 makes RustNotify raise on every later
    watch(): the segment is reported dead, rebuilt, and pushes again."""
    folder = tmp_path / "wf"
    folder.mkdir()
    watcher = make_watcher(**FAST)
    watcher.set_segment("workflows", [folder])
    watcher.start()
    with open(os.path.join(os.fsencode(folder), b"\xff"), "wb"):
        pass
    died = recorder.wait_health(lambda h: not h.ok and h.reason == WATCHER_DIED)
    assert recorder.health[died].segment == "workflows"
    assert "decode" in recorder.health[died].detail
    recorder.wait_health(lambda h: h.ok, after=died)
    (folder / "after").write_text("1")
    recorder.wait_batch(lambda bt: str(folder / "after") in names(bt))
    # Poisoning it again is reported again: it never stays silently dead.
    with open(os.path.join(os.fsencode(folder), b"\xfe"), "wb"):
        pass
    again = recorder.wait_health(lambda h: not h.ok and h.reason == WATCHER_DIED, after=died + 1)
    recorder.wait_health(lambda h: h.ok, after=again)


def test_a_renamed_and_recreated_folder_is_detected_and_rewatched(
    make_watcher: Callable[..., Watcher], recorder: Recorder, tmp_path: Path
) -> None:
    """``mv wf wf.old; mkdir wf``: the watch stays on wf.old (whose events would
    arrive under the old path); the segment must notice and watch the new wf."""
    folder = tmp_path / "wf"
    folder.mkdir()
    watcher = make_watcher(**FAST)
    watcher.set_segment("workflows", [folder])
    watcher.start()
    folder.rename(tmp_path / "wf.old")
    folder.mkdir()
    bad = recorder.wait_health(lambda h: not h.ok and h.reason == FOLDER_REPLACED)
    assert str(folder) in recorder.health[bad].detail
    recorder.wait_health(lambda h: h.ok, after=bad)
    (folder / "new").write_text("1")
    recorder.wait_batch(lambda bt: str(folder / "new") in names(bt))
    assert watcher.check().ok


def test_a_stuck_consumer_is_reported_as_stalled_and_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "wf"
    folder.mkdir()
    release = threading.Event()
    recorder = Recorder()

    def on_batch(batch: WatchBatch) -> None:
        recorder.on_batch(batch)
        if len(recorder.batches) == 1:
            release.wait(WAIT)  # the first consumer call never returns in time

    watcher = Watcher(on_batch=on_batch, on_health=recorder.on_health, stall_after=1.0, **FAST)
    try:
        watcher.set_segment("workflows", [folder])
        watcher.start()
        (folder / "one").write_text("1")
        stalled = recorder.wait_health(lambda h: not h.ok and h.reason == STALLED)
        recorder.wait_health(lambda h: h.ok, after=stalled)
        (folder / "two").write_text("1")  # the replacement thread pushes this
        recorder.wait_batch(lambda bt: str(folder / "two") in names(bt))
    finally:
        release.set()
        watcher.stop()


class Vanish(BaseException):
    """Not an Exception: escapes every handler, so the thread just ends."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_ends_silently_is_noticed(tmp_path: Path) -> None:
    folder = tmp_path / "wf"
    folder.mkdir()
    recorder = Recorder()

    def on_batch(batch: WatchBatch) -> None:
        recorder.on_batch(batch)
        if len(recorder.batches) == 1:
            raise Vanish

    watcher = Watcher(on_batch=on_batch, on_health=recorder.on_health, **FAST)
    try:
        watcher.set_segment("workflows", [folder])
        watcher.start()
        (folder / "one").write_text("1")
        gone = recorder.wait_health(lambda h: not h.ok and h.reason == WATCHER_DIED)
        assert recorder.health[gone].detail == "the watcher thread is gone"
        recorder.wait_health(lambda h: h.ok, after=gone)
        (folder / "two").write_text("1")
        recorder.wait_batch(lambda bt: str(folder / "two") in names(bt))
    finally:
        watcher.stop()


def test_a_watched_registry_follows_the_disk(tmp_path: Path) -> None:
    """The loop the daemon runs: segments from Registry.watch_paths(), each batch
    applied to the registry, folders the delta adds watched in a ``delta``
    segment. A new workflow folder, an ID changed in place inside it (seen only
    through the delta segment) and a removed team folder all reach lookups
    without any rescan."""
    root = (tmp_path / "workflows").resolve()
    (root / "team" / "a").mkdir(parents=True)
    (root / "team" / "a" / "workflow.json").write_text('{"id": "a"}')
    registry = Registry([root], cache_path=None, sweep_interval=3600)
    cond = threading.Condition()
    added: set[Path] = set()
    watcher: Watcher

    def on_batch(batch: WatchBatch) -> None:
        with cond:
            delta: RegistryDelta = registry.apply(batch.changes)
            assert not delta.full
            if delta.folders_added - added:
                added.update(delta.folders_added)
                watcher.set_segment("delta", sorted(added))
            cond.notify_all()

    def settled(pred: Callable[[], bool]) -> None:
        with cond:
            assert cond.wait_for(pred, WAIT), registry.watch_paths()

    watcher = Watcher(on_batch=on_batch, on_health=lambda h: None)
    try:
        with cond:
            for name, paths in registry.watch_paths().items():
                watcher.set_segment(name, paths)
        watcher.start()
        (root / "team" / "b").mkdir()
        (root / "team" / "b" / "workflow.json").write_text('{"id": "b"}')
        settled(lambda: isinstance(registry.find("b"), Found))
        settled(lambda: watcher.health().expected == 4)  # root, team, a, and now b
        (root / "team" / "b" / "workflow.json").write_text('{"id": "b2"}')
        settled(lambda: isinstance(registry.find("b2"), Found) and isinstance(registry.find("b"), Missing))
        for path in sorted((root / "team").rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (root / "team").rmdir()
        settled(lambda: isinstance(registry.find("a"), Missing) and isinstance(registry.find("b2"), Missing))
        assert registry.scans == 1
    finally:
        watcher.stop()


# -- failure modes that need a process of their own ----------------------------------


class Child:
    """tests/integration/watch_child.py in a subprocess (optionally under a prefix
    such as unshare), its JSON lines collected by a reader thread."""

    def __init__(self, config: dict[str, Any], *, prefix: list[str] | None = None) -> None:
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "tests.integration.watch_child", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=repo,
            text=True,
        )
        self.messages: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.messages.append(json.loads(line))
                self.cond.notify_all()

    def wait(self, pred: Callable[[dict[str, Any]], bool], *, after: int = 0, timeout: float = WAIT) -> int:
        with self.cond:

            def hit() -> int | None:
                return next((i for i in range(after, len(self.messages)) if pred(self.messages[i])), None)

            if not self.cond.wait_for(lambda: hit() is not None, timeout):
                stderr = ""
                if self.proc.poll() is not None and self.proc.stderr is not None:
                    stderr = self.proc.stderr.read()
                raise AssertionError(f"no matching message in {timeout} s: {self.messages[-20:]} {stderr}")
            index = hit()
            assert index is not None
            return index

    def send(self, **command: Any) -> int:
        assert self.proc.stdin is not None
        start = len(self.messages)
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        self.wait(lambda m: m["kind"] == "done" and m["op"] == command["op"], after=start)
        return start  # what the command caused may be reported before its "done"

    def close(self) -> None:
        if self.proc.poll() is None:
            with_stdin = self.proc.stdin
            if with_stdin is not None and not with_stdin.closed:
                try:
                    with_stdin.write(json.dumps({"op": "stop"}) + "\n")
                    with_stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(config: dict[str, Any], **kwargs: Any) -> Child:
        child = Child(config, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGCONT)  # in case a test failed while it was stopped
        child.close()


def health(pred: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m["kind"] == "health" and pred(m)


@pytest.mark.timeout(300)
def test_a_real_queue_overflow_is_reported_lossy(children: Callable[..., Child], tmp_path: Path) -> None:
    """The watcher process is stopped while 20,000 files appear in its folder:
    more events than the kernel queue holds (max_queued_events, 16,384 here). The
    overflow notice itself never reaches Python (watchfiles drops it); the burst
    must still be reported lossy, the health queue_overflow, and the segment must
    come back and push again."""
    folder = tmp_path / "wf"
    folder.mkdir()
    child = children({"segments": {"workflows": [str(folder)]}, "options": FAST})
    child.wait(lambda m: m["kind"] == "started")
    small = [folder / f"small{i}" for i in range(100)]
    for path in small:
        path.write_bytes(b"")
    first = child.wait(lambda m: m["kind"] == "batch" and str(small[-1]) in m["paths"])
    assert not any(m.get("lossy") for m in child.messages[: first + 1])  # 100 changes: not lossy
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(20_000):
                os.close(os.open(f"f{i:05d}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        finally:
            os.close(fd)
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    lossy = child.wait(lambda m: m["kind"] == "batch" and m["lossy"], after=first, timeout=60)
    bad = child.wait(health(lambda m: not m["ok"] and m["reason"] == QUEUE_OVERFLOW), after=first)
    recovered = child.wait(health(lambda m: m["ok"]), after=max(bad, lossy))
    (folder / "later").write_bytes(b"")
    child.wait(lambda m: m["kind"] == "batch" and str(folder / "later") in m["paths"], after=recovered)
    child.close()
    shutil.rmtree(folder)  # 20,000 files: do not leave them to pytest's tmp rotation


def userns_limit_works() -> bool:
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", "echo 7 > /proc/sys/user/max_inotify_watches"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.mark.timeout(120)
def test_the_watch_limit_is_detected_at_build_and_later(
    children: Callable[..., Child], tmp_path: Path
) -> None:
    """In a user namespace of its own, with max_inotify_watches lowered there
    (per user namespace: the host's limit is untouched). watchfiles leaves the
    folders beyond the limit unwatched without a word; the watcher must count
    its real watches (/proc/self/fdinfo) and say so: at build, and when a new
    segment is added later; and recover once watches are available."""
    if not userns_limit_works():
        pytest.fail("cannot lower max_inotify_watches in a user namespace here (the test needs it)")
    folders = []
    for i in range(24):
        folder = tmp_path / f"d{i:02d}"
        folder.mkdir()
        folders.append(str(folder))
    config = {
        "segments": {"a": folders[:8], "b": folders[8:16]},
        "options": {**FAST, "check_interval": 0.2},
        "max_user_watches": 12,
    }
    child = children(config, prefix=["unshare", "--user", "--map-root-user"])
    bad = child.wait(health(lambda m: not m["ok"] and m["reason"] == WATCH_LIMIT))
    assert child.messages[bad]["expected"] == 16 and child.messages[bad]["watches"] < 16
    assert "have no watch" in child.messages[bad]["detail"]
    # More watches become available: the rebuild (with backoff) picks them up.
    child.send(op="limit", value=1000)
    ok = child.wait(health(lambda m: m["ok"]), after=bad)
    assert child.messages[ok]["watches"] == 16
    # Later: the limit is reached again and a new segment is silently short of watches.
    child.send(op="limit", value=18)
    start = child.send(op="set", name="delta", paths=folders[16:24])
    later = child.wait(health(lambda m: not m["ok"] and m["reason"] == WATCH_LIMIT), after=start)
    assert child.messages[later]["segment"] == "delta"
    child.send(op="limit", value=1000)
    child.wait(health(lambda m: m["ok"] and m["watches"] == 24), after=later)


@pytest.mark.timeout(120)
def test_a_folder_mounted_over_without_any_event_is_detected(
    children: Callable[..., Child], tmp_path: Path
) -> None:
    """A mount over a watched folder raises no inotify event at all; only the
    periodic identity check (the watched inode vs the folder at the path now)
    can notice. The watcher runs in a mount namespace of its own, and the mount
    is made there (nsenter), so the host's mounts are untouched."""
    folder, other = tmp_path / "wf", tmp_path / "other"
    folder.mkdir()
    other.mkdir()
    config = {"segments": {"workflows": [str(folder)]}, "options": {**FAST, "check_interval": 0.2}}
    child = children(config, prefix=["unshare", "--mount", "--propagation", "private"])
    child.wait(lambda m: m["kind"] == "started")
    start = len(child.messages)
    subprocess.run(
        ["nsenter", "--target", str(child.proc.pid), "--mount", "mount", "--bind", str(other), str(folder)],
        check=True,
    )
    bad = child.wait(health(lambda m: not m["ok"] and m["reason"] == FOLDER_REPLACED), after=start)
    ok = child.wait(health(lambda m: m["ok"]), after=bad)
    (other / "seen").write_text("1")  # through the mount, the path the watcher knows
    child.wait(lambda m: m["kind"] == "batch" and str(folder / "seen") in m["paths"], after=ok)
