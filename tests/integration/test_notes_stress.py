"""Concurrent note writers with REAL processes (docs/notes.md, docs/performance.md "8 processes x 200
note writes into one notes/: 0 lost, 0 torn").

* 8 Python processes x 200 :func:`kbd.service.notes.write` calls into one source's
  ``notes/`` (distinct names per writer plus rewrites of one shared name);
* 8 concurrent ``kbd exec SID -- sh -c '<loop>'`` commands of 8 consumer
  workflows that all may write into that ``notes/``; each rewrites
  ``shared.md`` in several appends, so without the per-``notes/`` mutex the
  blocks would interleave;
* writers killed with SIGKILL mid-write (a ``kbd.service.notes.write`` stopped inside the
  temp-file write, ones killed at a random moment, and a ``kbd exec`` holding the
  mutex): no partial file, temp files swept by the next write, no stuck lock;
* an index reader racing a process that rewrites ``notes/_index.json``.

Processes are synchronised with pipes (ready/go lines) and ready-files, never
with sleeps.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from kbd.errors import KbdError
from kbd.fs.confined import pin_dir
from kbd.fs.notes import read_index
from kbd.service import notes as note_ops
from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from kbd.state import audit
from tests.features import backends
from tests.helpers import OPERATOR, KbRoot

WRITERS = 8
WRITES = 200
SHARED_EVERY = 4  # every 4th write of a Python writer goes to shared.md
LOCK_TIMEOUT = 60.0
TMP_NAME = re.compile(r"^\.kbd-[0-9a-f]{16}\.tmp$")
PROC_TIMEOUT = 60.0


# -- helpers ------------------------------------------------------------------------------------


def set_lock_timeout(kb: KbRoot, seconds: float) -> None:
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text()
    assert "timeout_seconds: 10" in text
    cfg.write_text(text.replace("timeout_seconds: 10", f"timeout_seconds: {seconds:g}"))


def split_note(text: str) -> tuple[dict[str, Any], str]:
    """(parsed frontmatter, body) of a note written by kbd; fails on anything torn."""
    assert text.startswith("---\n"), text[:120]
    end = text.index("\n---\n", 3)
    doc = yaml.safe_load(text[4:end])
    assert isinstance(doc, dict), text[:200]
    assert set(doc) >= {"contributed_by_workflow", "contributed_by_session", "contributed_at"}, doc
    return doc, text[end + 5 :]


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if TMP_NAME.match(p.name)]


def read_line(proc: subprocess.Popen[bytes], *, timeout: float = PROC_TIMEOUT) -> str:
    """One line from ``proc``'s (unbuffered) stdout, or a failure naming its stderr."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"process {proc.pid} printed nothing for {timeout}s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=timeout)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""
        raise AssertionError(f"process {proc.pid} exited {proc.returncode} early: {err}")
    return line.decode().rstrip("\n")


def wait_eof(proc: subprocess.Popen[bytes], *, timeout: float = PROC_TIMEOUT) -> bytes:
    """Everything left on ``proc``'s stdout up to EOF, i.e. until every process
    holding the pipe (including sandboxed grandchildren) has exited."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("the pipe stayed open: some writer process is still alive")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@contextmanager
def spawned(argvs: list[list[str]], **kwargs: Any) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start processes with piped, unbuffered stdio; kill (by pid) whatever is left at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv in argvs:
            procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    bufsize=0,
                    **kwargs,
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                if kwargs.get("start_new_session"):
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            p.wait(timeout=PROC_TIMEOUT)
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


def send(proc: subprocess.Popen[bytes], line: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}


@dataclasses.dataclass
class Source:
    kb: KbRoot
    src: Path

    @property
    def notes(self) -> Path:
        return self.src / "knowledgebase" / "notes"


def build(kb: KbRoot, consumers: list[str]) -> Source:
    src = kb.workflow(
        "src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": consumers}
    )
    for c in consumers:
        kb.workflow(
            c,
            access={"owners": ["alice"]},
            sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
        )
    return Source(kb, src)


def open_session(host: Root, wid: str) -> str:
    plan = session_ops.open_session(
        RootSessions(host), wid, actor=host.actor("alice"), kind="execution", kb_access="read-write"
    )
    sid = str(plan.session_id)
    return sid


def quick_host(kb: KbRoot, timeout: float) -> Root:
    """A host whose notes mutex gives up after ``timeout`` seconds."""
    host = kb.host()
    host.config = dataclasses.replace(host.config, lock_timeout=timeout)
    return host


# -- 1. 8 processes x 200 confined writes ------------------------------------------------------

WRITER = r"""
import json, sys, time
from pathlib import Path
from kbd.service import notes as note_ops
from kbd.service.root import Root
from kbd.core.principals import LocalOperator
from kbd.service.sessions import RootSessions
OPERATOR = LocalOperator.current()

job = json.loads(sys.stdin.readline())
sessions = RootSessions(Root(Path(job["root"])))
sessions.plan(job["sid"], actor=OPERATOR)  # warm the caches before the race starts
print("ready", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(3)
t0 = time.time()
for name, text in job["writes"]:
    note_ops.write(sessions, job["sid"], "src", name, text.encode(), actor=OPERATOR)
print(json.dumps({"start": t0, "end": time.time()}), flush=True)
"""


def distinct_body(w: int, i: int) -> str:
    return f"# Note {i} of writer {w}\n\n" + f"writer {w} fact {i}: " + "lorem ipsum dolor " * 12 + "\n"


def shared_block(w: int) -> str:
    return "".join(f"writer {w} shared line {k:03d} " + "abcdefgh" * 7 + "\n" for k in range(64))


def writer_plan(w: int) -> list[tuple[str, str]]:
    return [
        ("shared.md", shared_block(w))
        if i % SHARED_EVERY == SHARED_EVERY - 1
        else (f"w{w}/n{i:03d}.md", distinct_body(w, i))
        for i in range(WRITES)
    ]


# Eight real writers contending for one mutex: about a minute alone on 2 cores,
# and the parallel suite (README "Development") shares those cores with other
# workers, so the per-test limit (and the wait for the writers' reports) is
# raised; the writers' own lock timeout is not.
@pytest.mark.timeout(360)
def test_eight_processes_write_notes_concurrently_without_loss(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    set_lock_timeout(kb, LOCK_TIMEOUT)
    host = kb.host()
    sids = [open_session(host, "con") for _ in range(WRITERS)]
    assert len(set(sids)) == WRITERS

    with spawned([[sys.executable, "-c", WRITER]] * WRITERS) as procs:
        for w, p in enumerate(procs):
            send(p, orjson.dumps({"root": str(kb.root), "sid": sids[w], "writes": writer_plan(w)}))
        for p in procs:
            assert read_line(p) == "ready"
        for p in procs:
            send(p, b"go")
        spans = [orjson.loads(read_line(p, timeout=300)) for p in procs]
        for p in procs:
            assert p.wait(timeout=PROC_TIMEOUT) == 0, p.stderr.read() if p.stderr else b""

    # The writers really overlapped in time.
    assert max(s["start"] for s in spans) < min(s["end"] for s in spans)

    notes = source.notes
    expected = {"fact.md", "_index.json", "shared.md"}
    for w in range(WRITERS):
        for name, body in writer_plan(w):
            if name == "shared.md":
                continue
            expected.add(name)
            doc, got = split_note((notes / name).read_text())
            assert got == body, f"{name} is torn or lost"
            assert (doc["contributed_by_workflow"], doc["contributed_by_session"]) == ("con", sids[w])
    found = {str(p.relative_to(notes)) for p in notes.rglob("*") if p.is_file()}
    assert found == expected, sorted(found ^ expected)[:20]
    assert not temp_files(notes)

    doc, shared = split_note((notes / "shared.md").read_text())
    owners = [w for w in range(WRITERS) if shared == shared_block(w)]
    assert len(owners) == 1, "shared.md is not exactly one writer's complete block"
    assert doc["contributed_by_session"] == sids[owners[0]], "frontmatter of one writer, body of another"

    written = [e for e in audit.read(host.config.state_dir) if e["event"] == "note_written"]
    refused = [e for e in audit.read(host.config.state_dir) if e["event"] == "note_refused"]
    assert len(written) == WRITERS * WRITES and not refused
    assert {e["session"] for e in written} == set(sids)


# -- 2. the same through sandboxed shell commands -----------------------------------------------

FILL = "0123456789abcdef" * 30  # 480 bytes a chunk, 8 chunks a block
CHUNKS = 8

SHELL_LOOP = r"""
set -eu
N="$WORKFLOW_KB_SRC/notes"
W={w}
F={fill}
echo "start $(date +%s%N)"
i=0
while [ "$i" -lt {writes} ]; do
  printf 'writer %s note %s\n' "$W" "$i" > "$N/x-$W-$i.md"
  : > "$N/shared.md"
  k=0
  while [ "$k" -lt {chunks} ]; do
    printf 'writer %s chunk %s %s\n' "$W" "$k" "$F" >> "$N/shared.md"
    k=$((k + 1))
  done
  i=$((i + 1))
done
echo "end $(date +%s%N)"
"""


def shell_block(w: int) -> str:
    return "".join(f"writer {w} chunk {k} {FILL}\n" for k in range(CHUNKS))


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
# Eight real writers contending for one mutex: about a minute alone on 2 cores,
# and the parallel suite (README "Development") shares those cores with other
# workers, so the per-test limit (and the wait for the writers' reports) is
# raised; the writers' own lock timeout is not.
@pytest.mark.timeout(360)
def test_eight_sandboxed_shell_writers_are_serialised(kb: KbRoot) -> None:
    consumers = [f"c{w}" for w in range(WRITERS)]
    source = build(kb, consumers)
    set_lock_timeout(kb, LOCK_TIMEOUT)
    host = kb.host()
    sids = [open_session(host, c) for c in consumers]
    argvs = [
        [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c",
         SHELL_LOOP.format(w=w, fill=FILL, writes=WRITES, chunks=CHUNKS)]
        for w, sid in enumerate(sids)
    ]  # fmt: skip
    with spawned(argvs, env=cli_env()) as procs:
        outs = [p.communicate(timeout=180) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err.decode(errors="replace")

    # Each command wrote its own staging layer (docs/notes.md "Staged contributions"),
    # at the same time as the others; each changed path was committed at its
    # exit through the write path, one file at a time under the notes mutex.
    notes = source.notes
    for w in range(WRITERS):
        for i in range(WRITES):
            assert split_note((notes / f"x-{w}-{i}.md").read_text())[1] == f"writer {w} note {i}\n", (
                f"x-{w}-{i}.md lost or torn"
            )
    doc, shared = split_note((notes / "shared.md").read_text())
    owners = [w for w in range(WRITERS) if shared == shell_block(w)]
    assert len(owners) == 1, "shared.md is not exactly one writer's complete block: " + shared[:200]
    assert doc["contributed_by_session"] == sids[owners[0]], "frontmatter of one writer, body of another"
    # Nothing lost: every writer's complete block is a version in the note's history.
    from kbd.state.history import store_for

    store = store_for(host.config)
    blocks = {
        split_note(store.blob("src", "notes/shared.md", e.version).decode())[1]  # type: ignore[union-attr]
        for e in store.entries("src", "notes/shared.md")
    }
    assert {shell_block(w) for w in range(WRITERS)} <= blocks
    assert len(os.listdir(notes)) == WRITERS * WRITES + 3  # + fact.md, _index.json, shared.md
    assert (notes / "_index.json").read_bytes() == b'{"notes": ["fact.md"]}\n'


# -- 3. writers killed with SIGKILL ---------------------------------------------------------------

STALLING_WRITER = r"""
import json, os, sys
from pathlib import Path
from kbd.service import notes as note_ops
from kbd.service.root import Root
from kbd.core.principals import LocalOperator
from kbd.service.sessions import RootSessions
OPERATOR = LocalOperator.current()

job = json.loads(sys.stdin.readline())
sessions = RootSessions(Root(Path(job["root"])))
note_ops.write(sessions, job["sid"], "src", job["name"], job["first"].encode(), actor=OPERATOR)
real_write = os.write

def stalling_write(fd, data):
    # The note's temp file: write half of it, report, and wait to be killed.
    if len(data) >= job["stall_at"]:
        n = real_write(fd, bytes(data[: len(data) // 2]))
        print("stalled", flush=True)
        sys.stdin.readline()
        return n
    return real_write(fd, data)

os.write = stalling_write
note_ops.write(sessions, job["sid"], "src", job["name"], job["second"].encode(), actor=OPERATOR)
print("finished", flush=True)
"""


def big_body(tag: str, size: int = 300_000) -> str:
    line = f"{tag} " + "payload " * 15 + "\n"
    return line * (size // len(line))


def test_writer_killed_inside_the_temp_write_leaves_no_partial_file_and_no_stuck_lock(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    host = kb.host()
    sid = open_session(host, "con")
    first, second, third = big_body("first"), big_body("second"), big_body("third")
    target = source.notes / "big.md"
    job = {"root": str(kb.root), "sid": sid, "name": "big.md", "first": first, "second": second,
           "stall_at": 100_000}  # fmt: skip
    with spawned([[sys.executable, "-c", STALLING_WRITER]]) as (proc,):
        send(proc, orjson.dumps(job))
        assert read_line(proc) == "stalled"
        # Mid-write: the old note is whole, the new one is a partial temp file beside it.
        assert split_note(target.read_text())[1] == first
        (tmp,) = temp_files(source.notes)
        assert 0 < tmp.stat().st_size < len(second)
        # The writer holds the mutex: another writer waits, then gets Busy naming the holder.
        quick = quick_host(kb, 0.3)
        with pytest.raises(KbdError) as info:
            note_ops.write(RootSessions(quick), sid, "src", "other.md", b"other\n", actor=OPERATOR)
        assert (info.value.code, info.value.exit_code) == ("busy", 75)
        # It names the holder's workflow, never its session, pid or host (those stay in
        # the holder file for operators).
        assert "workflow con" in info.value.message and sid not in info.value.message
        assert f"pid {proc.pid}" not in info.value.message
        assert not (source.notes / "other.md").exists()

        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=PROC_TIMEOUT) == -signal.SIGKILL

    assert split_note(target.read_text())[1] == first, "a killed writer left a partial note"
    assert len(temp_files(source.notes)) == 1  # its temp file stays until the next write
    t0 = time.monotonic()
    note_ops.write(RootSessions(kb.host()), sid, "src", "big.md", third.encode(), actor=OPERATOR)
    assert time.monotonic() - t0 < host.config.lock_timeout, "the lock stayed stuck"
    assert split_note(target.read_text())[1] == third
    assert not temp_files(source.notes), "the next write did not sweep the dead writer's temp file"


LOOPING_WRITER = r"""
import json, sys
from pathlib import Path
from kbd.service import notes as note_ops
from kbd.service.root import Root
from kbd.core.principals import LocalOperator
from kbd.service.sessions import RootSessions
OPERATOR = LocalOperator.current()

job = json.loads(sys.stdin.readline())
sessions = RootSessions(Root(Path(job["root"])))
k = 0
while True:
    print(k, flush=True)
    note_ops.write(sessions, job["sid"], "src", job["name"], job["versions"][k % len(job["versions"])].encode(), actor=OPERATOR)
    k += 1
"""


def test_writers_killed_at_random_moments_leave_whole_notes_and_free_locks(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    host = kb.host()
    sid = open_session(host, "con")
    sessions = RootSessions(host)
    versions = [big_body(f"v{j}", 400_000) for j in range(3)]
    after = "after the kill\n"
    target = source.notes / "loop.md"
    rng = random.Random(0xC0FFEE)  # noqa: S311 - a reproducible kill schedule, not a secret
    for _ in range(4):
        with spawned([[sys.executable, "-c", LOOPING_WRITER]]) as (proc,):
            send(
                proc,
                orjson.dumps({"root": str(kb.root), "sid": sid, "name": "loop.md", "versions": versions}),
            )
            # Kill right after the writer announces its k-th write: somewhere inside it.
            stop_at = rng.randrange(1, 6)
            while int(read_line(proc)) < stop_at:
                pass
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=PROC_TIMEOUT) == -signal.SIGKILL
        if target.exists():
            doc, body = split_note(target.read_text())
            assert body in versions, "a killed writer left a partial note"
            assert doc["contributed_by_session"] == sid
        t0 = time.monotonic()
        note_ops.write(sessions, sid, "src", "loop.md", after.encode(), actor=OPERATOR)
        assert time.monotonic() - t0 < host.config.lock_timeout
        assert split_note(target.read_text())[1] == after
        assert not temp_files(source.notes)


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
def test_kbd_exec_killed_while_writing_commits_nothing_and_holds_no_lock(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    host = kb.host()
    sid = open_session(host, "con")
    script = (
        'N="$WORKFLOW_KB_SRC/notes"; B="$(printf "%0800d" 0)"; echo ready; '
        'while :; do printf "%s\\n" "$B" > "$N/looping.md"; printf "%s\\n" "$B" >> "$N/looping.md"; done'
    )
    argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c", script]
    with spawned([argv], env=cli_env(), start_new_session=True) as (proc,):
        assert read_line(proc) == "ready"
        # A running command holds no notes mutex (docs/notes.md "Staged contributions"):
        # a note write goes through at once.
        note_ops.write(RootSessions(quick_host(kb, 0.3)), sid, "src", "meanwhile.md", b"x\n", actor=OPERATOR)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=PROC_TIMEOUT) == -signal.SIGKILL
        # EOF on the pipe: bwrap and the sandboxed shell died with kbd exec.
        wait_eof(proc)
    t0 = time.monotonic()
    note_ops.write(RootSessions(kb.host()), sid, "src", "after.md", b"after\n", actor=OPERATOR)
    assert time.monotonic() - t0 < host.config.lock_timeout, "a lock stayed stuck"
    assert split_note((source.notes / "after.md").read_text())[1] == "after\n"
    # The killed command's staged writes were never committed, and its staging
    # layer goes with the next staged command.
    assert not (source.notes / "looping.md").exists()
    r = kb.cli("exec", sid, "--", "true")
    assert r.code == 0, r.err
    assert not any((kb.root / "state" / "staging").iterdir())


# -- 4. index readers racing a rewrite --------------------------------------------------------------

REWRITER = r"""
import json, os, sys
notes, stop, atomic = sys.argv[1], sys.argv[2], sys.argv[3] == "atomic"
dfd = os.open(notes, os.O_RDONLY | os.O_DIRECTORY)
k = 0
while True:
    doc = {"generation": k, "notes": [f"note-{j}.md" for j in range(k % 40)], "pad": "x" * (k * 7 % 997)}
    data = json.dumps(doc).encode()
    if atomic:
        fd = os.open("index.new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dfd)
        os.write(fd, data)
        os.close(fd)
        os.replace("index.new", "_index.json", src_dir_fd=dfd, dst_dir_fd=dfd)
    else:
        fd = os.open("_index.json", os.O_WRONLY | os.O_TRUNC, dir_fd=dfd)
        os.write(fd, data[: len(data) // 2])
        os.write(fd, data[len(data) // 2 :])
        os.close(fd)
    if k == 0:
        print("ready", flush=True)
    k += 1
    if k % 8 == 0 and os.path.exists(stop):
        break
print(k, flush=True)
"""


def check_index(data: bytes) -> int:
    """The generation of a complete index the rewriter wrote; fails on anything else."""
    assert data.strip(), "an empty index was reported"
    doc = orjson.loads(data)
    assert isinstance(doc, dict) and set(doc) == {"generation", "notes", "pad"}, data[:200]
    k = doc["generation"]
    assert isinstance(k, int)
    assert doc["notes"] == [f"note-{j}.md" for j in range(k % 40)] and doc["pad"] == "x" * (k * 7 % 997)
    return k


@contextmanager
def rewriting(source: Source, mode: str) -> Iterator[subprocess.Popen[bytes]]:
    stop = source.kb.root / f"stop-{mode}"
    with spawned([[sys.executable, "-c", REWRITER, str(source.notes), str(stop), mode]]) as (proc,):
        assert read_line(proc) == "ready"
        yield proc
        stop.write_text("stop")
        assert int(read_line(proc)) > 0
        assert proc.wait(timeout=PROC_TIMEOUT) == 0


def test_index_reader_never_sees_an_empty_or_partial_index_during_atomic_rewrites(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    generations: list[int] = []
    with rewriting(source, "atomic"), pin_dir(source.src / "knowledgebase") as kbfd:
        # At least 2,000 reads, and as many more as it takes to have overlapped 50 rewrites.
        deadline = time.monotonic() + PROC_TIMEOUT
        while len(generations) < 2000 or len(set(generations)) < 50:
            assert time.monotonic() < deadline, "the reader did not race the rewriter"
            generations.append(check_index(read_index(kbfd.fd, limit=2 * 1024 * 1024)))
        for _ in range(3):
            r = kb.cli("read", "con", "src", "notes/_index.json", "--as", "alice")
            assert r.code == 0, r.err
            generations.append(check_index(r.out.encode()))


def test_index_reader_retries_or_errors_during_non_atomic_rewrites(kb: KbRoot) -> None:
    source = build(kb, ["con"])
    errors = 0
    generations: list[int] = []
    with rewriting(source, "in-place"), pin_dir(source.src / "knowledgebase") as kbfd:
        # Each read either returns a complete index or raises; never anything in between.
        deadline = time.monotonic() + PROC_TIMEOUT
        while len(generations) + errors < 200 or len(set(generations)) < 5:
            assert time.monotonic() < deadline, "the reader did not race the rewriter"
            try:
                data = read_index(kbfd.fd, limit=2 * 1024 * 1024)
            except KbdError as err:
                assert (err.code, err.exit_code) == ("index-unreadable", 75)
                errors += 1
            else:
                generations.append(check_index(data))
    assert generations, "no read ever succeeded"


# -- 5. the notes mutex and a running command, under every sandbox backend -----------------------

BACKENDS = {
    "bwrap": {"backend: auto": "backend: bwrap"},
    "landlock": {
        "backend: auto": "backend: landlock",
        "unsafe_landlock_writes: false": "unsafe_landlock_writes: true",
    },
}


@pytest.mark.parametrize("backend", backends(*sorted(BACKENDS)))
def test_a_write_plan_and_the_notes_mutex_under_every_backend(kb: KbRoot, backend: str) -> None:
    source = build(kb, ["con"])
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text()
    for old, new in BACKENDS[backend].items():
        assert old in text
        text = text.replace(old, new)
    cfg.write_text(text)
    host = kb.host()
    sid = open_session(host, "con")
    script = 'echo ready; read line; echo done > "$WORKFLOW_KB_SRC/notes/from-exec.md"'
    argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c", script]
    with spawned([argv], env=cli_env(), start_new_session=True) as (proc,):
        assert read_line(proc) == "ready"
        # bubblewrap stages the command's writes (docs/notes.md "Staged contributions"):
        # no mutex is held while it runs, and a confined write goes through. The
        # Landlock-only backend (unsafe_landlock_writes) writes the real notes/,
        # so it holds the mutex for the whole command: the write must wait.
        try:
            note_ops.write(
                RootSessions(quick_host(kb, 0.3)), sid, "src", "meanwhile.md", b"meanwhile\n", actor=OPERATOR
            )
        except KbdError as err:
            assert backend == "landlock", f"kbd exec ({backend}) held the notes mutex while its command ran"
            assert err.code == "busy" and "workflow con" in err.message
        else:
            assert backend == "bwrap", (
                f"kbd exec ({backend}) ran a notes/ write plan without holding the mutex"
            )
        finally:
            send(proc, b"go")
            assert proc.wait(timeout=PROC_TIMEOUT) == 0
    body = split_note((source.notes / "from-exec.md").read_text())[1] if backend == "bwrap" else None
    assert (body or (source.notes / "from-exec.md").read_text()) == "done\n"
    assert (source.notes / "meanwhile.md").exists() == (backend == "bwrap")
    note_ops.write(RootSessions(kb.host()), sid, "src", "after.md", b"after\n", actor=OPERATOR)
