"""What the access log and request metrics (kbd.daemon.access_log.AccessLog) add to one
API request, in process: the ASGI call of a trivial app that answers a
12.5 KB body (the size of a 20-source plan) alone (the floor), then wrapped in
AccessLog with the access logger off (``--log-level warning``: the counters
only), then with one access line per request written as text to /dev/null
(stderr's cost without a terminal), then sent as a journald datagram to a
socket this script reads (what a systemd service pays).

The whole policy lookup over the socket costs ~450 us of server CPU per
request (bench/api.py); the budget for this layer is a few us.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from starlette.types import Message, Receive, Scope, Send

from kbd.core.telemetry import RequestStats
from kbd.daemon import journal
from kbd.daemon.access_log import AccessLog

BODY = b"x" * 12530
N = 20_000
ROUNDS = 5


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": BODY})


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    return None


async def run(target: object, n: int) -> float:
    """Microseconds per request, median of ROUNDS rounds of ``n``."""
    call = target  # an ASGI callable
    per: list[float] = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(n):
            scope: Scope = {"type": "http", "method": "GET", "path": "/v1/sessions/s_x", "headers": []}
            await call(scope, _receive, _send)  # type: ignore[operator]
        per.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per)


# journald's stand-in: another process (a reader thread here would compete
# for this one's GIL) that binds the socket and reads until killed.
DRAIN = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(sys.argv[1]); "
    "print('ready', flush=True)\nwhile True: s.recv(1 << 16)"
)


def main() -> None:
    root = logging.getLogger()
    results: list[tuple[str, float]] = []
    results.append(("floor: the app alone", asyncio.run(run(app, N))))
    wrapped = AccessLog(app, stats=RequestStats())
    root.setLevel(logging.WARNING)
    results.append(("AccessLog, access lines off (counting only)", asyncio.run(run(wrapped, N))))
    with open(os.devnull, "w") as devnull:
        handler = journal.configure(logging.INFO, stream=devnull)
        results.append(("AccessLog + text line to /dev/null", asyncio.run(run(wrapped, N))))
        root.removeHandler(handler)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "j.sock")
        sink = subprocess.Popen([sys.executable, "-c", DRAIN, path], stdout=subprocess.PIPE)
        assert sink.stdout is not None and sink.stdout.readline() == b"ready\n"
        fallback = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the run
        jh = journal.JournalHandler(path, fallback=fallback)
        jh.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(jh)
        root.setLevel(logging.INFO)
        results.append(("AccessLog + journald datagram", asyncio.run(run(wrapped, N // 4))))
        root.removeHandler(jh)
        sink.kill()
        sink.wait()
        fell_back = jh.gone
        jh.close()
    floor = results[0][1]
    print(f"access log and request metrics: one ASGI request in process, median of {ROUNDS} rounds")
    print(f"{'':48} {'us/req':>8} {'added':>8}")
    for name, us in results:
        print(f"{name:48} {us:8.2f} {us - floor:8.2f}")
    if fell_back:
        print("(journald figure invalid: the sink was unreachable and records went to the fallback)")
    print("budget: a few us added (the policy lookup costs ~450 us of server CPU per request: bench/api.py)")


if __name__ == "__main__":
    main()
