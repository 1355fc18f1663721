"""The one lock under ``state/locks`` (:func:`kbd.fs.locks.held`): a timeout is
Busy (exit 75) through one translation, and a lock that records its holder (the
notes mutex) names the holder's workflow to a waiter — never its session, pid
or host. Real flock locks: a second open of the lock file in this process waits
like another process would (flock binds to the open file description)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbd.errors import Busy
from kbd.fs.locks import held, lock_path
from kbd.fs.notes import notes_lock


def test_a_timeout_is_busy_naming_what_was_locked(tmp_path: Path) -> None:
    with (
        held(tmp_path, "manifest", "k", timeout=5, what="workflow.json of src"),
        pytest.raises(Busy) as info,
        held(tmp_path, "manifest", "k", timeout=0.05, what="workflow.json of src"),
    ):
        pass
    assert info.value.message == "workflow.json of src is locked by another kbd process (waited 0.05s)"
    assert info.value.exit_code == 75
    # Released with the block: the next holder gets it at once.
    with held(tmp_path, "manifest", "k", timeout=0.05, what="workflow.json of src"):
        pass


def test_a_recorded_holder_is_named_by_its_workflow_only(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    fd = os.open(notes, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with notes_lock(tmp_path, fd, timeout=5, who={"session": "sess-secret", "workflow": "con"}):
            st = os.fstat(fd)
            holder = lock_path(tmp_path, "notes", f"{st.st_dev}:{st.st_ino}").with_suffix(".holder")
            recorded = json.loads(holder.read_text())
            assert (recorded["session"], recorded["workflow"], recorded["pid"]) == (
                "sess-secret",
                "con",
                os.getpid(),
            )
            with (
                pytest.raises(Busy) as info,
                notes_lock(tmp_path, fd, timeout=0.05, who={"workflow": "other"}),
            ):
                pass
    finally:
        os.close(fd)
    message = info.value.message
    assert message.startswith("the source's notes/ is being written by workflow con (since ")
    assert message.endswith("; waited 0.05s")
    assert "sess-secret" not in message and str(os.getpid()) not in message
    assert info.value.hint is not None and "locks.timeout_seconds" in info.value.hint


def test_a_holder_that_left_no_record_is_another_workflow(tmp_path: Path) -> None:
    # The lock without a holder file (a holder whose record could not be written).
    busy = r"^the source's notes/ is being written by another workflow; waited"
    with (
        held(tmp_path, "notes", "k", timeout=5, what="x"),
        pytest.raises(Busy, match=busy),
        held(tmp_path, "notes", "k", timeout=0.05, what="the source's notes/", who={"workflow": "w"}),
    ):
        pass


def test_the_command_notes_guard_loads_no_json_library_for_kbd_exec() -> None:
    """``kbd exec`` of a write plan imports the notes guard; it must stay lean
    (no orjson: only the index reader parses JSON, and it imports it itself)."""
    code = (
        "import sys, kbd.service.command_notes\n"
        "heavy = {'orjson', 'yaml', 'pydantic', 'click', 'fastapi'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
