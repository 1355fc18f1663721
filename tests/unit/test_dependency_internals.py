"""The third-party internals kbd relies on, imported and exercised exactly as kbd
uses them, so that raising a version bound in pyproject.toml past a release that
moved them fails here, loudly, rather than in a daemon on a host.

A library appears in INTERNALS when kbd imports one of its private modules
(``watchfiles._rust_notify``) or subclasses an undocumented class and overrides
its methods (uvicorn's ``HttpToolsProtocol`` and ``Server``); each such library
carries an upper bound in pyproject.toml. The AST scan below fails on a new
import of a private module (a ``_name`` component) that is not listed here."""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.metadata
import inspect
import pkgutil
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import kbd

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(kbd.__file__).resolve().parent

#: distribution → the modules of it whose internals kbd uses.
INTERNALS: dict[str, set[str]] = {
    "uvicorn": {"uvicorn.protocols.http.httptools_impl"},
    "watchfiles": {"watchfiles._rust_notify"},
}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


def _imports() -> set[str]:
    """Every module a kbd/ file imports (absolute imports; relative ones are kbd's own)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
    return found


def _kbd_subclasses(base: type) -> list[type]:
    """kbd's own subclasses of ``base``, wherever in the package they live."""
    for info in pkgutil.walk_packages(kbd.__path__, "kbd."):
        if info.name != "kbd.__main__":
            importlib.import_module(info.name)
    todo: list[type] = list(base.__subclasses__())
    out: list[type] = []
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("kbd."):
            out.append(cls)
    return out


def _overrides(cls: type) -> list[str]:
    """The methods ``cls`` defines that are meant to override its base's: every
    public one (kbd's own helpers are ``_``-prefixed)."""
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("dist", sorted(INTERNALS))
def test_each_library_whose_internals_kbd_uses_is_bounded(dist: str) -> None:
    req = _requirements().get(dist)
    assert req is not None, f"{dist} is not a declared dependency"
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req}: no upper bound"
    installed = Version(importlib.metadata.version(dist))
    assert installed in req.specifier, f"{dist} {installed} is outside {req.specifier}"


def test_no_private_module_is_imported_unlisted() -> None:
    listed = set().union(*INTERNALS.values())
    private = {
        m for m in _imports()
        if m.split(".")[0] not in ("kbd", *sys.stdlib_module_names)
        and any(part.startswith("_") for part in m.split(".")[1:])
    }  # fmt: skip
    assert private <= listed, sorted(private - listed)
    assert listed <= _imports(), sorted(listed - _imports())  # a stale entry here: drop it and its bound


def test_uvicorn_httptools_protocol_has_what_kbd_overrides_and_reads() -> None:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    from uvicorn.server import ServerState

    subclasses = _kbd_subclasses(HttpToolsProtocol)
    assert subclasses, "kbd no longer subclasses HttpToolsProtocol: drop it from INTERNALS"
    for cls in subclasses:
        missing = [n for n in _overrides(cls) if not hasattr(HttpToolsProtocol, n)]
        assert missing == [], f"{cls.__qualname__} overrides what uvicorn no longer has: {missing}"

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app, log_config=None)
        proto = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        # What kbd's subclass reads and replaces on the instance.
        for name in ("app", "loop", "transport", "cycle"):
            assert hasattr(proto, name), name
    finally:
        loop.close()
    # What kbd reads on the request cycle (a stream still open at shutdown, a response begun).
    cycle = inspect.getsource(RequestResponseCycle.__init__)
    for name in ("self.scope", "self.response_started", "self.response_complete"):
        assert name in cycle, name


def test_uvicorn_server_has_what_kbd_overrides_and_reads() -> None:
    import uvicorn

    subclasses = _kbd_subclasses(uvicorn.Server)
    assert subclasses
    for cls in subclasses:
        missing = [n for n in _overrides(cls) if not hasattr(uvicorn.Server, n)]
        assert missing == [], f"{cls.__qualname__} overrides what uvicorn no longer has: {missing}"
    for method in (uvicorn.Server.startup, uvicorn.Server.shutdown):
        assert list(inspect.signature(method).parameters) == ["self", "sockets"], method
    assert "self.servers" in inspect.getsource(uvicorn.Server.startup)
    assert uvicorn.Server(uvicorn.Config(app=None, log_config=None)).should_exit is False  # type: ignore[arg-type]


def test_watchfiles_rust_notify_as_kbd_builds_and_drains_it(tmp_path: Path) -> None:
    from kbd.fs.watch import rust_notify

    notifier = rust_notify([str(tmp_path)])
    try:
        stop = threading.Event()
        assert notifier.watch(10, 5, 50, stop) == "timeout"
        (tmp_path / "new.md").write_text("x")
        changes = notifier.watch(10, 5, 5000, stop)
        assert isinstance(changes, set) and (1, str(tmp_path / "new.md")) in changes, changes
        stop.set()
        assert notifier.watch(10, 5, 5000, stop) == "stop"
    finally:
        notifier.close()
