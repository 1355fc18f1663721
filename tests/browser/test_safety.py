"""The page as an attack surface: hostile values stay text, links never lead out
of a KB, the CSP holds (and is watched), other origins cannot post into it."""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, expect

from tests.browser import worlds
from tests.browser.conftest import World
from tests.browser.harness import new_context, url_of, watch
from tests.helpers import snapshot

ASSETS = Path(__file__).resolve().parents[2] / "kbd" / "ui" / "assets"

HOSTILE_LABEL = '<img src=x onerror="alert(1)">'
HOSTILE_NAME = "<img src=x onerror=alert(2)>.md"
HOSTILE_TEXT = (
    "# <script>alert(3)</script>\n<img src=x onerror=\"fetch('/x')\">\n[link](javascript:alert(4))\n"
)


def requests_to_x(requests: list[str]) -> list[str]:
    return [u for u in requests if re.search(r"/x(\?|$)", u) or u.startswith("javascript:")]


def test_hostile_labels_names_and_note_text_stay_inert(world: World) -> None:
    worlds.build(world.kb)
    world.kb.workflow("wf_evil", label=HOSTILE_LABEL, access={"owners": ["alice"], "readers": ["bob"]})
    evil_kb = world.kb.workflows / "wf_evil" / "knowledgebase"
    (evil_kb / "notes" / HOSTILE_NAME).write_text(HOSTILE_TEXT)
    r = world.kb.cli("sources", "attach", worlds.MAIN, "wf_evil", "--alias", "evil", "--as", "alice")
    assert r.code == 0, r.err
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page

    # The label, as text, in the workflow list and on the card.
    expect(page.locator('[data-workflow="wf_evil"] .wf-label')).to_have_text(HOSTILE_LABEL)
    expect(page.locator('[data-alias="evil"]')).to_contain_text(HOSTILE_LABEL)
    # The file name in the listing, the file's text in the viewer: literally.
    page.locator('[data-alias="evil"] [data-action="open"]').click()
    page.locator('[data-panel="browser"] [data-path="notes"]').first.click()
    entry = page.locator(f'[data-panel="browser"] [data-path="notes/{HOSTILE_NAME}"]')
    expect(entry).to_contain_text(HOSTILE_NAME)
    entry.click()
    # Rendered: the Markdown's own structure from its text; the HTML in it stays text, and a
    # javascript: link is no link.
    md = page.locator("#viewer .md")
    expect(md.locator("h3")).to_have_text("<script>alert(3)</script>")
    expect(md).to_contain_text("<img src=x onerror=\"fetch('/x')\">")
    expect(md).to_contain_text("link (javascript:alert(4))")
    expect(md.locator("a, img, script")).to_have_count(0)
    page.locator('[data-action="render"]').click()
    expect(page.locator(".file-text")).to_have_text(HOSTILE_TEXT)
    # The search hit's title and snippet: text too.
    page.locator("#search-q").fill("alert")
    page.locator('[data-action="search"]').click()
    expect(page.locator(".hit").first).to_be_visible()
    # The workflow itself, selected: its label is the page's heading.
    page.locator('[data-workflow="wf_evil"]').click()
    expect(page.locator(".wf-head h2")).to_have_text(HOSTILE_LABEL)

    assert page.locator("img, script:not([src])").count() == 0, "markup from data reached the DOM"
    assert page.evaluate("document.querySelectorAll('[onerror], [onclick], [onload]').length") == 0
    assert watched.dialogs == []
    assert requests_to_x(watched.requests) == [], watched.requests


def test_the_browser_never_follows_a_link_out_of_a_kb(world: World) -> None:
    worlds.build(world.kb)
    for wid in ("wf_src", worlds.MAIN):
        worlds.plant_links(world.kb.workflows / wid / "knowledgebase")
    (world.kb.workflows / worlds.MAIN / "soul" / "secret.md").write_text(f"{worlds.SECRET}\n")
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    browser = page.locator('[data-panel="browser"]')

    for kb in ("own", "src"):
        browser.locator(f'[data-kb="{kb}"]').click()
        browser.locator('.entries [data-path="notes"]').click()
        expect(browser.locator('.entries [data-path="notes/fact.md"]')).to_be_visible()
        for name in ("soul.md", "passwd.md"):
            # Listed as what it is (a link), and refused when opened.
            entry = browser.locator(f'.entries [data-path="notes/{name}"]')
            expect(entry).to_have_attribute("data-type", "symlink")
            entry.click()
            expect(browser.locator('#browser-error .error[data-code="path-refused"]')).to_be_visible()
            expect(browser.locator(".file-text, .md")).to_have_count(0)
            # Asked for directly (as a crafted page would), the server refuses too.
            alias = "own" if kb == "own" else "sources/src"
            answer = page.evaluate(
                "async (p) => { const r = await fetch(p); return {status: r.status, body: await r.text()}; }",
                f"/api/workflows/{worlds.MAIN}/{alias}/file?path=notes/{name}",
            )
            assert answer["status"] >= 400, answer
            assert worlds.SECRET not in answer["body"] and "root:x:0:0" not in answer["body"]
        folder = browser.locator('.entries [data-path="notes/soul-dir"]')
        folder.click()
        expect(browser.locator('#browser-error .error[data-code="path-refused"]')).to_be_visible()
        expect(browser.locator('.entries [data-path="notes/soul-dir/secret.md"]')).to_have_count(0)
        # Even a listing asked for by hand does not go through the folder link.
        listing = page.evaluate(
            "async (p) => { const r = await fetch(p); return {status: r.status, body: await r.text()}; }",
            f"/api/workflows/{worlds.MAIN}/{'own' if kb == 'own' else 'sources/src'}/dir?path=notes/soul-dir",
        )
        assert listing["status"] >= 400 and "secret.md" not in listing["body"], listing
        text = page.locator("body").inner_text()
        assert worlds.SECRET not in text and "root:x:0:0" not in text
        expect(browser.locator(".file-text, .md")).to_have_count(0)


def test_the_csp_listener_sees_a_violation_and_the_page_causes_none(world: World) -> None:
    """The listener every test relies on works (an injected inline script is
    refused and reported), and the page under normal use reports nothing."""
    worlds.build(world.kb)
    ui, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    page.locator('[data-alias="src"] [data-action="open"]').click()
    page.locator('.entries [data-path="notes"]').click()
    page.locator('.entries [data-path="notes/router.md"]').click()
    expect(page.locator("#viewer")).to_contain_text("9000 bytes")
    assert watched.violations() == []

    probe_ctx = world.context()
    probe = watch(probe_ctx)
    refused = probe.page.goto(f"{ui.origin}/")  # a context without the cookie: the 403 page, same CSP
    assert refused is not None and refused.status == 403
    probe.page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.__ran = 1'; document.body.append(s); }"
    )
    probe.page.wait_for_function("window.__csp.length > 0")
    assert probe.page.evaluate("window.__ran === undefined"), "an inline script ran under the CSP"
    assert probe.violations()[0]["directive"].startswith("script-src")


def test_every_asset_is_free_of_inline_code_and_html_injection() -> None:
    """The CSP forbids inline code; app.js never hands data to an HTML parser."""
    html = (ASSETS / "index.html").read_text()
    assert re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html) is None, "an inline <script>"
    assert "<style" not in html and " style=" not in html, "inline style"
    assert re.search(r"\son[a-z]+=", html) is None, "an on*= handler attribute"
    assert re.search(r"(src|href)=\"(https?:)?//", html) is None, "a third-party asset"
    # Comments left out (the file's header names the sinks it never uses).
    js = "\n".join(
        ln for ln in (ASSETS / "app.js").read_text().splitlines() if not ln.lstrip().startswith("//")
    )
    for sink in (".innerHTML", ".outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, f"app.js uses {sink}"
    assert "http://" not in js and "https://" not in js, "app.js names another origin"
    css = (ASSETS / "app.css").read_text()
    assert "@import" not in css and "url(" not in css, "app.css loads something"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def other_origin(folder: Path) -> Iterator[str]:
    """A second local web server (127.0.0.1, another port): another origin."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_page_on_another_origin_cannot_post_into_the_ui(world: World, tmp_path: Path) -> None:
    worlds.build(world.kb)
    ui, ctx, _ = world.open("alice", worlds.MAIN)  # the browser holds the cookie now
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<!doctype html><title>elsewhere</title><p>another site</p>\n")
    before = snapshot(world.root, skip=("state",))
    target = f"{ui.origin}/api/workflows/{worlds.MAIN}/sources"
    body = '{"workflow_id": "wf_extra", "alias": "stolen", "access": "read"}'
    with other_origin(site) as origin:
        evil = watch(ctx)
        evil.page.goto(f"{origin}/index.html")
        # Reading the CSRF token: CORS refuses (no Access-Control-Allow-Origin).
        read = evil.page.evaluate(
            "async (u) => { try { await fetch(u, {credentials: 'include'}); return 'read'; }"
            " catch (e) { return 'refused'; } }", f"{ui.origin}/api/me",
        )  # fmt: skip
        assert read == "refused"
        # A JSON POST with a (guessed) CSRF header: the preflight is refused.
        fetched = evil.page.evaluate(
            "async ([u, b]) => { try { await fetch(u, {method: 'POST', credentials: 'include',"
            " headers: {'Content-Type': 'application/json', 'X-KBD-CSRF': 'guess'}, body: b}); return 'sent'; }"
            " catch (e) { return 'refused'; } }", [target, body],
        )  # fmt: skip
        assert fetched == "refused"
        # A "simple" POST needs no preflight: it arrives, cookie and all, and the server refuses it.
        # (Its answer is opaque to the page, and Cross-Origin-Resource-Policy blocks even that.)
        with evil.page.expect_request(target) as simple:
            evil.page.evaluate(
                "async ([u, b]) => { try { await fetch(u, {method: 'POST', mode: 'no-cors', credentials: 'include',"
                " headers: {'Content-Type': 'text/plain'}, body: b}); } catch (e) {} }", [target, body],
            )  # fmt: skip
        assert simple.value.method == "POST"
        # A form post (a top-level navigation): refused by the server's Origin check.
        with evil.page.expect_response(target) as answered:
            evil.page.evaluate(
                "([u, b]) => { const f = document.createElement('form'); f.method = 'POST'; f.action = u;"
                " f.enctype = 'text/plain'; const i = document.createElement('input'); i.name = b; i.value = '';"
                " f.append(i); document.body.append(f); f.submit(); }", [target, body],
            )  # fmt: skip
        assert answered.value.status == 403
    assert snapshot(world.root, skip=("state",)) == before, "a post from another origin changed the root"
    assert "stolen" not in worlds.manifest(world.kb).decode()


def test_a_browser_without_the_cookie_gets_nothing(world: World) -> None:
    worlds.build(world.kb)
    ui = world.ui("alice", worlds.MAIN)
    ctx = new_context(world.browser)
    world.contexts.append(ctx)
    page: Page = ctx.new_page()
    first = page.goto(f"{ui.origin}/")
    assert first is not None and first.status == 403
    used = world.context()
    used_page = used.new_page()
    used_page.goto(url_of(ui))  # the token works once ...
    again = page.goto(url_of(ui))  # ... and never again
    assert again is not None and again.status == 403
    try:
        answer = page.evaluate("async () => (await fetch('/api/workflows')).status")
    except PlaywrightError:  # a 403 html page may run no script at all: fine too
        answer = 403
    assert answer == 403
