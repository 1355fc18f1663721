"""The layering rule (docs/architecture.md "Layers"): a pure core that takes data and
returns decisions, and a shell that does I/O and calls it.

Two tiers, both checked here:

* :data:`CORE` — pure: every module under ``kbd/core/``, with no exemption.
  Every import of these modules, at any depth and inside functions too, stays
  inside the core and never names a forbidden library. Imports under
  ``if TYPE_CHECKING:`` are allowed (they never run). The files the core's rules
  judge (kbd.yaml, principals.yaml, the shipped policy tables) are read by
  :mod:`kbd.fs.datafiles` and :mod:`kbd.fs.rootconfig`, never by the core.
* :data:`IMPORT_CLEAN` — the core plus modules outside it (the Seatbelt
  renderer) that may reach the filesystem shell lazily, when called, but whose
  import must load nothing from the I/O layer: checked in a fresh interpreter,
  through ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kbd

PACKAGE = Path(kbd.__file__).resolve().parent


def _every_module() -> set[str]:
    every = set()
    for p in PACKAGE.rglob("*.py"):
        parts = ("kbd", *p.relative_to(PACKAGE).with_suffix("").parts)
        every.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return every


EVERY = frozenset(_every_module())
# Everything under kbd/core/ is pure, plus the error tree and the pure half of
# the sandbox package (plan -> mounts, the BPF program).
CORE = frozenset(
    {m for m in EVERY if m == "kbd.core" or m.startswith("kbd.core.")}
    | {"kbd", "kbd.errors", "kbd.sandbox", "kbd.sandbox.spec", "kbd.sandbox.seccomp"}
)
IMPORT_CLEAN = CORE | {"kbd.sandbox.seatbelt"}
# Libraries that mean I/O, processes or native calls; none may reach the core.
FORBIDDEN = frozenset(
    {
        "ctypes",
        "_ctypes",
        "sqlite3",
        "subprocess",
        "socket",
        "filelock",
        "psutil",
        "watchfiles",
        "multiprocessing",
    }
)
# The I/O layer of kbd: every other module (named so a failure reads plainly).
IO_MODULES = EVERY - IMPORT_CLEAN


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_file(name: str) -> Path | None:
    """The source file of a kbd module, or None when ``name`` is not a module
    (``from kbd import audience`` names the module kbd.core.audience; ``from kbd.x
    import y`` names a function y)."""
    parts = name.split(".")
    if parts[0] != "kbd":
        return None
    if len(parts) == 1:
        return PACKAGE / "__init__.py"
    rel = Path(*parts[1:])
    for candidate in (PACKAGE / rel / "__init__.py", PACKAGE / rel.parent / f"{rel.name}.py"):
        if candidate.is_file():
            return candidate
    return None


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from … import`` names, relative imports resolved in ``package``."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parent = ".".join(parts[: len(parts) - node.level + 1])
        base = f"{parent}.{base}" if base else parent
    return base


def imports_of(source: str, *, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, at any depth (functions, classes, try
    blocks), except under ``if TYPE_CHECKING:``. ``importlib.import_module`` and
    ``__import__`` with a literal name count too."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            found.add(base)
            # `from kbd import audience` imports the module kbd.core.audience.
            found.update(f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}"))
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _kbd_imports(module: str) -> set[str]:
    path = _module_file(module)
    assert path is not None, module
    return imports_of(path.read_text(encoding="utf-8"), module=module, is_package=path.name == "__init__.py")


def layering_problems(core: frozenset[str]) -> list[str]:
    """Each import that leaves the pure core, with the chain that reaches it."""
    problems: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, tuple[str, ...]]] = [(m, (m,)) for m in sorted(core)]
    while stack:
        module, chain = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        for imported in sorted(_kbd_imports(module)):
            top = imported.split(".")[0]
            route = " -> ".join((*chain, imported))
            if top in FORBIDDEN:
                problems.append(f"{route}: {top} is I/O, never core")
            elif top == "kbd" and _module_file(imported) is not None:
                if imported in IO_MODULES:
                    problems.append(f"{route}: an I/O-layer module")
                elif imported not in core:
                    problems.append(f"{route}: not a core module")
                else:
                    stack.append((imported, (*chain, imported)))
    return problems


def test_the_core_imports_only_the_core() -> None:
    assert layering_problems(CORE) == []


def test_core_and_io_lists_name_real_modules() -> None:
    """A renamed module must not silently drop out of the check."""
    for name in CORE | IMPORT_CLEAN | IO_MODULES:
        assert _module_file(name) is not None, name
    assert not CORE & IO_MODULES
    assert not IMPORT_CLEAN & IO_MODULES
    # The tiers are read from the tree: kbd/core/ is pure by where it lives.
    assert {m for m in EVERY if m.startswith("kbd.core")} <= CORE
    assert len(CORE) > 10


def test_the_scanner_sees_what_it_must() -> None:
    """The checks above can fail: imports inside functions, relative imports and
    import_module count; only TYPE_CHECKING blocks are exempt."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kbd.fs.registry import Registry\nelse:\n    import sqlite3\n"
        "def f():\n    import ctypes\n    from ..fs import confined\n"
        "    try:\n        from ..fs.atomic import write_atomic\n    except ImportError:\n        pass\n"
        "importlib.import_module('subprocess')\n"
    )
    found = imports_of(src, module="kbd.core.plan")
    assert {"sqlite3", "ctypes", "kbd.fs.confined", "kbd.fs.atomic", "subprocess"} <= found
    assert "kbd.fs.registry" not in found


def test_a_core_module_reaching_the_io_layer_is_reported() -> None:
    """The same walk over a core that wrongly lists a module with a lazy I/O
    import (the Seatbelt renderer reads its template through the shell) reports
    that import, with the chain."""
    problems = layering_problems(CORE | {"kbd.sandbox.seatbelt"})
    assert any("kbd.sandbox.seatbelt -> kbd.fs.datafiles" in p for p in problems), problems


SUBPROCESS_IMPORTS = (
    "kbd.core.plan",
    "kbd.core.folders",
    "kbd.core.resolve",
    "kbd.core.audience",
    "kbd.core.manifest",
    "kbd.core.policy",
    "kbd.core.identifiers",
    "kbd.core.relpaths",
    "kbd.sandbox.spec",
    "kbd.sandbox.seccomp",
    "kbd.sandbox.seatbelt",
    "kbd.core.injection",
    "kbd.core.principals",
    "kbd.core.config",
    "kbd.core.lookup",
    "kbd.core.layout",
)


@pytest.mark.parametrize("modules", [SUBPROCESS_IMPORTS, *[(m,) for m in SUBPROCESS_IMPORTS]], ids=str)
def test_importing_the_core_loads_no_io(modules: tuple[str, ...]) -> None:
    """In a fresh interpreter: no ctypes (so no openat2 probe), no sqlite3,
    subprocess, socket or filelock, and no I/O-layer module of kbd."""
    code = f"import json, sys\nimport {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout))
    assert {m for m in loaded if m.split(".")[0] in FORBIDDEN} == set()
    assert {m for m in loaded if m.startswith("kbd")} - IMPORT_CLEAN == set()


# -- the whole order ------------------------------------------------------------------------------

#: The tiers of kbd, lowest first (README "Architecture"). A module may import
#: its own folder and anything in a lower tier; sideways within a tier only
#: along SIDEWAYS; never up. Imports inside functions and under TYPE_CHECKING
#: count: a lazy import is still a dependency, and a type-only one still ties
#: the two modules' meanings together.
TIERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("core",),
    ("fs",),
    ("state", "sandbox"),
    ("service",),
    ("ops", "client"),
    ("daemon", "cli", "mcp", "ui"),
)
#: The operations reach a daemon through the client library; the CLI starts the
#: daemon (`kbd serve`), the MCP server (`kbd mcp`) and the page (`kbd ui`).
SIDEWAYS = frozenset({("ops", "client"), ("cli", "daemon"), ("cli", "mcp"), ("cli", "ui")})
TIER_OF = {unit: rank for rank, units in enumerate(TIERS) for unit in units}
#: What the top of kbd/ may hold besides the tiers: the package's own files.
PACKAGE_FILES = frozenset({"__init__.py", "__main__.py", "py.typed"})


def unit_of(module: str) -> str:
    """The tier folder (or module) a kbd module belongs to; ``kbd`` itself and
    ``kbd.__main__`` (``python -m kbd`` is the console script) belong to the
    bottom and the CLI."""
    parts = module.split(".")
    if len(parts) == 1:
        return "errors"
    return "cli" if parts[1] == "__main__" else parts[1]


def every_import(module: str) -> set[str]:
    """Every kbd module ``module`` imports, TYPE_CHECKING blocks included."""
    path = _module_file(module)
    assert path is not None, module
    return kbd_imports_in(
        path.read_text(encoding="utf-8"), module=module, is_package=path.name == "__init__.py"
    )


def kbd_imports_in(source: str, *, module: str, is_package: bool = False) -> set[str]:
    """The kbd modules ``source`` imports anywhere: in functions, in try
    blocks, under TYPE_CHECKING."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        found.update(n for n in names if n.split(".")[0] == "kbd" and _module_file(n) is not None)
    return found - {module}


def order_problems(graph: dict[str, set[str]]) -> list[str]:
    """Each import that points up a tier or sideways outside SIDEWAYS, and each
    circle of modules (its members, in order)."""
    problems = [f"{m}: in no tier (each module lives in a tier's folder)" for m in sorted(graph)
                if unit_of(m) not in TIER_OF]  # fmt: skip
    for module, imported in sorted(graph.items()):
        here = unit_of(module)
        for other in sorted(imported):
            there = unit_of(other)
            if here not in TIER_OF or there not in TIER_OF:
                continue  # reported above
            if there == here or TIER_OF[there] < TIER_OF[here] or (here, there) in SIDEWAYS:
                continue
            way = "up" if TIER_OF[there] > TIER_OF[here] else "sideways"
            problems.append(f"{module} -> {other}: {way} from {here} to {there}")
    problems.extend("circle: " + " -> ".join(c) for c in circles(graph))
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _import_graph() -> dict[str, set[str]]:
    # A package's __init__ is imported by each of its modules implicitly: not an edge.
    return {m: {i for i in every_import(m) if not m.startswith(i + ".")} for m in sorted(EVERY)}


def test_every_import_keeps_the_tier_order_and_closes_no_circle() -> None:
    assert order_problems(_import_graph()) == []


def test_the_top_of_kbd_holds_only_tiers() -> None:
    top = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    tiers = {unit for units in TIERS for unit in units}
    assert top - PACKAGE_FILES == {u if (PACKAGE / u).is_dir() else f"{u}.py" for u in tiers}


def test_the_order_check_can_fail() -> None:
    """An upward import, a forbidden sideways one, a lazy or type-only import and
    a circle are each reported."""
    graph = {
        "kbd.fs.lint": {"kbd.service.root"},
        "kbd.state.processes": {"kbd.sandbox.cgroup"},
        "kbd.daemon.broker": {"kbd.daemon.server"},
        "kbd.daemon.server": {"kbd.daemon.broker"},
        "kbd.ops": {"kbd.client.library"},
    }
    problems = order_problems(graph)
    assert "kbd.fs.lint -> kbd.service.root: up from fs to service" in problems
    assert "kbd.state.processes -> kbd.sandbox.cgroup: sideways from state to sandbox" in problems
    assert "circle: kbd.daemon.broker -> kbd.daemon.server" in problems
    assert len(problems) == 3, problems
    src = (
        "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from kbd.service.root import Root\n"
        "def f():\n    from kbd.daemon import server\n    from ..fs import atomic\n"
    )
    found = kbd_imports_in(src, module="kbd.core.plan")
    assert {"kbd.service.root", "kbd.daemon.server", "kbd.fs.atomic"} <= found


def test_every_package_is_shipped() -> None:
    """pyproject.toml lists kbd's packages by name (data packages come from
    other folders): a new folder left out would be missing from the wheel."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {".".join(("kbd", *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("__init__.py")}
    assert folders - listed == set()
