"""The framework's own refusals come from the error tree too (docs/api.md "Errors"): no route,
no such method, a body over the limit, a field that cannot be decoded — on the
real daemon and socket (docs/api.md "Errors")."""

from __future__ import annotations

import json

from kbd.daemon.routes import MAX_BODY_BYTES
from kbd.errors import MethodNotAllowed, NotFound, PayloadTooLarge
from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving


def test_framework_refusals_are_tree_errors(kb: KbRoot) -> None:
    with serving(kb.root) as daemon:
        client = daemon.client()
        r = client.get("/v1/no-such-route")
        assert (r.status_code, r.json()["error"]["code"]) == (NotFound.http_status, NotFound.code), r.text
        # /v1/health is GET (and HEAD) only: 405 with the Allow header RFC 9110 requires.
        r = client.delete("/v1/health")
        assert r.status_code == MethodNotAllowed.http_status == 405, r.text
        assert r.json()["error"]["code"] == MethodNotAllowed.code == "method-not-allowed", r.text
        assert r.headers.get("allow") == "GET, HEAD", r.headers
        r = client.post("/v1/sessions/s_x/notes", content=b"x" * (MAX_BODY_BYTES + 1))
        expected = PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
        assert (r.status_code, r.json()) == (expected.http_status, {"error": expected.to_dict()}), r.text


def test_non_ascii_base64_is_a_400_naming_the_field_whatever_the_request_names(kb: KbRoot) -> None:
    """Non-ASCII text in ``content_base64`` made both routes that take it answer
    500 (``base64.b64decode`` raises a bare ValueError for it). It is a 400
    naming the field, what is wrong and what is allowed, decided before the
    request looks at the session or workflow it names: the same answer for
    one the caller may use, one it may not see and one that does not exist."""
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src",
                                                                "access": "write"}])  # fmt: skip
    kb.workflow("hidden", access={"owners": ["bob"]})
    mine = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    bobs = kb.open_session("hidden", kind="builder", kb_access="read", actor="bob")
    tokens = issue_tokens(kb.root, ["alice"])
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    before = sorted(p.name for p in notes.iterdir())
    with serving(kb.root) as daemon:
        alice = daemon.client(tokens["alice"])
        for text in ("é", "aGk=é", "\u202e", "\U0001d518==", "\\ud800"):
            answers = set()
            for sid in (mine, bobs, "s_doesnotexist"):
                r = alice.post(f"/v1/sessions/{sid}/notes",
                               json={"alias": "src", "path": "x.md", "content_base64": text})  # fmt: skip
                assert r.status_code == 400, (sid, text, r.text)
                answers.add(r.text)
            (answer,) = answers  # one answer: nothing about the session leaks
            error = json.loads(answer)["error"]
            assert error["code"] == "invalid-input" and error["message"].startswith(
                "content_base64 is not base64"
            )
            assert "standard base64" in error["message"] and error["hint"], error
            answers = set()
            for wid in ("con", "hidden", "nope"):
                r = alice.post(f"/v1/workflows/{wid}/import", json={
                    "folder": "docs", "documents": [{"file": "a.md", "content_base64": "IyBUCg=="},
                                                     {"file": "b.md", "content_base64": text}]})  # fmt: skip
                assert r.status_code == 400, (wid, text, r.text)
                answers.add(r.text)
            (answer,) = answers
            error = json.loads(answer)["error"]
            assert error["message"].startswith("documents[1].content_base64 is not base64"), error
    assert sorted(p.name for p in notes.iterdir()) == before
    assert not (kb.workflows / "con" / "knowledgebase" / "context" / "docs").exists()
