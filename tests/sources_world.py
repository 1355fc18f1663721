"""The world of the attachment-validation tests, shared by the operations-layer
unit tests (tests/unit/service/test_workflows.py) and the CLI smoke layer over
them (tests/integration/test_cli_validation.py), so both judge the same cases."""

from __future__ import annotations

from typing import Any

from tests.helpers import KbRoot

ALIAS_RULE = "lowercase letters, digits and underscores, starting with a letter"

# The consumer's audience is {alice, carol, bob}; every ordinary source below lets
# all three read it, so only the property under test makes a case fail.
CONSUMER_ACCESS: dict[str, Any] = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}
SOURCE_ACCESS: dict[str, Any] = {"owners": ["alice"], "editors": ["bob"], "readers": ["carol"]}
FIRST: dict[str, str] = {"workflow_id": "src", "alias": "s"}


def build(kb: KbRoot) -> KbRoot:
    """con (consumer, one attachment `s` → src) and sources of every kind."""
    kb.workflow("con", label="Consumer", access=CONSUMER_ACCESS, sources=[FIRST])
    kb.workflow("src", label="Source", access=SOURCE_ACCESS)
    kb.workflow("src2", label="Second source", access=SOURCE_ACCESS)
    kb.workflow("private", label="Private", access={"owners": ["alice"]})
    kb.workflow("remote", label="Remote", access=SOURCE_ACCESS, host="elsewhere")
    kb.workflow("nokb", label="No KB", access=SOURCE_ACCESS, kb=False)
    kb.workflow("legacy", label="Legacy (no owner)")
    return kb


def workflow_files(kb: KbRoot) -> dict[str, bytes]:
    """Bytes of every file in the workflow tree (state/ is kbd's own and may change)."""
    return {
        str(p.relative_to(kb.root)): p.read_bytes() for p in sorted(kb.workflows.rglob("*")) if p.is_file()
    }
