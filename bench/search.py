"""Confined search (docs/performance.md, docs/search.md): 10,000 notes (~50 MB) across 20 attached KBs.

Figures, each beside a floor measured in the same run:

* cold index build of every KB (confined walk, confined reads, injection gate,
  FTS5 inserts), with MB/s — beside reading the same files with plain
  ``open().read()`` and inserting the same texts into one bare FTS5 table;
* warm search in process with the daemon's searcher (``kbd.service.search.run``
  with the KB watch up: the per-KB FTS5 queries, the confirmation of every
  hit through the confined layer, review lookups, snippets) p50/p99 over mixed
  queries — beside the bare FTS5 ranking queries on the same index files (no
  scope, no confirmation, no snippets), and the same search when every KB is
  walked first (a CLI call's lazy verification);
* the same search through the daemon on its socket, beside ``GET /v1/whoami``
  on the same connection;
* a note written through the API until ``GET …/search`` returns it
  (``include_unreviewed``), p50/p99 — beside the same search when the note is
  already indexed.
"""

from __future__ import annotations

import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbd.core import knowledge, layout
from kbd.service import search as search_ops
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving

KBS = 20
NOTES_PER_KB = 500
NOTE_BYTES = 5000
QUERIES = 400
API_QUERIES = 200
WRITES = 20
VOCAB = [f"w{i:04d}" for i in range(4000)] + ["retry", "backoff", "latency", "deploy", "budget", "quorum"]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def note_text(rng: random.Random, i: int) -> str:
    words: list[str] = []
    size = 0
    while size < NOTE_BYTES:
        # Zipf-like: a few words are everywhere, most are rare.
        w = (
            VOCAB[min(len(VOCAB) - 1, int(rng.paretovariate(1.1)) - 1)]
            if rng.random() < 0.7
            else rng.choice(VOCAB)
        )
        words.append(w)
        size += len(w) + 1
    return f"# Note {i} about {rng.choice(VOCAB)}\n\n" + " ".join(words) + "\n"


def build(root: Path) -> tuple[KbRoot, int]:
    kb = KbRoot.create(root)
    rng = random.Random(13)
    total = 0
    for k in range(KBS):
        folder = kb.workflow(f"s{k:02d}", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
        ctx = folder / "knowledgebase" / "context"
        for i in range(NOTES_PER_KB):
            sub = ctx / f"d{i % 10}"
            sub.mkdir(exist_ok=True)
            data = note_text(rng, i).encode()
            (sub / f"n{i:04d}.md").write_bytes(data)
            total += len(data)
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": f"s{k:02d}", "alias": f"a{k:02d}", "access": "write"} for k in range(KBS)],
    )
    return kb, total


def floor_read_and_insert(kb: KbRoot) -> tuple[float, float]:
    """Plain reads of every note, and bare FTS5 inserts of the same texts (s)."""
    t0 = time.perf_counter()
    texts = [p.read_text() for p in sorted(kb.workflows.glob("s*/knowledgebase/context/*/*.md"))]
    read_s = time.perf_counter() - t0
    con = sqlite3.connect(":memory:")
    con.execute("CREATE VIRTUAL TABLE f USING fts5(body)")
    t0 = time.perf_counter()
    with con:
        con.executemany("INSERT INTO f (body) VALUES (?)", ((t,) for t in texts))
    return read_s, time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb, total = build(Path(tmp) / "root")
        time.sleep(layout.RACY_NS / 1e9 * 1.5)
        host = Root(kb.root)
        sessions = RootSessions(host)
        alice = host.actor("alice")
        sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
        where = search_ops.scope(sessions, sid, [], actor=alice)
        assert len(where.kbs) == KBS + 1, where.kbs
        state = host.config.state_dir

        floor_read, floor_insert = floor_read_and_insert(kb)
        engine = search_ops.FullTextSearcher(state, watch=True)  # as the daemon's
        t0 = time.perf_counter()
        for scope in where.kbs:
            engine.refresh(scope, force=True)
        cold = time.perf_counter() - t0

        rng = random.Random(7)
        queries = [rng.choice(["retry", "w0001", "w0003 w0010", "latency budget", rng.choice(VOCAB), "w0002"])
                   for _ in range(QUERIES)]  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(engine.watcher.covers(k.key) for k in where.kbs if engine.watcher is not None):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        it = iter(queries * 2)
        for _ in range(20):
            search_ops.run(state, where, next(it), searcher=engine)
        warm = timed(lambda: search_ops.run(state, where, next(it), searcher=engine), QUERIES)
        hits = len(search_ops.run(state, where, "retry", searcher=engine).hits)

        it2 = iter(queries * 2)

        def bare() -> None:
            match = knowledge.match_expression(next(it2))
            for scope in where.kbs:
                engine.index.query(match, scope.key, limit=40)

        floor_query = timed(bare, QUERIES)
        every_walk = search_ops.FullTextSearcher(state, fresh_seconds=0)
        lazy = timed(lambda: search_ops.run(state, where, "retry", searcher=every_walk), 30)
        if engine.watcher is not None:
            engine.watcher.close()

        tokens = issue_tokens(kb.root, ["alice"])
        with serving(kb.root, sock=Path(tmp) / "kbd.sock", home=Path(tmp) / "home") as daemon:
            client = daemon.client(tokens["alice"])
            params = {"q": "retry"}
            for _ in range(3):
                assert client.get(f"/v1/sessions/{sid}/search", params=params).status_code == 200
            it3 = iter(queries * 2)
            api = timed(
                lambda: client.get(f"/v1/sessions/{sid}/search", params={"q": next(it3)}), API_QUERIES
            )
            whoami = timed(lambda: client.get("/v1/whoami"), API_QUERIES)
            fresh: list[float] = []
            for n in range(WRITES):
                word = f"zq{n}x{rng.randrange(10**6)}"
                body = {"alias": f"a{n % KBS:02d}", "path": f"bench-{n}.md", "content": f"# B\n{word}\n"}
                t0 = time.perf_counter()
                assert client.post(f"/v1/sessions/{sid}/notes", json=body).status_code == 201
                q = {"q": word, "include_unreviewed": "true"}
                while not client.get(f"/v1/sessions/{sid}/search", params=q).json()["hits"]:
                    assert time.perf_counter() - t0 < 10
                fresh.append((time.perf_counter() - t0) * 1000)
                time.sleep(rng.random() * 0.3)  # not in step with the freshness window
            found = timed(lambda: client.get(f"/v1/sessions/{sid}/search", params=q), 50)

    mb = total / 1e6
    print(f"search bench: {KBS} KBs x {NOTES_PER_KB} notes = {KBS * NOTES_PER_KB} notes, {mb:.1f} MB; "
          f"'retry' finds {hits} hits (limit 10)")  # fmt: skip
    print(f"{'measure':<66} {'p50':>8} {'p99':>8}  budget")
    rows = [
        ("warm search in process (scope, freshness, FTS5, confirm), ms", warm, "p50 <= 30, p99 <= 100"),
        ("  floor: bare FTS5 queries of the same index files, ms", floor_query, ""),
        ("  lazy verification (walk every KB each query, as a CLI call), ms", lazy, ""),
        ("search through the daemon (GET …/search), ms", api, ""),
        ("  floor: GET /v1/whoami on the same connection, ms", whoami, ""),
        ("note written (API) -> returned by search (daemon), ms", fresh, "<= 1000"),
        ("  floor: the same search when already indexed, ms", found, ""),
    ]
    for name, samples, budget in rows:
        print(f"{name:<66} {statistics.median(samples):8.1f} {pct(samples, 0.99):8.1f}  {budget}")
    print(f"{'cold index build (20 KBs): s, MB/s':<66} {cold:8.2f} {mb / cold:8.1f}  <= 30 s")
    print(
        f"{'  floor: plain open().read() of every note: s, MB/s':<66} {floor_read:8.2f} {mb / floor_read:8.1f}"
    )
    print(
        f"{'  floor: bare FTS5 insert of the same texts: s, MB/s':<66} {floor_insert:8.2f} {mb / floor_insert:8.1f}"
    )


if __name__ == "__main__":
    main()
