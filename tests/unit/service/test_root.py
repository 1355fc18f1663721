"""The root context (kbd/service/root.py): a long-lived daemon's view of the
config files must never answer with settings a reload is replacing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from kbd.errors import PermissionDenied
from kbd.service.root import Root
from tests.helpers import KbRoot


def test_a_refresh_during_another_threads_reload_waits_for_it(tmp_path: Path) -> None:
    """The daemon's watcher reloads principals.yaml as a request arrives: the
    request's refresh must wait and see the new file, not return at once with
    the old principals (a CI run answered a just-disabled principal with 200)."""
    kb = KbRoot.create(tmp_path / "root")
    host = Root(kb.root)
    assert host.actor("alice").id == "alice"
    path = kb.root / "principals.yaml"
    doc = yaml.safe_load(path.read_text())
    for entry in doc["principals"]:
        if entry["id"] == "alice":
            entry["disabled"] = True
    path.write_text(yaml.safe_dump(doc))

    done = threading.Event()

    def request() -> None:
        host.refresh()
        done.set()

    with host._reloading:  # another thread's reload in progress
        t = threading.Thread(target=request)
        t.start()
        assert not done.wait(0.3), "refresh returned while a reload was in progress"
    t.join(timeout=10)
    assert done.is_set()
    with pytest.raises(PermissionDenied, match="disabled"):
        host.actor("alice")
