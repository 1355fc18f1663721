"""docs/on-disk.md "Validation" and docs/cli.md exit codes and shapes, through the real `kbd` CLI.

One case per validation rule lives at the operations layer
(tests/unit/service/test_workflows.py); here each table keeps smoke cases of
every exit code, the rules the CLI checks itself (a bad --alias, JSON parsing,
--as and the uid mapping), and a check that the CLI prints exactly the
operation's error. The cases run kbd's real entry point in this process
(KbRoot.call: same argv, environment, descriptors, bytes and exit code as a
subprocess, without a new interpreter per case); each command keeps smoke tests
through a real `kbd` subprocess (KbRoot.cli): set, attach, detach, list, grant,
workflows list.

Every rejection asserts three things: the exit code of the contract, an
``error[<code>]: …`` line naming the entry/field and what is allowed (plus a
``hint:``), and that every workflow.json under the root is byte-identical
afterwards. The accepted paths assert what was saved and what is reported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kbd.errors import KbdError
from kbd.service import auth, workflows
from kbd.service.root import Root
from tests.helpers import CliResult, KbRoot
from tests.sources_world import ALIAS_RULE, CONSUMER_ACCESS, FIRST, SOURCE_ACCESS, build
from tests.sources_world import workflow_files as snapshot

ERROR_LINE = re.compile(r"^error\[[a-z][a-z-]*\]: (?P<message>.+)$")


# -- helpers ------------------------------------------------------------------------


def error_message(r: CliResult) -> str:
    """The message of the contract's `error[<code>]: message` line; asserts a hint follows."""
    lines = r.err.strip().splitlines()
    assert lines, f"no error output (exit {r.code}, stdout {r.out!r})"
    m = ERROR_LINE.match(lines[0])
    assert m is not None, f"stderr does not start with error[<code>]: …\n{r.err}"
    assert any(line.startswith("hint: ") for line in lines[1:]), f"no hint: line\n{r.err}"
    assert "Traceback" not in r.err
    return m.group("message")


def assert_rejected(
    kb: KbRoot, before: dict[str, bytes], r: CliResult, code: int, fragments: list[str]
) -> None:
    assert r.code == code, f"exit {r.code}, expected {code}\nstdout: {r.out}\nstderr: {r.err}"
    message = error_message(r)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error message {message!r}"
    assert r.out == ""
    assert snapshot(kb) == before, "a rejected request changed a file"


def manifest_meaning(path: Path) -> Any:
    """workflow.json parsed by the stdlib (exact big ints and floats)."""
    return json.loads((path / "workflow.json").read_bytes())


def body(entries: Any) -> bytes:
    return json.dumps(entries).encode()


def sources_json(kb: KbRoot, wf: str, actor: str = "alice") -> list[dict[str, Any]]:
    r = kb.call("sources", "list", wf, "--as", actor, "--json")
    assert r.code == 0, r.err
    rows: list[dict[str, Any]] = r.json()["sources"]
    return rows


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    """con (consumer, one attachment `s` → src) and sources of every kind."""
    return build(kb)


# -- sources set: smoke cases of each exit code, and the CLI's own JSON parse ----------

SET_REJECTIONS = [
    pytest.param(
        body([FIRST, {"workflow_id": "src2", "alias": "Upper"}]),
        65,
        ["knowledgebase_sources[1]", "alias 'Upper'", ALIAS_RULE],
        id="alias-uppercase",
    ),
    pytest.param(
        body({"workflow_id": "src2", "alias": "t"}),
        65,
        ["knowledgebase_sources must be a JSON array", "got a mapping"],
        id="non-array",
    ),
    pytest.param(b'[{"workflow_id": "src2",', 65, ["stdin is not valid JSON"], id="invalid-json"),
    pytest.param(
        body([FIRST, {"workflow_id": "ghost", "alias": "g"}]),
        66,
        ["'ghost'", "not_found"],
        id="missing-workflow",
    ),
    pytest.param(
        body([{"workflow_id": "private", "alias": "p"}]),
        77,
        ["'private'", "audience_denied"],
        id="audience-denied",
    ),
]


@pytest.mark.parametrize(("payload", "code", "fragments"), SET_REJECTIONS)
def test_sources_set_rejects(world: KbRoot, payload: bytes, code: int, fragments: list[str]) -> None:
    before = snapshot(world)
    r = world.call("sources", "set", "con", "--file", "-", "--as", "alice", input=payload)
    assert_rejected(world, before, r, code, fragments)


def test_sources_set_rejects_a_file_argument_the_same_way(world: KbRoot, tmp_path: Path) -> None:
    f = tmp_path / "sources.json"
    f.write_bytes(body([{"workflow_id": "src2", "alias": "Bad"}]))
    before = snapshot(world)
    r = world.cli("sources", "set", "con", "--file", str(f), "--as", "alice")
    assert_rejected(world, before, r, 65, ["knowledgebase_sources[0]", "alias 'Bad'", ALIAS_RULE])


# -- sources attach: the CLI's own --alias check, and smoke cases of each exit code ---

ATTACH_REJECTIONS = [
    pytest.param(["src2", "--alias", "Upper"], 65, ["alias 'Upper'", ALIAS_RULE], id="alias-uppercase"),
    pytest.param(["src2", "--alias", "2fast"], 65, ["alias '2fast'", ALIAS_RULE], id="alias-leading-digit"),
    pytest.param(
        ["src2", "--alias", "b" * 49], 65, ["alias 'bbbb", "1-48 characters", ALIAS_RULE], id="alias-49-chars"
    ),
    pytest.param(["src2", "--alias", "../escape"], 65, ["alias '../escape'", ALIAS_RULE], id="alias-path"),
    pytest.param(["src2", "--alias", ""], 65, ["alias ''", ALIAS_RULE], id="alias-empty"),
    pytest.param(["src2", "--alias", "access"], 65, ["'access' is reserved"], id="alias-reserved"),
    pytest.param(
        ["src2", "--alias", "s"],
        65,
        ["knowledgebase_sources[1]", "alias 's' is already used"],
        id="dup-alias",
    ),
    pytest.param(["ghost", "--alias", "g"], 66, ["'ghost'", "not_found"], id="missing-workflow"),
    pytest.param(["private", "--alias", "p"], 77, ["'private'", "audience_denied"], id="audience-denied"),
    pytest.param(
        ["legacy", "--alias", "l", "--access", "write"], 65, ["'legacy'", "no owner"], id="write-on-legacy"
    ),
]


@pytest.mark.parametrize(("args", "code", "fragments"), ATTACH_REJECTIONS)
def test_sources_attach_rejects(world: KbRoot, args: list[str], code: int, fragments: list[str]) -> None:
    before = snapshot(world)
    r = world.call("sources", "attach", "con", *args, "--as", "alice")
    assert_rejected(world, before, r, code, fragments)


def test_attach_to_a_missing_consumer_is_not_found(world: KbRoot) -> None:
    before = snapshot(world)
    r = world.cli("sources", "attach", "ghost", "src", "--alias", "x", "--as", "alice")
    assert_rejected(world, before, r, 66, ["'ghost'"])


def test_attach_unknown_access_mode_is_a_usage_error(world: KbRoot) -> None:
    """click refuses the choice (exit 2, usage); the contract's error format still applies."""
    before = snapshot(world)
    r = world.cli("sources", "attach", "con", "src2", "--alias", "t", "--access", "admin", "--as", "alice")
    assert_rejected(world, before, r, 2, ["admin", "read", "write"])


def test_attach_beyond_20_sources(kb: KbRoot) -> None:
    # 19 hand-written entries naming workflows that do not exist: unchanged entries
    # may stay unavailable, so the 20th attach succeeds and the 21st hits the limit.
    ghosts = [{"workflow_id": f"gone{i}", "alias": f"g{i}"} for i in range(19)]
    kb.workflow("con", access=CONSUMER_ACCESS, sources=ghosts)
    kb.workflow("src", access=SOURCE_ACCESS)
    kb.workflow("src2", access=SOURCE_ACCESS)
    r = kb.call("sources", "attach", "con", "src", "--alias", "twentieth", "--as", "alice")
    assert r.code == 0, r.err
    before = snapshot(kb)
    r = kb.call("sources", "attach", "con", "src2", "--alias", "extra", "--as", "alice")
    assert_rejected(kb, before, r, 65, ["21 entries", "at most 20"])


# -- who may attach ---------------------------------------------------------------------

ACTOR_REJECTIONS = [
    pytest.param(["--as", "bob"], ["'bob' may not manage the sources of 'con'"], id="reader"),
    pytest.param(["--as", "mallory"], ["principal 'mallory' is disabled"], id="disabled"),
    pytest.param(["--as", "nobody"], ["unknown principal 'nobody'"], id="unknown-principal"),
    pytest.param([], ["no principal is mapped to uid"], id="no-as-no-uid-mapping"),
]


@pytest.mark.parametrize(("as_args", "fragments"), ACTOR_REJECTIONS)
def test_attach_refused_for_actor(world: KbRoot, as_args: list[str], fragments: list[str]) -> None:
    before = snapshot(world)
    r = world.call("sources", "attach", "con", "src2", "--alias", "t", *as_args)
    assert_rejected(world, before, r, 77, fragments)


# -- the CLI prints exactly what the operation raises ------------------------------------

UPPER = [FIRST, {"workflow_id": "src2", "alias": "Upper"}]
RENDERED: list[Any] = [
    pytest.param(
        ["sources", "set", "con", "--file", "-", "--as", "alice"],
        body(UPPER),
        lambda h: workflows.set_sources(h, "con", UPPER, actor=h.actor("alice")),
        id="set-invalid-input",
    ),
    pytest.param(
        ["sources", "attach", "con", "private", "--alias", "p", "--as", "alice"],
        None,
        lambda h: workflows.attach(h, "con", "private", alias="p", access="read", actor=h.actor("alice")),
        id="attach-audience-denied",
    ),
    pytest.param(
        ["sources", "attach", "con", "ghost", "--alias", "g", "--as", "alice"],
        None,
        lambda h: workflows.attach(h, "con", "ghost", alias="g", access="read", actor=h.actor("alice")),
        id="attach-not-found",
    ),
    pytest.param(
        ["writers", "grant", "src", "con", "--as", "bob"],
        None,
        lambda h: workflows.grant(h, "src", "con", actor=h.actor("bob")),
        id="grant-permission-denied",
    ),
    pytest.param(
        ["sources", "attach", "con", "src2", "--alias", "t", "--as", "mallory"],
        None,
        lambda h: auth.named_or_mapped(h.principals, flag="mallory", env=None, uid=os.getuid()),
        id="disabled-actor",
    ),
]


@pytest.mark.parametrize(("argv", "stdin", "operation"), RENDERED)
def test_the_cli_prints_exactly_the_operations_error(
    world: KbRoot, argv: list[str], stdin: bytes | None, operation: Callable[[Root], object]
) -> None:
    """The validation cases run at the operations layer; this is what ties them
    to the CLI: its exit code, stderr and (empty) stdout are the error's own."""
    with pytest.raises(KbdError) as info:
        operation(world.host())
    err = info.value
    r = world.call(*argv, input=stdin)
    rendered = f"error[{err.code}]: {err.message}\nhint: {err.hint}\n"
    assert (r.code, r.out, r.err) == (err.exit_code, "", rendered)


def test_outsider_learns_nothing_about_the_workflow(world: KbRoot) -> None:
    """Someone outside the consumer's audience gets the same answer as for a missing workflow."""
    before = snapshot(world)
    r = world.call("sources", "attach", "con", "src2", "--alias", "t", "--as", "dave")
    assert_rejected(world, before, r, 66, ["no workflow with ID 'con'"])
    missing = world.call("sources", "attach", "nope", "src2", "--alias", "t", "--as", "dave")
    assert missing.err.replace("nope", "con") == r.err


def test_no_uid_mapping_hint_names_as(world: KbRoot) -> None:
    r = world.cli("sources", "attach", "con", "src2", "--alias", "t")
    assert r.code == 77
    assert "--as" in r.err.split("hint:", 1)[1]


@pytest.mark.parametrize("actor", ["alice", "carol", "ops"], ids=["owner", "editor", "admin"])
def test_attach_allowed_for_owner_editor_admin(world: KbRoot, actor: str) -> None:
    r = world.call("sources", "attach", "con", "src2", "--alias", "t", "--as", actor, "--json")
    assert r.code == 0, r.err
    assert r.json()["available"] is True
    assert manifest_meaning(world.workflows / "con")["knowledgebase_sources"] == [
        {"workflow_id": "src", "alias": "s", "access": "read"},
        {"workflow_id": "src2", "alias": "t", "access": "read"},
    ]


# -- writers grant ----------------------------------------------------------------------

GRANT_REJECTIONS = [
    pytest.param(
        ["src", "con", "--as", "bob"],
        77,
        ["'bob' may not change who writes into 'src'", "only its owners or an admin"],
        id="non-owner-editor",
    ),
    pytest.param(["src", "con", "--as", "mallory"], 77, ["'mallory' is disabled"], id="disabled"),
    pytest.param(["src", "ghost", "--as", "alice"], 66, ["'ghost'"], id="unknown-consumer"),
    pytest.param(
        ["src", "  src ", "--as", "alice"],
        65,
        ["allowed_kb_writers", "names the source workflow itself"],
        id="self-padded",
    ),
]


@pytest.mark.parametrize(("args", "code", "fragments"), GRANT_REJECTIONS)
def test_writers_grant_rejects(world: KbRoot, args: list[str], code: int, fragments: list[str]) -> None:
    before = snapshot(world)
    r = world.call("writers", "grant", *args)
    assert_rejected(world, before, r, code, fragments)


def test_writers_grant_limit_is_50(kb: KbRoot) -> None:
    existing = [f"w{i:02d}" for i in range(49)]
    kb.workflow("src", access={**SOURCE_ACCESS, "allowed_kb_writers": existing})
    kb.workflow("fiftieth", access=CONSUMER_ACCESS)
    kb.workflow("fifty_first", access=CONSUMER_ACCESS)
    r = kb.call("writers", "grant", "src", "fiftieth", "--as", "alice")
    assert r.code == 0, r.err
    assert len(manifest_meaning(kb.workflows / "src")["access"]["allowed_kb_writers"]) == 50
    before = snapshot(kb)
    r = kb.call("writers", "grant", "src", "fifty_first", "--as", "alice")
    assert_rejected(kb, before, r, 65, ["allowed_kb_writers", "51 workflows", "at most 50"])


def test_writers_grant_trims_and_deduplicates(world: KbRoot) -> None:
    r = world.cli("writers", "grant", "src", "  con\t", "--as", "alice", "--json")
    assert r.code == 0, r.err
    assert r.json() == {"source": "src", "consumer": "con", "granted": True, "changed": True}
    assert manifest_meaning(world.workflows / "src")["access"]["allowed_kb_writers"] == ["con"]
    before = snapshot(world)
    r = world.cli("writers", "grant", "src", "con ", "--as", "ops", "--json")
    assert r.code == 0, r.err
    assert r.json()["changed"] is False
    assert manifest_meaning(world.workflows / "src")["access"]["allowed_kb_writers"] == ["con"]
    assert snapshot(world) == before, "a grant that changes nothing must not rewrite the file"


# -- version conflicts ------------------------------------------------------------------


def test_sources_set_with_wrong_expected_version_conflicts(world: KbRoot) -> None:
    before = snapshot(world)
    r = world.call(
        "sources",
        "set",
        "con",
        "--file",
        "-",
        "--expected-version",
        "sha256:wrong",
        "--as",
        "alice",
        input=body([]),
    )
    assert_rejected(world, before, r, 75, ["sha256:wrong"])


def test_sources_set_with_current_expected_version_saves(world: KbRoot) -> None:
    listed = world.cli("sources", "list", "con", "--as", "alice", "--json")
    assert listed.code == 0, listed.err
    version = listed.json()["version"]
    r = world.cli(
        "sources",
        "set",
        "con",
        "--file",
        "-",
        "--expected-version",
        version,
        "--as",
        "alice",
        "--json",
        input=body([{"workflow_id": "src2", "alias": "two"}]),
    )
    assert r.code == 0, r.err
    assert r.json()["version"] != version
    assert [a["alias"] for a in r.json()["sources"]] == ["two"]


# -- accepted paths -----------------------------------------------------------------------

UNKNOWN_FIELDS_JSON = """{
  "id": "con",
  "label": "Consümer ☃ 工作流",
  "access": {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]},
  "knowledgebase_sources": [{"workflow_id": "src", "alias": "s"}],
  "schedule": {"cron": "0 6 * * *", "tz": "Europe/Zürich", "retries": {"max": 3, "backoff": [1, 2.5, 10]}},
  "big": 12345678901234567890,
  "bigger": -123456789012345678901234567890123456789,
  "floats": [0.1, 3.141592653589793, 1e-300, 1.7976931348623157e308, -0.0, 2.5e-8],
  "nested": {"a": {"b": {"c": [null, true, false, {"d": "\\u00e9\\ud83d\\ude00"}]}}},
  "emoji": "🚀 naïve café",
  "empty": {},
  "list_of_objects": [{"x": 1}, {"y": [2, {"z": 3}]}]
}
"""


def _without(doc: Any, key: str) -> Any:
    return {k: v for k, v in doc.items() if k != key}


def test_attach_preserves_every_unknown_field(world: KbRoot) -> None:
    con = world.workflows / "con"
    (con / "workflow.json").write_text(UNKNOWN_FIELDS_JSON, encoding="utf-8")
    before = manifest_meaning(con)
    r = world.call("sources", "attach", "con", "src2", "--alias", "two", "--as", "alice")
    assert r.code == 0, r.err
    after = manifest_meaning(con)
    assert _without(after, "knowledgebase_sources") == _without(before, "knowledgebase_sources")
    assert after["big"] == 12345678901234567890
    assert after["bigger"] == -123456789012345678901234567890123456789
    assert after["floats"] == before["floats"]
    assert after["nested"]["a"]["b"]["c"][3]["d"] == "é😀"
    assert after["knowledgebase_sources"] == [
        {"workflow_id": "src", "alias": "s", "access": "read"},
        {"workflow_id": "src2", "alias": "two", "access": "read"},
    ]


def test_grant_preserves_every_unknown_field(world: KbRoot) -> None:
    src = world.workflows / "src"
    doc = json.loads(UNKNOWN_FIELDS_JSON)
    doc.update(id="src", access={**SOURCE_ACCESS, "custom_note": {"k": 12345678901234567890}})
    del doc["knowledgebase_sources"]
    (src / "workflow.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    before = manifest_meaning(src)
    r = world.call("writers", "grant", "src", "con", "--as", "alice")
    assert r.code == 0, r.err
    after = manifest_meaning(src)
    assert _without(after, "access") == _without(before, "access")
    assert _without(after["access"], "allowed_kb_writers") == before["access"]
    assert after["access"]["allowed_kb_writers"] == ["con"]


def test_attach_preserves_a_float_beyond_double_range(world: KbRoot) -> None:
    """1e400 is valid JSON (RFC 8259 sets no range); saving must not turn it into
    `Infinity` (invalid JSON) or refuse to touch the manifest."""
    con = world.workflows / "con"
    doc = json.loads(UNKNOWN_FIELDS_JSON)
    text = json.dumps(doc, ensure_ascii=False)[:-1] + ', "huge": 1e400}'
    (con / "workflow.json").write_text(text, encoding="utf-8")
    r = world.call("sources", "attach", "con", "src2", "--alias", "two", "--as", "alice")
    assert r.code == 0, r.err
    saved = (con / "workflow.json").read_text(encoding="utf-8")
    assert "Infinity" not in saved
    assert json.loads(saved)["huge"] == json.loads(text)["huge"]


def test_attach_preserves_an_escaped_lone_surrogate(world: KbRoot) -> None:
    """`"\\ud800"` is valid JSON text; the saved file must keep it (as an escape),
    not crash with a traceback."""
    con = world.workflows / "con"
    text = json.dumps(json.loads(UNKNOWN_FIELDS_JSON), ensure_ascii=False)[:-1] + ', "lone": "x\\ud800y"}'
    (con / "workflow.json").write_text(text, encoding="utf-8")
    r = world.cli("sources", "attach", "con", "src2", "--alias", "two", "--as", "alice")
    assert "Traceback" not in r.err
    assert r.code == 0, r.err
    assert manifest_meaning(con)["lone"] == "x\ud800y"


def test_sources_set_empty_list_detaches_all(world: KbRoot) -> None:
    r = world.call("sources", "set", "con", "--file", "-", "--as", "alice", "--json", input=b"[]")
    assert r.code == 0, r.err
    assert r.json()["sources"] == []
    assert manifest_meaning(world.workflows / "con")["knowledgebase_sources"] == []
    assert sources_json(world, "con") == []


def test_write_attach_without_grant_is_saved_write_pending(world: KbRoot) -> None:
    r = world.call(
        "sources", "attach", "con", "src2", "--alias", "two", "--access", "write", "--as", "alice", "--json"
    )
    assert r.code == 0, r.err
    att = r.json()
    assert att["available"] is True
    assert att["reason"] is None
    assert att["path"] == str((world.workflows / "src2" / "knowledgebase").resolve())
    assert att["write"]["available"] is False
    assert att["write"]["reason"] == "write_not_granted"
    saved = manifest_meaning(world.workflows / "con")["knowledgebase_sources"]
    assert {"workflow_id": "src2", "alias": "two", "access": "write"} in saved
    listed = {a["alias"]: a for a in sources_json(world, "con")}
    assert listed["two"]["write"] == {
        **listed["two"]["write"],
        "available": False,
        "reason": "write_not_granted",
    }
    # Once the source's owner consents, the same entry becomes writable.
    g = world.call("writers", "grant", "src2", "con", "--as", "alice")
    assert g.code == 0, g.err
    listed = {a["alias"]: a for a in sources_json(world, "con")}
    assert listed["two"]["write"]["available"] is True
    assert listed["two"]["write"]["reason"] is None


ATTACHMENT_KEYS = {
    "alias",
    "workflow_id",
    "label",
    "access",
    "available",
    "reason",
    "message",
    "write",
    "env",
    "path",
}


def test_sources_list_json_shape(world: KbRoot) -> None:
    payload = body(
        [
            FIRST,
            {"workflow_id": "src2", "alias": "two", "access": "write"},
        ]
    )
    r = world.cli("sources", "set", "con", "--file", "-", "--as", "alice", input=payload)
    assert r.code == 0, r.err
    # A hand edit adds an entry that does not resolve (kept, shown unavailable).
    doc = manifest_meaning(world.workflows / "con")
    doc["knowledgebase_sources"].append({"workflow_id": "ghost", "alias": "gone", "access": "read"})
    (world.workflows / "con" / "workflow.json").write_text(json.dumps(doc))

    r = world.cli("sources", "list", "con", "--as", "bob", "--json")
    assert r.code == 0, r.err
    data = r.json()
    assert data["workflow_id"] == "con"
    assert isinstance(data["sources"], list)
    rows = data["sources"]
    assert [a["alias"] for a in rows] == ["s", "two", "gone"]
    for a in rows:
        assert set(a) >= ATTACHMENT_KEYS, ATTACHMENT_KEYS - set(a)
        assert a["access"] in ("read", "write")
        assert isinstance(a["available"], bool)
        assert a["env"] == "WORKFLOW_KB_" + a["alias"].upper()
        if a["available"]:
            assert a["reason"] is None and a["message"] is None
            assert isinstance(a["path"], str) and a["path"].endswith("/knowledgebase")
        else:
            assert isinstance(a["reason"], str) and isinstance(a["message"], str)
            assert a["path"] is None
        if a["access"] == "read":
            assert a["write"] is None
        else:
            assert isinstance(a["write"], dict)
            assert {"available", "reason"} <= set(a["write"])
    s, two, gone = rows
    assert (s["workflow_id"], s["label"], s["available"], s["write"]) == ("src", "Source", True, None)
    assert (two["access"], two["available"]) == ("write", True)
    assert (two["write"]["available"], two["write"]["reason"]) == (False, "write_not_granted")
    assert (gone["workflow_id"], gone["available"], gone["reason"], gone["path"]) == (
        "ghost",
        False,
        "not_found",
        None,
    )


def test_workflows_list_json_shape(world: KbRoot) -> None:
    # A second folder claiming `src2` makes that ID ambiguous; an unreadable manifest shows too.
    world.workflow("src2", folder="copy_of_src2", access=SOURCE_ACCESS)
    broken = world.workflows / "broken"
    broken.mkdir()
    (broken / "workflow.json").write_text('{"id": "broken", "access": "everyone"}')
    r = world.cli("workflows", "list", "--as", "ops", "--json")
    assert r.code == 0, r.err
    data = r.json()
    assert set(data) >= {"workflows"}
    rows = data["workflows"]
    for w in rows:
        assert {"id", "label", "path", "status"} <= set(w), w
        assert w["status"] in ("ok", "ambiguous_id", "manifest_unreadable")
        assert isinstance(w["path"], str) and Path(w["path"]).is_absolute()
    by_path = {Path(w["path"]).name: w for w in rows}
    assert by_path["con"] == {**by_path["con"], "id": "con", "label": "Consumer", "status": "ok"}
    assert by_path["src2"]["status"] == by_path["copy_of_src2"]["status"] == "ambiguous_id"
    assert by_path["broken"]["status"] == "manifest_unreadable"
    assert by_path["broken"]["id"] == "broken"


def test_workflows_list_json_hides_what_the_actor_cannot_inspect(world: KbRoot) -> None:
    r = world.call("workflows", "list", "--as", "dave", "--json")
    assert r.code == 0, r.err
    ids = {w["id"] for w in r.json()["workflows"]}
    assert ids == {"legacy"}  # dave is in no audience; the legacy workflow is account-visible


UNAVAILABLE_WAYS = [
    pytest.param("deleted", "not_found", id="source-deleted"),
    pytest.param("narrowed", "audience_denied", id="audience-narrowed"),
    pytest.param("moved_host", "other_host", id="other-host"),
    pytest.param("kb_removed", "kb_missing", id="kb-removed"),
]


def _make_unavailable(kb: KbRoot, how: str) -> None:
    src = kb.workflows / "src"
    if how == "deleted":
        (src / "workflow.json").unlink()
    elif how == "narrowed":
        kb.edit(src, access={"owners": ["alice"]})
    elif how == "moved_host":
        kb.edit(src, host="elsewhere")
    else:
        shutil.rmtree(src / "knowledgebase")


@pytest.mark.parametrize(("how", "reason"), UNAVAILABLE_WAYS)
def test_unchanged_unavailable_entry_is_kept_on_attach(world: KbRoot, how: str, reason: str) -> None:
    _make_unavailable(world, how)
    r = world.call("sources", "attach", "con", "src2", "--alias", "two", "--as", "alice")
    assert r.code == 0, r.err
    assert manifest_meaning(world.workflows / "con")["knowledgebase_sources"] == [
        {"workflow_id": "src", "alias": "s", "access": "read"},
        {"workflow_id": "src2", "alias": "two", "access": "read"},
    ]
    rows = {a["alias"]: a for a in sources_json(world, "con")}
    assert (rows["s"]["available"], rows["s"]["reason"], rows["s"]["path"]) == (False, reason, None)
    assert rows["two"]["available"] is True


def test_unchanged_unavailable_entry_is_kept_by_set_but_a_changed_one_must_resolve(world: KbRoot) -> None:
    _make_unavailable(world, "narrowed")
    keep = body([FIRST, {"workflow_id": "src2", "alias": "two"}])
    r = world.call("sources", "set", "con", "--file", "-", "--as", "alice", input=keep)
    assert r.code == 0, r.err
    # Changing the unavailable entry (read → write) makes it a new entry: it must resolve.
    before = snapshot(world)
    changed = body([{**FIRST, "access": "write"}, {"workflow_id": "src2", "alias": "two"}])
    r = world.call("sources", "set", "con", "--file", "-", "--as", "alice", input=changed)
    assert_rejected(world, before, r, 77, ["'src'", "audience_denied"])


def test_detach_unknown_alias_is_not_found(world: KbRoot) -> None:
    before = snapshot(world)
    r = world.cli("sources", "detach", "con", "nope", "--as", "alice")
    assert_rejected(world, before, r, 66, ["'con'", "no attachment with alias 'nope'"])


def test_detach_known_alias(world: KbRoot) -> None:
    r = world.cli("sources", "detach", "con", "s", "--as", "carol", "--json")
    assert r.code == 0, r.err
    assert r.json() == {"workflow_id": "con", "detached": "s"}
    assert manifest_meaning(world.workflows / "con")["knowledgebase_sources"] == []


@pytest.mark.parametrize("planted", [0o6755, 0o4640, 0o1660, 0o600])
def test_manifest_save_keeps_owner_and_rw_mode_but_never_set_id_or_exec(world: KbRoot, planted: int) -> None:
    """docs/on-disk.md "Validation": a manifest save (run as root) keeps the manifest's owner and
    read/write bits, but set-id, sticky and executable bits never survive it."""
    import os
    import stat

    manifest = world.workflows / "con" / "workflow.json"
    os.chown(manifest, 4242, 4343)
    os.chmod(manifest, planted)
    r = world.call("sources", "attach", "con", "src2", "--alias", "two", "--as", "alice")
    assert r.code == 0, r.err
    st = os.lstat(manifest)
    assert (st.st_uid, st.st_gid) == (4242, 4343)
    assert stat.S_IMODE(st.st_mode) == planted & 0o666, oct(st.st_mode)
