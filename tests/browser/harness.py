"""The real parts the browser tests drive: a `kbd ui --no-browser` process and
Debian's Chromium through Playwright (never a downloaded browser build).

`open_ui` starts `python -m kbd --root ROOT ui [WF] --no-browser --as P` with the
integration tests' helper (tests/integration/ui.py: the one-time URL from its
first stdout line; SIGTERM and a clean exit at the end).

`Watched` wraps a Playwright page with what every test checks afterwards: the
Content-Security-Policy violations the page reported (a listener installed
before any page script runs), the dialogs it tried to open and every request it
made (so a hostile `<img src=x>` that loaded would be seen).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, BrowserContext, Page, Request, expect

from tests.integration.ui import Ui, start_ui

CHROMIUM = Path("/usr/bin/chromium")
WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 400, "height": 860}
# Installed into every page before its own scripts: records CSP violations.
CSP_LISTENER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', (e) => {
  window.__csp.push({directive: e.violatedDirective, blocked: e.blockedURI, sample: e.sample});
});
// When each change-feed frame reached the page (wall clock, ms): a late refresh says where the time went.
window.__sse = [];
if (window.EventSource) {
  const Original = window.EventSource;
  window.EventSource = function (url, init) {
    const source = new Original(url, init);
    source.addEventListener('message', (e) => window.__sse.push([Date.now(), e.data.slice(0, 120)]));
    return source;
  };
  window.EventSource.prototype = Original.prototype;
  Object.assign(window.EventSource, {CONNECTING: 0, OPEN: 1, CLOSED: 2});
}
// And each API request: [start, ms, path].
window.__fetches = [];
{
  const originalFetch = window.fetch;
  window.fetch = async (...args) => {
    const t = Date.now();
    try { return await originalFetch(...args); }
    finally { window.__fetches.push([t, Date.now() - t, String(args[0]).slice(0, 80)]); }
  };
}
"""


def chromium_or_fail() -> str:
    """Debian's Chromium, or a hard failure that says how to get it (never a skip:
    the browser tests are the page's only tests)."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        raise AssertionError(
            f"{CHROMIUM} is missing: the browser tests need Debian's Chromium. "
            "Install it with `apt-get install -y chromium` (CI's .ci/run does); "
            "never `playwright install` (browser downloads are not available here)."
        )
    return str(CHROMIUM)


def url_of(ui: Ui) -> str:
    """The one-time URL `kbd ui` printed (it works once)."""
    return f"{ui.base}/?token={ui.token}"


def open_ui(root: Path, *, as_: str | None, workflow: str | None = None, args: tuple[str, ...] = ()) -> Ui:
    """`kbd --root ROOT ui ARGS… [WF] --no-browser [--as P]` (tests/integration/ui.py starts it)."""
    return start_ui(root, *args, *([workflow] if workflow else []), *(["--as", as_] if as_ else []))


@dataclass
class Watched:
    """A page and what it did: CSP violations, dialogs, requests."""

    page: Page
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)

    def violations(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.page.evaluate("window.__csp || []")
        return found

    def assert_clean(self) -> None:
        """No CSP violation, no dialog, no request to a name a hostile value carried."""
        assert self.violations() == [], self.violations()
        assert self.dialogs == [], self.dialogs
        refused = [m for m in self.console_errors if "Content Security Policy" in m or "Refused to" in m]
        assert refused == [], refused


def watch(context: BrowserContext, page: Page | None = None) -> Watched:
    page = page or context.new_page()
    watched = Watched(page)

    def on_dialog(dialog: Any) -> None:
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def on_request(request: Request) -> None:
        watched.requests.append(request.url)

    def on_console(msg: Any) -> None:
        if msg.type == "error":
            watched.console_errors.append(msg.text)

    page.on("dialog", on_dialog)
    page.on("request", on_request)
    page.on("console", on_console)
    return watched


def new_context(browser: Browser, *, viewport: dict[str, int] | None = None) -> BrowserContext:
    context = browser.new_context(viewport=viewport or WIDE)  # type: ignore[arg-type]
    context.add_init_script(CSP_LISTENER)
    context.set_default_timeout(10_000)
    return context


def sign_in(context: BrowserContext, ui: Ui, *, workflow: str | None = None) -> Watched:
    """Open the one-time URL in a fresh page (the token becomes the context's cookie)
    and wait until the page has loaded its workflow (if one is named)."""
    watched = watch(context)
    watched.page.goto(url_of(ui))
    ready(watched.page, workflow)
    return watched


def second_page(context: BrowserContext, ui: Ui, *, workflow: str | None = None) -> Watched:
    """Another tab of the same browser (same cookie): the token works once."""
    watched = watch(context)
    watched.page.goto(f"{ui.origin}/" + (f"#wf={workflow}" if workflow else ""))
    ready(watched.page, workflow)
    return watched


def ready(page: Page, workflow: str | None) -> None:
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    if workflow is not None:
        expect(page.locator(f'[data-workflow="{workflow}"]')).to_have_attribute("aria-current", "page")
        expect(page.locator(".wf-head .wf-id")).to_have_text(workflow)
