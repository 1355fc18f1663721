"""Fast policy lookups stay exact. The verified plan memo of
:class:`kbd.service.sessions.RootSessions` (docs/sessions.md, docs/daemon.md): a lookup asks the registry and
the KB probes again every time, and reuses
the remembered plan only when every answer is the one it was built from. Real
roots, real folders, real renames; no watcher anywhere (the memo must not
depend on one)."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import orjson
import pytest
import yaml

from kbd.core import layout
from kbd.fs.registry import probe_kb
from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions, RunningCommand, SessionView
from kbd.state.processes import ProcessRow
from tests.helpers import KbRoot


@pytest.fixture
def kb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KbRoot:
    return world(tmp_path, monkeypatch)


def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KbRoot:
    """This module's root (also tests/integration/test_mount_namespaces.py's)."""
    # Files changed within RACY_NS are never trusted unchanged (every lookup
    # re-reads them, so nothing is remembered): a fresh root would be racy for
    # the whole test. Every edit below changes the file's size.
    monkeypatch.setattr(layout, "RACY_NS", 0)
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("other", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]},
                sources=[{"workflow_id": "src", "alias": "src", "access": "write"},
                         {"workflow_id": "other", "alias": "other"}])  # fmt: skip
    return kb


def _open(kb: KbRoot) -> tuple[Root, RootSessions, str]:
    host = kb.host()
    sessions = RootSessions(host)
    plan = session_ops.open_session(sessions, "con", actor=host.actor("alice"), kind="execution",
                                    kb_access="read-write")  # fmt: skip
    return host, sessions, str(plan.session_id)


def _source(plan: object, alias: str) -> object:
    return next(a for a in plan.sources if a.alias == alias)  # type: ignore[attr-defined]


def test_nothing_changed_gives_the_same_plan_object(kb: KbRoot) -> None:
    host, sessions, sid = _open(kb)
    first = sessions.plan(sid, actor=host.actor("alice"))
    assert sessions.plan(sid, actor=host.actor("alice")) is first
    assert sessions.plan(sid, actor=host.actor("svc")) is first


def test_a_replaced_kb_folder_is_what_the_next_lookup_names(kb: KbRoot) -> None:
    host, sessions, sid = _open(kb)
    alice = host.actor("alice")
    before = sessions.plan(sid, actor=alice)
    kb_dir = kb.workflows / "src" / "knowledgebase"
    os.rename(kb_dir, kb.workflows / "src" / "kb-old")
    (kb_dir / "notes").mkdir(parents=True)
    (kb_dir / "notes" / "_index.json").write_text('{"notes": []}\n')
    after = sessions.plan(sid, actor=alice)
    st = os.stat(kb_dir)
    assert after is not before
    assert _source(after, "src").kb_identity == (st.st_dev, st.st_ino)  # type: ignore[attr-defined]
    assert _source(before, "src").kb_identity != (st.st_dev, st.st_ino)  # type: ignore[attr-defined]
    # The same grants: the generation does not move for a new folder in the same place.
    assert after.generation == before.generation and after.digest() == before.digest()


@pytest.mark.parametrize("replacement", ["symlink", "file", "gone", "notes-gone"])
def test_a_kb_folder_replaced_by_something_unusable_is_refused_at_once(kb: KbRoot, replacement: str) -> None:
    host, sessions, sid = _open(kb)
    alice = host.actor("alice")
    before = sessions.plan(sid, actor=alice)
    assert _source(before, "src").writable  # type: ignore[attr-defined]
    kb_dir = kb.workflows / "src" / "knowledgebase"
    if replacement == "notes-gone":
        os.rename(kb_dir / "notes", kb_dir / "notes-old")
    else:
        os.rename(kb_dir, kb.workflows / "src" / "kb-old")
        if replacement == "symlink":
            kb_dir.symlink_to(kb.workflows / "other" / "knowledgebase")
        elif replacement == "file":
            kb_dir.write_text("not a folder\n")
    after = sessions.plan(sid, actor=alice)
    src = _source(after, "src")
    if replacement == "notes-gone":
        assert src.available and not src.writable and src.write.reason == "notes_unavailable"  # type: ignore[attr-defined]
    else:
        assert not src.available  # type: ignore[attr-defined]
        expected = {"symlink": "kb_symlinked", "file": "kb_not_dir", "gone": "kb_missing"}[replacement]
        assert src.reason == expected  # type: ignore[attr-defined]
    assert after.generation > before.generation


def test_a_hand_edited_source_manifest_is_seen_by_the_next_lookup(kb: KbRoot) -> None:
    host, sessions, sid = _open(kb)
    alice = host.actor("alice")
    before = sessions.plan(sid, actor=alice)
    kb.edit(kb.workflows / "src", access={"owners": ["bob"]})  # alice's consumer may no longer read it
    after = sessions.plan(sid, actor=alice)
    assert _source(after, "src").reason == "audience_denied"  # type: ignore[attr-defined]
    assert after.generation > before.generation
    kb.edit(kb.workflows / "src", access={"owners": ["alice"], "allowed_kb_writers": ["con", "nobody-else"]})
    again = sessions.plan(sid, actor=alice)
    assert again.digest() == before.digest() and again.generation > after.generation


def test_a_consumer_detach_and_a_new_principals_file_rebuild(kb: KbRoot) -> None:
    host, sessions, sid = _open(kb)
    alice = host.actor("alice")
    before = sessions.plan(sid, actor=alice)
    doc = yaml.safe_load((kb.root / "principals.yaml").read_text())
    doc["principals"].append({"id": "erin"})
    (kb.root / "principals.yaml").write_text(yaml.safe_dump(doc))
    host.refresh()
    reloaded = sessions.plan(sid, actor=host.actor("alice"))
    assert reloaded is not before and reloaded.digest() == before.digest()
    kb.edit(kb.workflows / "con", knowledgebase_sources=[])
    detached = sessions.plan(sid, actor=host.actor("alice"))
    assert detached.sources == () and detached.generation > before.generation


def test_the_policy_answer_is_the_session_views_json_byte_for_byte(kb: KbRoot) -> None:
    from kbd.daemon.routes import State, _running_tail  # the API stack only here

    host, _, sid = _open(kb)
    state = State(host)
    plan = state.sessions.plan(sid, actor=host.actor("alice"))
    rows = (
        RunningCommand(
            ProcessRow(sid, 4242, 4242, plan.generation - 1, 1.5, ["sleep", "9"], cgroup=None), True
        ),
        RunningCommand(
            ProcessRow(sid, 4343, 4343, plan.generation, 2.5, ["sh", "-c", "é"], cgroup=None), False
        ),
    )
    for running in ((), rows):
        view = SessionView(plan, running)
        body = state.plan_bytes(sid, plan) + _running_tail(view)
        assert body == orjson.dumps(view.to_json())
    assert state.plan_bytes(sid, plan) is state.plan_bytes(sid, plan)  # serialised once per plan
    state.event_log.close()


IN_OPEN, IN_CLOSE_NOWRITE, IN_ALL = 0x20, 0x10, 0xFEE  # the mask watchfiles sets


def test_a_kb_probe_makes_no_inotify_event(kb: KbRoot) -> None:
    """The daemon watches workflow and KB folders; its per-lookup probes open
    them O_PATH only, so 20 sources per lookup never wake its own watcher."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0
    try:
        folder = kb.workflows / "src"
        for watched in (kb.workflows, folder, folder / "knowledgebase", folder / "knowledgebase" / "notes"):
            assert libc.inotify_add_watch(fd, bytes(watched), IN_ALL) >= 0
        for notes in (False, True):
            assert probe_kb(folder, notes=notes).problem is None
        with pytest.raises(BlockingIOError):
            os.read(fd, 4096)
        # The watch works: an ordinary open of the folder is seen.
        os.close(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
        data = os.read(fd, 4096)
        assert struct.unpack_from("iI", data)[1] & (IN_OPEN | IN_CLOSE_NOWRITE)
    finally:
        os.close(fd)


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)
