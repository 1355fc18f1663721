"""Lookups see bind mounts made in a private mount namespace (``unshare --mount``;
the host's mounts are never touched): a real `python -m kbd` or a lookup in a
child process, in the namespace. The rules are unit-tested in
tests/unit/test_resolver_scenarios.py and tests/unit/test_policy_lookup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kbd.core.lookup import KbProbe
from kbd.fs.registry import probe_kb
from tests.helpers import KbRoot
from tests.unit import test_policy_lookup as lookups
from tests.unit.test_resolver_scenarios import statuses


def test_bind_mounted_kb_is_kb_mountpoint(kb: KbRoot) -> None:
    """A bind mount of someone else's KB over the source's knowledgebase/ (same
    filesystem, so st_dev alone cannot tell). Runs in a private mount namespace."""
    other = kb.workflow("other", access={"owners": ["carol"]})
    src = kb.workflow("b", access={"owners": ["alice"]})
    kb.workflow("a", access={"owners": ["alice"]}, sources=[{"workflow_id": "b", "alias": "s"}])
    script = (
        f"mount --bind {other}/knowledgebase {src}/knowledgebase && "
        f"{sys.executable} -m kbd --root {kb.root} sources list a --as alice --json"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        timeout=60,
        check=False,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr.decode()
    src_json: list[dict[str, Any]] = orjson.loads(proc.stdout)["sources"]
    assert (src_json[0]["available"], src_json[0]["reason"], src_json[0]["path"]) == (
        False,
        "kb_mountpoint",
        None,
    )
    # Outside that namespace nothing was mounted.
    assert statuses(kb, "a")["s"].available


# A lookup in a private mount namespace (the host's mounts are never touched):
# the memo is warm (the same Plan object twice), then a bind mount is made, then
# the very next lookup. Printed as JSON for the test process.
_MOUNT_AFTER_WARM = """
import json, subprocess, sys
from pathlib import Path
from kbd.core import layout
layout.RACY_NS = 0  # as the fixture: the fresh root's files are trusted unchanged
from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
host = Root(Path(sys.argv[1]))
sessions = RootSessions(host)
alice = host.actor("alice")
sid = str(session_ops.open_session(sessions, "con", actor=alice, kind="execution",
                                   kb_access="read-write").session_id)
first = sessions.plan(sid, actor=alice)
warm = sessions.plan(sid, actor=alice) is first
subprocess.run(["mount", "--bind", *sys.argv[2:]], check=True)
after = sessions.plan(sid, actor=alice)
src = next(a for a in after.sources if a.alias == "src")
print(json.dumps({"warm": warm, "same_object": after is first, "available": src.available,
                  "reason": src.reason, "writable": src.writable,
                  "write_reason": src.write.reason if src.write is not None else None,
                  "generations": [first.generation, after.generation]}))
"""


@pytest.mark.parametrize("mounted", ["another-kb", "the-kb-itself", "another-notes"])
def test_a_bind_mount_made_after_a_memoised_lookup_is_seen_by_the_next_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mounted: str
) -> None:
    """``the-kb-itself``: the KB bound over itself keeps its (st_dev, st_ino) and
    contents; only its mount differs (statx STATX_ATTR_MOUNT_ROOT). No mount event
    reaches any watcher, and there is none here: the lookup's own probe must see it."""
    kb = lookups.world(tmp_path, monkeypatch)
    src = kb.workflows / "src" / "knowledgebase"
    other = kb.workflows / "other" / "knowledgebase"
    (other / "notes").mkdir(exist_ok=True)
    bind = {
        "another-kb": [str(other), str(src)],
        "the-kb-itself": [str(src), str(src)],
        "another-notes": [str(other / "notes"), str(src / "notes")],
    }[mounted]
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _MOUNT_AFTER_WARM, str(kb.root),
         *bind],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    seen = json.loads(proc.stdout)
    assert seen["warm"] and not seen["same_object"]
    if mounted == "another-notes":
        assert (seen["available"], seen["writable"], seen["write_reason"]) == (
            True,
            False,
            "notes_unavailable",
        )
    else:
        assert (seen["available"], seen["reason"]) == (False, "kb_mountpoint")
    assert seen["generations"][1] > seen["generations"][0]
    # Nothing was mounted outside that namespace.
    assert probe_kb(kb.workflows / "src", notes=True) == KbProbe(None, lookups._identity(src), None)
