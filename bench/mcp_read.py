"""``kbd mcp`` (docs/mcp.md): ``kb_read`` of a 4 KB note, p50 per call.

Figures, each beside the others and floors measured in the same run:

* ``kb_read`` over stdio to one long-lived ``kbd mcp`` process, on the root
  (direct) and through the daemon (KBD_SOCKET + token) — each call fetches the
  session's plan and then reads, so it is two operations;
* the floor of the protocol: an MCP ``ping`` round trip to the same process;
* ``GET …/file`` for the same file through the daemon on one connection
  (the API), and ``GET /v1/sessions/SID`` (the plan fetch kb_read adds);
* ``kbd read`` of the same file, a process per call.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import KbRoot
from tests.integration.daemon import clean_env, issue_tokens, serving

CALLS = 200
CLI_CALLS = 20
ARGS = {"alias": "rts", "relpath": "notes/four.md"}


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def atimed(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def mcp_figures(root: Path, sid: str, env: dict[str, str]) -> tuple[float, float]:
    """(kb_read p50, ping p50) in ms against one ``kbd mcp`` process."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kbd", "--root", str(root), "mcp", sid, "--as", "alice"], env=env
    )
    found: list[float] = []

    async def main() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            first = await client.call_tool("kb_read", ARGS)
            assert not getattr(first, "is_error", True), first
            for _ in range(10):  # warm
                await client.call_tool("kb_read", ARGS)
            reads = await atimed(lambda: client.call_tool("kb_read", ARGS), CALLS)
            pings = await atimed(client.send_ping, CALLS)
            found.extend((p50(reads), p50(pings)))

    anyio.run(main)
    return found[0], found[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kb = KbRoot.create(Path(tmp) / "root")
        team = {"owners": ["alice"], "allowed_kb_writers": ["con"]}
        kb.workflow("src", access=team)
        kb.workflow("con", access=team, sources=[{"workflow_id": "src", "alias": "rts", "access": "write"}])
        (kb.workflows / "src" / "knowledgebase" / "notes" / "four.md").write_text(
            ("kbd " * 1024)[:4095] + "\n"
        )
        sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
        env = clean_env()
        direct_read, direct_ping = mcp_figures(kb.root, sid, env)
        cli = timed(
            lambda: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kbd",
                    "--root",
                    str(kb.root),
                    "read",
                    "con",
                    "rts",
                    ARGS["relpath"],
                    "--as",
                    "alice",
                ],
                env=env,
                capture_output=True,
                check=True,
            ),
            CLI_CALLS,
        )
        tokens = issue_tokens(kb.root, ["alice"])
        with serving(kb.root, sock=Path(tmp) / "kbd.sock", home=Path(tmp) / "home") as daemon:
            remote_env = {**env, "KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": tokens["alice"]}
            remote_read, remote_ping = mcp_figures(kb.root, sid, remote_env)
            client = daemon.client(tokens["alice"])
            file_url = "/v1/workflows/con/sources/rts/file"
            assert client.get(file_url, params={"path": ARGS["relpath"]}).status_code == 200
            api = timed(lambda: client.get(file_url, params={"path": ARGS["relpath"]}), CALLS)
            plan = timed(lambda: client.get(f"/v1/sessions/{sid}"), CALLS)
    print(
        f"kbd mcp kb_read 4 KB, direct        p50 {direct_read:7.2f} ms  (MCP ping floor {direct_ping:.2f} ms)"
    )
    print(
        f"kbd mcp kb_read 4 KB, via daemon    p50 {remote_read:7.2f} ms  (MCP ping floor {remote_ping:.2f} ms)"
    )
    print(
        f"API GET …/file 4 KB                 p50 {p50(api):7.2f} ms  (+ plan GET /v1/sessions/SID {p50(plan):.2f} ms)"
    )
    print(f"kbd read 4 KB (process per call)    p50 {p50(cli):7.2f} ms")
    print(f"(pid {os.getpid()}, {CALLS} calls per MCP/API figure, {CLI_CALLS} per CLI figure)")


if __name__ == "__main__":
    main()
