"""The workflows the browser tests build (the same builder makes a CLI-driven twin root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers import KbRoot

MAIN = "wf_main"
# An unknown top-level field: every save through the page must keep it untouched.
CUSTOM: dict[str, Any] = {"x_custom": {"keep": [1, "two", {"three": None}], "note": "kept by kbd"}}
SECRET = "SOUL-SECRET-7f3a"


def build(kb: KbRoot) -> None:
    """wf_main (alice owns, bob reads) attaches:
    - ``src``: wf_src, read, available;
    - ``cost``: wf_cost (carol's), write, not granted → "waiting for the owner's grant";
    - ``gone``: wf_gone, which does not exist → not_found;
    - ``private``: wf_private (dave's alone) → audience_denied.
    wf_extra is a candidate nobody attached yet."""
    shared = {"owners": ["alice"], "readers": ["bob"]}
    kb.workflow("wf_src", label="Source KB", access=shared)
    kb.workflow("wf_extra", label="Extra KB", access=shared)
    kb.workflow("wf_cost", label="Cost tracking", access={"owners": ["carol"], "readers": ["alice", "bob"]})
    kb.workflow("wf_private", label="Private KB", access={"owners": ["dave"]})
    kb.workflow(
        MAIN,
        label="Main workflow",
        access=shared,
        sources=[
            {"workflow_id": "wf_src", "alias": "src", "access": "read"},
            {"workflow_id": "wf_cost", "alias": "cost", "access": "write"},
            {"workflow_id": "wf_gone", "alias": "gone", "access": "read"},
            {"workflow_id": "wf_private", "alias": "private", "access": "read"},
        ],
        **CUSTOM,
    )
    main_kb = kb.workflows / MAIN / "knowledgebase"
    (main_kb / "notes" / "howto.md").write_text("# How to\nRun `make test` before you push.\n")
    src_kb = kb.workflows / "wf_src" / "knowledgebase"
    (src_kb / "notes" / "router.md").write_text("# Router\nThe router drops packets over 9000 bytes.\n")
    (kb.workflows / "wf_src" / "soul" / "secret.md").write_text(f"{SECRET}\n")


def manifest(kb: KbRoot, wid: str = MAIN) -> bytes:
    return (kb.workflows / wid / "workflow.json").read_bytes()


def plant_links(kb_dir: Path) -> dict[str, str]:
    """Links in a KB's notes/ that lead out of it: to the workflow's soul/, to /etc/passwd,
    and a folder link; the name → its target."""
    links = {
        "soul.md": "../../soul/secret.md",
        "passwd.md": "/etc/passwd",
        "soul-dir": "../../soul",
    }
    for name, target in links.items():
        (kb_dir / "notes" / name).symlink_to(target)
    return links


def doc(kb: KbRoot, wid: str = MAIN) -> dict[str, Any]:
    return kb.read_manifest(kb.workflows / wid)
