"""Running-command records and process control (kbd.state.processes), on real
processes: a record is reported only while its process is the same one."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.state.processes import RunningCommands, terminate_group

SID = "s_" + "ab" * 10


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_recorded_command_is_reported_while_it_runs(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    commands = RunningCommands(tmp_path)
    commands.add(SID, pid=sleeper.pid, generation=3, argv=["sleep", "60"], started_at=12.5)
    [row] = commands.of_session(SID)
    assert (row.session_id, row.pid, row.pgid, row.alive, row.cgroup) == (
        SID,
        sleeper.pid,
        sleeper.pid,
        True,
        None,
    )
    assert row.to_json() == {"pid": sleeper.pid, "pgid": sleeper.pid, "generation": 3, "started_at": 12.5,
                             "argv": ["sleep", "60"]}  # fmt: skip
    assert commands.of_session("s_" + "cd" * 10) == []
    commands.remove(SID, sleeper.pid)
    commands.remove(SID, sleeper.pid)  # already gone: nothing to do
    assert commands.of_session(SID) == []


def test_an_ended_or_other_boots_process_is_never_reported(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    commands = RunningCommands(tmp_path)
    commands.add(SID, pid=sleeper.pid, generation=0, argv=["sleep"])
    record = tmp_path / "procs" / SID / f"{sleeper.pid}.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "boot_id": "another-boot"}))
    assert commands.of_session(SID) == []  # same PID, but a record from another boot
    record.write_text(json.dumps(data))
    assert [r.pid for r in commands.of_session(SID)] == [sleeper.pid]
    sleeper.kill()
    sleeper.wait()
    assert commands.of_session(SID) == []  # the PID may be recycled: never reported again
    (tmp_path / "procs" / SID / "junk.json").write_text("{")
    assert commands.of_session(SID) == []


def test_terminate_group_ends_the_whole_group(sleeper: subprocess.Popen[bytes]) -> None:
    # Reaped as it ends (in kbd its parent, kbd exec, does that): a zombie would keep the group.
    reaper = threading.Thread(target=sleeper.wait)
    reaper.start()
    assert terminate_group(sleeper.pid, grace=5.0) is True
    reaper.join(timeout=10)
    assert sleeper.returncode == -15  # SIGTERM was enough
    assert terminate_group(sleeper.pid, grace=0) is True  # nothing left: still True
