"""Confined open cost (docs/performance.md: ≤ 20 µs for a 6-component path).

Prints µs per call, median of several rounds, for the same 6-component path:
plain os.open, os.path.realpath, kbd's openat2 path and its O_NOFOLLOW walk
fallback, and kbd's full read_file (O_PATH open, fstat, reopen, read).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kbd.fs.confined import HAVE_OPENAT2, open_beneath, pin_dir, read_file

ROUNDS = 7
CALLS = 20_000


def per_call_us(fn: Callable[[], object]) -> float:
    samples = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter_ns() - t0) / CALLS / 1000)
    return statistics.median(samples)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb = Path(tmp) / "kb"
        rel = "notes/a/b/c/d/note.md"
        (kb / rel).parent.mkdir(parents=True)
        (kb / rel).write_text("hello\n")
        full = str(kb / rel)

        def plain() -> None:
            os.close(os.open(full, os.O_RDONLY | os.O_CLOEXEC))

        def realpath() -> None:
            os.path.realpath(full)

        with pin_dir(kb) as pinned:

            def confined() -> None:
                os.close(open_beneath(pinned.fd, rel))

            def walk() -> None:
                os.close(open_beneath(pinned.fd, rel, use_openat2=False))

            def read() -> None:
                read_file(pinned.fd, rel, limit=1 << 20)

            rows = [
                ("os.open (no checks)", per_call_us(plain), ""),
                ("os.path.realpath (no open)", per_call_us(realpath), ""),
                (
                    "kbd open_beneath, openat2" if HAVE_OPENAT2 else "kbd open_beneath (walk)",
                    per_call_us(confined),
                    "<= 20",
                ),
                ("kbd open_beneath, O_NOFOLLOW walk", per_call_us(walk), "<= 20"),
                ("kbd read_file (open+fstat+reopen+read)", per_call_us(read), ""),
            ]
    print(f"confined open of a 6-component path ({CALLS} calls x {ROUNDS} rounds, median)")
    print(f"{'measure':<42} {'us/call':>9}  budget")
    for name, us, budget in rows:
        print(f"{name:<42} {us:>9.2f}  {budget}")


if __name__ == "__main__":
    main()
