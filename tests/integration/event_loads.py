"""The change feed's loads against a REAL daemon (docs/daemon.md "The change feed" and docs/multi-user.md
"Threat model"); shared by tests/integration/test_event_flood.py and
bench/event_flood.py.

- :func:`fill_log`: a full event log, appended through kbd's own
  :class:`kbd.state.events.EventLog` (as CLI processes on the root append).
- :class:`Stream`: one ``GET /v1/events`` on a raw socket. The request is sent
  and the answer's head read; the body is read only when asked, so a stream
  that is never asked is a subscriber that never reads.
- :func:`connect_as`: connections made by a process running as another uid
  (``SO_PEERCRED`` is the connector's), handed back to this process.
- :func:`rss_mib` and :func:`health_ms`: what the flood costs the daemon.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kbd.state.events import EventLog

TIMEOUT = 15.0
#: Appended per lock hold (one line per write, as ever).
BATCH = 1000


def fill_log(state_dir: Path, n: int, workflows: list[str]) -> str:
    """Append ``n`` ``session.opened`` events about ``workflows`` in turn (about
    150 bytes a line: 42,000 of them stay within one 8 MiB log file); the last id."""
    last = ""
    with EventLog(state_dir, sync_interval=0.05) as log:
        done = 0
        while done < n:
            batch = [
                ("session.opened", workflows[i % len(workflows)], {"session_id": f"s_{i:08d}"})
                for i in range(done, min(n, done + BATCH))
            ]
            last = log.append_many(batch)[-1].id
            done += len(batch)
    return last


def rss_mib(pid: int) -> float:
    """The process's resident set now (``VmRSS``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)
    assert m is not None, status
    return int(m.group(1)) / 1024


def health_ms(
    sock: Path, n: int, *, each: Callable[[], None] | None = None, within: float = 60.0
) -> tuple[list[float], list[str]]:
    """``n`` ``GET /v1/health`` on one keep-alive connection, each timed (ms),
    or fewer when ``within`` seconds have passed; and what each failed one got.
    ``each`` runs after every answer (not timed)."""
    out: list[float] = []
    failed: list[str] = []
    deadline = time.monotonic() + within
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://kbd", timeout=30) as c:
        while len(out) < n and time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                r = c.get("/v1/health")
            except httpx.HTTPError as exc:
                failed.append(repr(exc))
            else:
                if r.status_code != 200:
                    failed.append(f"{r.status_code} {r.text}")
            out.append((time.perf_counter() - t0) * 1000)
            if each is not None:
                each()
    return out, failed


def pct(samples: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank): p99 of 200 samples is the second highest."""
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(len(ordered) * q) - 1))] if ordered else 0.0


_CONNECTOR = """
import socket, sys
path, n, back = sys.argv[1], int(sys.argv[2]), socket.socket(fileno=int(sys.argv[3]))
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socket.send_fds(back, [b"c"], [s.fileno()])
    s.close()
"""


def connect_as(uid: int, sock: Path, n: int) -> list[socket.socket]:
    """``n`` connections to ``sock`` made by a process running as ``uid`` (with
    supplementary groups 0 and the socket's, to reach a root-group socket in a
    0750 folder): the daemon sees ``uid`` as each one's peer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CONNECTOR, str(sock), str(n), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            user=uid,
            group=uid,
            extra_groups=sorted({0, os.stat(sock).st_gid}),
        )
        theirs.close()
        ours.settimeout(TIMEOUT)
        out = []
        for _ in range(n):
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
            assert len(fds) == 1, "the connector sent no connection"
            out.append(socket.socket(fileno=fds[0]))
        assert proc.wait(timeout=TIMEOUT) == 0
        return out
    finally:
        ours.close()
        theirs.close()


class Stream:
    """One ``GET /v1/events`` over a raw connection: the head is read at once,
    the body only by :meth:`events` (HTTP/1.1, chunked)."""

    def __init__(
        self,
        conn: socket.socket | Path,
        token: str,
        *,
        since: str | None = None,
        follow: bool = True,
    ) -> None:
        if isinstance(conn, Path):
            path, conn = conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(path))
        self.s = conn
        self.s.settimeout(TIMEOUT)
        query = f"follow={'true' if follow else 'false'}" + (f"&since={since}" if since else "")
        head = f"GET /v1/events?{query} HTTP/1.1\r\nHost: kbd\r\nAuthorization: Bearer {token}\r\n\r\n"
        self.s.sendall(head.encode())
        self.raw = b""
        while b"\r\n\r\n" not in self.raw:
            self._recv()
        header, self.raw = self.raw.split(b"\r\n\r\n", 1)
        self.status = int(header.split(b" ", 2)[1])
        self.headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (ln.partition(":") for ln in header.decode().split("\r\n")[1:])
        }
        self.body = b""
        self.ended = False

    def _recv(self) -> None:
        data = self.s.recv(1 << 16)
        if not data:
            self.ended = True
            raise EOFError("the daemon closed the stream")
        self.raw += data

    def error(self) -> dict[str, str]:
        """The error envelope of a refused request."""
        length = int(self.headers["content-length"])
        while len(self.raw) < length:
            self._recv()
        doc = json.loads(self.raw[:length])
        assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message", "hint"}, doc
        err: dict[str, str] = doc["error"]
        return err

    def _dechunk(self) -> None:
        while (end := self.raw.find(b"\r\n")) >= 0:
            size = int(self.raw[:end], 16)
            if size == 0:
                self.ended = True
                return
            if len(self.raw) < end + 2 + size + 2:
                return
            self.body += self.raw[end + 2 : end + 2 + size]
            self.raw = self.raw[end + 2 + size + 2 :]

    def events(
        self, until: Callable[[dict[str, Any]], bool], timeout: float = TIMEOUT
    ) -> list[dict[str, Any]]:
        """The events received up to the first for which ``until`` holds (comments skipped)."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            self._dechunk()
            while b"\n\n" in self.body:
                frame, self.body = self.body.split(b"\n\n", 1)
                data = [ln[6:] for ln in frame.split(b"\n") if ln.startswith(b"data: ")]
                if data:
                    out.append(json.loads(data[0]))
                    if until(out[-1]):
                        return out
            assert not self.ended, f"the stream ended after {out[-3:]}"
            assert time.monotonic() < deadline, f"no such event within {timeout}s; got {out[-3:]}"
            self.s.settimeout(max(0.01, deadline - time.monotonic()))
            self._recv()

    def close(self) -> None:
        self.s.close()
