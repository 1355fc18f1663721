"""Contributed-note writes under contention (docs/performance.md: "8 processes x 200 note
writes into one notes/ | 0 lost, 0 torn, throughput reported | upstream: no
serialisation at all").

8 writer processes (``sys.executable -c``) each call the confined entry point
:func:`kbd.service.notes.write` 200 times into the same source ``notes/``, all
released at once by a "go" line on their stdin after they have warmed up. Every
4th write rewrites one shared name (``shared.md``, a writer-unique 4.5 KB block);
the others are distinct names. Afterwards every note is read back: a lost note
(missing) or a torn one (content not exactly what one writer wrote, frontmatter
that does not parse) is counted and reported.

Lock wait, method: inside each writer process ``kbd.service.notes.notes_lock``
is replaced by a thin wrapper (``commit`` looks the name up in its module at
call time) that takes ``time.perf_counter()`` on entry and again when the real
``notes_lock`` yields, i.e. once the mutex is held. The difference is the time
spent getting the notes mutex: the ``fstat`` of ``notes/``, opening the lock
file and filelock's acquisition (a non-blocking ``flock`` retried every
``poll_interval``, 50 ms by default) — with no contention it is the bare cost
of taking a free lock. The wrapper also records how long the mutex is then held
(sweep + temp write + fsync + rename + folder fsync). Throughput is
1,600 / (last writer's end - first writer's start), taken from the writers' own
clocks; the wall time is measured by this process from "go" to the last result.
A single uncontended writer (1 x 200) is measured first as a baseline.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

from kbd.service import sessions as session_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import KbRoot  # noqa: E402

WRITERS = 8
WRITES = 200
SHARED_EVERY = 4

WRITER = r"""
import contextlib, json, sys, time
from pathlib import Path
import kbd.service.notes as notes
from kbd.service.root import Root
from kbd.core.principals import LocalOperator
from kbd.service.sessions import RootSessions
OPERATOR = LocalOperator.current()

real_lock = notes.notes_lock
waits, holds, latencies = [], [], []

@contextlib.contextmanager
def timed_lock(*args, **kwargs):
    t0 = time.perf_counter()
    with real_lock(*args, **kwargs):
        t1 = time.perf_counter()
        waits.append(t1 - t0)
        try:
            yield
        finally:
            holds.append(time.perf_counter() - t1)

notes.notes_lock = timed_lock
job = json.loads(sys.stdin.readline())
sessions = RootSessions(Root(Path(job["root"])))
sessions.plan(job["sid"], actor=OPERATOR)  # warm caches before the race
print("ready", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(3)
start = time.time()
for name, text in job["writes"]:
    t = time.perf_counter()
    notes.write(sessions, job["sid"], "src", name, text.encode(), actor=OPERATOR)
    latencies.append(time.perf_counter() - t)
print(json.dumps({"start": start, "end": time.time(), "waits": waits, "holds": holds,
                  "latencies": latencies}), flush=True)
"""


def distinct_body(w: int, i: int) -> str:
    return f"# Note {i} of writer {w}\n\nwriter {w} fact {i}: " + "lorem ipsum dolor " * 12 + "\n"


def shared_block(w: int) -> str:
    return "".join(f"writer {w} shared line {k:03d} " + "abcdefgh" * 7 + "\n" for k in range(64))


def writer_plan(w: int) -> list[tuple[str, str]]:
    return [
        ("shared.md", shared_block(w))
        if i % SHARED_EVERY == SHARED_EVERY - 1
        else (f"w{w}/n{i:03d}.md", distinct_body(w, i))
        for i in range(WRITES)
    ]


def body_of(text: str) -> tuple[dict[str, Any], str] | None:
    """(frontmatter, body) of a kbd-written note, or None when it does not parse."""
    if not text.startswith("---\n") or (end := text.find("\n---\n", 3)) == -1:
        return None
    try:
        doc = yaml.safe_load(text[4:end])
    except yaml.YAMLError:
        return None
    return (doc, text[end + 5 :]) if isinstance(doc, dict) else None


def run_writers(kb: KbRoot, sids: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """Start one writer per session, release them together; (wall seconds, results)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0
        )
        for _ in sids
    ]
    try:
        for w, (p, sid) in enumerate(zip(procs, sids, strict=True)):
            assert p.stdin is not None
            p.stdin.write(orjson.dumps({"root": str(kb.root), "sid": sid, "writes": writer_plan(w)}) + b"\n")
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n", "a writer failed to start"
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
        results = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, "a writer died"
            results.append(orjson.loads(line))
        wall = time.perf_counter() - t0
        for p in procs:
            assert p.wait(timeout=120) == 0
        return wall, results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def verify(notes: Path, sids: list[str]) -> tuple[int, int]:
    """(lost, torn) over every note the writers wrote, shared.md included."""
    lost = torn = 0
    for w in range(len(sids)):
        for name, body in writer_plan(w):
            if name == "shared.md":
                continue
            path = notes / name
            if not path.exists():
                lost += 1
                continue
            parsed = body_of(path.read_text(errors="replace"))
            if parsed is None or parsed[1] != body or parsed[0].get("contributed_by_session") != sids[w]:
                torn += 1
    shared = notes / "shared.md"
    if not shared.exists():
        lost += 1
    else:
        parsed = body_of(shared.read_text(errors="replace"))
        owners = [w for w in range(len(sids)) if parsed is not None and parsed[1] == shared_block(w)]
        if len(owners) != 1 or parsed is None or parsed[0].get("contributed_by_session") != sids[owners[0]]:
            torn += 1
    torn += sum(1 for p in notes.rglob(".kbd-*.tmp"))  # a leftover temp file counts as torn
    return lost, torn


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def dist_ms(samples: list[float]) -> str:
    ms = [s * 1000 for s in samples]
    return " / ".join(f"{pct(ms, q):.2f}" for q in (0.5, 0.9, 0.99)) + f" / {max(ms):.2f}"


def scenario(tmp: Path, name: str, writers: int) -> dict[str, Any]:
    kb = KbRoot.create(tmp / name)
    cfg = kb.root / "kbd.yaml"
    cfg.write_text(cfg.read_text().replace("timeout_seconds: 10", "timeout_seconds: 120"))
    src = kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    time.sleep(0.3)  # let the racy-timestamp window pass so caches are trusted, as on a live host
    host = Root(kb.root)
    sessions = RootSessions(host)
    sids = [
        str(
            session_ops.open_session(
                sessions, "con", actor=host.actor("alice"), kind="execution", kb_access="read-write"
            ).session_id
        )
        for _ in range(writers)
    ]
    wall, results = run_writers(kb, sids)
    lost, torn = verify(src / "knowledgebase" / "notes", sids)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    total = writers * WRITES
    return {
        "wall": wall,
        "span": span,
        "rate": total / span,
        "total": total,
        "lost": lost,
        "torn": torn,
        "waits": [x for r in results for x in r["waits"]],
        "holds": [x for r in results for x in r["holds"]],
        "latencies": [x for r in results for x in r["latencies"]],
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kbd-bench-notes-") as tmp:
        base = scenario(Path(tmp), "single", 1)
        cont = scenario(Path(tmp), "contended", WRITERS)
    budget = "budget: 0 lost, 0 torn, throughput reported | anchor: upstream: no serialisation at all"
    print('docs/performance.md: "8 processes x 200 note writes into one notes/ | 0 lost, 0 torn, throughput reported '
          '| upstream: no serialisation at all"')  # fmt: skip
    print(f"note writes through notes.write into one notes/ ({WRITES} writes per process; every "
          f"{SHARED_EVERY}th rewrites shared.md); lock wait = entering notes_lock -> mutex held")  # fmt: skip
    rows = [
        ("baseline 1 process x 200: throughput", f"{base['rate']:.0f} writes/s", ""),
        ("baseline lock wait p50/p90/p99/max (ms)", dist_ms(base["waits"]), ""),
        (f"{WRITERS} processes x {WRITES}: total wall (go -> last done)", f"{cont['wall']:.2f} s", ""),
        (f"{WRITERS} processes x {WRITES}: throughput", f"{cont['rate']:.0f} writes/s", budget),
        (f"lost / torn (of {cont['total']})", f"{cont['lost']} / {cont['torn']}", "budget: 0 / 0"),
        ("lock wait p50/p90/p99/max (ms)", dist_ms(cont["waits"]), ""),
        ("lock hold p50/p90/p99/max (ms)", dist_ms(cont["holds"]), ""),
        ("notes.write latency p50/p90/p99/max (ms)", dist_ms(cont["latencies"]), ""),
    ]
    for name, value, note in rows:
        print(f"{name:<52} {value:<34} {note}")
    print(f"median lock wait {statistics.median(cont['waits']) * 1000:.2f} ms; "
          f"mean {statistics.fmean(cont['waits']) * 1000:.2f} ms")  # fmt: skip
    if cont["lost"] or cont["torn"] or base["lost"] or base["torn"]:
        raise SystemExit("FAILED: lost or torn notes")


if __name__ == "__main__":
    main()
