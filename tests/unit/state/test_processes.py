"""Running-command records (kbd.state.processes) and ending process groups
(kbd.sandbox.trees), on real processes: a record is reported alive only while
its process is the same one."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.sandbox.trees import terminate_group
from kbd.state.processes import RunningCommands

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
    commands.add(SID, pid=sleeper.pid, generation=3, argv=["sleep", "60"], started_at=12.5, principal=None)
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
    commands.add(SID, pid=sleeper.pid, generation=0, argv=["sleep"], principal="alice")
    record = tmp_path / "procs" / SID / f"{sleeper.pid}.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "boot_id": "another-boot"}))
    assert commands.of_session(SID) == []  # same PID, but a record from another boot
    record.write_text(json.dumps(data))
    assert [(r.pid, r.principal) for r in commands.of_session(SID)] == [(sleeper.pid, "alice")]
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


def test_a_record_written_through_a_spare_is_the_same_record_and_uses_it_up(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """The daemon makes record files ahead of time (creating a file is slow on
    some disks): a record written through one reads back exactly as a created
    one, and the spare is gone; without spares the record is created."""
    spared, plain = RunningCommands(tmp_path / "a"), RunningCommands(tmp_path / "b")
    spared.make_spare()
    spare_dir = tmp_path / "a" / "procs" / ".spare"
    assert len(list(spare_dir.iterdir())) == 1
    for commands in (spared, plain):
        commands.add(SID, pid=sleeper.pid, generation=3, argv=["sleep", "60"], started_at=12.5, principal=None,
                     cgroup="b_" + "0" * 20 + ".1.00000000", broker=True)  # fmt: skip
    assert list(spare_dir.iterdir()) == []
    records = [
        json.loads((r / "procs" / SID / f"{sleeper.pid}.json").read_text())
        for r in (tmp_path / "a", tmp_path / "b")
    ]
    assert records[0] == records[1] and records[0]["broker"] is True
    [row] = spared.of_session(SID)
    assert (row.pid, row.cgroup) == (sleeper.pid, "b_" + "0" * 20 + ".1.00000000")
    assert (tmp_path / "a" / "procs" / SID / f"{sleeper.pid}.json").stat().st_mode & 0o777 == 0o640


def test_a_stub_cgroup_counts_only_in_a_record_that_says_broker(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    commands = RunningCommands(tmp_path)
    name = "b_" + "0" * 20 + ".1.00000000"
    commands.add(SID, pid=sleeper.pid, generation=3, argv=["sleep"], cgroup=name, principal=None)
    [row] = commands.of_session(SID)
    assert row.cgroup is None  # a b_ name in a record that does not say broker: ignored


def test_spares_of_gone_processes_and_of_this_one_are_dropped(tmp_path: Path) -> None:
    commands = RunningCommands(tmp_path)
    commands.make_spare()
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = tmp_path / "procs" / ".spare"
    (folder / f"{dead.pid}.abcdef").touch()
    (folder / "1.abcdef").touch()  # pid 1 is alive: its spares stay
    commands.drop_spares()
    assert sorted(p.name for p in folder.iterdir()) == ["1.abcdef"]
