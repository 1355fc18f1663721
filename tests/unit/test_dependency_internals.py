"""The third-party internals kbd relies on, imported and exercised exactly as kbd
uses them, so that raising a version bound in pyproject.toml past a release that
moved them fails here, loudly, rather than in a daemon on a host.

A library appears in INTERNALS when kbd imports one of its private modules
(``watchfiles._rust_notify``) or subclasses an undocumented class and overrides
its methods (uvicorn's ``HttpToolsProtocol`` and ``Server``); each such library
carries an upper bound in pyproject.toml. The AST scan below fails on a new
import of a private module (a ``_name`` component) that is not listed here,
``importlib.import_module("x._y")`` included.

The standard library's private modules kbd uses (STDLIB_INTERNALS: the regex
parser behind kbd/core/injection.py, the JSON scanner of the Landlock helper)
are bound by the Python version instead; their test below fails on the first
Python that moves them."""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.metadata
import inspect
import json
import pkgutil
import re
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
#: The standard library's private modules kbd uses: the regex parser (kbd/core/injection.py), and C
#: modules that spare the lean start-up paths (kbd exec, the Landlock helper) their Python wrappers.
STDLIB_INTERNALS = {
    "_ctypes", "_frozen_importlib_external", "_json", "_signal", "_socket",
    "re._casefix", "re._compiler", "re._constants", "re._parser",
}  # fmt: skip


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


def _imports() -> set[str]:
    """Every module a kbd/ file imports (absolute imports, relative ones being
    kbd's own, and ``importlib.import_module`` of a literal name)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.add(node.args[0].value)
    return found


def _private(module: str) -> bool:
    parts = module.split(".")
    return not module.startswith("__") and any(part.startswith("_") for part in parts)


def _used_names() -> dict[str, set[str]]:
    """Private module → the names kbd takes from it: ``from m import a`` and
    ``m.a`` after ``import m`` (in the same file)."""
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level and _private(node.module):
                used.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                bound.update({a.asname or a.name: a.name for a in node.names if _private(a.name)})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
            ):
                used.setdefault(bound[node.value.id], set()).add(node.attr)
    return used


def test_every_name_kbd_takes_from_a_private_module_exists() -> None:
    for module, names in _used_names().items():
        mod = importlib.import_module(module)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert missing == [], f"{module} lacks {missing}"


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
    imported = _imports()
    listed = set().union(*INTERNALS.values())
    private = {
        m for m in imported if m.split(".")[0] not in ("kbd", *sys.stdlib_module_names) and _private(m)
    }
    assert private <= listed, sorted(private - listed)
    assert listed <= imported, sorted(listed - imported)  # a stale entry here: drop it and its bound
    stdlib = {m for m in imported if m.split(".")[0] in sys.stdlib_module_names and _private(m)}
    assert stdlib == STDLIB_INTERNALS, sorted(stdlib ^ STDLIB_INTERNALS)


def test_the_stdlib_internals_have_what_kbd_uses() -> None:
    """Every ``sre_parse.X`` / ``sre_constants.X`` / ``sre_compiler.X`` that
    kbd/core/injection.py names, the case-folding table, and the C JSON scanner
    with the decoder attributes the Landlock helper hands it."""
    source = (PACKAGE / "core" / "injection.py").read_text()
    for alias, module in (("sre_parse", "re._parser"), ("sre_constants", "re._constants"),
                          ("sre_compiler", "re._compiler")):  # fmt: skip
        assert f'{alias}: Any = importlib.import_module("{module}")' in source, alias
        used = set(re.findall(rf"\b{alias}\.(\w+)", source))
        assert used, alias
        missing = sorted(n for n in used if not hasattr(importlib.import_module(module), n))
        assert missing == [], f"{module} lacks {missing}"
    assert isinstance(importlib.import_module("re._casefix")._EXTRA_CASES, dict)
    from kbd.sandbox.landlock_helper import loads

    assert loads(' {"a": [1, 2.5, "x", null, true]} ') == json.loads('{"a": [1, 2.5, "x", null, true]}')
    make_scanner = importlib.import_module("_json").make_scanner
    assert callable(make_scanner)


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
