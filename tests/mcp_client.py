"""A blocking MCP client over stdio for tests: a real ``kbd mcp`` process, driven
by the MCP SDK's own ``ClientSession`` on an event loop in a helper thread, so
that ordinary (synchronous) test cases can ask it one call at a time and the
same case tables run through the CLI and through MCP.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import mcp_types as types
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

T = TypeVar("T")
CALL_SECONDS = 60


@dataclass
class Roots:
    """The roots this client declares; ``changed()`` after editing ``uris``."""

    uris: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Answer:
    """One tool call's outcome: kbd's error code (None: it succeeded) and text."""

    code: str | None
    text: str
    structured: dict[str, Any] | None

    @staticmethod
    def of(result: types.CallToolResult) -> Answer:
        block = result.content[0]
        assert isinstance(block, types.TextContent)
        text = block.text
        assert "Traceback" not in text, text
        code = None
        if result.is_error:
            assert text.startswith("error["), text
            code = text.split("]", 1)[0].removeprefix("error[")
        return Answer(code, text, result.structured_content)


class McpClient:
    def __init__(
        self, portal: BlockingPortal, session: ClientSession, roots: Roots | None, notices: list[str]
    ) -> None:
        self._portal, self._session, self.roots = portal, session, roots
        self.notices = notices  # methods of the server's notifications, in order

    def _within(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)`` on the client's loop, failing after CALL_SECONDS: a
        server that died must fail the test, not hang it until pytest-timeout."""

        async def bounded() -> T:
            with anyio.fail_after(CALL_SECONDS):
                return await fn(*args)

        return self._portal.call(bounded)

    def tools(self) -> set[str]:
        return {t.name for t in self._within(self._session.list_tools).tools}

    def call(self, name: str, arguments: dict[str, Any]) -> Answer:
        result = self._within(self._session.call_tool, name, arguments)
        assert isinstance(result, types.CallToolResult)
        return Answer.of(result)

    def roots_changed(self) -> None:
        """Tell the server the roots changed (notifications/roots/list_changed)."""
        self._portal.call(self._session.send_notification, types.RootsListChangedNotification())


@contextmanager
def mcp_client(
    root: Path,
    sid: str,
    *,
    as_: str | None = "alice",
    env: dict[str, str] | None = None,
    roots: Roots | None = None,
    extra: Sequence[str] = (),
) -> Iterator[McpClient]:
    """``kbd --root ROOT mcp SID [--as P]`` as a real process; with ``roots`` the
    client declares the roots capability and answers roots/list from it."""
    # KBD_DEBUG: should the server ever fail, its traceback lands in the test's output.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KBD_")},
        "KBD_DEBUG": "1",
        **(env or {}),
    }
    args = ["-m", "kbd", "--root", str(root), "mcp", sid, *(["--as", as_] if as_ else []), *extra]
    params = StdioServerParameters(command=sys.executable, args=args, env=env)

    async def list_roots(context: Any) -> types.ListRootsResult | types.ErrorData:
        del context
        assert roots is not None
        return types.ListRootsResult(roots=[types.Root(uri=u) for u in roots.uris])

    notices: list[str] = []

    async def on_message(message: Any) -> None:
        if not isinstance(message, Exception):
            notices.append(str(getattr(message, "method", type(message).__name__)))

    callback = list_roots if roots is not None else None
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(stdio_client(params)) as streams,
    ):
        session = ClientSession(*streams, list_roots_callback=callback, message_handler=on_message)
        with portal.wrap_async_context_manager(session):
            portal.call(session.initialize)
            yield McpClient(portal, session, roots, notices)


def raw_exchange(
    argv: list[str],
    lines: Sequence[bytes],
    *,
    env: dict[str, str],
    wait_for: set[int] | None = None,
    timeout: float = 100,
) -> dict[int, Any]:
    """Speak JSON-RPC lines to a ``kbd mcp`` process by hand (what the SDK client
    would refuse to send): write ``lines``, read until every request id among
    them (or in ``wait_for``) is answered, then close stdin. stdin stays open until then because the
    SDK's server cancels requests still in flight when its input ends."""
    import json  # not orjson: these lines may hold what orjson rightly refuses
    import subprocess
    import threading

    wanted = wait_for if wait_for is not None else {m["id"] for m in map(json.loads, lines) if "id" in m}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd="/")  # fmt: skip
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    answers: dict[int, Any] = {}
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
        proc.stdin.flush()
        while not wanted <= set(answers):
            line = proc.stdout.readline()
            if not line:
                break
            message = json.loads(line)
            if "id" in message:
                answers[message["id"]] = message
        _, err = proc.communicate()  # closes stdin: the server ends
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")
    assert wanted <= set(answers), (answers, err.decode(errors="replace"))
    assert b"Traceback" not in err, err.decode(errors="replace")
    return answers


def initialize_lines() -> list[bytes]:
    """An ``initialize`` request (id 0) and the ``initialized`` notification."""
    import orjson

    init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    return [orjson.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}),
            orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})]  # fmt: skip
