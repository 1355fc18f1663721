"""The daemon's fast policy lookups stay exact (docs/sessions.md, docs/cli.md, docs/daemon.md): the REAL
daemon on its socket, its per-session plan memo warm, then a change on disk or
in principals.yaml, then the very next request — sent at once, well before the
watcher's debounce, so the answer comes from the lookup's own verification,
never from a pushed event.

- a KB folder replaced by another folder: the next brokered command reads the
  new one (a memo that did not re-probe identities would hand the sandbox the
  old identity, which the launch refuses);
- a KB folder replaced by a link, a source manifest edited by hand, a bind
  mount over a KB folder (even of the folder itself: same inode, another
  mount; no inotify event exists for a mount): the next GET says so;
- a rotated token and a disabled principal: refused by the next request.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kbd.core import layout
from tests.helpers import KbRoot, issue_token
from tests.integration import daemon
from tests.waiting import wait_for

WARM = 5  # lookups before the change: the memo holds the plan


@dataclass
class World:
    kb: KbRoot
    daemon: daemon.Daemon
    tokens: dict[str, str]
    sid: str

    def plan(self, token: str | None = None) -> Any:
        r = self.daemon.client(token or self.tokens["svc"]).get(f"/v1/sessions/{self.sid}")
        assert r.status_code == 200, r.text
        return r.json()

    def warm(self) -> Any:
        plans = [self.plan() for _ in range(WARM)]
        assert all(p == plans[0] for p in plans)
        return plans[0]


def _source(plan: Any, alias: str) -> Any:
    return next(a for a in plan["sources"] if a["alias"] == alias)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with _world(tmp_path) as w:
        yield w


@pytest.fixture
def world_in_own_mounts(tmp_path: Path) -> Iterator[World]:
    """The daemon in a private mount namespace: a test mounts there (nsenter),
    never on the host."""
    with _world(tmp_path, prefix=["unshare", "--mount", "--propagation", "private"]) as w:
        yield w


@contextlib.contextmanager
def _world(tmp_path: Path, prefix: Sequence[str] = ()) -> Iterator[World]:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={"owners": ["alice"]})
    kb.workflow("other", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src"}])
    r = kb.call("session", "open", "con", "--kind", "execution", "--as", "alice", "--json")
    assert r.code == 0, r.err
    daemon.map_uid(kb.root, "ops", os.getuid())  # brokered commands of this uid act as ops
    tokens = daemon.issue_tokens(kb.root, ["svc", "alice"])
    # A file changed within RACY_NS is never trusted unchanged: until the new
    # root's files are older than that, every lookup rebuilds (nothing is
    # remembered) and these tests would not exercise the memo.
    wait_for(lambda: not any(layout.racy(os.lstat(p), time.time_ns()) for p in kb.root.rglob("*")), 10,
             "every file of the new root to be older than layout.RACY_NS")  # fmt: skip
    kb.exec_env = {}
    with daemon.serving(kb.root, prefix=prefix) as served:
        yield World(kb, served, tokens, str(r.json()["session_id"]))


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_replaced_kb_folder_is_what_the_next_brokered_command_reads(world: World) -> None:
    env = {"KBD_SOCKET": str(world.daemon.sock)}
    read = ["exec", world.sid, "--", "sh", "-c", 'cat "$WORKFLOW_KB_SRC/context/about.md"']
    first = world.kb.cli(*read, env=env)
    assert (first.code, first.out) == (0, "about src\n"), first.err
    world.warm()
    kb_dir = world.kb.workflows / "src" / "knowledgebase"
    os.rename(kb_dir, kb_dir.parent / "kb-old")
    (kb_dir / "context").mkdir(parents=True)
    (kb_dir / "context" / "about.md").write_text("the new folder\n")
    second = world.kb.cli(*read, env=env)
    assert (second.code, second.out) == (0, "the new folder\n"), second.err


def test_a_kb_folder_replaced_by_a_link_is_unavailable_at_once(world: World) -> None:
    before = world.warm()
    assert _source(before, "src")["available"] is True
    kb_dir = world.kb.workflows / "src" / "knowledgebase"
    os.rename(kb_dir, kb_dir.parent / "kb-old")
    kb_dir.symlink_to(world.kb.workflows / "other" / "knowledgebase")
    after = world.plan()
    src = _source(after, "src")
    assert (src["available"], src["reason"], src["path"]) == (False, "kb_symlinked", None)
    assert after["generation"] > before["generation"] and "WORKFLOW_KB_SRC" not in after["env"]


def test_a_hand_edited_source_manifest_is_seen_by_the_next_lookup(world: World) -> None:
    before = world.warm()
    world.kb.edit(world.kb.workflows / "src", access={"owners": ["bob"]})  # con's audience may not read it
    after = world.plan()
    assert _source(after, "src")["reason"] == "audience_denied"
    assert after["generation"] > before["generation"] and "WORKFLOW_KB_SRC" not in after["env"]


def test_a_rotated_token_and_a_disabled_principal_take_effect_with_the_next_request(world: World) -> None:
    old = world.tokens["svc"]
    world.warm()
    new = issue_token(world.kb.root, "svc", timeout=10)
    r = world.daemon.client(old).get(f"/v1/sessions/{world.sid}")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated", r.text
    assert world.plan(new)["session_id"] == world.sid
    path = world.kb.root / "principals.yaml"
    doc = yaml.safe_load(path.read_text())
    for p in doc["principals"]:
        if p["id"] == "svc":
            p["disabled"] = True
    path.write_text(yaml.safe_dump(doc))
    r = world.daemon.client(new).get(f"/v1/sessions/{world.sid}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission-denied", r.text
    assert "disabled" in r.json()["error"]["message"]
    # alice (who opened the session) is unaffected.
    assert world.plan(world.tokens["alice"])["session_id"] == world.sid


@pytest.mark.parametrize("mounted", ["another-kb", "the-kb-itself"])
def test_a_bind_mount_over_a_kb_after_warm_lookups_is_refused_by_the_next_get(
    world_in_own_mounts: World, mounted: str
) -> None:
    world = world_in_own_mounts
    before = world.warm()
    assert _source(before, "src")["available"] is True
    kb_dir = world.kb.workflows / "src" / "knowledgebase"
    source = world.kb.workflows / "other" / "knowledgebase" if mounted == "another-kb" else kb_dir
    pid = str(world.daemon.proc.pid)  # unshare exec'd the daemon: the same process
    subprocess.run(
        ["nsenter", "--target", pid, "--mount", "mount", "--bind", str(source), str(kb_dir)], check=True
    )
    after = world.plan()
    src = _source(after, "src")
    assert (src["available"], src["reason"], src["path"]) == (False, "kb_mountpoint", None)
    assert after["generation"] > before["generation"] and "WORKFLOW_KB_SRC" not in after["env"]
    subprocess.run(["nsenter", "--target", pid, "--mount", "umount", str(kb_dir)], check=True)
    again = world.plan()
    assert _source(again, "src")["available"] is True
