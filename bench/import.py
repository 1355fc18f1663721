"""`kbd import` of 1,000 Markdown documents (docs/performance.md: report docs/s).

1,000 documents of about 2 KB (20 container folders of 50) are imported into a
workflow's empty ``context/`` by the real ``kbd import`` command (a fresh
process each run, median of RUNS): on the root (direct) and through the real
daemon on its socket (the CLI reads the folder and sends the documents). Each
figure is printed as docs/s beside floors measured in the same run on the same
files: ``shutil.copyfile`` of each file into a fresh tree (no fsync), and the
same with what kbd's atomic write does per file (temp file, fsync, rename,
folder fsync). Also: the operation alone in this process
(:func:`kbd.service.importing.import_docs`, no interpreter start, no folder
walk), a second import (everything unchanged) and a ``--dry-run``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kbd.fs.importing import read_folder  # noqa: E402
from kbd.service import importing  # noqa: E402
from tests.helpers import KbRoot  # noqa: E402
from tests.integration.daemon import issue_tokens, serving  # noqa: E402

DOCS = 1_000
CONTAINERS = 20
RUNS = 5
TEAM = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}


def make_docs(folder: Path) -> list[Path]:
    paths: list[Path] = []
    para = ("Runbooks describe what to do when the pager fires. " * 8).strip() + "\n\n"
    for i in range(DOCS):
        c = folder / f"TEAM{i % CONTAINERS:02d}"
        c.mkdir(parents=True, exist_ok=True)
        p = c / f"doc-{i:04d}.md"
        p.write_text(f"# Document {i}\n\n" + para * 4 + f"## Section\nitem {i}\n")
        paths.append(p)
    return paths


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def line(what: str, seconds: float, docs: int = DOCS) -> None:
    print(f"  {what:<62} {seconds * 1000:9.1f} ms  {docs / seconds:9.0f} docs/s")


def copy_floor(files: list[Path], base: Path, *, durable: bool) -> float:
    out = base / f"copy-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    for f in files:
        d = out / f.parent.name
        if not d.exists():
            d.mkdir(parents=True)
        if not durable:
            shutil.copyfile(f, d / f.name)
            continue
        tmp = d / f".{f.name}.tmp"
        shutil.copyfile(f, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, d / f.name)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
    took = time.perf_counter() - t0
    shutil.rmtree(out)
    return took


def cli(kb: KbRoot, docs: Path, *extra: str, env: dict[str, str] | None = None) -> float:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")} | (env or {})
    argv = [
        sys.executable,
        "-m",
        "kbd",
        "--root",
        str(kb.root),
        "import",
        "wf",
        str(docs),
        "--as",
        "alice",
        *extra,
    ]
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=full, capture_output=True, check=False)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"kbd import failed ({r.returncode}): {r.stderr.decode()}")
    return took


def fresh_context(kb: KbRoot) -> None:
    ctx = kb.workflows / "wf" / "knowledgebase" / "context"
    shutil.rmtree(ctx)
    ctx.mkdir()


def runs(setup: Callable[[], None], measure: Callable[[], float]) -> float:
    out: list[float] = []
    for _ in range(RUNS):
        setup()
        out.append(measure())
    return statistics.median(out)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kbd-bench-import-") as tmp:
        base = Path(tmp)
        docs = base / "docs"
        files = make_docs(docs)
        size = sum(f.stat().st_size for f in files)
        kb = KbRoot.create(base / "root")
        kb.workflow("wf", access=TEAM)
        print(
            f"kbd import: {DOCS} documents ({size / 1e6:.1f} MB) in {CONTAINERS} folders; median of {RUNS} runs"
        )
        print("floors (same files, same run):")
        line(
            "shutil.copyfile each file (no fsync)",
            runs(lambda: None, lambda: copy_floor(files, base, durable=False)),
        )
        line("copyfile to a temp + fsync + rename + folder fsync", runs(lambda: None, lambda: copy_floor(files, base, durable=True)))  # fmt: skip

        def in_process() -> float:
            host = kb.host()
            alice = host.actor("alice")
            t0 = time.perf_counter()
            found = read_folder(docs)
            importing.import_docs(host, "wf", found.docs, folder=found.folder, actor=alice)
            return time.perf_counter() - t0

        print("kbd:")
        line(
            "read_folder + import_docs in this process (created)", runs(lambda: fresh_context(kb), in_process)
        )
        line(
            "`kbd import` on the root, new process (created)",
            runs(lambda: fresh_context(kb), lambda: cli(kb, docs)),
        )
        line("`kbd import` again (all unchanged)", runs(lambda: None, lambda: cli(kb, docs)))
        line("`kbd import --dry-run` into an empty context/", runs(lambda: fresh_context(kb), lambda: cli(kb, docs, "--dry-run")))  # fmt: skip
        tokens = issue_tokens(kb.root, ["alice"])
        with serving(kb.root, sock=base / "kbd.sock", home=base / "home") as daemon:
            env = {"KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": tokens["alice"]}
            line("`kbd import` through the daemon (created)", runs(lambda: fresh_context(kb), lambda: cli(kb, docs, env=env)))  # fmt: skip
            line("`kbd import` through the daemon again (all unchanged)", runs(lambda: None, lambda: cli(kb, docs, env=env)))  # fmt: skip
        print("budget: report docs/s")


if __name__ == "__main__":
    main()
