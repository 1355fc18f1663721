"""A second process that swaps two names with renameat2(RENAME_EXCHANGE) in a
loop, for race tests. Run: python -m tests.security.swapper DIR A B STOPFILE."""

from __future__ import annotations

import ctypes
import os
import sys

RENAME_EXCHANGE = 2
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(dirfd: int, a: str, b: str) -> None:
    rc = _libc.renameat2(dirfd, a.encode(), dirfd, b.encode(), RENAME_EXCHANGE)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def main() -> int:
    folder, a, b, stop = sys.argv[1:5]
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    swaps = 0
    # Ready signal: the parent waits for this file instead of sleeping.
    with open(stop + ".ready", "w") as fh:
        fh.write("ready")
    while not os.path.exists(stop):
        exchange(dfd, a, b)
        swaps += 1
    # Leave the names as they started.
    if swaps % 2:
        exchange(dfd, a, b)
    print(swaps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
