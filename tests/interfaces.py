"""One table of cases, every interface: the same read, listing or note write
through the real CLI or through a real ``kbd mcp`` process (docs/mcp.md: an agent's
file tools must get the decisions its shell and CLI get).

``Outcome.error`` is kbd's stable error code in both; ``exit`` is the CLI's exit
code (MCP has none, so it is None there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from tests.helpers import CliResult, KbRoot
from tests.mcp_client import Answer, McpClient, mcp_client

INTERFACES = ("cli", "mcp")


@dataclass(frozen=True)
class Outcome:
    error: str | None
    exit: int | None
    text: str
    data: dict[str, Any] | None


class Interface(Protocol):
    def read(self, alias: str, relpath: str) -> Outcome: ...
    def ls(self, alias: str, reldir: str) -> Outcome: ...
    def write_note(self, alias: str, relpath: str, data: str) -> Outcome: ...


def _from_cli(r: CliResult, *, json: bool = False) -> Outcome:
    error = None if r.code == 0 else r.err.split("]", 1)[0].removeprefix("error[")
    data = r.json() if json and r.code == 0 else None
    return Outcome(error, r.code, r.out + r.err, data)


def _from_mcp(a: Answer) -> Outcome:
    return Outcome(a.code, None, a.text, a.structured)


@dataclass(frozen=True)
class Cli:
    kb: KbRoot
    wf: str
    sid: str
    as_: str

    def read(self, alias: str, relpath: str) -> Outcome:
        return _from_cli(self.kb.call("read", self.wf, alias, relpath, "--as", self.as_))

    def ls(self, alias: str, reldir: str) -> Outcome:
        return _from_cli(self.kb.call("ls", self.wf, alias, reldir, "--as", self.as_, "--json"), json=True)

    def write_note(self, alias: str, relpath: str, data: str) -> Outcome:
        r = self.kb.call("notes", "write", self.sid, alias, relpath, "--as", self.as_, input=data.encode())
        return _from_cli(r)


@dataclass(frozen=True)
class Mcp:
    client: McpClient

    def read(self, alias: str, relpath: str) -> Outcome:
        return _from_mcp(self.client.call("kb_read", {"alias": alias, "relpath": relpath}))

    def ls(self, alias: str, reldir: str) -> Outcome:
        return _from_mcp(self.client.call("kb_list", {"alias": alias, "reldir": reldir}))

    def write_note(self, alias: str, relpath: str, data: str) -> Outcome:
        return _from_mcp(
            self.client.call("kb_write_note", {"alias": alias, "relpath": relpath, "content": data})
        )


@contextmanager
def interface(name: str, kb: KbRoot, wf: str, sid: str, *, as_: str = "alice") -> Iterator[Interface]:
    """``name`` ("cli" or "mcp") bound to session ``sid`` of workflow ``wf``."""
    if name == "cli":
        yield Cli(kb, wf, sid, as_)
        return
    assert name == "mcp", name
    with mcp_client(kb.root, sid, as_=as_) as client:
        yield Mcp(client)
