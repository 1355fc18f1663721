"""The operations layer (kbd.service): every interface's product logic, tested
once here on real temporary roots (fast: no subprocess, no daemon). The CLI and
API tests stay as the contract's smoke layer over it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kbd.core.plan import Plan
from kbd.core.principals import Principal, Principals
from kbd.errors import (
    InvalidInput,
    KbdError,
    ManifestUnreadable,
    NotFound,
    PermissionDenied,
    UsageError,
    WorkflowNotFound,
)
from kbd.service import admin, auth, browse, notes, sessions, workflows
from kbd.service import principals as principal_ops
from kbd.service.sessions import RootSessions
from kbd.state import audit
from tests.helpers import OPERATOR, KbRoot, issue_token

SERVICE_MODULES = (auth, workflows, sessions, browse, notes, admin)


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    kb.workflow("src", access={"owners": ["bob"], "editors": ["carol"], "readers": ["alice"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"], "readers": ["bob"]},
        sources=[{"workflow_id": "src", "alias": "src"}],
    )
    kb.workflow("lib", access={"owners": ["alice"], "readers": ["bob"]})
    return kb


# -- every operation names who acts -----------------------------------------------------------


def _operations() -> list[tuple[str, Callable[..., Any]]]:
    out: list[tuple[str, Callable[..., Any]]] = []
    for module in SERVICE_MODULES:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                out.append((f"{module.__name__}.{name}", fn))
    return out


def test_every_service_operation_that_takes_an_actor_requires_it() -> None:
    ops = {name: fn for name, fn in _operations() if "actor" in inspect.signature(fn).parameters}
    for name in ("kbd.service.workflows.grant", "kbd.service.sessions.open_child", "kbd.service.browse.read",
                 "kbd.service.notes.write", "kbd.service.sessions.check"):  # fmt: skip
        assert name in ops, sorted(ops)
    for name, fn in ops.items():
        param = inspect.signature(fn).parameters["actor"]
        assert param.default is inspect.Parameter.empty, name
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name


def test_service_modules_define_no_error_classes() -> None:
    """Operations raise errors from the one tree; they never invent their own."""
    for module in SERVICE_MODULES:
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module.__name__:
                assert not issubclass(obj, BaseException), obj


# -- auth: who is acting ----------------------------------------------------------------------

TOKEN = "kbd_secret-token"
PEOPLE = Principals(
    by_id={
        "alice": Principal("alice", uid=1001, token_sha256=auth.token_digest(TOKEN)),
        "gone": Principal("gone", disabled=True, uid=1002, token_sha256=auth.token_digest("kbd_gone")),
        "svc": Principal("svc", kind="service"),
    }
)


def test_a_bearer_token_names_its_principal() -> None:
    assert auth.authenticate(PEOPLE, authorization=f"Bearer {TOKEN}", peer_uid=None) == PEOPLE.by_id["alice"]
    assert auth.authenticate(PEOPLE, authorization=f"bearer {TOKEN} ", peer_uid=None) == PEOPLE.by_id["alice"]


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ("Basic abc", "malformed"),
        ("Bearer", "malformed"),
        ("Bearer ", "malformed"),
        ("Bearer kbd_x", "unknown"),
    ],
)
def test_a_bad_token_never_falls_back_to_the_uid(header: str, why: str) -> None:
    who = auth.authenticate(PEOPLE, authorization=header, peer_uid=1001)
    assert isinstance(who, auth.NotAuthenticated) and why in who.message


def test_a_disabled_principal_is_refused_not_unknown() -> None:
    with pytest.raises(PermissionDenied, match="'gone' is disabled"):
        auth.authenticate(PEOPLE, authorization="Bearer kbd_gone", peer_uid=None)
    with pytest.raises(PermissionDenied, match="'gone' is disabled"):
        auth.authenticate(PEOPLE, authorization=None, peer_uid=1002)


def test_the_peer_uid_maps_to_a_principal() -> None:
    assert auth.authenticate(PEOPLE, authorization=None, peer_uid=1001) == PEOPLE.by_id["alice"]
    for uid in (4242, None):
        who = auth.authenticate(PEOPLE, authorization=None, peer_uid=uid)
        assert isinstance(who, auth.NotAuthenticated) and "not mapped" in who.message


def test_the_cli_principal_is_named_or_mapped() -> None:
    assert auth.named_or_mapped(PEOPLE, flag="svc", env="alice", uid=0).id == "svc"
    assert auth.named_or_mapped(PEOPLE, flag=None, env="svc", uid=1001).id == "svc"
    assert auth.named_or_mapped(PEOPLE, flag=None, env=None, uid=1001).id == "alice"
    with pytest.raises(UsageError):
        auth.named_or_mapped(PEOPLE, flag=" ", env=None, uid=1001)  # never a fallback
    with pytest.raises(PermissionDenied, match="no principal is mapped to uid 4242"):
        auth.named_or_mapped(PEOPLE, flag=None, env=None, uid=4242)
    with pytest.raises(PermissionDenied, match="disabled"):
        auth.named_or_mapped(PEOPLE, flag=None, env=None, uid=1002)


def test_session_commands_act_as_the_operator_unless_a_principal_is_named() -> None:
    assert auth.named_or_operator(PEOPLE, flag=None, env=None, operator=OPERATOR) is OPERATOR
    assert auth.named_or_operator(PEOPLE, flag=None, env="alice", operator=OPERATOR) == PEOPLE.by_id["alice"]
    with pytest.raises(UsageError):
        auth.named_or_operator(PEOPLE, flag=None, env="", operator=OPERATOR)


# -- workflows, sources, writers -------------------------------------------------------------


def test_sources_view_is_the_contract_shape(world: KbRoot) -> None:
    h = world.host()
    view = workflows.sources(h, "con", actor=h.actor("alice"))
    body = view.to_json()
    assert list(body) == ["workflow_id", "version", "sources"]
    assert body["workflow_id"] == "con" and body["sources"][0]["alias"] == "src"
    assert body["sources"] == [a.to_json() for a in view.sources]
    # The same view after a replacement: one builder for both.
    saved = workflows.set_sources(h, "con", [], actor=h.actor("alice"), expected_version=view.version)
    assert saved.to_json() == {"workflow_id": "con", "version": saved.version, "sources": []}


def test_outsiders_are_told_the_workflow_does_not_exist(world: KbRoot) -> None:
    h = world.host()
    for op in (workflows.sources, workflows.show, workflows.candidates, workflows.writers):
        with pytest.raises(WorkflowNotFound):
            op(h, "con", actor=h.actor("dave"))


def test_grant_and_revoke_report_the_same_trimmed_consumer(world: KbRoot) -> None:
    h = world.host()
    granted = workflows.grant(h, "src", " con ", actor=h.actor("bob"))
    revoked = workflows.revoke(h, "src", " con ", actor=h.actor("bob"))
    assert granted.to_json() == {"source": "src", "consumer": "con", "granted": True, "changed": True}
    assert revoked.to_json() == {"source": "src", "consumer": "con", "granted": False, "changed": True}
    records = [
        e for e in audit.read(world.root / "state") if e["event"] in ("writer_granted", "writer_revoked")
    ]
    assert [e["consumer"] for e in records] == ["con", "con"]


def test_show_lists_everything_a_builder_needs(world: KbRoot) -> None:
    h = world.host()
    d = workflows.show(h, "con", actor=h.actor("alice"))
    body = d.to_json()
    assert body["workflow_id"] == "con" and body["path"] == str(world.workflows / "con")
    assert body["owners"] == ["alice"] and body["readers"] == ["bob"] and body["can_manage"] is True
    assert [s["alias"] for s in body["sources"]] == ["src"] and body["writes_into"] == []
    assert [c["workflow_id"] for c in body["candidates"]] == ["lib"]
    assert workflows.show(h, "con", actor=h.actor("bob")).can_manage is False  # a reader only inspects


def test_attach_and_detach(world: KbRoot) -> None:
    h = world.host()
    att = workflows.attach(h, "con", "lib", alias="lib", access="read", actor=h.actor("alice"))
    assert att.available and att.to_json()["env"] == "WORKFLOW_KB_LIB"
    assert workflows.detach(h, "con", "lib", actor=h.actor("alice")).to_json() == {
        "workflow_id": "con",
        "detached": "lib",
    }
    with pytest.raises(NotFound):
        workflows.detach(h, "con", "lib", actor=h.actor("alice"))


def test_workflow_list_is_typed_rows(world: KbRoot) -> None:
    h = world.host()
    rows = workflows.list_workflows(h, actor=h.actor("ops")).workflows
    assert sorted(r.id or "" for r in rows) == ["con", "lib", "src"]
    assert all(r.status == "ok" and r.contains == () for r in rows)


def sid_of(plan: Plan) -> str:
    assert plan.session_id is not None  # every plan of an opened session names it
    return plan.session_id


# -- sessions ---------------------------------------------------------------------------------


def test_a_child_session_defaults_to_its_parents_kind(world: KbRoot) -> None:
    h = world.host()
    s = RootSessions(h)
    alice = h.actor("alice")
    parent = sessions.open_session(s, "con", actor=alice, kind="execution", kb_access="read")
    child = sessions.open_child(s, sid_of(parent), actor=alice)
    assert (child.kind, child.workflow_id, child.kb_access) == ("execution", "con", "read")
    assert child.to_json()["parent"] == sid_of(parent)
    with pytest.raises(PermissionDenied, match="keeps its parent's kind"):
        sessions.open_child(s, sid_of(parent), actor=alice, kind="builder")
    with pytest.raises(NotFound):
        sessions.open_child(s, "s_00000000000000000000", actor=alice)


def test_session_show_list_check_and_close(world: KbRoot) -> None:
    h = world.host()
    s = RootSessions(h)
    sid = sid_of(sessions.open_session(s, "con", actor=h.actor("alice"), kind="execution"))
    view = sessions.show(s, sid, actor=OPERATOR)
    assert view.running == () and view.to_json()["running"] == []
    assert view.to_json() == {**view.plan.to_json(), "running": []}
    assert [r.id for r in sessions.list_sessions(s, actor=h.actor("alice")).sessions] == [sid]
    assert sessions.list_sessions(s, actor=h.actor("bob")).to_json() == {"sessions": []}  # not bob's session
    inside = str(world.workflows / "con" / "runs" / "x")
    assert sessions.check(s, sid, inside, "write", actor=OPERATOR).allowed
    assert sessions.check(s, sid, "/etc/passwd", "read", actor=OPERATOR).to_json() == {
        "allowed": False,
        "reason": "not granted to this session",
    }
    assert sessions.close(s, sid, actor=h.actor("alice")).to_json() == {"session_id": sid, "closed": [sid]}


def test_revoke_follows_the_configured_default(world: KbRoot) -> None:
    h = world.host()
    s = RootSessions(h)
    sid = sid_of(sessions.open_session(s, "con", actor=h.actor("alice"), kind="execution"))
    r = sessions.revoke(s, sid, actor=OPERATOR)
    generation = sessions.show(s, sid, actor=OPERATOR).plan.generation
    assert r.to_json() == {"session_id": sid, "generation": generation, "terminated": [], "still_running": []}
    assert [e["immediate"] for e in audit.read(world.root / "state") if e["event"] == "session_revoke"] == [
        False
    ]
    cfg = world.root / "kbd.yaml"
    text = cfg.read_text()
    assert "  immediate: false" in text
    cfg.write_text(text.replace("  immediate: false", "  immediate: true", 1))
    sessions.revoke(RootSessions(world.host()), sid, actor=OPERATOR)
    assert [e["immediate"] for e in audit.read(world.root / "state") if e["event"] == "session_revoke"][
        -1
    ] is True


# -- browse and notes -------------------------------------------------------------------------


def test_browse_read_and_list_shapes(world: KbRoot) -> None:
    h = world.host()
    f = browse.read(h, "con", "src", "notes/fact.md", actor=h.actor("alice"))
    assert f.to_json() == {"workflow_id": "con", "alias": "src", "path": "notes/fact.md", "size": 4,
                           "encoding": "utf-8", "content": "src\n"}  # fmt: skip
    page = browse.ls(h, "con", "src", "", actor=h.actor("alice"), limit=1)
    assert page.truncated and page.next == "context" and [e["name"] for e in page.entries] == ["context"]
    assert page.to_json() == {"workflow_id": "con", "alias": "src", "path": "", "truncated": True, "next": "context",
                              "entries": [{"name": "context", "type": "dir"}]}  # fmt: skip
    binary = world.workflows / "src" / "knowledgebase" / "context" / "blob.bin"
    binary.write_bytes(b"\xff\x00")
    blob = browse.read(h, "con", "src", "context/blob.bin", actor=h.actor("alice")).to_json()
    assert (blob["encoding"], blob["content"]) == ("base64", "/wA="), "bytes are never altered"


def test_a_note_write_returns_what_was_written(kb: KbRoot) -> None:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    h = kb.host()
    s = RootSessions(h)
    sid = sessions.open_session(s, "con", actor=h.actor("alice"), kind="execution", kb_access="read-write")
    written = notes.write(s, sid_of(sid), "src", "notes/a.md", b"a note\n", actor=OPERATOR)
    assert written.to_json() == {
        "workflow_id": "src",
        "alias": "src",
        "path": "notes/a.md",
        "bytes": written.bytes,
        "version": written.version,  # docs/notes.md "Note history": a new field
    }
    assert (kb.workflows / "src" / "knowledgebase" / "notes" / "a.md").stat().st_size == written.bytes


# -- admin --------------------------------------------------------------------------------------


def test_validate_lists_every_problem(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text('{"id": "wf", "knowledgebase_sources": [{"workflow_id": "a", "alias": "a"}]}')
    v = admin.validate(good)
    assert v.valid and v.entries == 1 and v.to_json()["problems"] == []
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"id": "wf", "knowledgebase_sources": [{"workflow_id": "wf", "alias": "Bad"}],'
        ' "folder_access": [{"path": 3}]}'
    )
    v = admin.validate(bad)
    assert not v.valid and v.to_json()["valid"] is False
    assert any(p.startswith("knowledgebase_sources[0]:") and "alias" in p for p in v.problems), v.problems
    assert any(p.startswith("knowledgebase_sources[0]:") and "itself" in p for p in v.problems), v.problems
    assert any(p.startswith("folder_access[0]:") for p in v.problems), v.problems


def test_validate_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        admin.validate(tmp_path / "missing.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(InvalidInput, match="not a regular file"):
        admin.validate(fifo)  # never blocks
    (tmp_path / "list.json").write_text('{"id": "wf", "knowledgebase_sources": 3}')
    # A field's problem is listed, with every other one (docs/on-disk.md "Validation")...
    listed = admin.validate(tmp_path / "list.json")
    assert listed.workflow_id == "wf" and listed.problems == (
        "knowledgebase_sources must be a list, got int",
    )
    # ...a file that is not one JSON object is one error, naming the file.
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ManifestUnreadable, match=r"list\.json must be a JSON object") as info:
        admin.validate(tmp_path / "list.json")
    body = admin.unreadable_json(tmp_path / "list.json", info.value)
    assert body["valid"] is False and body["error"]["code"] == info.value.code


def test_doctor_reports_a_broken_config_as_one_failed_check(tmp_path: Path) -> None:
    (tmp_path / "kbd.yaml").write_text("host: [\n")
    report = admin.doctor(tmp_path)
    assert not report.ok and [c.check for c in report.checks] == ["config"]
    assert report.to_json()["checks"][0]["ok"] is False


def test_principals_list_never_shows_a_token_hash(kb: KbRoot) -> None:
    h = kb.host()
    token = issue_token(h.config.root, "alice")
    rows = principal_ops.listing(kb.host(), actor=OPERATOR).to_json()["principals"]
    alice = next(r for r in rows if r["id"] == "alice")
    assert alice == {
        "id": "alice",
        "kind": "user",
        "admin": False,
        "disabled": False,
        "uid": None,
        "has_token": True,
        "label": None,  # docs/on-disk.md: principals may carry a label (a field added, none renamed)
    }
    assert auth.token_digest(token) not in str(rows)
    who = auth.authenticate(kb.host().principals, authorization=f"Bearer {token}", peer_uid=None)
    assert isinstance(who, Principal) and who.id == "alice"


def test_init_returns_what_it_made(tmp_path: Path) -> None:
    done = admin.init(tmp_path / "r", host="h1", force=False, demo=False)
    assert done.to_json() == {"root": str((tmp_path / "r").resolve()), "host": "h1", "demo_workflows": [],
                              "replaced": False}  # fmt: skip
    with pytest.raises(KbdError):
        admin.init(tmp_path / "r", host="h1", force=False, demo=False)


def test_metrics_are_for_operators_only(world: KbRoot) -> None:
    h = world.host()
    s = RootSessions(h)
    sessions.open_session(s, "con", actor=h.actor("alice"), kind="execution")
    for who in ("alice", "bob"):
        with pytest.raises(PermissionDenied):
            admin.metrics(s, actor=h.actor(who), requests={})
    m = admin.metrics(s, actor=h.actor("svc"), requests={"sessions": 2})
    assert m.to_json() == {
        "requests": {"sessions": 2},
        "registry_scans": m.registry_scans,
        "open_sessions": 1,
    }
    assert admin.metrics(s, actor=h.actor("ops"), requests={}).open_sessions == 1


def test_whoami_tells_the_effective_admin_flag_never_the_token() -> None:
    assert auth.Identity.of(PEOPLE.by_id["alice"]).to_json() == {
        "id": "alice",
        "kind": "user",
        "admin": False,
    }
    former = Principal("ex", admin=True, disabled=True, token_sha256="0" * 64)
    assert auth.Identity.of(former).to_json() == {"id": "ex", "kind": "user", "admin": False}


def test_a_session_without_a_parent_needs_a_kind(world: KbRoot) -> None:
    h = world.host()
    with pytest.raises(InvalidInput, match="kind is required"):
        sessions.open_session(RootSessions(h), "con", actor=h.actor("alice"), kind=None)


def test_session_environment_is_the_plans(world: KbRoot) -> None:
    h = world.host()
    s = RootSessions(h)
    plan = sessions.open_session(s, "con", actor=h.actor("alice"), kind="execution", kb_access="read")
    sid = sid_of(plan)
    env = sessions.environment(s, sid, actor=OPERATOR)
    assert env.to_json() == dict(plan.env) and env.to_json()["WORKFLOW_KB_ACCESS"] == "read"
    with pytest.raises(NotFound):
        sessions.environment(s, sid, actor=h.actor("bob"))  # not bob's session
    sessions.close(s, sid, actor=OPERATOR)
    with pytest.raises(KbdError) as info:
        sessions.environment(s, sid, actor=OPERATOR)
    assert info.value.code == "session-closed"


def test_health_says_host_and_uptime(kb: KbRoot) -> None:
    assert admin.health(kb.host(), started=100.0, now=142.46).to_json() == {
        "status": "ok",
        "host": "test-host",
        "uptime_seconds": 42.5,
    }


def test_the_audit_feed_selects_and_counts_torn_lines(world: KbRoot) -> None:
    h = world.host()
    state = h.config.state_dir
    audit.append(state, "sources_changed", workflow_id="con", actor="alice")
    with open(state / audit.AUDIT_NAME, "ab") as fh:
        fh.write(b"{torn\n")
    audit.append(state, "sources_changed", workflow_id="lib", actor="alice")

    def chunk(offset: int) -> admin.AuditChunk:
        return admin.audit_chunk(h, offset=offset, scope=None)

    feed = admin.AuditFeed(chunk, since=None, workflow="con")
    page = feed.records().to_json()
    assert [e["workflow_id"] for e in page["events"]] == ["con"] and page["skipped_lines"] == 1
    audit.append(state, "writer_granted", source="con", consumer="lib", actor="alice")
    assert [e["event"] for e in feed.poll()] == ["writer_granted"]  # only what was appended since
    assert admin.AuditFeed(chunk, since=None, workflow=None).records().to_json()["skipped_lines"] == 1


def test_an_owners_audit_view_reads_past_chunks_with_nothing_of_its_workflow(world: KbRoot) -> None:
    """A chunk the server selected nothing from still moves the offset on: the feed reads
    on to the end, not only to the first empty chunk (a log over a chunk long lost the rest)."""
    h = world.host()
    state = h.config.state_dir
    filler = "x" * 1000
    for _ in range(admin.AUDIT_CHUNK_BYTES // 1000 + 50):  # more than one chunk of other workflows' records
        audit.append(state, "sources_changed", workflow_id="lib", actor="bob", note=filler)
    audit.append(state, "sources_changed", workflow_id="con", actor="alice")
    scope = admin.audit_scope(RootSessions(h), actor=h.actor("alice"), workflow="con")
    assert scope is not None

    def chunk(offset: int) -> admin.AuditChunk:
        return admin.audit_chunk(h, offset=offset, scope=scope)

    assert chunk(0).events == ()  # the first chunk holds nothing of con's
    feed = admin.AuditFeed(chunk, since=None, workflow="con")
    assert [e["actor"] for e in feed.records().events] == ["alice"]


def test_a_child_with_an_empty_kind_keeps_its_parents_kind(world: KbRoot) -> None:
    """The child's default kind is decided in the operations layer, not the API:
    an empty kind (what a JSON client may send for none) is the parent's too."""
    h = world.host()
    s = RootSessions(h)
    alice = h.actor("alice")
    parent = sid_of(sessions.open_session(s, "con", actor=alice, kind="execution", kb_access="read"))
    child = sessions.open_child(s, parent, actor=alice, kind="")
    assert (child.kind, child.parent) == ("execution", parent)


def test_every_refused_session_open_is_audited(world: KbRoot) -> None:
    """Refusals that happen while the default kind or workflow is looked up (no
    parent session, no kind) are audited like every other refused open."""
    h = world.host()
    s = RootSessions(h)
    alice = h.actor("alice")
    missing = "s_00000000000000000000"
    attempts: list[tuple[Callable[[], Plan], dict[str, Any]]] = [
        (lambda: sessions.open_child(s, missing, actor=alice), {"workflow_id": None, "parent": missing}),
        (
            lambda: sessions.open_session(s, "con", actor=alice, kind=None, parent=missing),
            {"workflow_id": "con", "parent": missing},
        ),
        (
            lambda: sessions.open_session(s, "con", actor=alice, kind=None),
            {"workflow_id": "con", "parent": None},
        ),
    ]
    for attempt, target in attempts:
        seen = len(audit.read(world.root / "state"))
        with pytest.raises(KbdError) as info:
            attempt()
        events = audit.read(world.root / "state")[seen:]
        assert [(e["event"], e["action"], e["code"], e["kind"]) for e in events] == [
            ("session_refused", "open", info.value.code, None)
        ]
        assert {k: events[0][k] for k in target} == target
