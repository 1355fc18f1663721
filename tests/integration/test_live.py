"""The live daemon (docs/daemon.md): watched changes become
events, a change that shrinks a session's grants reaches its running commands
(terminated with ``revocation.immediate``, marked stale otherwise) within a
second, also when the watcher is poisoned (the verifier), and SIGTERM stops the
daemon cleanly while the sessions and their in-process commands survive.

Real daemon on its real socket, real watchers, real sandboxed commands started
by an in-process ``kbd exec`` (``KBD_NO_DAEMON=1``) as real processes."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from kbd.core.events import parse_line
from tests import waiting
from tests.helpers import KbRoot, alive, issue_token
from tests.integration.daemon import Daemon, clean_env, map_uid, serving

# A background loop that leaves the command's process group (setsid): only the
# command's cgroup still holds it.
SETSID_LOOP = "setsid sh -c 'while :; do sleep 0.1; done' & wait"


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """:func:`tests.waiting.wait_for`, polled finely; the seconds it took (some tests time it)."""
    start = time.monotonic()
    waiting.wait_for(predicate, timeout, what, max_interval=0.02)
    return time.monotonic() - start


def events(root: Path) -> list[dict[str, Any]]:
    """The events the daemon appended, as subscribers see them (plus ``_wf``)."""
    try:
        data = (root / "state" / "events.log").read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        event = parse_line(line)
        if event is not None:
            out.append(event.public())
    return out


def of_type(root: Path, event_type: str, **fields: object) -> list[dict[str, Any]]:
    return [
        e for e in events(root) if e["type"] == event_type and all(e.get(k) == v for k, v in fields.items())
    ]


def set_revocation(root: Path, *, immediate: bool, grace: float = 0) -> None:
    path = root / "kbd.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["revocation"] = {"immediate": immediate, "grace_seconds": grace}
    path.write_text(yaml.safe_dump(doc))


def loop_pids(sid: str, tag: str = "") -> list[int]:
    """Live processes of the background loop (its shell carries the loop text;
    ``tag``: only one Runner's — forked copies of its shell included)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            comm = Path(f"/proc/{entry}/comm").read_bytes()
        except OSError:
            continue
        if (
            comm != b"bwrap\n"  # its argv carries the loop too, before the sandbox is even set up
            and f"KBD_SESSION={sid}".encode() in raw.split(b"\0")
            and b"while :" in cmd
            and tag.encode() in cmd
            and alive(int(entry))
        ):
            out.append(int(entry))
    return out


_RUNNERS = itertools.count()


class Runner:
    """``kbd exec SID -- sh -c SETSID_LOOP`` as a real process: in process (no
    broker), or brokered by the daemon listening on ``socket``."""

    def __init__(self, kb: KbRoot, sid: str, *, socket: Path | None = None, as_: str | None = None) -> None:
        env = clean_env()
        if socket is None:
            env["KBD_NO_DAEMON"] = "1"
        else:
            env["KBD_SOCKET"] = str(socket)
        self.sid = sid
        # Its own mark: two Runners in one session are told apart (a bare
        # before/after diff would also catch the other loop's forked copies).
        self.tag = f"kbd-runner-{next(_RUNNERS)}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, *(["--as", as_] if as_ else []),
             "--", "sh", "-c", SETSID_LOOP.replace("done'", f"done # {self.tag}'")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            wait_for(self.pids, 30, "the background loop started")
        except BaseException:
            self.close()  # never leave a half-started loop behind a failed test
            raise

    def pids(self) -> list[int]:
        return loop_pids(self.sid, self.tag)

    def gone(self) -> bool:
        return not loop_pids(self.sid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for pid in loop_pids(self.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.fixture
def world(kb: KbRoot) -> Iterator[KbRoot]:
    """src (owned by bob, read by alice, writable by con) attached to con (alice's)."""
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    yield kb


def _open(kb: KbRoot) -> str:
    return kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")


def _replace_manifest(folder: Path, **changes: Any) -> None:
    """A hand edit as an editor saves it: write a new file, rename it over the old."""
    doc = orjson.loads((folder / "workflow.json").read_bytes())
    doc.update(changes)
    tmp = folder / ".workflow.json.tmp"
    tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    os.rename(tmp, folder / "workflow.json")


def _revoked(kb: KbRoot, sid: str) -> list[dict[str, Any]]:
    return [
        e for e in kb.cli("audit", "--json").json()["events"]
        if e["event"] == "session_revoke" and e["session"] == sid and e.get("pushed") is True
    ]  # fmt: skip


# -- pushed revocation ----------------------------------------------------------------------------


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda kb: kb.cli("sources", "detach", "con", "src", "--as", "alice"), id="cli-detach"),
        pytest.param(
            lambda kb: kb.cli("writers", "revoke", "src", "con", "--as", "bob"), id="cli-writer-revoke"
        ),
        pytest.param(
            lambda kb: _replace_manifest(kb.workflows / "con", knowledgebase_sources=[]),
            id="hand-edit-detach",
        ),
    ],
)
@pytest.mark.parametrize("via", ["in_process", "brokered"])
def test_a_shrinking_change_terminates_the_running_tree_within_a_second(
    world: KbRoot, change: Callable[[KbRoot], object], via: str
) -> None:
    """Commands run by an in-process `kbd exec` and commands the daemon's broker
    runs are recorded alike, and pushed revocation ends both."""
    kb = world
    set_revocation(kb.root, immediate=True, grace=0)
    sid = _open(kb)
    if via == "brokered":
        map_uid(kb.root, "alice", os.getuid())  # the broker authenticates the caller's uid, as the API does
    with serving(kb.root) as daemon:
        runner = Runner(kb, sid, socket=daemon.sock if via == "brokered" else None)
        try:
            (running,) = kb.cli("session", "show", sid, "--json").json()["running"]
            generation, pid = running["generation"], running["pid"]
            result = change(kb)
            assert getattr(result, "code", 0) == 0, getattr(result, "err", "")
            took = wait_for(runner.gone, 1.0, "the setsid loop was terminated")
            assert took <= 1.0
            wait_for(lambda: of_type(kb.root, "command.terminated", session_id=sid), 5, "command.terminated")
            (ended,) = of_type(kb.root, "command.terminated", session_id=sid)
            assert ended["generation"] == generation and ended["pid"] == pid
            assert of_type(kb.root, "session.plan_changed", session_id=sid, generation=generation + 1)
            wait_for(lambda: _revoked(kb, sid), 5, "the audit record")
            (record,) = _revoked(kb, sid)
            assert record["immediate"] is True and record["terminated"] == [pid]
            assert record["trigger"] == "watch"
            runner.proc.wait(timeout=30)
            assert kb.cli("session", "show", sid, "--json").json()["running"] == []
        finally:
            runner.close()
        assert daemon.proc.poll() is None


def _disable(kb: KbRoot, principal: str) -> None:
    """An operator's hand edit of principals.yaml (rename over the old file)."""
    path = kb.root / "principals.yaml"
    doc = yaml.safe_load(path.read_text())
    for entry in doc["principals"]:
        if entry["id"] == principal:
            entry["disabled"] = True
    tmp = kb.root / ".principals.yaml.tmp"
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.rename(tmp, path)


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda kb: _disable(kb, "alice"), id="principal-disabled"),
        pytest.param(
            lambda kb: _replace_manifest(kb.workflows / "con", access={"owners": ["bob"]}), id="role-removed"
        ),
    ],
)
@pytest.mark.parametrize("via", ["in_process", "brokered"])
def test_commands_of_a_principal_who_loses_the_session_are_terminated(
    world: KbRoot, change: Callable[[KbRoot], object], via: str
) -> None:
    """Disabling alice, or taking her role on the consumer, leaves the
    session's grants as they were, but alice may no longer use it: the commands
    she started (brokered as her uid, or in-process with ``--as alice``) end,
    as a grant revoke ends them; the local operator's command in the same
    session runs on."""
    kb = world
    set_revocation(kb.root, immediate=True, grace=0)
    # A read plan: two write commands into one notes/ would take turns (the notes mutex).
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    map_uid(kb.root, "alice", os.getuid())
    with serving(kb.root) as daemon:
        mine = Runner(kb, sid, socket=daemon.sock if via == "brokered" else None,
                      as_=None if via == "brokered" else "alice")  # fmt: skip
        operator: Runner | None = None
        try:
            (running,) = kb.cli("session", "show", sid, "--json").json()["running"]
            operator = Runner(kb, sid)  # in-process, as the local operator: no principal to lose
            change(kb)
            wait_for(lambda: not mine.pids(), 5, "alice's setsid loop was terminated")
            wait_for(lambda: of_type(kb.root, "command.terminated", session_id=sid, pid=running["pid"]), 5,
                     "command.terminated")  # fmt: skip
            mine.proc.wait(timeout=30)
            # A negative window: a wrong second termination would come with the same pass.
            waiting.holds_for(lambda: operator.proc.poll() is None and operator.pids(), 0.5,
                              "the operator's command running", detail=operator.proc.poll)  # fmt: skip
            (left,) = kb.cli("session", "show", sid, "--json").json()["running"]
            assert left["pid"] != running["pid"]
        finally:
            mine.close()
            if operator is not None:
                operator.close()
        assert daemon.proc.poll() is None


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_without_immediate_the_command_is_marked_stale_not_touched(world: KbRoot) -> None:
    kb = world
    set_revocation(kb.root, immediate=False)
    sid = _open(kb)
    with serving(kb.root):
        runner = Runner(kb, sid)
        try:
            (running,) = kb.cli("session", "show", sid, "--json").json()["running"]
            generation, pid = running["generation"], running["pid"]
            assert kb.cli("writers", "revoke", "src", "con", "--as", "bob").code == 0
            wait_for(lambda: of_type(kb.root, "command.stale", session_id=sid), 1.0, "command.stale")
            (stale,) = of_type(kb.root, "command.stale", session_id=sid)
            assert stale == {**stale, "pid": pid, "generation": generation}
            assert of_type(kb.root, "writers.changed", workflow_id="src")
            assert of_type(kb.root, "session.plan_changed", session_id=sid, generation=generation + 1)
            (record,) = _revoked(kb, sid)
            assert record["immediate"] is False and record["still_running"] == [pid]
            assert "STALE" in kb.cli("session", "show", sid).out
            assert not runner.gone() and runner.proc.poll() is None
            # A change that does not touch the grants again is not a second notice.
            _replace_manifest(kb.workflows / "con", label="renamed")
            wait_for(lambda: of_type(kb.root, "workflow.changed", workflow_id="con"), 2, "workflow.changed")
            assert len(of_type(kb.root, "command.stale", session_id=sid)) == 1
        finally:
            runner.close()


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_widening_change_leaves_running_commands_alone(world: KbRoot) -> None:
    kb = world
    kb.workflow("more", access={"owners": ["alice"]})
    set_revocation(kb.root, immediate=True, grace=0)
    sid = _open(kb)
    with serving(kb.root):
        runner = Runner(kb, sid)
        try:
            generation = kb.cli("session", "show", sid, "--json").json()["generation"]
            r = kb.cli("sources", "attach", "con", "more", "--alias", "more", "--as", "alice")
            assert r.code == 0, r.err
            wait_for(lambda: of_type(kb.root, "session.plan_changed", session_id=sid, generation=generation + 1),
                     2, "session.plan_changed")  # fmt: skip
            assert of_type(kb.root, "sources.changed", workflow_id="con")
            assert not runner.gone() and runner.proc.poll() is None
            assert of_type(kb.root, "command.terminated") == [] and of_type(kb.root, "command.stale") == []
        finally:
            runner.close()


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_revocation_reaches_running_commands_through_the_verifier_when_the_watcher_is_poisoned(
    world: KbRoot,
) -> None:
    kb = world
    set_revocation(kb.root, immediate=True, grace=0)
    sid = _open(kb)
    with serving(kb.root) as daemon:
        runner = Runner(kb, sid)
        try:
            # Any folder owner can kill a watch segment: a file name that is not UTF-8.
            poison = os.fsencode(kb.workflows / "con") + b"/\xff"
            with open(poison, "wb"):
                pass
            wait_for(lambda: of_type(kb.root, "resync", reason="watcher_died"), 10, "resync watcher_died")
            assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
            took = wait_for(runner.gone, 5.0, "the setsid loop was terminated")
            assert took <= 2.5  # the degraded verifier runs every second
            wait_for(lambda: of_type(kb.root, "command.terminated", session_id=sid), 5, "command.terminated")
            # Lookups never depended on the watcher: exec already sees the change.
            env = {"KBD_NO_DAEMON": "1"}
            r = kb.cli("exec", sid, "--", "sh", "-c", 'echo "${WORKFLOW_KB_SRC:-none}"', env=env)
            assert r.code == 0 and r.out == "none\n", r
        finally:
            runner.close()
            os.unlink(poison)
        assert daemon.proc.poll() is None


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_after_a_queue_overflow_the_change_is_still_pushed_with_a_resync(world: KbRoot) -> None:
    kb = world
    set_revocation(kb.root, immediate=True, grace=0)
    sid = _open(kb)
    with serving(kb.root) as daemon:
        runner = Runner(kb, sid)
        flood = kb.workflows / "con"  # watched itself (watches are not recursive)
        try:
            # Stopped, the daemon reads nothing: more changes than the kernel's
            # inotify queue holds (16,384 events), then the one that matters.
            daemon.proc.send_signal(signal.SIGSTOP)
            try:
                for i in range(20_000):
                    (flood / f"f{i}").touch()
                _replace_manifest(kb.workflows / "src", access={"owners": ["bob"]})
                # Lookups never needed the daemon: the very next exec sees it.
                env = {"KBD_NO_DAEMON": "1"}
                r = kb.cli("exec", sid, "--", "sh", "-c", 'echo "${WORKFLOW_KB_SRC:-none}"', env=env)
                assert r.code == 0 and r.out == "none\n", r
            finally:
                daemon.proc.send_signal(signal.SIGCONT)
            wait_for(runner.gone, 3.0, "the older-generation command was terminated")
            wait_for(lambda: of_type(kb.root, "resync", reason="queue_overflow"), 2, "resync")
            wait_for(lambda: of_type(kb.root, "workflow.changed", workflow_id="src"), 2, "workflow.changed")
        finally:
            runner.close()
        assert daemon.proc.poll() is None


# -- events ---------------------------------------------------------------------------------------


def test_a_hand_edit_and_a_cli_edit_give_the_same_events(world: KbRoot) -> None:
    kb = world
    kb.workflow("other", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
    with serving(kb.root):
        assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
        _replace_manifest(kb.workflows / "other", knowledgebase_sources=[])
        for wid in ("con", "other"):
            wait_for(lambda wid=wid: of_type(kb.root, "sources.changed", workflow_id=wid), 2, f"{wid} events")  # type: ignore[misc]
        by = {
            wid: sorted(e["type"] for e in events(kb.root) if e.get("workflow_id") == wid)
            for wid in ("con", "other")
        }
        assert by["con"] == by["other"] == ["sources.changed", "workflow.changed"]
        # A workflow that appears, moves and vanishes.
        kb.workflow("new", access={"owners": ["alice"]})
        wait_for(lambda: of_type(kb.root, "workflow.changed", workflow_id="new"), 2, "added")
        os.rename(kb.workflows / "new", kb.workflows / "moved")
        wait_for(lambda: len(of_type(kb.root, "workflow.changed", workflow_id="new")) == 2, 2, "moved")
        (kb.workflows / "moved" / "workflow.json").unlink()
        wait_for(lambda: len(of_type(kb.root, "workflow.changed", workflow_id="new")) == 3, 2, "removed")
    # No event ever carries more than its type's fields.
    for e in events(kb.root):
        assert set(e) <= {"id", "type", "at", "workflow_id", "session_id", "generation", "pid", "reason",
                          "relpath", "by_workflow"}  # fmt: skip


def test_a_hand_edit_made_while_the_watcher_rebuilds_a_segment_is_pushed_within_a_second(
    world: KbRoot,
) -> None:
    """A workflow that appears makes the daemon rebuild the watch segment of
    the folders added since it started, ``user``'s among them: an edit of
    ``user`` made between the old watch's end and the new one's start raised no
    event (it waited for the periodic verifier, 10 s). The edits are spread over
    the 300 ms after each new workflow, so some land inside the rebuild."""
    kb = world
    with serving(kb.root):
        kb.workflow("user", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
        wait_for(lambda: of_type(kb.root, "workflow.changed", workflow_id="user"), 2, "user added")
        for i in range(40):
            kb.workflow(f"new{i}", access={"owners": ["alice"]}, kb=False)
            # Not a wait: the edit's offset from the new workflow, spread over 0-270 ms
            # so that some edits land inside the segment's rebuild.
            time.sleep((i % 10) * 0.03)
            seen = len(of_type(kb.root, "sources.changed", workflow_id="user"))
            attached = [] if i % 2 == 0 else [{"workflow_id": "src", "alias": "src"}]
            _replace_manifest(kb.workflows / "user", knowledgebase_sources=attached)
            wait_for(lambda seen=seen: len(of_type(kb.root, "sources.changed", workflow_id="user")) > seen,  # type: ignore[misc]
                     1.0, f"the edit after new workflow {i} to be pushed (within 1 s)")  # fmt: skip


def test_a_session_opened_while_the_daemon_runs_gets_plan_changed_without_running_commands(
    world: KbRoot,
) -> None:
    kb = world
    with serving(kb.root):
        sid = _open(kb)
        generation = kb.cli("session", "show", sid, "--json").json()["generation"]
        # First seen by the pass of this change: recorded as the store had it then.
        assert kb.cli("writers", "revoke", "src", "con", "--as", "bob").code == 0
        wait_for(lambda: of_type(kb.root, "session.plan_changed", session_id=sid), 2, "session.plan_changed")
        (changed,) = of_type(kb.root, "session.plan_changed", session_id=sid)
        assert changed["generation"] == generation + 1
        assert kb.cli("session", "show", sid, "--json").json()["generation"] == generation + 1


# -- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.requires_bwrap
def test_sigterm_stops_cleanly_and_sessions_and_their_commands_survive_a_restart(world: KbRoot) -> None:
    kb = world
    set_revocation(kb.root, immediate=True, grace=0)
    sid = kb.open_session("con", kind="reviewer_strategic", kb_access="read", actor="alice")
    with serving(kb.root) as first:
        runner = Runner(kb, sid)
    # serving() sent SIGTERM and checked: exit 0 within the timeout, socket removed.
    assert "kbd: stopped" in first.stderr
    try:
        assert not runner.gone() and runner.proc.poll() is None  # not the daemon's command
        with serving(kb.root):
            restarts = of_type(kb.root, "resync", reason="restart")
            assert len(restarts) == 2
            # The old command's plan is unchanged: nothing to push.
            assert kb.cli("session", "show", sid, "--json").json()["running"][0]["stale"] is False
            assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
            wait_for(runner.gone, 1.0, "the loop started before the restart was terminated")
    finally:
        runner.close()


def test_sigterm_stops_the_daemon_promptly_while_the_watcher_runs(world: KbRoot) -> None:
    kb = world
    daemon: Daemon
    with serving(kb.root) as daemon:
        kb.workflow("late", access={"owners": ["alice"]})
        wait_for(lambda: of_type(kb.root, "workflow.changed", workflow_id="late"), 2, "watched")
        start = time.monotonic()
    assert time.monotonic() - start < 5.0
    assert not daemon.sock.exists()


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_revocation_setting_changed_while_the_daemon_runs_applies_to_the_next_push(world: KbRoot) -> None:
    kb = world
    set_revocation(kb.root, immediate=False)
    sid = _open(kb)
    with serving(kb.root):
        runner = Runner(kb, sid)
        try:
            set_revocation(kb.root, immediate=True, grace=0)
            # Every pass re-reads kbd.yaml when it changed, before it acts: the
            # push of the detach below sees the new setting, whichever comes first.
            assert kb.cli("sources", "detach", "con", "src", "--as", "alice").code == 0
            wait_for(runner.gone, 1.0, "terminated under the new setting")
            assert of_type(kb.root, "command.stale") == []
        finally:
            runner.close()


# -- in process: the live state and the shutdown order ----------------------------------------------


def test_the_registry_sweeps_rarely_only_while_the_watcher_is_healthy(world: KbRoot) -> None:
    import threading

    from kbd.service.changefeed import Feed
    from kbd.service.live import HEALTHY_SWEEP, LiveState
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions
    from kbd.state.events import EventLog

    kb = world
    host = Root(kb.root, sweep_interval=1.0)
    log = EventLog(kb.root / "state")
    lock = threading.RLock()
    live = LiveState(host, RootSessions(host), lock=lock, events=Feed(host, log, lock=lock))
    live.start()
    poison = os.fsencode(kb.workflows / "con") + b"/\xff"
    try:
        wait_for(lambda: live.healthy, 10, "healthy")
        assert host.registry.sweep_interval == HEALTHY_SWEEP
        with open(poison, "wb"):
            pass
        wait_for(lambda: not live.healthy, 10, "the poisoned watcher reported")
        assert host.registry.sweep_interval == 1.0
        assert of_type(kb.root, "resync", reason="watcher_died")
        os.unlink(poison)
        wait_for(lambda: live.healthy, 15, "rebuilt after its backoff")
        assert host.registry.sweep_interval == HEALTHY_SWEEP
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(poison)
        live.stop()
        log.close()
    assert not live.running


def test_shutdown_stops_accepting_and_watching_before_it_drains_with_the_grace(
    world: KbRoot, tmp_path: Path
) -> None:
    import asyncio
    import socket

    import uvicorn

    from kbd.daemon.listen import bind_socket
    from kbd.daemon.protocol import PeerCredProtocol
    from kbd.daemon.routes import create_app
    from kbd.daemon.server import KbdServer, start_live
    from kbd.service.root import Root

    kb = world
    set_revocation(kb.root, immediate=False, grace=2.5)
    host = Root(kb.root)
    app = create_app(host)
    events_log, live = start_live(host, app)
    path = tmp_path / "run" / "kbd.sock"
    sock = bind_socket(path)
    seen: dict[str, object] = {}

    async def hook(grace: float) -> None:
        seen["grace"] = grace
        seen["watching"] = live.running
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            seen["accepting"] = False
        else:
            seen["accepting"] = True
        finally:
            probe.close()

    app.state.drain.append(hook)
    config = uvicorn.Config(app, http=PeerCredProtocol, lifespan="off", log_level="warning")
    server = KbdServer(config, live=live, drain=app.state.drain, grace=lambda: host.config.revoke_grace)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task

    try:
        asyncio.run(run())
    finally:
        live.stop()
        events_log.close()
        sock.close()
    assert seen == {"grace": 2.5, "watching": False, "accepting": False}


# -- previews (docs/access.md "Previews") -----------------------------------------------------------


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
@pytest.mark.parametrize("immediate", [True, False], ids=["immediate", "stale"])
@pytest.mark.parametrize(
    ("change", "who", "route"),
    [
        # An admin: bob (src's owner) may revoke too, but may not see con, so its sessions and
        # commands are only counted for him (tests/unit/service/test_preview.py).
        (["writers", "revoke", "src", "con"], "ops", ("DELETE", "/v1/workflows/src/writers/con")),
        (["principals", "disable", "alice"], "ops", ("POST", "/v1/principals/alice/disable")),
    ],
    ids=["writer-revoke", "principal-disabled"],
)
def test_a_preview_names_the_running_commands_the_change_then_acts_on(
    world: KbRoot, immediate: bool, change: list[str], who: str, route: tuple[str, str]
) -> None:
    """Through the daemon's API (``?dry_run=true``) and the CLI alike: the running command the
    change would end (or mark stale), and nothing changed; then the change, and the daemon does
    exactly that to exactly that command."""
    kb = world
    set_revocation(kb.root, immediate=immediate, grace=0)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    map_uid(kb.root, "alice", os.getuid())
    tokens = {p: issue_token(kb.root, p) for p in ("bob", "ops")}
    with serving(kb.root) as daemon:
        runner = Runner(kb, sid, socket=daemon.sock)
        try:
            (running,) = kb.cli("session", "show", sid, "--json").json()["running"]
            effect = "terminated" if immediate else "stale"
            method, path = route
            answer = daemon.client(tokens[who]).request(method, path, params={"dry_run": "true"},
                                                        json={} if method == "POST" else None)  # fmt: skip
            assert answer.status_code == 200, answer.text
            preview = answer.json()
            assert preview["dry_run"] is True
            assert preview["commands"] == [{"session_id": sid, "pid": running["pid"], "effect": effect}], (
                preview
            )
            cli = kb.cli(*change, "--dry-run", "--as", who, "--json")
            assert cli.code == 0 and cli.json() == preview, cli.err
            waiting.holds_for(lambda: runner.proc.poll() is None and not of_type(kb.root, f"command.{effect}"),
                              0.5, "nothing acted on by a preview")  # fmt: skip
            assert kb.cli(*change, "--as", who).code == 0
            wait_for(lambda: of_type(kb.root, f"command.{effect}", session_id=sid), 5, f"command.{effect}")
            (acted,) = of_type(kb.root, f"command.{effect}", session_id=sid)
            assert acted["pid"] == running["pid"]
        finally:
            runner.close()
