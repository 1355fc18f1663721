"""The real parts the browser tests drive: a `kbd ui --no-browser` process and
Debian's Chromium through Playwright (never a downloaded browser build).

`UiServer` starts `python -m kbd --root ROOT ui [WF] --no-browser --as P`, reads
the one-time URL from its first stdout line (a pump thread and a queue with a
timeout: never a sleep), and on stop sends SIGTERM and asserts a clean exit.

`Watched` wraps a Playwright page with what every test checks afterwards: the
Content-Security-Policy violations the page reported (a listener installed
before any page script runs), the dialogs it tried to open and every request it
made (so a hostile `<img src=x>` that loaded would be seen).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from playwright.sync_api import Browser, BrowserContext, Page, Request, expect

from tests.integration.daemon import clean_env

CHROMIUM = Path("/usr/bin/chromium")
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
URL_LINE = re.compile(r"^http://127\.0\.0\.1:(\d+)/\?token=([A-Za-z0-9_-]+)$")
WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 400, "height": 860}
# Installed into every page before its own scripts: records CSP violations.
CSP_LISTENER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', (e) => {
  window.__csp.push({directive: e.violatedDirective, blocked: e.blockedURI, sample: e.sample});
});
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


class _Pump(threading.Thread):
    def __init__(self, stream: IO[bytes], lines: queue.Queue[bytes | None] | None) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines = lines
        self.data = bytearray()

    def run(self) -> None:
        try:
            for line in iter(self.stream.readline, b""):
                self.data += line
                if self.lines is not None:
                    self.lines.put(line)
        finally:
            if self.lines is not None:
                self.lines.put(None)


@dataclass
class UiServer:
    proc: subprocess.Popen[bytes]
    url: str  # the one-time URL (token included)
    port: int
    _out: _Pump
    _err: _Pump

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stderr(self) -> str:
        return self._err.data.decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM; assert exit 0 within the timeout and no traceback."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"kbd ui did not exit within {STOP_TIMEOUT}s of SIGTERM\n{self.stderr}"
            ) from None
        self._reap()
        assert code == 0, f"kbd ui exited {code} after SIGTERM\n{self.stderr}"
        assert "Traceback" not in self.stderr, self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)
        self._reap()

    def _reap(self) -> None:
        self._out.join(timeout=STOP_TIMEOUT)
        self._err.join(timeout=STOP_TIMEOUT)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def start_ui(root: Path, *, as_: str, workflow: str | None = None, args: tuple[str, ...] = ()) -> UiServer:
    argv = [sys.executable, "-m", "kbd", "--root", str(root), *args, "ui"]
    if workflow is not None:
        argv.append(workflow)
    argv += ["--no-browser", "--as", as_]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(Path(os.environ["HOME"])))  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[bytes | None] = queue.Queue()
    out, err = _Pump(proc.stdout, lines), _Pump(proc.stderr, None)
    out.start()
    err.start()
    try:
        first = lines.get(timeout=START_TIMEOUT)
    except queue.Empty:
        first = b""
    text = (first or b"").decode(errors="replace").rstrip("\n")
    match = URL_LINE.match(text)
    if match is None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)
        raise AssertionError(
            f"kbd ui printed no URL line (got {text!r}); stderr:\n{err.data.decode(errors='replace')}"
        )
    return UiServer(proc=proc, url=text, port=int(match.group(1)), _out=out, _err=err)


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


def sign_in(context: BrowserContext, ui: UiServer, *, workflow: str | None = None) -> Watched:
    """Open the one-time URL in a fresh page (the token becomes the context's cookie)
    and wait until the page has loaded its workflow (if one is named)."""
    watched = watch(context)
    watched.page.goto(ui.url)
    ready(watched.page, workflow)
    return watched


def second_page(context: BrowserContext, ui: UiServer, *, workflow: str | None = None) -> Watched:
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


def wait_until(check: Callable[[], bool], *, timeout: float, what: str) -> float:
    """Poll ``check`` (every 10 ms) until true; the seconds it took. Fails after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.01)
    return time.monotonic() - t0
