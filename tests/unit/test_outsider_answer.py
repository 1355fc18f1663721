"""What an outsider is told about a workflow it may not inspect: word for word
what a missing workflow gets (docs/access.md "Invisible is not found"), built in one place —
:func:`kbd.core.audience.require_inspectable` — so no operation can phrase it
differently and let IDs be probed."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import kbd
from kbd.core import audience
from kbd.core.manifest import parse_manifest
from kbd.core.principals import Principal
from kbd.errors import WorkflowNotFound, workflow_not_found

PACKAGE = Path(kbd.__file__).resolve().parent
OWNED = parse_manifest(
    json.dumps({"id": "con", "access": {"owners": ["alice"], "readers": ["bob"]}}).encode()
)


@pytest.mark.parametrize("actor", [Principal("dave"), Principal("alice", disabled=True)])
def test_an_outsider_gets_the_missing_workflow_answer(actor: Principal) -> None:
    missing = workflow_not_found("con")
    with pytest.raises(WorkflowNotFound) as info:
        audience.require_inspectable(actor, OWNED, "con")
    err = info.value
    assert (err.code, err.message, err.hint, err.exit_code, err.http_status) == (
        missing.code, missing.message, missing.hint, missing.exit_code, missing.http_status,
    )  # fmt: skip
    # Only the audit record tells the two apart.
    assert (err.reason, missing.reason) == ("not_visible", None)


@pytest.mark.parametrize("actor", [Principal("alice"), Principal("bob"), Principal("root", admin=True)])
def test_whoever_may_inspect_passes(actor: Principal) -> None:
    audience.require_inspectable(actor, OWNED, "con")


def _outsider_answers(tree: ast.AST) -> list[int]:
    """Lines that build the outsider answer by hand: ``workflow_not_found(...,
    outsider=True)`` or a ``WorkflowNotFound(...)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "WorkflowNotFound" or (
                name == "workflow_not_found" and any(k.arg == "outsider" for k in node.keywords)
            ):
                lines.append(node.lineno)
    return lines


def test_the_outsider_answer_is_built_in_one_place() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in (
            "errors/__init__.py",
            "core/audience.py",
        ):  # the answer itself, and the one check that gives it
            continue
        lines = _outsider_answers(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[rel] = lines
    assert found == {}, f"use kbd.core.audience.require_inspectable instead: {found}"
