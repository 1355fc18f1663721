"""The change feed's producers (kbd/service/events.py, kbd/service/changefeed.py;
docs/daemon.md "The change feed"), in process on a real root and a real event log.

- Manifest events have ONE producer, the diff of manifest facts: a save by kbd
  and a hand edit of workflow.json with the same effect give the same events,
  and a change reported twice (kbd's save, then the watcher seeing the file)
  is emitted once.
- Moves, removals and label-only edits give ``workflow.changed`` alone.
- A process on the root (LogSink) appends session and note events to the
  shared log, never manifest events; a log it cannot write loses the notice,
  never the operation.
- Who sees what at delivery: resync everyone, services and admins all,
  others what they may inspect, a disabled principal nothing.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from kbd.core.events import Event, EventRefused, Replay, manifest_change_types, manifest_facts
from kbd.core.manifest import parse_manifest
from kbd.service import sessions as session_ops
from kbd.service import workflows as workflow_ops
from kbd.service.changefeed import Feed
from kbd.service.events import LogSink, ManifestTracker, may_see
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from kbd.state.events import EventLog
from tests.helpers import KbRoot
from tests.waiting import wait_for

TEAM = {"owners": ["alice"], "readers": ["bob"]}


def replayed(log: EventLog, after: str) -> tuple[Event, ...]:
    replay = log.since(after)
    assert isinstance(replay, Replay), replay
    return replay.events


def types_of(log: EventLog, after: str) -> list[tuple[str, str | None]]:
    return [(e.type, e.workflow_id) for e in replayed(log, after)]


@pytest.fixture
def world(kb: KbRoot) -> tuple[KbRoot, Root, Feed]:
    kb.workflow("src", access=TEAM)
    kb.workflow("src2", access=TEAM)
    kb.workflow("con1", access=TEAM)
    kb.workflow("con2", access=TEAM)
    host = Root(kb.root, sweep_interval=0)
    log = EventLog(host.config.state_dir, sync_interval=0)
    feed = Feed(host, log, lock=threading.RLock())
    host.events = feed
    return kb, host, feed


def test_a_hand_edit_and_a_kbd_save_give_the_same_events_once(world: tuple[KbRoot, Root, Feed]) -> None:
    kb, host, feed = world
    alice = host.actor("alice")
    mark = feed.log.last_id
    before = host.workflow("con1").manifest
    workflow_ops.attach(host, "con1", "src", alias="rts", access="read", actor=alice)
    by_kbd = types_of(feed.log, mark)
    assert by_kbd == [("workflow.changed", "con1"), ("sources.changed", "con1")]
    # The watcher then sees the same file change: nothing more.
    mark = feed.log.last_id
    assert feed.observe("con1", before, host.workflow("con1").manifest) == ()
    assert types_of(feed.log, mark) == []
    # A builder makes the same change to con2 by hand; the watcher reports it.
    old = host.workflow("con2").manifest
    kb.edit(kb.workflows / "con2", knowledgebase_sources=[{"workflow_id": "src", "alias": "rts"}])
    assert feed.observe("con2", old, host.workflow("con2").manifest) == (
        "workflow.changed",
        "sources.changed",
    )
    # Writers: a grant through kbd and the same grant by hand.
    mark = feed.log.last_id
    workflow_ops.grant(host, "src", "con1", actor=alice)
    assert types_of(feed.log, mark) == [("workflow.changed", "src"), ("writers.changed", "src")]
    old = host.workflow("src2").manifest
    kb.edit(kb.workflows / "src2", access={**TEAM, "allowed_kb_writers": ["con1"]})
    assert feed.observe("src2", old, host.workflow("src2").manifest) == (
        "workflow.changed",
        "writers.changed",
    )
    # A revoke that changes nothing writes nothing, and so gives nothing.
    mark = feed.log.last_id
    workflow_ops.revoke(host, "src2", "con2", actor=alice)
    assert types_of(feed.log, mark) == []


def test_moves_removals_and_label_edits(kb: KbRoot) -> None:
    path = kb.workflow("w", access=TEAM, sources=[{"workflow_id": "x", "alias": "a"}])
    m = parse_manifest((path / "workflow.json").read_bytes())
    here, there = manifest_facts(m, folder="/a/w"), manifest_facts(m, folder="/b/w")
    assert manifest_change_types(here, here) == ()
    assert manifest_change_types(here, there) == ("workflow.changed",)  # moved
    assert manifest_change_types(here, manifest_facts(m)) == ()  # folder unknown: no move claimed
    assert manifest_change_types(None, here) == ("workflow.changed", "sources.changed")  # added
    assert manifest_change_types(here, None) == ("workflow.changed", "sources.changed")  # removed
    kb.edit(path, label="renamed")
    relabelled = parse_manifest((path / "workflow.json").read_bytes())
    assert manifest_change_types(here, manifest_facts(relabelled, folder="/a/w")) == ("workflow.changed",)
    tracker = ManifestTracker()
    assert tracker.observe("w", None, m, folder=Path("/a/w")) == ("workflow.changed", "sources.changed")
    assert tracker.observe("w", None, m, folder=Path("/b/w")) == ("workflow.changed",)
    assert tracker.observe("w", m, None) == ("workflow.changed", "sources.changed")
    assert tracker.last_manifest("w") is m  # who may see events about it after it is gone


def test_a_process_on_the_root_appends_session_events_but_never_manifest_events(kb: KbRoot) -> None:
    kb.workflow("w", access=TEAM)
    kb.workflow("s", access=TEAM)
    host = Root(kb.root, sweep_interval=0)
    assert isinstance(host.events, LogSink)
    sessions = RootSessions(host)
    plan = session_ops.open_session(sessions, "w", actor=host.actor("alice"), kind="builder")
    sid = plan.session_id
    assert sid is not None
    session_ops.close(sessions, sid, actor=host.actor("alice"))
    workflow_ops.attach(host, "w", "s", alias="s", access="read", actor=host.actor("alice"))
    with EventLog(host.config.state_dir, sync_interval=0) as log:
        got = [(e.type, e.workflow_id, e.fields.get("session_id")) for e in replayed(log, f"{log.epoch}-0")]
    assert got == [("session.opened", "w", sid), ("session.closed", "w", sid)]


def test_a_log_closed_on_its_own_fsync_thread_closes_without_error(tmp_path: Path) -> None:
    """A LogSink's log is closed by a finalizer, which the garbage collector may
    run on any thread: on the log's own fsync thread, inside an fsync that holds
    its mutex, close() can neither join that thread nor take the mutex."""
    errors: list[BaseException] = []

    class ClosedWhileSyncing(EventLog):
        def sync(self) -> None:
            try:
                with self._mutex:  # where a collection inside sync() finds the thread
                    self.close()
            except BaseException as exc:
                errors.append(exc)

    log = ClosedWhileSyncing(tmp_path, sync_interval=0.001)
    log.append("resync", workflow_id=None, reason="restart")
    wait_for(lambda: errors or log._fd is None, 10, "the log closed (or an error) on its fsync thread")
    assert errors == [] and log._fd is None


def test_a_log_that_cannot_be_written_loses_the_notice_not_the_operation(kb: KbRoot) -> None:
    kb.workflow("w", access=TEAM)
    host = Root(kb.root, sweep_interval=0)
    state = host.config.state_dir
    (state / "locks").mkdir(exist_ok=True)
    shutil.rmtree(state / "locks")
    (state / "locks").write_text("not a folder")  # the log's lock cannot be taken
    try:
        plan = session_ops.open_session(RootSessions(host), "w", actor=host.actor("alice"), kind="builder")
    finally:
        os.unlink(state / "locks")
    assert plan.session_id and plan.session_id in {r.id for r in RootSessions(host).store.rows()}
    log_file = state / "events.log"
    assert not log_file.exists() or b"session.opened" not in log_file.read_bytes()
    with pytest.raises(EventRefused):  # a producer bug is never swallowed
        host.events.emit("session.opened", workflow_id="w", session_id="s_1", text="content")


def test_who_sees_what(kb: KbRoot) -> None:
    path = kb.workflow("w", access=TEAM)
    m = parse_manifest((path / "workflow.json").read_bytes())
    host = Root(kb.root, sweep_interval=0)
    p = host.principals
    assert may_see(p.actor("dave"), None, None)  # resync: everyone
    assert may_see(p.actor("bob"), "w", m) and may_see(p.actor("alice"), "w", m)
    assert not may_see(p.actor("dave"), "w", m)
    assert may_see(p.actor("ops"), "w", None) and may_see(p.actor("svc"), "w", None)
    assert not may_see(p.actor("alice"), "w", None)  # never known: hidden
    mallory = p.get("mallory")
    assert mallory is not None and not may_see(mallory, None, None)
