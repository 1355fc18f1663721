"""The Knowledge page's server (docs/knowledge-page.md): the real `kbd ui` process over real HTTP on 127.0.0.1.

Its web surface (Host, one-time token, cookie, CSRF, Origin, CSP and headers),
its JSON API (each route the CLI's operation, as the start-up principal, with
the operation's refusals), confinement of browsing, its search session's life,
and its change feed. The browser-level tests are in tests/browser/ (UI-PAGE).
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers import KbRoot, snapshot
from tests.integration import daemon
from tests.integration.ui import Ui, serving_ui
from tests.waiting import holds_for, wait_for

pytestmark = pytest.mark.timeout(300)

HOSTILE = '<img src=x onerror="alert(1)">'
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}


def build(kb: KbRoot) -> None:
    """alice owns src, con and lib (bob reads them); carol's private is hidden from both."""
    kb.workflow("src", label=HOSTILE, access={"owners": ["alice"], "readers": ["bob"]})
    kb.workflow("lib", label="Library", access={"owners": ["alice"], "readers": ["bob"]})
    kb.workflow("con", label="Consumer", access={"owners": ["alice"], "readers": ["bob"]},
                sources=[{"workflow_id": "src", "alias": "rts"}])  # fmt: skip
    kb.workflow("private", access={"owners": ["carol"]})
    # Links out of a KB: to the source's private folders and to the host.
    (kb.workflows / "src" / "knowledgebase" / "notes" / "leak.md").symlink_to("../../credentials/token")
    (kb.workflows / "con" / "knowledgebase" / "notes" / "passwd.md").symlink_to("/etc/passwd")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> KbRoot:
    kb = KbRoot.create(tmp_path_factory.mktemp("ui") / "root")
    build(kb)
    return kb


@pytest.fixture(scope="module")
def alice(world: KbRoot) -> Iterator[Ui]:
    with serving_ui(world.root, "--as", "alice") as ui:
        yield ui


@pytest.fixture(scope="module")
def alice_client(alice: Ui) -> httpx.Client:
    return alice.login()


def assert_secure_headers(r: httpx.Response, *, api: bool) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert r.headers.get(name) == value, (r.request.url, name, r.headers)
    if api:
        assert r.headers.get("cache-control") == "no-store", r.headers
    assert "server" not in r.headers


def manifests(kb: KbRoot) -> dict[str, Any]:
    return snapshot(kb.workflows)


# -- start-up ---------------------------------------------------------------------------------------


def test_url_is_stdout_first_line_and_bound_to_loopback_only(alice: Ui) -> None:
    # /proc/net/tcp: the listening socket of this port is 127.0.0.1 (0100007F), never 0.0.0.0 or IPv6.
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.split(":")
            if int(port, 16) == alice.port and state == "0A":
                listening.append((table, addr))
    assert listening == [("/proc/net/tcp", "0100007F")], listening


def test_refusals_before_serving(world: KbRoot) -> None:
    r = world.cli("ui", "--no-browser", "--as", "nobody")
    assert r.code == 77 and r.out == "" and "error[" in r.err, r
    r = world.cli("ui", "private", "--no-browser", "--as", "alice")
    assert r.code == 66 and r.out == "" and "error[" in r.err, r
    r = world.cli("ui", "--no-browser", "--as", "")
    assert r.code == 2 and r.out == "", r


def test_port_taken_is_refused(world: KbRoot, alice: Ui) -> None:
    r = world.cli("ui", "--no-browser", "--as", "alice", "--port", str(alice.port))
    assert r.code == 69 and r.out == "" and "cannot listen" in r.err, r


# -- Host ---------------------------------------------------------------------------------------------

ROUTES: list[tuple[str, str]] = [
    ("GET", "/"),
    ("GET", "/?token=x"),
    ("GET", "/assets/app.js"),
    ("GET", "/assets/index.html"),
    ("GET", "/api/me"),
    ("GET", "/api/workflows"),
    ("GET", "/api/workflows/con"),
    ("GET", "/api/workflows/con/sources"),
    ("GET", "/api/workflows/con/candidates"),
    ("POST", "/api/workflows/con/sources"),
    ("DELETE", "/api/workflows/con/sources/rts"),
    ("PATCH", "/api/workflows/con/sources/rts"),
    ("GET", "/api/workflows/src/writers"),
    ("POST", "/api/workflows/src/writers"),
    ("DELETE", "/api/workflows/src/writers/con"),
    ("GET", "/api/workflows/src/notes/pending"),
    ("POST", "/api/workflows/src/notes/review"),
    ("GET", "/api/workflows/con/own/dir"),
    ("GET", "/api/workflows/con/own/file?path=notes/fact.md"),
    ("GET", "/api/workflows/con/sources/rts/dir"),
    ("GET", "/api/workflows/con/sources/rts/file?path=notes/fact.md"),
    ("GET", "/api/workflows/con/search?q=fact"),
    ("GET", "/api/events"),
    ("GET", "/api/nosuch"),
]


def bad_hosts(port: int) -> list[str]:
    return [f"localhost:{port}", f"127.0.0.1:{port + 1 if port < 65535 else 1}", "127.0.0.1",
            f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}", f"[::1]:{port}",
            f"0.0.0.0:{port}", f"127.0.0.1:{port}.evil.example", f"127.0.0.1:0{port}"]  # fmt: skip


def test_wrong_host_is_refused_on_every_route(world: KbRoot, alice: Ui, alice_client: httpx.Client) -> None:
    before = manifests(world)
    headers = {"X-KBD-CSRF": alice.csrf, "Origin": alice.origin}
    for method, path in ROUTES:
        for host in bad_hosts(alice.port):
            r = alice_client.request(method, path, headers={**headers, "Host": host}, json={})
            assert r.status_code == 403, (method, path, host, r.status_code, r.text)
            assert_secure_headers(r, api=path.startswith("/api"))
            if path.startswith("/api"):
                assert r.json()["error"]["code"] == "ui-host", (path, host, r.text)
            else:
                assert r.headers["content-type"].startswith("text/html")
    assert manifests(world) == before


# -- the one-time token and the cookie ----------------------------------------------------------------


def test_token_is_one_time_and_cookie_flags(world: KbRoot) -> None:
    with serving_ui(world.root, "--as", "alice") as ui:
        c = ui.client()
        assert c.get("/").status_code == 403  # no cookie yet
        assert c.get("/api/me").json()["error"]["code"] == "ui-unauthenticated"
        wrong = c.get("/", params={"token": ui.token[:-1] + ("A" if ui.token[-1] != "A" else "B")})
        assert wrong.status_code == 403 and "kbd ui" in wrong.text
        r = c.get("/", params={"token": ui.token})
        assert r.status_code == 303 and r.headers["location"] == "/", r.headers
        cookie = r.headers["set-cookie"]
        name_value, *flags = [p.strip() for p in cookie.split(";")]
        assert (
            name_value.startswith(f"kbd_ui_{ui.port}=") and len(name_value) > len(f"kbd_ui_{ui.port}=") + 40
        )
        assert set(flags) == {"HttpOnly", "SameSite=Strict", "Path=/"}, cookie
        assert ui.token not in cookie
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert_secure_headers(page, api=False)
        # The token works once: a second use (even with the cookie) and another client are refused.
        again = c.get("/", params={"token": ui.token})
        assert again.status_code == 403, again.status_code
        other = ui.client()
        assert other.get("/", params={"token": ui.token}).status_code == 403
        assert other.get("/api/workflows").status_code == 403
        # A forged cookie is no cookie.
        forged = ui.client(cookies={f"kbd_ui_{ui.port}": "x" * 43})
        assert forged.get("/api/workflows").json()["error"]["code"] == "ui-unauthenticated"
        assert forged.get("/").status_code == 403


# -- CSRF and Origin ----------------------------------------------------------------------------------

CHANGES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/api/workflows/con/sources", {"workflow_id": "lib", "alias": "lib"}),
    ("DELETE", "/api/workflows/con/sources/rts", None),
    ("PATCH", "/api/workflows/con/sources/rts", {"access": "write"}),
    ("POST", "/api/workflows/src/writers", {"workflow_id": "con"}),
    ("DELETE", "/api/workflows/src/writers/con", None),
    (
        "POST",
        "/api/workflows/src/notes/review",
        {"path": "notes/fact.md", "decision": "approve", "expected_version": "sha256:" + "0" * 64},
    ),
]


def test_changes_need_cookie_csrf_and_same_origin(
    world: KbRoot, alice: Ui, alice_client: httpx.Client
) -> None:
    before = manifests(world)
    other_port = alice.port + 1 if alice.port < 65535 else 1
    cases: list[tuple[dict[str, str], str]] = [
        ({"Origin": alice.origin}, "ui-csrf"),  # no CSRF token
        ({"Origin": alice.origin, "X-KBD-CSRF": ""}, "ui-csrf"),
        ({"Origin": alice.origin, "X-KBD-CSRF": alice.csrf[:-2]}, "ui-csrf"),
        ({"Origin": alice.origin, "X-KBD-CSRF": "x" * 43}, "ui-csrf"),
        ({"X-KBD-CSRF": alice.csrf}, "ui-origin"),  # no Origin
        ({"X-KBD-CSRF": alice.csrf, "Origin": "null"}, "ui-origin"),
        ({"X-KBD-CSRF": alice.csrf, "Origin": "http://evil.example"}, "ui-origin"),
        ({"X-KBD-CSRF": alice.csrf, "Origin": f"http://localhost:{alice.port}"}, "ui-origin"),
        ({"X-KBD-CSRF": alice.csrf, "Origin": f"http://127.0.0.1:{other_port}"}, "ui-origin"),
        ({"X-KBD-CSRF": alice.csrf, "Origin": f"https://127.0.0.1:{alice.port}"}, "ui-origin"),
        ({"X-KBD-CSRF": alice.csrf, "Origin": f"{alice.origin}/"}, "ui-origin"),
    ]
    for method, path, body in CHANGES:
        for headers, code in cases:
            r = alice_client.request(method, path, json=body, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == code, (method, path, headers, r.text)
            assert_secure_headers(r, api=True)
        # Everything right but the cookie.
        anon = alice.client()
        r = anon.request(method, path, json=body, headers={"X-KBD-CSRF": alice.csrf, "Origin": alice.origin})
        assert r.status_code == 403 and r.json()["error"]["code"] == "ui-unauthenticated", r.text
    assert manifests(world) == before, "a refused change changed a file"


def test_headers_on_every_response_type(alice: Ui, alice_client: httpx.Client) -> None:
    html = alice_client.get("/")
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert_secure_headers(html, api=False)
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css"), ("index.html", "text/html")):
        r = alice_client.get(f"/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (name, r.headers)
        assert_secure_headers(r, api=False)
    for path, status in (("/api/me", 200), ("/api/workflows/nosuch", 404), ("/api/nosuch", 404),
                         ("/assets/nosuch.js", 404)):  # fmt: skip
        r = alice_client.get(path)
        assert r.status_code == status and r.headers["content-type"] == "application/json", (path, r.text)
        assert_secure_headers(r, api=path.startswith("/api"))
        if status != 200:
            assert set(r.json()["error"]) == {"code", "message", "hint"}
    r = alice_client.put("/api/workflows/con/sources", json={}, headers={"X-KBD-CSRF": alice.csrf,
                                                                          "Origin": alice.origin})  # fmt: skip
    assert r.status_code == 405 and r.json()["error"]["code"] == "method-not-allowed", r.text
    assert_secure_headers(r, api=True)
    with alice_client.stream("GET", "/api/events") as sse:
        assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
        assert_secure_headers(sse, api=True)


def test_me_and_rights(alice: Ui, alice_client: httpx.Client, world: KbRoot) -> None:
    me = alice_client.get("/api/me").json()
    assert me == {"principal": "alice", "csrf": alice.csrf, "workflow": None, "live": False, "mode": "direct"}
    shown = alice_client.get("/api/workflows/con").json()
    assert shown["rights"] == {"manage": True, "grant": True}
    # The same JSON as the CLI's, plus rights.
    cli = world.cli("workflows", "show", "con", "--as", "alice", "--json").json()
    assert {k: v for k, v in shown.items() if k != "rights"} == cli
    listed = alice_client.get("/api/workflows").json()
    assert listed == world.cli("workflows", "list", "--as", "alice", "--json").json()
    assert "private" not in {w["id"] for w in listed["workflows"]}
    assert alice_client.get("/api/workflows/private").status_code == 404  # not 403: IDs cannot be probed


# -- browsing: the same confinement as kbd read / kbd ls ---------------------------------------------


def raw_get(ui: Ui, cookie: str, path: str) -> tuple[int, bytes]:
    """A GET with ``path`` sent byte for byte (httpx would normalise dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", ui.port, timeout=15)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", f"127.0.0.1:{ui.port}")
        conn.putheader("Cookie", f"kbd_ui_{ui.port}={cookie}")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_asset_traversal_is_refused(alice: Ui, alice_client: httpx.Client) -> None:
    cookie = alice_client.cookies[f"kbd_ui_{alice.port}"]
    for path in ("/assets/../server.py", "/assets/..%2fserver.py", "/assets/%2e%2e%2fserver.py",
                 "/assets/%2e%2e/server.py", "/assets/..", "/assets/.hidden.js", "/assets//etc/passwd",
                 "/assets/%2fetc%2fpasswd", "/assets/..%5cserver.py", "/assets/sub/app.js",
                 "/assets/../../kbd/ui/server.py", "/assets/server.py", "/assets/__init__.py"):  # fmt: skip
        status, body = raw_get(alice, cookie, path)
        assert status in (403, 404), (path, status)
        assert b"import" not in body and b"root:" not in body, (path, body[:200])


def test_browse_traversal_and_links_out_are_refused(alice: Ui, alice_client: httpx.Client) -> None:
    cookie = alice_client.cookies[f"kbd_ui_{alice.port}"]
    for base in ("/api/workflows/con/own", "/api/workflows/con/sources/rts"):
        for q in ("../workflow.json", "..%2fworkflow.json", "%2e%2e/workflow.json", "/etc/passwd",
                  "%2Fetc%2Fpasswd", "notes/../../credentials/token", "../credentials/token",
                  "notes/leak.md", "notes/passwd.md", "..", "notes/%00x"):  # fmt: skip
            for kind in ("file", "dir"):
                status, body = raw_get(alice, cookie, f"{base}/{kind}?path={q}")
                assert status in (400, 403, 404), (base, q, kind, status, body[:200])
                assert b"secret-" not in body and b"root:x:0" not in body, (base, q, body[:200])
                assert set(orjson.loads(body)["error"]) == {"code", "message", "hint"}
    # What is inside is served, as `kbd read` serves it.
    own = alice_client.get("/api/workflows/con/own/file", params={"path": "notes/fact.md"}).json()
    assert own["content"] == "con\n" and own["alias"] is None
    shared = alice_client.get("/api/workflows/con/sources/rts/file", params={"path": "notes/fact.md"}).json()
    assert shared["content"] == "src\n" and shared["alias"] == "rts"
    listing = alice_client.get("/api/workflows/con/own/dir", params={"path": "notes"}).json()
    assert {e["name"]: e["type"] for e in listing["entries"]}[
        "passwd.md"
    ] == "symlink"  # listed, never followed


def test_own_kb_that_is_a_link_is_refused(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    wf = kb.workflow("mine", access={"owners": ["alice"]}, kb=False)
    (wf / "knowledgebase").symlink_to("soul")  # the workflow's private folder
    (wf / "soul" / "diary.md").write_text("private\n")
    r = kb.cli("read", "mine", ".", "diary.md", "--as", "alice")
    assert r.code == 69 and "kb_symlinked" in r.err and "private" not in r.out, r
    r = kb.cli("ls", "mine", ".", "--as", "alice")
    assert r.code == 69 and "diary" not in r.out, r


# -- a reader's forged changes: refused by the operation, nothing changed ----------------------------


def test_reader_sees_no_rights_and_forged_changes_are_refused(world: KbRoot) -> None:
    before = manifests(world)
    with serving_ui(world.root, "--as", "bob") as bob:
        c = bob.login()
        for wid in ("con", "src"):
            assert c.get(f"/api/workflows/{wid}").json()["rights"] == {"manage": False, "grant": False}
        for method, path, body in CHANGES:
            r = bob.change(c, method, path, body)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "permission-denied", r.text
        # What bob may not see answers 404, as the daemon does.
        r = bob.change(c, "POST", "/api/workflows/private/sources", {"workflow_id": "lib", "alias": "x"})
        assert r.status_code == 404, r.text
        assert c.get("/api/workflows/private/own/dir").status_code == 404
    assert manifests(world) == before
    audit = (world.root / "state" / "audit.log").read_text()
    assert '"actor":"bob"' in audit.replace(" ", "") and "sources_refused" in audit


def test_malformed_bodies_and_numbers_are_400s_naming_what_is_wrong(
    world: KbRoot, alice: Ui, alice_client: httpx.Client
) -> None:
    """No input makes the page's JSON API answer 5xx (docs/api.md "Malformed requests"): a body
    that is not JSON, not UTF-8, with a lone surrogate or nested too deeply, a
    field of the wrong type, a limit of thousands of digits. A body is checked
    before the workflow it names is looked at: the same 400 for one alice cannot
    see (private) as for her own."""
    before = manifests(world)
    headers = {"X-KBD-CSRF": alice.csrf, "Origin": alice.origin, "Content-Type": "application/json"}
    bodies: list[tuple[bytes, str]] = [
        (b"{", "not JSON"),
        (b'{"workflow_id": "\xff"}', "not JSON"),
        (b'{"workflow_id": "\\ud800", "alias": "x"}', "not JSON"),
        (b"[" * 5000 + b"]" * 5000, "not JSON"),
        (b'{"workflow_id": ' + b"9" * 5000 + b', "alias": "x"}', "not JSON"),
        (b'{"workflow_id": 5, "alias": "x"}', "field 'workflow_id' must be a str"),
        (b"[]", "must be a JSON object"),
    ]
    for wid in ("con", "private"):
        for raw, says in bodies:
            r = alice_client.post(f"/api/workflows/{wid}/sources", content=raw, headers=headers)
            assert r.status_code == 400, (wid, raw[:40], r.text)
            assert says in r.json()["error"]["message"] and set(r.json()["error"]) == {
                "code",
                "message",
                "hint",
            }
    for limit in ("9" * 5000, "1" * 10, "²", "-1"):
        r = alice_client.get("/api/workflows/con/own/dir", params={"limit": limit})
        assert r.status_code == 400 and "limit must be a whole number" in r.json()["error"]["message"], r.text
    assert manifests(world) == before


# -- changes through the page are the CLI's changes ---------------------------------------------------


def test_attach_access_detach_write_what_the_cli_writes(tmp_path: Path) -> None:
    page_kb, cli_kb = KbRoot.create(tmp_path / "page"), KbRoot.create(tmp_path / "cli")
    for kb in (page_kb, cli_kb):
        build(kb)
        # An unknown field is kept on every save, whoever saves.
        kb.edit(kb.workflows / "con", x_extra={"kept": [1, 2]})
    with serving_ui(page_kb.root, "--as", "alice") as ui:
        c = ui.login()
        cands = c.get("/api/workflows/con/candidates").json()
        assert [x["workflow_id"] for x in cands["candidates"]] == ["lib"]
        assert "path" not in orjson.dumps(cands).decode()  # candidates never carry paths
        r = ui.change(
            c, "POST", "/api/workflows/con/sources", {"workflow_id": "lib", "alias": "lib", "access": "read"}
        )
        assert r.status_code == 200, r.text
        version = c.get("/api/workflows/con/sources").json()["version"]
        r = ui.change(
            c, "PATCH", "/api/workflows/con/sources/lib", {"access": "write", "expected_version": version}
        )
        assert r.status_code == 200 and r.json()["write"]["reason"] == "write_not_granted", r.text
        # Decided on an older view: refused, nothing changed.
        held = (page_kb.workflows / "con" / "workflow.json").read_bytes()
        r = ui.change(
            c, "PATCH", "/api/workflows/con/sources/lib", {"access": "read", "expected_version": version}
        )
        assert r.status_code == 409 and r.json()["error"]["code"] == "version-conflict", r.text
        assert (page_kb.workflows / "con" / "workflow.json").read_bytes() == held
        r = ui.change(c, "DELETE", "/api/workflows/con/sources/rts")
        assert r.status_code == 200 and r.json() == {"workflow_id": "con", "detached": "rts"}, r.text
        for bad in ({"access": "admin"}, {"access": "read", "x": 1}, {}, {"access": 1}):
            r = ui.change(c, "PATCH", "/api/workflows/con/sources/lib", bad)
            assert r.status_code == 400 and r.json()["error"]["code"] in ("invalid-input", "usage"), (
                bad,
                r.text,
            )
    for args in (["sources", "attach", "con", "lib", "--alias", "lib", "--access", "read"],
                 ["sources", "access", "con", "lib", "write"], ["sources", "detach", "con", "rts"]):  # fmt: skip
        done = cli_kb.cli(*args, "--as", "alice")
        assert done.code == 0, done
    assert page_kb.read_manifest(page_kb.workflows / "con") == cli_kb.read_manifest(cli_kb.workflows / "con")
    page = (page_kb.workflows / "con" / "workflow.json").read_bytes()
    assert page == (cli_kb.workflows / "con" / "workflow.json").read_bytes()


def test_grant_review_through_the_page(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    build(kb)
    kb.edit(
        kb.workflows / "con",
        knowledgebase_sources=[{"workflow_id": "src", "alias": "rts", "access": "write"}],
    )
    with serving_ui(kb.root, "--as", "alice") as ui:
        c = ui.login()
        card = c.get("/api/workflows/con/sources").json()["sources"][0]
        assert card["write"] == {
            "available": False,
            "reason": "write_not_granted",
            "message": card["write"]["message"],
        }
        r = ui.change(c, "POST", "/api/workflows/src/writers", {"workflow_id": "con"})
        assert r.status_code == 200 and r.json()["granted"] is True, r.text
        assert c.get("/api/workflows/src/writers").json()["writers"] == [
            {"workflow_id": "con", "exists": True}
        ]
        assert c.get("/api/workflows/con/sources").json()["sources"][0]["write"]["available"] is True
        sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
        done = kb.cli("notes", "write", sid, "rts", "tip.md", "--file", "-", input=b"# Tip\nuse retries\n")
        assert done.code == 0, done
        pending = c.get("/api/workflows/src/notes/pending").json()
        (item,) = pending["pending"]
        # The page sends the version it showed; an approval without one is refused, naming the field.
        r = ui.change(
            c, "POST", "/api/workflows/src/notes/review", {"path": item["relpath"], "decision": "approve"}
        )
        assert r.status_code == 400 and "expected_version" in r.json()["error"]["message"], r.text
        r = ui.change(c, "POST", "/api/workflows/src/notes/review",
                      {"path": item["relpath"], "decision": "approve", "expected_version": item["digest"]})  # fmt: skip
        assert r.status_code == 200, r.text
        assert c.get("/api/workflows/src/notes/pending").json()["pending"] == []
        r = ui.change(c, "DELETE", "/api/workflows/src/writers/con")
        assert r.status_code == 200 and r.json()["changed"] is True, r.text
        kb.cli("session", "close", sid)


# -- the search session -----------------------------------------------------------------------------


def sessions_of(kb: KbRoot) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = kb.cli("session", "list", "--all", "--json").json()["sessions"]
    return listed


def test_search_opens_one_reviewer_session_and_sigterm_closes_it(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    build(kb)
    ui = serving_ui(kb.root, "--as", "bob")  # a reader: reviewer kinds only (docs/sessions.md)
    with ui as page:
        c = page.login()
        for _ in range(3):
            r = c.get("/api/workflows/con/search", params={"q": "src"})
            assert r.status_code == 200, r.text
        hits = r.json()["hits"]
        assert {h["alias"] for h in hits} == {"rts"} and all(h["relpath"] != "notes/leak.md" for h in hits)
        assert c.get("/api/workflows/con/search", params={"q": "con", "alias": "rts"}).json()["hits"] == []
        assert c.get("/api/workflows/private/search", params={"q": "x"}).status_code == 404
        bad = c.get("/api/workflows/con/search", params={"q": "src", "include_unreviewed": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid-input", bad.text
        assert "include_unreviewed" in bad.json()["error"]["message"]
        both = c.get("/api/workflows/con/search", params={"q": "src", "include_unreviewed": "true"})
        assert both.status_code == 200, both.text
        opened = [s for s in sessions_of(kb) if not s["closed"]]
        assert [(s["workflow_id"], s["kind"], s["kb_access"]) for s in opened] == [
            ("con", "reviewer_strategic", "read")
        ]
        # Closed behind the page's back: the next search opens a new one.
        assert kb.cli("session", "close", opened[0]["session_id"]).code == 0
        assert c.get("/api/workflows/con/search", params={"q": "src"}).status_code == 200
        assert len([s for s in sessions_of(kb) if not s["closed"]]) == 1
    # serving_ui's exit sent SIGTERM and checked the exit status (0).
    assert [s for s in sessions_of(kb) if not s["closed"]] == [], "kbd ui left a session open"


# -- the change feed --------------------------------------------------------------------------------


def read_events(
    c: httpx.Client, until: float, want: int = 1, following: threading.Event | None = None
) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, event) from /api/events until ``want`` arrived or the deadline
    passed (the stream pings every few seconds, so a read never blocks for long).
    Frames are ``id:`` and ``data:`` only: EventSource.onmessage gets every one.
    ``following`` is set at the first ``: ping``: the server relays one as soon as
    its own subscription to the change feed is open (``: kbd events``)."""
    out: list[tuple[float, dict[str, Any]]] = []
    with c.stream("GET", "/api/events", timeout=httpx.Timeout(15, read=20)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert not line.startswith("event:"), line
            if line == ": ping" and following is not None:
                following.set()
            if line.startswith("data: "):
                out.append((time.monotonic(), orjson.loads(line[6:])))
            if time.monotonic() > until or len(out) >= want:
                break
    return out


def test_live_with_a_daemon_a_hand_edit_reaches_the_page_within_a_second(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    build(kb)
    with daemon.serving(kb.root), serving_ui(kb.root, "--as", "bob") as ui:
        c = ui.login()
        assert c.get("/api/me").json()["live"] is True
        got: list[tuple[float, dict[str, Any]]] = []
        following = threading.Event()

        def listen() -> None:
            got.extend(read_events(c, time.monotonic() + 10, want=1, following=following))

        t = threading.Thread(target=listen)
        t.start()
        wait_for(following.is_set, 10, "the page's event stream to follow the feed")
        # A workflow bob may not see changes first: never delivered to him (a
        # negative window in which a leaked event would arrive).
        kb.edit(kb.workflows / "private", label="hidden change")
        holds_for(lambda: not got, 0.3, "no event for a workflow bob may not see", detail=lambda: got)
        edited = time.monotonic()
        kb.edit(kb.workflows / "con", knowledgebase_sources=[])  # a hand detach
        t.join(timeout=30)
        assert got, f"no event within 10 s\n{ui.stderr}"
        arrived, event = got[0]
        assert event.get("workflow_id") == "con", got  # never the private workflow's
        assert event["type"] in ("workflow.changed", "sources.changed"), got
        assert arrived - edited < 1.0, arrived - edited


def test_direct_without_a_daemon_says_not_live(alice_client: httpx.Client) -> None:
    assert alice_client.get("/api/me").json()["live"] is False


# -- through the daemon -------------------------------------------------------------------------------


def test_through_the_daemon_with_a_token(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    build(kb)
    tokens = daemon.issue_tokens(kb.root, ["alice"])
    token_file = tmp_path / "alice.token"
    token_file.write_text(tokens["alice"])
    os.chmod(token_file, 0o600)
    with daemon.serving(kb.root) as served:
        sock = str(served.sock)
        with serving_ui(kb.root, "--socket", sock, "--token-file", str(token_file)) as ui:
            c = ui.login()
            me = c.get("/api/me").json()
            assert (me["principal"], me["mode"], me["live"]) == ("alice", "daemon", True)
            assert c.get("/api/workflows/con").json()["rights"] == {"manage": True, "grant": True}
            r = ui.change(c, "POST", "/api/workflows/con/sources", {"workflow_id": "lib", "alias": "lib"})
            assert r.status_code == 201 or r.status_code == 200, r.text
            assert [s["alias"] for s in kb.read_manifest(kb.workflows / "con")["knowledgebase_sources"]] == [
                "rts",
                "lib",
            ]
            assert (
                c.get("/api/workflows/con/own/file", params={"path": "../workflow.json"}).status_code == 400
            )
            assert c.get("/api/workflows/con/search", params={"q": "src"}).status_code == 200
            # The daemon refuses as the CLI would: --as someone else through the daemon.
        done = kb.cli("ui", "--no-browser", "--socket", sock, "--token-file", str(token_file), "--as", "bob")
        assert done.code == 77 and done.out == "", done
        open_now = [
            s for s in kb.cli("session", "list", "--all", "--json").json()["sessions"] if not s["closed"]
        ]
        assert open_now == [], open_now


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_with_an_open_stream_and_exit_0(world: KbRoot, sig: str) -> None:
    import signal
    import threading

    from tests.integration.ui import start_ui

    ui = start_ui(world.root, "--as", "bob")
    try:
        c = ui.login()
        assert c.get("/api/workflows/con/search", params={"q": "src"}).status_code == 200
        opened = threading.Event()

        def hold() -> None:
            with c.stream("GET", "/api/events", timeout=httpx.Timeout(15, read=30)) as r:
                opened.set()
                for _ in r.iter_lines():
                    pass

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        assert opened.wait(10)
        start = time.monotonic()
        ui.proc.send_signal(getattr(signal, sig))
        code = ui.proc.wait(timeout=15)
        assert code == 0 and time.monotonic() - start < 5, (code, time.monotonic() - start, ui.stderr)
        t.join(timeout=10)
        assert not t.is_alive(), "the event stream was not ended by the shutdown"
    finally:
        ui.kill()
    assert "closed 1 search session" in ui.stderr and "Traceback" not in ui.stderr, ui.stderr
    assert [s for s in sessions_of(world) if not s["closed"]] == []


def test_pages_that_leave_their_event_stream_leave_no_error(world: KbRoot) -> None:
    """A browser closes its EventSource at any moment (a reload, a closed tab): the
    stream ends cleanly, whatever it was waiting for (regression: closing it while it
    waited for the next event raised in the server)."""
    with serving_ui(world.root, "--as", "alice") as ui:
        c = ui.login()
        for i in range(40):
            with c.stream("GET", "/api/events") as r:
                assert r.status_code == 200
                if i % 2:
                    next(r.iter_lines())  # the first frame, then gone
        # A negative window: an error of a left stream is logged as the server notices it.
        holds_for(lambda: "Traceback" not in ui.stderr and "Exception" not in ui.stderr, 0.5,
                  "a clean server log", detail=lambda: ui.stderr)  # fmt: skip
        assert c.get("/api/me").status_code == 200
    assert "Traceback" not in ui.stderr and "Exception" not in ui.stderr, ui.stderr


def test_every_read_route_answers_the_cli_s_json(world: KbRoot, alice_client: httpx.Client) -> None:
    """Each route is the CLI's operation: the same JSON as its `--json` (as the same principal)."""
    pairs = [
        ("/api/workflows/con/sources", ["sources", "list", "con"]),
        ("/api/workflows/con/candidates", ["sources", "candidates", "con"]),
        ("/api/workflows/src/writers", ["writers", "list", "src"]),
        ("/api/workflows/src/notes/pending", ["notes", "pending", "src"]),
        ("/api/workflows/con/own/dir?path=notes", ["ls", "con", ".", "notes"]),
        ("/api/workflows/con/own/file?path=context/about.md", ["read", "con", ".", "context/about.md"]),
        ("/api/workflows/con/sources/rts/dir?path=", ["ls", "con", "rts"]),
        ("/api/workflows/con/sources/rts/file?path=notes/fact.md", ["read", "con", "rts", "notes/fact.md"]),
    ]
    for path, argv in pairs:
        page = alice_client.get(path)
        cli = world.cli(*argv, "--as", "alice", "--json")
        assert page.status_code == 200 and cli.code == 0, (path, page.text, cli.err)
        assert page.json() == cli.json(), path
    # And the same refusal: code and status as the daemon would answer.
    page = alice_client.get("/api/workflows/con/sources/nosuch/file", params={"path": "x"})
    cli = world.cli("read", "con", "nosuch", "x", "--as", "alice")
    assert page.status_code == 404 and cli.code == 66
    assert f"error[{page.json()['error']['code']}]" in cli.err, (page.text, cli.err)


def test_two_pages_on_one_host_keep_their_own_cookies(world: KbRoot) -> None:
    """Browsers keep cookies per host, not per port: a second `kbd ui` (here bob's)
    must not log the first one's page out by overwriting its cookie."""
    jar = httpx.Cookies()  # one browser's cookie jar for 127.0.0.1
    with serving_ui(world.root, "--as", "alice") as first, serving_ui(world.root, "--as", "bob") as second:
        for ui in (first, second):
            with httpx.Client(base_url=f"http://127.0.0.1:{ui.port}", cookies=jar) as c:
                assert c.get("/", params={"token": ui.token}).status_code == 303
                jar.update(c.cookies)
        for ui, who in ((first, "alice"), (second, "bob")):
            with httpx.Client(base_url=f"http://127.0.0.1:{ui.port}", cookies=jar) as c:
                me = c.get("/api/me")
                assert me.status_code == 200 and me.json()["principal"] == who, me.text
