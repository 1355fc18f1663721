"""The Knowledge page's web-surface decisions (kbd.ui.security): pure, so every case is cheap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.service.workflows import WorkflowDetail
from kbd.ui import security
from kbd.ui.server import TokenGate, body_fields, rights

PORT = 43210
ORIGIN = f"http://127.0.0.1:{PORT}"


@pytest.mark.parametrize(
    "host",
    [
        None,
        "",
        "localhost",
        f"localhost:{PORT}",
        "127.0.0.1",
        f"127.0.0.1:{PORT + 1}",
        f"127.0.0.1:0{PORT}",
        f"127.0.0.1:{PORT} ",
        f"127.0.0.1:{PORT}.evil.example",
        f"evil.example:{PORT}",
        f"[::1]:{PORT}",
        f"0.0.0.0:{PORT}",
        f"127.0.0.2:{PORT}",
        f"127.1:{PORT}",
        f"2130706433:{PORT}",
        f"127.0.0.1.:{PORT}",
        f"user@127.0.0.1:{PORT}",
    ],
)
def test_only_the_bound_host_and_port(host: str | None) -> None:
    assert not security.host_ok(host, PORT)


def test_the_bound_host_and_port() -> None:
    assert security.host_ok(f"127.0.0.1:{PORT}", PORT)


def _check(method: str, **kw: object) -> security.Refusal | None:
    args: dict[str, object] = {"cookie": "c" * 43, "session_cookie": "c" * 43, "csrf": "t" * 43,
                               "session_csrf": "t" * 43, "origin": ORIGIN, "port": PORT}  # fmt: skip
    args.update(kw)
    return security.check_api(method, **args)  # type: ignore[arg-type]


def test_api_reads_need_the_cookie_only() -> None:
    assert _check("GET", csrf=None, origin=None) is None
    assert _check("GET", cookie=None) is security.NO_COOKIE
    assert _check("GET", session_cookie=None) is security.NO_COOKIE  # the token was never used
    assert _check("GET", session_cookie=None, cookie=None) is security.NO_COOKIE  # None never equals None
    assert _check("GET", cookie="c" * 42) is security.NO_COOKIE


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "post", "OPTIONS", "TRACE"])
def test_changes_need_csrf_and_same_origin(method: str) -> None:
    assert _check(method) is None
    assert _check(method, cookie=None) is security.NO_COOKIE  # the cookie first
    assert _check(method, csrf=None) is security.NO_CSRF
    assert _check(method, csrf="") is security.NO_CSRF
    assert _check(method, csrf="t" * 42 + "u") is security.NO_CSRF
    for origin in (None, "null", "", "http://localhost:43210", f"http://127.0.0.1:{PORT + 1}", "https://127.0.0.1:43210",
                   f"{ORIGIN}/", "http://evil.example", ORIGIN.upper()):  # fmt: skip
        assert _check(method, origin=origin) is security.BAD_ORIGIN, origin


def test_refusal_codes_are_the_contract() -> None:
    assert [r.code for r in (security.WRONG_HOST, security.NO_COOKIE, security.NO_CSRF, security.BAD_ORIGIN)] == [
        "ui-host", "ui-unauthenticated", "ui-csrf", "ui-origin"]  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "../x.js",
        "..%2fx.js",
        "a/b.js",
        "/etc/passwd",
        ".hidden.js",
        "x.py",
        "x",
        "x.",
        "",
        "x.js/",
        "x..js",
        "-x.js",
        "x.js\x00",
        "x\\y.js",
        "index.html\n",
        "ÿ.js",
    ],
)
def test_asset_names_that_are_never_served(name: str) -> None:
    assert security.asset_type(name) is None


def test_asset_types() -> None:
    assert security.asset_type("index.html") == "text/html; charset=utf-8"
    assert security.asset_type("app.js") == "text/javascript; charset=utf-8"
    assert security.asset_type("app.css") == "text/css; charset=utf-8"
    assert security.asset_type("icon-1.svg") == "image/svg+xml"


@given(st.text(max_size=40))
def test_an_asset_name_is_one_plain_segment(name: str) -> None:
    if security.asset_type(name) is not None:
        assert "/" not in name and "\\" not in name and not name.startswith(".") and ".." not in name
        assert name.isascii() and "\x00" not in name


def test_cookie_header_and_parsing() -> None:
    header = security.cookie_header("abc", 8123)
    assert header == "kbd_ui_8123=abc; HttpOnly; SameSite=Strict; Path=/"
    assert security.cookie_from("a=1; kbd_ui_8123=abc; b=2", 8123) == "abc"
    # Another kbd ui on another port of the same host: its cookie is not ours.
    assert security.cookie_from("kbd_ui_9000=zzz; kbd_ui_8123=abc", 8123) == "abc"
    assert security.cookie_from("kbd_ui_9000=zzz", 8123) is None
    assert security.cookie_from("xkbd_ui_8123=abc", 8123) is None
    assert security.cookie_from(None, 8123) is None
    assert security.cookie_from("kbd_ui_8123", 8123) is None


def test_csp_allows_no_inline_script_and_no_other_origin() -> None:
    directives = dict(d.strip().split(" ", 1) for d in security.CSP.split(";"))
    assert directives["default-src"] == "'none'"
    for name in ("script-src", "style-src", "img-src", "connect-src", "font-src"):
        assert directives[name] == "'self'", name
    assert directives["frame-ancestors"] == "'none'" and directives["form-action"] == "'none'"
    assert "unsafe" not in security.CSP and "http" not in security.CSP and "*" not in security.CSP


def test_the_token_is_exchanged_once() -> None:
    gate = TokenGate()
    assert gate.exchange(None) is None and gate.exchange("") is None
    assert gate.exchange(gate.token + "x") is None
    assert gate.cookie is None
    cookie = gate.exchange(gate.token)
    assert cookie is not None and cookie == gate.cookie and cookie != gate.token and cookie != gate.csrf
    assert gate.exchange(gate.token) is None and gate.cookie == cookie
    assert len({gate.token, gate.csrf, cookie}) == 3 and all(
        len(s) >= 43 for s in (gate.token, gate.csrf, cookie)
    )


def test_body_fields_name_the_field() -> None:
    assert body_fields({"access": "read"}, {"access": str}) == {"access": "read"}
    assert body_fields({"a": "x", "b": None}, {"a": str}, {"b": str}) == {"a": "x"}
    for body, words in (([], "JSON object"), ({}, "'access' is required"), ({"access": 1}, "'access' must be a str"),
                        ({"access": "read", "zz": 1}, "unknown field(s) zz"), ({"access": True}, "must be a str")):  # fmt: skip
        with pytest.raises(Exception) as err:
            body_fields(body, {"access": str})
        assert words in str(err.value), (body, err.value)


def test_rights_come_from_the_operations_answer() -> None:
    def shown(manage: bool, grant: bool) -> WorkflowDetail:
        return WorkflowDetail(
            "wf", "WF", "/w/wf", "sha256:0", None, False, (), (), (), (), (), (), manage, grant
        )

    assert rights(shown(True, False)) == {"manage": True, "grant": False}
    assert rights(shown(False, True)) == {"manage": False, "grant": True}
    assert rights(shown(False, False)) == {"manage": False, "grant": False}


def test_no_browser_to_open_is_said_not_silent() -> None:
    """On a host with no browser (a server, an ssh session) `kbd ui` says so on stderr (the URL is on stdout)."""
    import subprocess
    import sys

    code = "from kbd.ui.server import _open_browser; _open_browser('http://127.0.0.1:1/')"
    r = subprocess.run([sys.executable, "-c", code], env={"PATH": "/nonexistent", "HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr == "kbd ui: could not open a browser (no browser found); open the URL above yourself\n"
