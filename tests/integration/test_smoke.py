from __future__ import annotations

from kbd.service import workflows
from tests.helpers import KbRoot


def test_available_source_resolves(kb: KbRoot) -> None:
    kb.workflow("src", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "s"}])
    h = kb.host()
    atts = workflows.sources(h, "con", actor=h.actor("alice")).sources
    assert [a.available for a in atts] == [True]
    r = kb.cli("sources", "list", "con", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert r.json()["sources"][0]["path"].endswith("workflows/src/knowledgebase")
