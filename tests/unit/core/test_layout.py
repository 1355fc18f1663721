"""On-disk names and the racy-timestamp window are spelled once, in
kbd/core/layout.py (docs/on-disk.md "Root layout"): no other module of kbd holds them as literals."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import kbd
from kbd.core import layout

PACKAGE = Path(kbd.__file__).resolve().parent
# "notes" and "state" also name other things (a local_kb mode, an index field, a
# lock namespace), so only the names that mean nothing else are checked.
NAMES = frozenset(
    {layout.KB_DIR, layout.INDEX_NAME, layout.MANIFEST, layout.CONFIG_NAME, layout.PRINCIPALS_NAME}
)


def spelled_names(source: str) -> list[tuple[int, object]]:
    """Each literal that names an on-disk name (alone or as a component of a
    path such as ``knowledgebase/notes``) or the racy window's value. Text with
    whitespace is prose (messages, docstrings), not a path."""
    found: list[tuple[int, object]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Constant):
            continue
        value = node.value
        if isinstance(value, str) and not any(c.isspace() for c in value):
            if NAMES & set(value.split("/")):
                found.append((node.lineno, value))
        elif type(value) is int and value == layout.RACY_NS:
            found.append((node.lineno, value))
    return found


def test_on_disk_names_are_spelled_only_in_layout() -> None:
    spelled = {
        path.relative_to(PACKAGE).as_posix(): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "layout.py" or path.parent.name != "core"
        if (hits := spelled_names(path.read_text(encoding="utf-8")))
    }
    assert spelled == {}


def test_the_scanner_sees_paths_but_not_prose() -> None:
    src = (
        'A = "knowledgebase/notes/_index.json"\nB = "workflow.json"\nC = 200_000_000\n'
        'D = "the source has no knowledgebase/ folder"\nE = "notes"\n'
    )
    assert [line for line, _ in spelled_names(src)] == [1, 2, 3]


def test_racy_is_the_window(tmp_path: Path) -> None:
    """A file whose last change is within RACY_NS of now is racy; a moment later it is settled."""
    f = tmp_path / "f"
    f.write_text("x")
    st = os.stat(f)
    changed = max(st.st_mtime_ns, st.st_ctime_ns)
    assert layout.racy(st, changed + layout.RACY_NS)
    assert not layout.racy(st, changed + layout.RACY_NS + 1)
