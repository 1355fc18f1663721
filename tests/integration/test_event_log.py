"""The persisted event log (kbd/state/events.py; docs/daemon.md) on real
files, with real processes.

- Ids: ``<epoch>-<seq>``, consecutive, continued across a reopen; a deleted log
  (or one that is not a kbd log: a symlink, a FIFO) starts a new epoch, and an
  id of the old epoch then resyncs.
- Resuming: from the ring, from the files (rotated one included), else Resync
  (unknown epoch, future, too old, a gap, malformed); from the ring alone, which
  a prefilled log starts with the newest events of the files.
- Rotation at the size bound keeps the epoch and the order.
- Concurrency: appenders in several processes, with and without rotations,
  never interleave lines, never reuse or skip an id.
- Crashes: a writer killed in a loop leaves a readable log; a torn last line is
  skipped on read, and the next append (same process or after a restart) still
  writes a valid line after it.
- The files are 0640 whatever the umask; a held lock is Busy, not a race; an
  event off the allow-list writes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.core.events import EventRefused, Replay, Resync, parse_header, parse_id, parse_line
from kbd.errors import Busy
from kbd.state.events import LOG_NAME, ROTATED_NAME, EventLog

APPENDER = """
import sys
from pathlib import Path
from kbd.state.events import EventLog
state, tag, n, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
log = EventLog(Path(state), max_bytes=max_bytes, sync_interval=0.05)
print("ready", flush=True)
sys.stdin.read()  # the barrier: every appender starts when the test closes stdin
i = 0
while n < 0 or i < n:
    e = log.append("session.opened", workflow_id="wf_" + tag, session_id=f"s_{tag}_{i}")
    print(e.id, flush=n < 0)
    i += 1
log.close()
"""


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def log(state: Path) -> Iterator[EventLog]:
    with EventLog(state, sync_interval=0) as opened:
        yield opened


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def stored_events(path: Path) -> list[tuple[str, int]]:
    """(epoch, seq) of every valid event line in ``path``."""
    out = []
    for line in lines(path):
        event = parse_line(line) if line else None
        if event is not None:
            parsed = parse_id(event.id)
            assert parsed is not None
            out.append(parsed)
    return out


def changed(log: EventLog, n: int, *, prefix: str = "wf") -> list[str]:
    return [log.append("workflow.changed", workflow_id=f"{prefix}_{i}").id for i in range(n)]


def test_ids_files_and_modes(state: Path) -> None:
    old = os.umask(0o077)
    try:
        with EventLog(state, sync_interval=0) as log:
            ids = changed(log, 3)
            note = log.append(
                "note.written", workflow_id="wf_src", relpath="notes/a.md", by_workflow="wf_con"
            )
    finally:
        os.umask(old)
    epoch = log.epoch
    assert len(epoch) == 8 and ids == [f"{epoch}-1", f"{epoch}-2", f"{epoch}-3"] and note.id == f"{epoch}-4"
    assert stat.S_IMODE((state / LOG_NAME).stat().st_mode) == 0o640
    raw = lines(state / LOG_NAME)
    assert parse_header(raw[0]) == (epoch, 0) and raw[-1] == b""
    assert json.loads(raw[4]) == {
        "id": f"{epoch}-4",
        "type": "note.written",
        "at": note.at,
        "workflow_id": "wf_src",
        "relpath": "notes/a.md",
        "by_workflow": "wf_con",
        "_wf": "wf_src",
    }
    assert note.public() == {k: v for k, v in json.loads(raw[4]).items() if k != "_wf"}


def test_refused_events_write_nothing(log: EventLog, state: Path) -> None:
    changed(log, 1)
    before = (state / LOG_NAME).read_bytes()
    with pytest.raises(EventRefused, match="unknown event type"):
        log.append("file.contents", workflow_id="wf")
    with pytest.raises(EventRefused, match="field 'text' is not allowed"):
        log.append("workflow.changed", workflow_id="wf", text="the note's body")
    assert (state / LOG_NAME).read_bytes() == before
    assert log.last_id == f"{log.epoch}-1"


def test_since_from_the_ring_from_the_files_or_resync(state: Path) -> None:
    with EventLog(state, ring=3, sync_interval=0) as log:
        ids = changed(log, 10)
        epoch = log.epoch
        got = log.since(ids[7])
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[8:]  # the ring
        got = log.since(ids[1])
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[2:]  # the file
        assert log.since(ids[9]) == Replay(())
        assert log.since(f"{epoch}-0") == Replay(tuple(log.since(f"{epoch}-0").events))  # type: ignore[union-attr]
        assert len(log.since(f"{epoch}-0").events) == 10  # type: ignore[union-attr]
        assert log.since(f"{epoch}-11") == Resync("future")
        assert log.since("00000000-1" if epoch != "00000000" else "00000001-1") == Resync("unknown-epoch")
        assert log.since("not-an-id") == Resync("malformed-id")
    # Reopened: the same epoch, the seq continues, old ids still resume (from the file).
    with EventLog(state, sync_interval=0) as again:
        assert again.epoch == epoch and again.last_id == ids[-1]
        assert again.append("workflow.changed", workflow_id="wf_x").id == f"{epoch}-11"
        got = again.since(ids[4])
        assert isinstance(got, Replay) and [e.seq for e in got.events] == [6, 7, 8, 9, 10, 11]


def test_rotation_keeps_the_epoch_and_drops_only_the_oldest(state: Path) -> None:
    with EventLog(state, ring=1, max_bytes=4096, sync_interval=0) as log:
        ids: list[str] = []
        while not (state / ROTATED_NAME).exists():
            ids += changed(log, 1, prefix=f"a{len(ids)}")
        first_rotation = len(ids)
        base = parse_header(lines(state / LOG_NAME)[0])
        assert base == (log.epoch, first_rotation - 1)  # the new file starts after the last rotated event
        got = log.since(ids[0])
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[1:]
        while parse_header(lines(state / ROTATED_NAME)[0]) == (log.epoch, 0):  # a second rotation
            ids += changed(log, 1, prefix=f"b{len(ids)}")
        assert log.since(ids[0]) == Resync("too-old")
        kept = stored_events(state / ROTATED_NAME) + stored_events(state / LOG_NAME)
        assert [s for _, s in kept] == list(range(kept[0][1], len(ids) + 1))
        got = log.since(f"{log.epoch}-{kept[0][1] - 1}")
        assert isinstance(got, Replay) and [e.seq for e in got.events] == [s for _, s in kept]
        assert stat.S_IMODE((state / ROTATED_NAME).stat().st_mode) == 0o640


def test_the_ring_alone_and_a_ring_prefilled_from_the_files(state: Path) -> None:
    """What the daemon serves subscribers from (docs/daemon.md "The change feed"):
    ``since(files=False)`` answers from the ring or ``too-old``; with
    ``prefill`` the ring starts with the newest events already in the files,
    the rotated one included, and never reaches across a gap."""
    with EventLog(state, ring=5, max_bytes=4096, sync_interval=0) as log:
        ids: list[str] = []
        while not (state / ROTATED_NAME).exists():
            ids += changed(log, 1, prefix=f"a{len(ids)}")
        ids += changed(log, 1, prefix="b")  # the new file holds two; the ring reaches into the rotated one
        got = log.since(ids[-3], files=False)
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[-2:]
        assert log.since(ids[0], files=False) == Resync("too-old")
        got = log.since(ids[0])
        assert isinstance(got, Replay) and len(got.events) == len(ids) - 1  # the files reach back
        assert [e.id for e in log.recent(3)] == ids[-3:]
    with EventLog(state, ring=5, sync_interval=0) as cold:  # not prefilled: the ring starts empty
        assert cold.recent(5) == () and cold.since(ids[-2], files=False) == Resync("too-old")
    with EventLog(state, ring=5, sync_interval=0, prefill=True) as warm:
        assert [e.id for e in warm.recent(10)] == ids[-5:]
        got = warm.since(ids[-6], files=False)
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[-5:]
        assert warm.since(ids[-7], files=False) == Resync("too-old")
        new = warm.append("workflow.changed", workflow_id="wf_new")
        assert [e.id for e in warm.recent(2)] == [ids[-1], new.id]
    # A corrupted line: the prefilled ring starts after it (a replay stays contiguous).
    data = (state / LOG_NAME).read_bytes()
    line = lines(state / LOG_NAME)[2]
    (state / LOG_NAME).write_bytes(data.replace(line, b"x" * len(line)))
    with EventLog(state, ring=5, sync_interval=0, prefill=True) as gapped:
        assert [e.id for e in gapped.recent(10)] == [new.id]
        assert gapped.since(ids[-2], files=False) == Resync("too-old")


def test_a_deleted_log_starts_a_new_epoch(state: Path) -> None:
    with EventLog(state, sync_interval=0) as log, EventLog(state, sync_interval=0) as other:
        old_ids = changed(log, 3)
        old_epoch = log.epoch
        (state / LOG_NAME).unlink()
        # The open instance notices at its next append: no id of the old epoch is reused.
        new = log.append("workflow.changed", workflow_id="wf_n")
        assert log.epoch != old_epoch and new.id == f"{log.epoch}-1"
        assert log.since(old_ids[1]) == Resync("unknown-epoch")
        assert other.since(old_ids[1]) == Resync("unknown-epoch")  # a reader follows
        assert other.append("workflow.changed", workflow_id="wf_o").id == f"{log.epoch}-2"
    (state / LOG_NAME).unlink()
    with EventLog(state, sync_interval=0) as fresh:
        assert fresh.epoch not in (old_epoch, log.epoch) and fresh.last_id == f"{fresh.epoch}-0"


def test_an_old_copy_put_back_is_not_continued(state: Path) -> None:
    with EventLog(state, sync_interval=0) as log:
        changed(log, 3)
        copy = (state / LOG_NAME).read_bytes()
        changed(log, 3)
        epoch = log.epoch
        (state / "old").write_bytes(copy)
        os.rename(state / "old", state / LOG_NAME)
        # This instance issued up to 6: continuing the copy at 4 would issue 4..6 twice.
        assert not log.append("workflow.changed", workflow_id="wf").id.startswith(epoch)


def test_what_is_not_a_log_is_replaced_never_followed(tmp_path: Path, state: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"precious\n")
    state.mkdir(mode=0o750)
    (state / LOG_NAME).symlink_to(target)
    with EventLog(state, sync_interval=0) as log:
        changed(log, 1)
    assert target.read_bytes() == b"precious\n"
    assert stat.S_ISREG((state / LOG_NAME).lstat().st_mode)
    (state / LOG_NAME).unlink()
    os.mkfifo(state / LOG_NAME)  # opening a FIFO must not hang the daemon
    with EventLog(state, sync_interval=0) as log:
        assert log.append("workflow.changed", workflow_id="wf").id == f"{log.epoch}-1"
    (state / LOG_NAME).write_bytes(b"hand-written notes\n")  # no header: not a kbd log
    with EventLog(state, sync_interval=0) as log:
        assert log.last_id == f"{log.epoch}-0"


def _truncate_inside_last_line(path: Path, keep: int) -> bytes:
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    torn = data[: start + keep]
    path.write_bytes(torn)
    return data[start : start + keep]


@pytest.mark.parametrize("keep", [1, 20, -2, -1])
def test_a_torn_last_line_is_skipped_and_the_next_append_is_valid(state: Path, keep: int) -> None:
    """The on-disk state a crash mid-write leaves (a last line cut anywhere, even
    just before its newline), seen after a restart and by a running instance."""
    with EventLog(state, sync_interval=0) as running:
        ids = changed(running, 5)
        epoch = running.epoch
        last_len = len(lines(state / LOG_NAME)[-2])
        fragment = _truncate_inside_last_line(state / LOG_NAME, keep if keep > 0 else last_len + 1 + keep)
        assert fragment and b"\n" not in fragment
        with EventLog(state, sync_interval=0) as restarted:
            got = restarted.since(f"{epoch}-0")
            assert isinstance(got, Replay) and [e.id for e in got.events] == ids[:4]
            again = restarted.append("workflow.changed", workflow_id="wf_after")
            assert again.id == ids[4]  # the torn seq was never readable: reused, not skipped
        raw = lines(state / LOG_NAME)
        assert raw[-1] == b"" and parse_line(raw[-2]) == again
        assert [s for _, s in stored_events(state / LOG_NAME)] == [1, 2, 3, 4, 5]
        # The running instance (which had written seq 5 itself) follows the repaired file.
        nxt = running.append("workflow.changed", workflow_id="wf_next")
        assert nxt.id == f"{epoch}-6" and parse_line(lines(state / LOG_NAME)[-2]) == nxt


def test_a_torn_line_left_by_another_process_is_closed_by_the_next_append(log: EventLog, state: Path) -> None:
    changed(log, 2)
    with open(state / LOG_NAME, "ab") as fh:  # a writer that died after half a line
        fh.write(b'{"id":"' + log.epoch.encode() + b'-3","type":"workflow.cha')
    event = log.append("workflow.changed", workflow_id="wf")
    assert event.seq == 3
    raw = lines(state / LOG_NAME)
    assert parse_line(raw[-3]) is None and parse_line(raw[-2]) == event


def test_a_corrupted_middle_line_is_a_gap(state: Path) -> None:
    with EventLog(state, sync_interval=0) as log:
        ids = changed(log, 5)
    data = (state / LOG_NAME).read_bytes()
    line = lines(state / LOG_NAME)[3]
    (state / LOG_NAME).write_bytes(data.replace(line, b"x" * len(line)))
    with EventLog(state, sync_interval=0) as log:
        assert log.since(ids[0]) == Resync("gap")
        got = log.since(ids[2])
        assert isinstance(got, Replay) and [e.id for e in got.events] == ids[3:]


def _appenders(state: Path, n: int, max_bytes: int, tags: str) -> list[list[str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", APPENDER, str(state), tag, str(n), str(max_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for tag in tags
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    outs = []
    for p in procs:
        assert p.stdout is not None
        outs.append(p.stdout.read().decode().split())
        p.stdout.close()
        assert p.wait(timeout=120) == 0
    return outs


def test_concurrent_processes_never_interleave_or_reuse_ids(state: Path) -> None:
    with EventLog(state, sync_interval=0) as reader:
        outs = _appenders(state, 150, 8 << 20, "abc")
        every = [i for out in outs for i in out]
        assert len(every) == len(set(every)) == 450
        raw = lines(state / LOG_NAME)
        assert raw[-1] == b"" and len(raw) == 452  # header + 450 lines + the final empty split
        events = [parse_line(line) for line in raw[1:-1]]
        assert all(e is not None for e in events)
        assert [e.seq for e in events if e] == list(range(1, 451))
        for tag, out in zip("abc", outs, strict=True):
            mine = [e for e in events if e and e.workflow_id == f"wf_{tag}"]
            assert [e.id for e in mine] == out  # each process's events in its own order
            assert [e.fields["session_id"] for e in mine] == [f"s_{tag}_{i}" for i in range(150)]
        # A process that shares the log (opened before they wrote) sees their events, in order.
        got = reader.since(f"{reader.epoch}-0")
        assert isinstance(got, Replay) and [e.seq for e in got.events] == list(range(1, 451))
        got = reader.since(f"{reader.epoch}-400")
        assert isinstance(got, Replay) and [e.seq for e in got.events] == list(range(401, 451))


def test_concurrent_processes_across_rotations(state: Path) -> None:
    outs = _appenders(state, 120, 4096, "ab")
    every = sorted(parse_id(i)[1] for out in outs for i in out)  # type: ignore[index]
    assert every == list(range(1, 241))  # every id issued exactly once, no gap
    kept = stored_events(state / ROTATED_NAME) + stored_events(state / LOG_NAME)
    assert len({e for e, _ in kept}) == 1
    assert [s for _, s in kept] == list(range(kept[0][1], 241))


def test_a_writer_killed_mid_loop_leaves_a_readable_log(state: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(state), "k", "-1", str(8 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdin.close()
    for _ in range(50):  # it is appending
        assert proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    with EventLog(state, sync_interval=0) as log:
        seqs = [s for _, s in stored_events(state / LOG_NAME)]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 50
        event = log.append("workflow.changed", workflow_id="wf_after")
        assert event.seq == seqs[-1] + 1 and parse_line(lines(state / LOG_NAME)[-2]) == event


def test_a_held_lock_is_busy_and_nothing_is_written(log: EventLog, state: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from kbd.fs.locks import held\n"
            f"with held(Path({str(state)!r}), 'events', 'log', timeout=5, what='x'):\n"
            "    print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline() == b"held\n"
        before = (state / LOG_NAME).read_bytes()
        slow = EventLog.__new__(EventLog)
        slow.__dict__.update(log.__dict__)
        slow._lock_timeout = 0.2
        with pytest.raises(Busy, match="the event log is locked by another kbd process"):
            slow.append("workflow.changed", workflow_id="wf")
        assert (state / LOG_NAME).read_bytes() == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert log.append("workflow.changed", workflow_id="wf").seq == 1


def test_every_cut_of_the_last_line_is_torn_never_half_read(state: Path) -> None:
    """Wherever a crash cuts the last line (its newline included), reading
    skips it, and the next append leaves exactly seqs 1..5, each once, all valid."""
    with EventLog(state, sync_interval=0) as log:
        changed(log, 5)
        epoch = log.epoch
    whole = (state / LOG_NAME).read_bytes()
    start = whole.rstrip(b"\n").rfind(b"\n") + 1
    for cut in range(start + 1, len(whole)):
        (state / LOG_NAME).write_bytes(whole[:cut])
        with EventLog(state, sync_interval=0.05) as log:
            got = log.since(f"{epoch}-0")
            assert isinstance(got, Replay) and [e.seq for e in got.events] == [1, 2, 3, 4], cut
            assert log.append("workflow.changed", workflow_id="wf_after").id == f"{epoch}-5"
        raw = lines(state / LOG_NAME)
        assert [s for _, s in stored_events(state / LOG_NAME)] == [1, 2, 3, 4, 5], cut
        assert raw[-1] == b"" and parse_line(raw[-2]) is not None and raw[-3].endswith(b" (torn)")


def test_a_batch_is_checked_whole_and_written_in_order(log: EventLog, state: Path) -> None:
    before = (state / LOG_NAME).read_bytes()
    with pytest.raises(EventRefused, match="field 'body' is not allowed"):
        log.append_many([("workflow.changed", "wf_a", {}), ("workflow.changed", "wf_b", {"body": "x"})])
    assert (state / LOG_NAME).read_bytes() == before
    batch = log.append_many(
        [
            ("workflow.changed", "wf_a", {}),
            ("sources.changed", "wf_a", {}),
            ("resync", None, {"reason": "overflow"}),
        ]
    )
    assert [e.id for e in batch] == [f"{log.epoch}-{s}" for s in (1, 2, 3)]
    assert [parse_line(line) for line in lines(state / LOG_NAME)[1:-1]] == batch
