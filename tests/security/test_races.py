"""Swap races: a second process exchanges a real folder and a symlink to the
outside (renameat2 RENAME_EXCHANGE) in a loop while reads and writes run."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.errors import KbdError
from kbd.fs.confined import pin_dir, read_file, replace_file

ITERATIONS = 20_000


def tree_digest(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p.relative_to(root))] = "link:" + os.readlink(p)
            elif p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p.relative_to(root))] = "dir"
    return out


@pytest.fixture
def swapping(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """kb/{sw,alt} where alt is a symlink to ../outside; a swapper exchanges them."""
    kb = tmp_path / "kb"
    outside = tmp_path / "outside"
    (kb / "sw").mkdir(parents=True)
    outside.mkdir()
    (kb / "sw" / "f.md").write_text("inside\n")
    (outside / "f.md").write_text("SECRET\n")
    (kb / "alt").symlink_to("../outside")
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.security.swapper", str(kb), "sw", "alt", str(stop)],
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not Path(str(stop) + ".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "swapper did not start"
        os.sched_yield()
    try:
        yield kb, outside
    finally:
        stop.write_text("stop")
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert int(out) > 0, "the swapper never swapped: the race test proved nothing"


def test_naive_open_escapes_under_the_swap(swapping: tuple[Path, Path]) -> None:
    """Control: the race is real. Plain path-joined opens do leak the outside file."""
    kb, _ = swapping
    leaks = 0
    for _ in range(ITERATIONS):
        try:
            with open(kb / "sw" / "f.md") as fh:
                leaks += fh.read() == "SECRET\n"
        except OSError:
            pass
    assert leaks > 0


def test_confined_reads_never_escape(swapping: tuple[Path, Path]) -> None:
    kb, _ = swapping
    ok = refused = 0
    with pin_dir(kb) as pinned:
        for _ in range(ITERATIONS):
            try:
                data = read_file(pinned.fd, "sw/f.md", limit=1024)
            except KbdError:
                refused += 1
                continue
            assert data == b"inside\n"
            ok += 1
    assert ok > 0 and refused > 0  # both sides of the race were exercised


def test_confined_writes_never_escape(swapping: tuple[Path, Path]) -> None:
    kb, outside = swapping
    before = tree_digest(outside)
    written = 0
    with pin_dir(kb) as pinned:
        for i in range(ITERATIONS // 4):
            try:
                replace_file(pinned.fd, f"sw/n{i % 50}.md", f"note {i}\n".encode())
                written += 1
            except KbdError:
                pass
    assert written > 0
    assert tree_digest(outside) == before
    assert not any(p.name.startswith(".") for p in outside.iterdir())  # no stray temp files
