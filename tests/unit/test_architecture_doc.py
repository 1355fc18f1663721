"""docs/architecture.md's module table names every module of ``kbd/`` (README "Architecture"):
a module added without a line there fails here, so the map a newcomer reads stays whole."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def named_in_table() -> set[str]:
    names: set[str] = set()
    for line in (REPO / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            names.update(m.rstrip("/*") for m in re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_every_module_has_a_line_in_the_architecture_table() -> None:
    named = named_in_table()
    modules = [
        str(p.relative_to(REPO / "kbd").with_suffix(""))
        for p in sorted((REPO / "kbd").rglob("*.py"))
        if p.stem not in ("__init__", "__main__")
    ]
    assert len(modules) > 100, modules  # the walk found the package
    missing = [m for m in modules if m not in named and not any(m.startswith(f"{n}/") for n in named)]
    assert missing == [], f"docs/architecture.md has no line for: {', '.join(missing)}"
