"""The HTTP API says what it does and does what HTTP says, on the REAL daemon
over its Unix socket (docs/api.md "Malformed requests"): documented answers and security,
the 400 envelope instead of 422, the limits the server enforces, strict body
types, ``Allow`` on every 405, ``HEAD``, ``WWW-Authenticate`` on 401,
``If-Match: *`` and ``If-None-Match: *`` on note writes, and strong ETags
with conditional GETs on reads. Each correction is tested by its refusal."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.helpers import KbRoot
from tests.integration.daemon import Daemon, issue_tokens, serving

NOTE = b"# Fact\nthe sky is blue\n"


def version(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class World:
    kb: KbRoot
    daemon: Daemon
    sid: str
    tokens: dict[str, str]
    doc: dict[str, Any]

    def as_(self, pid: str) -> httpx.Client:
        return self.daemon.client(self.tokens[pid])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("conformance")
    kb = KbRoot.create(base / "root")
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src",
                                                                "access": "write"}])  # fmt: skip
    (kb.workflows / "src" / "knowledgebase" / "context" / "fact.md").write_bytes(NOTE)
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    tokens = issue_tokens(kb.root, ["alice", "bob", "ops"])
    with serving(kb.root, home=base / "home") as daemon:
        doc = daemon.client().get("/openapi.json").json()
        yield World(kb, daemon, sid, tokens, doc)


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return str(body["error"]["message"])


# -- the document ---------------------------------------------------------------------


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield method.upper(), path, op


def test_every_answer_is_documented_with_its_schema(world: World) -> None:
    schemas = world.doc["components"]["schemas"]
    for method, path, op in _operations(world.doc):
        ok = [code for code in op["responses"] if code.startswith("2")]
        # One success answer; a grant-changing route also answers its ?dry_run=true preview
        # (docs/access.md "Previews"): 200 beside a 201, or the two results as anyOf.
        assert len(ok) == 1 or (len(ok) == 2 and "200" in ok and "dry_run" in str(op["parameters"])), (
            method,
            path,
        )
        for code in ok:
            for media, content in op["responses"][code]["content"].items():
                schema = content.get("schema", {})
                if media != "application/json":
                    assert schema, (method, path, media)
                    continue
                for one in schema.get("anyOf", [schema]):
                    ref = one.get("$ref", "")
                    assert ref.startswith("#/components/schemas/"), (method, path, schema)
                    named = schemas[ref.rsplit("/", 1)[1]]
                    assert named.get("properties") or named.get("additionalProperties"), (
                        method,
                        path,
                    )  # never bare


def test_refusals_are_documented_as_400_never_422(world: World) -> None:
    assert "HTTPValidationError" not in world.doc["components"]["schemas"]
    for method, path, op in _operations(world.doc):
        assert "422" not in op["responses"], (method, path)
        bad = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert bad == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
        assert op["responses"]["default"]["content"]["application/json"]["schema"] == bad


def test_bearer_security_is_declared_on_every_route_but_health(world: World) -> None:
    (scheme,) = world.doc["components"]["securitySchemes"].items()
    assert scheme[0] == "bearer" and (scheme[1]["type"], scheme[1]["scheme"]) == ("http", "bearer"), scheme
    for method, path, op in _operations(world.doc):
        assert (op.get("security") == [{"bearer": []}]) is (path != "/v1/health"), (method, path)


def _param(doc: dict[str, Any], path: str, name: str, method: str = "get") -> dict[str, Any]:
    found: list[dict[str, Any]] = [p for p in doc["paths"][path][method]["parameters"] if p["name"] == name]
    assert len(found) == 1, (path, name)
    return found[0]


def test_limits_the_server_enforces_are_in_the_schema(world: World) -> None:
    doc = world.doc
    ls = _param(doc, "/v1/workflows/{wid}/sources/{alias}/dir", "limit")["schema"]
    assert ls == {"type": "integer", "minimum": 1, "maximum": 10_000, "title": "Limit"}
    search = "/v1/sessions/{sid}/search"
    assert _param(doc, search, "limit")["schema"]["maximum"] == 100
    q = _param(doc, search, "q")
    assert q["required"] is True and "default" not in q["schema"], q
    assert q["schema"]["minLength"] == 1 and q["schema"]["maxLength"] == 500
    assert _param(doc, "/v1/metrics", "format")["schema"]["enum"] == ["json", "prometheus"]
    version = _param(doc, "/v1/workflows/{wid}/notes/history/version", "version")["schema"]
    assert version["pattern"].startswith("^\\s*(sha256:[0-9a-f]{64}"), version
    body = doc["components"]["schemas"]
    assert body["AccessBody"]["properties"]["access"]["enum"] == ["read", "write"]
    assert "execution" in body["OpenSessionBody"]["properties"]["kind"]["anyOf"][0]["enum"]


# -- strict bodies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/principals", {"id": "newp", "uid": 4321, "admin": "yes"}, "admin"),
        ("/v1/principals", {"id": "newp", "uid": "4321"}, "uid"),
        ("/v1/principals", {"id": "newp", "uid": 4321.5}, "uid"),
        ("/v1/sessions/{sid}/revoke", {"immediate": 0}, "immediate"),
        ("/v1/principals/carol/disable", {"force": "true"}, "force"),
        ("/v1/workflows/con/import", {"folder": "d", "documents": [], "dry_run": 1}, "dry_run"),
    ],
)
def test_lax_types_are_refused_naming_the_field(
    world: World, route: str, body: dict[str, Any], field: str
) -> None:
    r = world.as_("ops").post(route.replace("{sid}", world.sid), json=body)
    message = _error(r, 400, "invalid-input")
    assert message.startswith(f"{field}: Input should be a valid "), message


def test_an_integral_number_is_an_integer(world: World) -> None:
    """JSON has one number type: 4321.0 is the integer 4321 (to JSON Schema too)."""
    r = world.as_("ops").post("/v1/principals", json={"id": "intp", "uid": 4321.0, "label": "Int"})
    assert r.status_code == 201, r.text
    assert r.json()["principal"]["uid"] == 4321


# -- HTTP itself ----------------------------------------------------------------------------


def test_405_allows_every_method_of_the_path(world: World) -> None:
    alice = world.as_("alice")
    r = alice.delete("/v1/workflows/con/sources")
    _error(r, 405, "method-not-allowed")
    assert r.headers["allow"] == "GET, HEAD, POST, PUT", r.headers
    r = alice.put("/v1/sessions/x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD", r.headers
    r = alice.get("/v1/sessions/x/notes")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers


def test_head_is_get_without_the_body(world: World) -> None:
    alice = world.as_("alice")
    for path in ("/v1/health", "/v1/workflows", "/v1/workflows/con/sources/src/file?path=context/fact.md",
                 f"/v1/sessions/{world.sid}", "/v1/workflows/nope"):  # fmt: skip
        got, head = alice.get(path), alice.head(path)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert head.headers.get("etag") == got.headers.get("etag"), path
        if path != "/v1/health":  # its uptime changes between the two
            assert head.headers["content-length"] == str(len(got.content)), path
    # The change feed follows forever on GET; HEAD ends with its headers.
    head = alice.head("/v1/events")
    assert (head.status_code, head.content) == (200, b""), head.text
    assert head.headers["content-type"].startswith("text/event-stream")
    # HEAD only where GET is.
    r = alice.head(f"/v1/sessions/{world.sid}/notes")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
    assert alice.get("/v1/health").status_code == 200  # the connection still serves


def test_401_names_the_bearer_scheme(world: World) -> None:
    for headers in ({"Authorization": "Bearer not-a-token"}, {}):
        r = world.daemon.client(headers=headers).get("/v1/whoami")
        _error(r, 401, "unauthenticated")
        assert r.headers["www-authenticate"] == "Bearer", r.headers
    r = world.as_("alice").get("/v1/principals")
    assert r.status_code == 403 and "www-authenticate" not in r.headers


# -- preconditions and validators ---------------------------------------------------------


def test_if_match_star_needs_a_current_note(world: World) -> None:
    alice = world.as_("alice")
    notes = world.kb.workflows / "src" / "knowledgebase" / "notes"
    body = {"alias": "src", "path": "star.md", "content": "# Star\nfirst\n"}
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=body, headers={"If-Match": "*"})
    _error(r, 412, "note-version-conflict")
    assert r.headers["etag"] == '"none"' and not (notes / "star.md").exists()
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=body)
    assert r.status_code == 201, r.text
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json={**body, "content": "# Star\nsecond\n"},
                   headers={"If-Match": "*"})  # fmt: skip
    assert r.status_code == 201, r.text
    assert (notes / "star.md").read_text().endswith("second\n")


def test_if_none_match_star_refuses_to_overwrite(world: World) -> None:
    alice = world.as_("alice")
    notes = world.kb.workflows / "src" / "knowledgebase" / "notes"
    body = {"alias": "src", "path": "once.md", "content": "# Once\nfirst\n"}
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=body, headers={"If-None-Match": "*"})
    assert r.status_code == 201, r.text
    written = r.json()["version"]
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json={**body, "content": "# Once\nagain\n"},
                   headers={"If-None-Match": "*"})  # fmt: skip
    _error(r, 412, "note-version-conflict")
    assert r.headers["etag"] == f'"{written}"'
    assert (notes / "once.md").read_text().endswith("first\n")
    # Both preconditions hold or the write is refused: a version named with If-None-Match: *.
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json={**body, "path": "twice.md", "expected_version": written},
                   headers={"If-None-Match": "*"})  # fmt: skip
    _error(r, 412, "note-version-conflict")
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=body, headers={"If-None-Match": f'"{written}"'})
    message = _error(r, 400, "usage")
    assert message.startswith("If-None-Match on a note write takes only *"), message


def test_if_match_and_expected_version_must_both_hold(world: World) -> None:
    """If-Match and the body's expected_version are two preconditions, each
    checked once the note is found: the same version passes, two that differ
    can never both hold (412, nothing written), a session that does not exist
    is 404 first (a schema-valid request is never a 400 for this)."""
    alice = world.as_("alice")
    notes = world.kb.workflows / "src" / "knowledgebase" / "notes"
    body = {"alias": "src", "path": "both.md", "content": "# Both\nfirst\n"}
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=body)
    assert r.status_code == 201, r.text
    first = r.json()["version"]
    again = {**body, "content": "# Both\nsecond\n", "expected_version": first}
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=again, headers={"If-Match": '"none"'})
    _error(r, 412, "note-version-conflict")
    assert r.headers["etag"] == f'"{first}"' and (notes / "both.md").read_text().endswith("first\n")
    r = alice.post(f"/v1/sessions/s_{'0' * 20}/notes", json=again, headers={"If-Match": '"none"'})
    assert r.status_code == 404, r.text
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json=again, headers={"If-Match": f'"{first}"'})
    assert r.status_code == 201, r.text
    assert (notes / "both.md").read_text().endswith("second\n")


def test_reads_carry_a_strong_etag_and_honour_if_none_match(world: World) -> None:
    alice = world.as_("alice")
    tag = f'"{version(NOTE)}"'
    for path in ("/v1/workflows/con/sources/src/file?path=context/fact.md",
                 "/v1/workflows/src/kb/file?path=context/fact.md"):  # fmt: skip
        who = world.as_("bob") if "/kb/" in path else alice
        r = who.get(path)
        assert r.status_code == 200 and r.headers["etag"] == tag, (path, r.headers)
        for known in (tag, "*", f'"sha256:{"0" * 64}", {tag}', f"W/{tag}"):
            r = who.get(path, headers={"If-None-Match": known})
            assert (r.status_code, r.content, r.headers["etag"]) == (304, b"", tag), (path, known)
        r = who.get(path, headers={"If-None-Match": f'"sha256:{"0" * 64}"'})
        assert r.status_code == 200 and r.json()["content"] == NOTE.decode()
    # A note's history version: its ETag is the version it shows.
    r = alice.post(f"/v1/sessions/{world.sid}/notes", json={"alias": "src", "path": "h.md", "content": "h\n"})
    assert r.status_code == 201, r.text
    written = r.json()["version"]
    bob = world.as_("bob")
    r = bob.get("/v1/workflows/src/notes/history/version", params={"path": "notes/h.md"})
    assert r.status_code == 200 and r.headers["etag"] == f'"{written}"', r.text
    r = bob.get("/v1/workflows/src/notes/history/version", params={"path": "notes/h.md"},
                headers={"If-None-Match": f'"{written}"'})  # fmt: skip
    assert r.status_code == 304 and r.content == b""
