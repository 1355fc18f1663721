"""The framework's own refusals come from the error tree too (issue 10): no route,
no such method, a body over the limit — on the real daemon and socket."""

from __future__ import annotations

from kbd.api import MAX_BODY_BYTES
from kbd.errors import MethodNotAllowed, NotFound, PayloadTooLarge
from tests.helpers import KbRoot
from tests.integration.daemon import serving


def test_framework_refusals_are_tree_errors(kb: KbRoot) -> None:
    with serving(kb.root) as daemon:
        client = daemon.client()
        r = client.get("/v1/no-such-route")
        assert (r.status_code, r.json()["error"]["code"]) == (NotFound.http_status, NotFound.code), r.text
        # /v1/health is GET only: 405 with the Allow header RFC 9110 requires.
        r = client.delete("/v1/health")
        assert r.status_code == MethodNotAllowed.http_status == 405, r.text
        assert r.json()["error"]["code"] == MethodNotAllowed.code == "method-not-allowed", r.text
        assert r.headers.get("allow") == "GET", r.headers
        r = client.post("/v1/sessions/s_x/notes", content=b"x" * (MAX_BODY_BYTES + 1))
        expected = PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
        assert (r.status_code, r.json()) == (expected.http_status, {"error": expected.to_dict()}), r.text
