"""API policy lookups over the real socket (docs/performance.md), each figure beside the
floors of the same client load measured in the same run.

Servers, each on its own Unix socket, started by this script:
- ``kbd``: a real ``kbd serve`` on a root with a consumer of 20 sources; a
  session is opened, and every request is ``GET /v1/sessions/{sid}`` with a
  service's bearer token (the full lookup: auth, row, every manifest and KB
  verified, the plan answered);
- floor ``asgi``: a bare uvicorn + httptools server with a trivial ASGI app
  that answers kbd's own response bytes (same size) to every request;
- floor ``fastapi``: a bare FastAPI app with one route ``GET
  /v1/sessions/{sid}`` returning those bytes as a prebuilt ``Response``
  (routing and the framework, no serialisation).

Loads (client processes forked from this one, httpx over the Unix socket, one
connection per client, all started together):
- 8 clients, closed loop (each sends its next request when the answer
  arrives): p50 <= 3 ms, p99 <= 15 ms;
- 64 clients (8 processes x 8 threads) offering 1,000 requests/s in total,
  each client on its own fixed schedule; latency is counted from the
  scheduled send time (a late server cannot hide its backlog): achieved
  throughput >= 1,000/s and p99 <= 25 ms;
- 64 clients, closed loop: the throughput they reach (capacity). In a closed
  loop the mean latency is clients / throughput (64 / 1,000/s = 64 ms), which
  is why the 25 ms budget is measured at an offered 1,000/s.
The rounds are interleaved (asgi, fastapi, kbd; repeated ``KBD_BENCH_ROUNDS``
times, default 2) and the samples of all rounds pooled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import KbRoot, issue_token

ROUNDS = int(os.environ.get("KBD_BENCH_ROUNDS", "2"))
CLOSED_CLIENTS = 8
CLOSED_REQUESTS = 300
MANY = 64
MANY_PROCS = 8
OFFERED = 1000.0  # requests/s over all MANY clients
PACED_SECONDS = 4.0
SATURATE_SECONDS = 2.0
WARMUP = 20
SERVERS = ("asgi", "fastapi", "kbd")

# -- the floor servers (run as `python bench/api.py --floor KIND SOCKET BODYFILE`) -------------


def floor_server(kind: str, sock: str, body_file: str) -> None:
    import uvicorn

    body = Path(body_file).read_bytes()
    headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]

    async def trivial(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    app: ASGIApp = trivial
    if kind == "fastapi":
        from fastapi import FastAPI, Response

        fast = FastAPI()

        @fast.get("/v1/sessions/{sid}")
        async def plan(sid: str) -> Response:
            return Response(body, media_type="application/json")

        app = fast
    config = uvicorn.Config(app, uds=sock, http="httptools", log_level="warning", lifespan="off",
                            access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    print("serving", flush=True)
    server.run()


# -- the clients ------------------------------------------------------------------------------


def _client(sock: str, token: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://kbd",
                        headers={"Authorization": f"Bearer {token}"}, timeout=60)  # fmt: skip


@dataclass
class Result:
    latencies: list[float]  # ms
    first: float  # perf_counter of the first measured send
    last: float  # perf_counter of the last answer


def closed_worker(sock: str, token: str, url: str, n: int, threads: int, seconds: float, start: Barrier,
                  out: mp.Queue) -> None:  # type: ignore[type-arg]  # fmt: skip
    """``threads`` clients, each sending its next request when its answer
    arrives: ``n`` requests each, or for ``seconds`` when n == 0."""
    results: list[Result] = []
    clients = [_client(sock, token) for _ in range(threads)]
    for c in clients:
        for _ in range(WARMUP):
            c.get(url).raise_for_status()
    start.wait()
    cpu = time.process_time()

    def run(c: httpx.Client) -> None:
        lat: list[float] = []
        t_first = time.perf_counter()
        deadline = t_first + seconds
        i = 0
        while (n and i < n) or (not n and time.perf_counter() < deadline):
            t0 = time.perf_counter()
            c.get(url).raise_for_status()
            lat.append((time.perf_counter() - t0) * 1000)
            i += 1
        results.append(Result(lat, t_first, time.perf_counter()))

    ts = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    cpu = time.process_time() - cpu
    for c in clients:
        c.close()
    out.put((results, cpu))


def paced_worker(sock: str, token: str, url: str, threads: int, rate: float, seconds: float, start: Barrier,
                 out: mp.Queue) -> None:  # type: ignore[type-arg]  # fmt: skip
    """``threads`` clients, each sending at ``rate`` per second on a fixed
    schedule (phases spread); latency from the scheduled send time."""
    results: list[Result] = []
    clients = [_client(sock, token) for _ in range(threads)]
    for c in clients:
        for _ in range(WARMUP):
            c.get(url).raise_for_status()
    start.wait()
    cpu = time.process_time()
    t_start = time.perf_counter() + 0.05
    period = 1.0 / rate

    def run(k: int, c: httpx.Client) -> None:
        lat: list[float] = []
        due = t_start + period * ((os.getpid() * 7 + k * 0.37) % 1.0)
        end = t_start + seconds
        while due < end:
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            c.get(url).raise_for_status()
            lat.append((time.perf_counter() - due) * 1000)
            due += period
        results.append(Result(lat, t_start, time.perf_counter()))

    ts = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    cpu = time.process_time() - cpu
    for c in clients:
        c.close()
    out.put((results, cpu))


def drive(
    procs: int, target: Callable[..., None], args: tuple[object, ...]
) -> tuple[list[float], float, float]:
    """Run ``procs`` client processes together: (latencies, requests/s over
    the common window, the clients' CPU seconds)."""
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    start = ctx.Barrier(procs)
    ps = [ctx.Process(target=target, args=(*args, start, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    answers = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join()
    results = [r for rs, _ in answers for r in rs]
    lat = [x for r in results for x in r.latencies]
    window = max(r.last for r in results) - min(r.first for r in results)
    return lat, len(lat) / window, sum(cpu for _, cpu in answers)


# -- the run ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) process ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Figures:
    samples: list[float]
    rates: list[float]
    cpu_us: list[float]  # server CPU per answered request
    client_us: list[float]  # the clients' CPU per answered request

    def p(self, q: float) -> float:
        s = sorted(self.samples)
        return s[max(0, int(len(s) * q) - 1)]

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def start_server(argv: list[str], sock: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.readline()  # its readiness line, once the socket listens
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="kbd-bench-api-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        kb = KbRoot.create(base / "root")
        for i in range(20):
            kb.workflow(f"s{i:02d}", access={"owners": ["alice"]})
        kb.workflow("con", access={"owners": ["alice"]},
                    sources=[{"workflow_id": f"s{i:02d}", "alias": f"a{i:02d}"} for i in range(20)])  # fmt: skip
        token = issue_token(kb.root, "svc", timeout=10)
        socks = {name: base / f"{name}.sock" for name in SERVERS}
        procs.append(start_server([sys.executable, "-m", "kbd", "--root", str(kb.root), "serve", "--socket",
                                   str(socks["kbd"])], socks["kbd"]))  # fmt: skip
        time.sleep(0.3)  # let the root's fresh timestamps leave the racy window, as on a live host
        with _client(str(socks["kbd"]), token) as c:
            sid = c.post("/v1/sessions", json={"workflow_id": "con", "kind": "execution"}).json()[
                "session_id"
            ]
            url = f"/v1/sessions/{sid}"
            body = c.get(url).content
        (base / "body.json").write_bytes(body)
        for name in ("asgi", "fastapi"):
            argv = [sys.executable, __file__, "--floor", name, str(socks[name]), str(base / "body.json")]
            procs.append(start_server(argv, socks[name]))
        loads: dict[str, Callable[[str], tuple[list[float], float, float]]] = {
            "closed8": lambda s: drive(
                CLOSED_CLIENTS, closed_worker, (s, token, url, CLOSED_REQUESTS, 1, 0.0)
            ),
            "paced64": lambda s: drive(
                MANY_PROCS, paced_worker, (s, token, url, MANY // MANY_PROCS, OFFERED / MANY, PACED_SECONDS)
            ),
            "closed64": lambda s: drive(
                MANY_PROCS, closed_worker, (s, token, url, 0, MANY // MANY_PROCS, SATURATE_SECONDS)
            ),
        }
        pids = {"kbd": procs[0].pid, "asgi": procs[1].pid, "fastapi": procs[2].pid}
        figures = {(load, name): Figures([], [], [], []) for load in loads for name in SERVERS}
        for _ in range(ROUNDS):
            for load, run in loads.items():
                for name in SERVERS:
                    cpu = cpu_seconds(pids[name])
                    lat, rate, client_cpu = run(str(socks[name]))
                    used = cpu_seconds(pids[name]) - cpu  # warm-up requests included
                    figures[load, name].samples += lat
                    figures[load, name].rates.append(rate)
                    figures[load, name].cpu_us.append(used / len(lat) * 1e6)
                    figures[load, name].client_us.append(client_cpu / len(lat) * 1e6)
    finally:
        for proc in procs:
            stop(proc)
        shutil.rmtree(base, ignore_errors=True)
    report(figures, len(body))


def report(f: dict[tuple[str, str], Figures], size: int) -> None:
    print(
        f"API policy lookup: GET /v1/sessions/{{sid}} (20 sources, {size} bytes), {ROUNDS} interleaved rounds"
    )
    print("floors: asgi = bare uvicorn+httptools, trivial app; fastapi = bare FastAPI, one constant route")
    print(
        "cpu us: CPU time per answered request of the server process (every thread) / of all client processes"
    )
    head = f"{'load':<34} {'server':<8} {'p50 ms':>7} {'p99 ms':>7} {'min ms':>7} {'req/s':>7} {'cpu us srv/cli':>14}  budget"
    print(head)
    budgets = {
        "closed8": ("8 clients, closed loop", "kbd: p50 <= 3, p99 <= 15"),
        "paced64": (f"64 clients offering {OFFERED:,.0f}/s", "kbd: >= 1,000/s, p99 <= 25"),
        "closed64": ("64 clients, closed loop (capacity)", "kbd: >= 1,000/s"),
    }
    for load, (what, budget) in budgets.items():
        for name in SERVERS:
            x = f[load, name]
            print(f"{what:<34} {name:<8} {x.p(0.5):7.2f} {x.p(0.99):7.2f} {min(x.samples):7.2f} {x.rate:7.0f}"
                  f" {statistics.median(x.cpu_us):6.0f} /{statistics.median(x.client_us):6.0f}"
                  f"  {budget if name == 'kbd' else ''}")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--floor":
        floor_server(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
