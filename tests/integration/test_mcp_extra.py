"""The MCP SDK is an extra (``kbd[mcp]``, pyproject.toml): a real ``kbd mcp``
process on a host without it ends with exit 69 and an error naming the extra,
never a traceback, and writes nothing on stdout (the MCP channel).

The host without the SDK is simulated for the child process only: a
``sitecustomize`` on its PYTHONPATH makes ``import mcp`` and ``import
mcp_types`` fail exactly as on a host that never installed them."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import KbRoot

WITHOUT_SDK = """\
import sys

# A host installed without kbd's MCP extra: these imports fail (ModuleNotFoundError).
for name in ("mcp", "mcp_types"):
    sys.modules[name] = None
"""


def _without_sdk(tmp_path: Path) -> dict[str, str]:
    """The environment of a child that cannot import the MCP SDK."""
    shim = tmp_path / "without-mcp"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(WITHOUT_SDK)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)}


def test_kbd_mcp_without_the_sdk_names_the_extra(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("con", access={"owners": ["alice"]})
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    r = kb.cli("mcp", sid, "--as", "alice", env=_without_sdk(tmp_path), stdin="")
    assert r.code == 69, r.err
    assert r.err.startswith("error[unavailable]: kbd mcp needs the MCP SDK"), r.err
    assert "no module 'mcp_types'" in r.err, r.err
    assert "hint: install kbd with its MCP extra: pip install 'kbd[mcp]'" in r.err, r.err
    assert "Traceback" not in r.err
    assert r.out == ""


def test_the_shim_leaves_the_rest_of_kbd_working(tmp_path: Path) -> None:
    """The same simulated host runs every other command: only ``kbd mcp`` needs the SDK."""
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("con", access={"owners": ["alice"]})
    r = kb.cli("workflows", "list", "--as", "alice", "--json", env=_without_sdk(tmp_path))
    assert r.code == 0, r.err
    assert [w["id"] for w in r.json()["workflows"]] == ["con"]
