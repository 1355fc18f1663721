from __future__ import annotations

from tests.helpers import KbRoot


def test_available_source_resolves(kb: KbRoot) -> None:
    kb.workflow("src", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "s"}])
    h = kb.host()
    _, atts = h.sources("con", h.actor("alice"))
    assert [a.available for a in atts] == [True]
    r = kb.cli("sources", "list", "con", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert r.json()["sources"][0]["path"].endswith("workflows/src/knowledgebase")
