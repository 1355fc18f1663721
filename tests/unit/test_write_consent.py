"""Write consent (docs/access.md "Access rules"): pending until the
source's owner grants; only owners or admins grant; revoke restores pending."""

from __future__ import annotations

import pytest

from kbd.core.resolve import Attachment
from kbd.errors import InvalidInput, InvalidManifest, PermissionDenied, WorkflowNotFound
from kbd.service import workflows
from kbd.state import audit
from tests.helpers import KbRoot


@pytest.fixture
def pair(kb: KbRoot) -> KbRoot:
    kb.workflow("src", access={"owners": ["bob"], "editors": ["carol"], "readers": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]})
    return kb


def att(kb: KbRoot, alias: str = "s") -> Attachment:
    h = kb.host()
    atts = workflows.sources(h, "con", actor=h.actor("alice")).sources
    return next(a for a in atts if a.alias == alias)


def test_write_attach_without_grant_is_saved_pending(pair: KbRoot) -> None:
    h = pair.host()
    a = workflows.attach(h, "con", "src", alias="s", access="write", actor=h.actor("alice"))
    assert a.available and a.path is not None
    assert a.write is not None and (a.write.available, a.write.reason) == (False, "write_not_granted")
    saved = pair.read_manifest(pair.workflows / "con")
    assert saved["knowledgebase_sources"] == [{"workflow_id": "src", "alias": "s", "access": "write"}]


def test_owner_grant_makes_writable_and_revoke_restores_pending(pair: KbRoot) -> None:
    h = pair.host()
    workflows.attach(h, "con", "src", alias="s", access="write", actor=h.actor("alice"))
    assert workflows.grant(h, "src", "con", actor=h.actor("bob")).changed is True
    assert att(pair).writable
    assert workflows.grant(h, "src", " con ", actor=h.actor("bob")).changed is False  # trimmed, de-duplicated
    assert pair.read_manifest(pair.workflows / "src")["access"]["allowed_kb_writers"] == ["con"]
    assert workflows.revoke(h, "src", "con", actor=h.actor("bob")).changed is True
    a = att(pair)
    assert a.available and a.write is not None and a.write.reason == "write_not_granted"
    events = [e["event"] for e in audit.read(pair.root / "state")]
    assert events.count("writer_granted") == 2 and "writer_revoked" in events


def test_admin_may_grant(pair: KbRoot) -> None:
    h = pair.host()
    workflows.attach(h, "con", "src", alias="s", access="write", actor=h.actor("alice"))
    workflows.grant(h, "src", "con", actor=h.actor("ops"))
    assert att(pair).writable


@pytest.mark.parametrize("who", ["carol", "alice", "dave", "svc"])
def test_only_source_owner_or_admin_grants(pair: KbRoot, who: str) -> None:
    h = pair.host()
    before = (pair.workflows / "src" / "workflow.json").read_bytes()
    # An outsider (dave) learns nothing: the answer for a missing workflow.
    expected = (
        (WorkflowNotFound, "no workflow")
        if who == "dave"
        else (PermissionDenied, "only its owners or an admin")
    )
    with pytest.raises(expected[0], match=expected[1]):
        workflows.grant(h, "src", "con", actor=h.actor(who))
    assert (pair.workflows / "src" / "workflow.json").read_bytes() == before
    refused = [e for e in audit.read(pair.root / "state") if e["event"] == "writer_grant_refused"]
    assert refused and refused[-1]["actor"] == who


@pytest.mark.parametrize("who", ["mallory", "exadmin", "nobody"])
def test_disabled_and_unknown_principals_refused(pair: KbRoot, who: str) -> None:
    h = pair.host()
    with pytest.raises(PermissionDenied):
        workflows.grant(h, "src", "con", actor=h.actor(who))


def test_grant_validation(pair: KbRoot) -> None:
    h = pair.host()
    bob = h.actor("bob")
    before = (pair.workflows / "src" / "workflow.json").read_bytes()
    with pytest.raises(WorkflowNotFound):
        workflows.grant(h, "src", "ghost", actor=bob)
    with pytest.raises(InvalidManifest, match="itself"):
        workflows.grant(h, "src", "src", actor=bob)
    with pytest.raises(InvalidManifest, match="must not"):
        workflows.grant(h, "src", "a/b", actor=bob)
    assert (pair.workflows / "src" / "workflow.json").read_bytes() == before


def test_grant_limit_of_fifty(pair: KbRoot) -> None:
    for i in range(51):
        pair.workflow(f"w{i:02d}", access={"owners": ["bob"]})
    h = pair.host()
    bob = h.actor("bob")
    for i in range(50):
        workflows.grant(h, "src", f"w{i:02d}", actor=bob)
    with pytest.raises(InvalidManifest, match="at most 50"):
        workflows.grant(h, "src", "w50", actor=bob)


def test_legacy_source_cannot_grant_or_be_attached_for_write(kb: KbRoot) -> None:
    kb.workflow("legacy")
    kb.workflow("con", access={"owners": ["alice"]})
    h = kb.host()
    with pytest.raises(InvalidInput, match="legacy"):
        workflows.grant(h, "legacy", "con", actor=h.actor("ops"))
    with pytest.raises(InvalidInput, match="nobody can ever grant"):
        workflows.attach(h, "con", "legacy", alias="l", access="write", actor=h.actor("alice"))
    a = workflows.attach(h, "con", "legacy", alias="l", access="read", actor=h.actor("alice"))
    assert a.available and a.write is None


def test_write_status_keeps_read_failure_reason(pair: KbRoot) -> None:
    h = pair.host()
    workflows.attach(h, "con", "src", alias="s", access="write", actor=h.actor("alice"))
    workflows.grant(h, "src", "con", actor=h.actor("bob"))
    pair.edit(pair.workflows / "src", access={"owners": ["bob"], "allowed_kb_writers": ["con"]})
    a = att(pair)
    assert (a.available, a.reason) == (False, "audience_denied")
    assert a.write is not None and (a.write.available, a.write.reason) == (False, "audience_denied")


def test_revoking_a_grant_that_is_not_there_is_a_noop(pair: KbRoot) -> None:
    h = pair.host()
    before = (pair.workflows / "src" / "workflow.json").read_bytes()
    assert workflows.revoke(h, "src", "con", actor=h.actor("bob")).changed is False
    assert (pair.workflows / "src" / "workflow.json").read_bytes() == before
