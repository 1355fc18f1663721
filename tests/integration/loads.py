"""The three loads of docs/api.md "Limits", against a REAL daemon; shared by
tests/integration/test_api_starvation.py and bench/api_load.py.

- :func:`half_open_flood`: another process, as another uid (``nobody`` with
  supplementary group 0, so it may reach a root-group 0660 socket but is not a
  mapped principal), opens many connections and sends half a request on each.
- :func:`note_posts`: many ``POST /v1/sessions/SID/notes`` while the source's
  notes mutex is held elsewhere.
- :func:`index_reads`: many reads of a source's unparsable ``notes/_index.json``.

Run as ``python -m tests.integration.loads SOCKET N`` it is the flood process:
it prints ``ready HELD`` once it has tried N connections, then on each line
``report`` on stdin prints ``open=… answered=… closed=…`` (connections still
open, answered with a response, closed without one), and exits at EOF.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.waiting import wait_for

NOBODY = 65534
HALF_REQUEST = b"GET /v1/health HTTP/1.1\r\nHost: kbd\r\nX-Slow: "
REPO = Path(__file__).resolve().parents[2]


# -- the flood process -------------------------------------------------------------------


def _drop_to_nobody(fds: int, sock: str) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds))
    if os.getuid() == 0:
        # Group 0 traverses the test's folders; the socket's group (kbd, when
        # this host has it) may connect.
        os.setgroups(sorted({0, os.stat(sock).st_gid}))
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _connect(path: str, patience: float = 2.0) -> socket.socket | None:
    """A connection, retried while the listen queue is full (a Unix socket's
    connect fails with EAGAIN then); None when the daemon stopped accepting."""
    deadline = time.monotonic() + patience
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.002)  # not a test's wait: the flood's own retry of a full listen queue


def _flood(path: str, n: int) -> None:
    _drop_to_nobody(n + 64, path)
    conns: list[socket.socket] = []
    while len(conns) < n:
        s = _connect(path)
        if s is None:
            break
        with contextlib.suppress(OSError):
            s.send(HALF_REQUEST)
        conns.append(s)
    print(f"ready {len(conns)}", flush=True)
    final: dict[int, str] = {}  # what each connection got, once it got something
    for line in sys.stdin:
        if line.strip() != "report":
            continue
        for i, s in enumerate(conns):
            if i in final:
                continue
            try:
                data = s.recv(64)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            final[i] = "answered" if data.startswith(b"HTTP/1.1 ") else "closed"
        counts = Counter(final.values())
        counts["open"] = len(conns) - len(final)
        print(" ".join(f"{k}={counts[k]}" for k in ("open", "answered", "closed")), flush=True)


@dataclass
class Flood:
    proc: subprocess.Popen[str]
    held: int

    def settled(self, open_at_most: int, timeout: float = 10.0) -> dict[str, int]:
        """The report once at most ``open_at_most`` connections are still open
        (the daemon may still be draining its listen queue); fails after ``timeout``."""
        last: list[dict[str, int]] = []

        def drained() -> dict[str, int] | None:
            last[:] = [self.report()]
            return last[0] if last[0]["open"] <= open_at_most else None

        return wait_for(drained, timeout, f"at most {open_at_most} of the flood's connections open",
                        detail=lambda: last)  # fmt: skip

    def report(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split())}


@contextlib.contextmanager
def half_open_flood(sock: Path, n: int) -> Iterator[Flood]:
    """``n`` half-sent requests from another process (as ``nobody`` when run as root)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.loads", str(sock), str(n)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        yield Flood(proc, int(line.split()[1]))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- request loads ----------------------------------------------------------------------------


@dataclass
class Requests:
    """``n`` requests, each from its own thread and connection, started together."""

    answers: list[httpx.Response | BaseException] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def join(self, timeout: float = 60.0) -> list[httpx.Response | BaseException]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request got no answer"
        return self.answers


def in_threads(
    n: int, make: Callable[[], httpx.Client], request: Callable[[httpx.Client], httpx.Response]
) -> Requests:
    out = Requests()
    lock = threading.Lock()

    def one() -> None:
        try:
            with make() as c:
                r: httpx.Response | BaseException = request(c)
        except BaseException as exc:  # reported by the caller
            r = exc
        with lock:
            out.answers.append(r)

    out.threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in out.threads:
        t.start()
    return out


def note_posts(make: Callable[[], httpx.Client], sid: str, alias: str, n: int) -> Requests:
    body = {"alias": alias, "path": "load.md", "content": "# Load\nqueued behind a held notes mutex\n"}
    return in_threads(n, make, lambda c: c.post(f"/v1/sessions/{sid}/notes", json=body))


def index_reads(make: Callable[[], httpx.Client], wid: str, alias: str, n: int) -> Requests:
    return in_threads(
        n,
        make,
        lambda c: c.get(f"/v1/workflows/{wid}/sources/{alias}/file", params={"path": "notes/_index.json"}),
    )


def timed(c: httpx.Client, path: str) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = c.get(path)
    return time.perf_counter() - t0, r


if __name__ == "__main__":
    _flood(sys.argv[1], int(sys.argv[2]))
