"""Fixtures of the browser tests: one Chromium for the run, and per test a
temporary root served by a real daemon (its watcher feeds the change feed) with
real `kbd ui` processes in front of it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Playwright, expect, sync_playwright

from tests.browser.harness import Watched, chromium_or_fail, new_context, open_ui, sign_in
from tests.helpers import KbRoot
from tests.integration import daemon as daemons
from tests.integration.ui import Ui

SHOTS_ENV = "KBD_SCREENSHOTS"
# A page's state is awaited up to this long (the default 5 s is short on a loaded
# 2-core machine); the live tests measure their 1 s budget themselves.
expect.set_options(timeout=10_000)


# Package scope: Playwright's sync API runs an asyncio loop on this thread while
# it is started, so it must stop when tests/browser is done (later tests call asyncio.run).
@pytest.fixture(scope="package")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="package")
def browser(playwright: Playwright) -> Iterator[Browser]:
    executable = chromium_or_fail()  # a hard failure with the fix, never a skip
    launched = playwright.chromium.launch(executable_path=executable, headless=True)
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $KBD_SCREENSHOTS (`make screenshots`: docs/screenshots), else a tmp folder."""
    given = os.environ.get(SHOTS_ENV)
    folder = Path(given) if given else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@dataclass
class World:
    """A root, its daemon, and the `kbd ui` servers and browser contexts a test opened."""

    kb: KbRoot
    daemon: daemons.Daemon | None
    browser: Browser
    uis: list[Ui] = field(default_factory=list)
    contexts: list[BrowserContext] = field(default_factory=list)
    pages: list[Watched] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.kb.root

    def ui(self, as_: str | None, workflow: str | None = None, *, args: tuple[str, ...] = ()) -> Ui:
        server = open_ui(self.root, as_=as_, workflow=workflow, args=args)
        self.uis.append(server)
        return server

    def context(self, viewport: dict[str, int] | None = None) -> BrowserContext:
        ctx = new_context(self.browser, viewport=viewport)
        self.contexts.append(ctx)
        return ctx

    def open(
        self, as_: str | None, workflow: str | None = None, *, viewport: dict[str, int] | None = None,
        args: tuple[str, ...] = (),
    ) -> tuple[Ui, BrowserContext, Watched]:  # fmt: skip
        """`kbd ui WF --as P` and a signed-in page showing WF."""
        server = self.ui(as_, workflow, args=args)
        ctx = self.context(viewport)
        page = sign_in(ctx, server, workflow=workflow)
        self.pages.append(page)
        return server, ctx, page

    def restart_daemon(self) -> daemons.Daemon:
        """A fresh daemon (it reads principals.yaml, tokens included, when it starts)."""
        self.stop_daemon()
        self.daemon = daemons.start(self.root)
        return self.daemon

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.stop()
        self.daemon = None

    def watched(self, page: Watched) -> Watched:
        self.pages.append(page)
        return page

    def close(self) -> None:
        """Every page was clean (no CSP violation, no dialog); every `kbd ui` exits 0 on SIGTERM."""
        problems: list[BaseException] = []
        for page in self.pages:
            try:
                if not page.page.is_closed():
                    page.assert_clean()
            except BaseException as exc:
                problems.append(exc)
        # The servers stop first, with the pages' event streams still open: the
        # shutdown must end them (a server that waits for a stream fails here).
        for server in self.uis:
            try:
                server.stop()
            except BaseException as exc:
                problems.append(exc)
        for ctx in self.contexts:
            with contextlib.suppress(Exception):
                ctx.close()
        if problems:
            raise problems[0]


@pytest.fixture
def world(kb: KbRoot, browser: Browser) -> Iterator[World]:
    w = World(kb=kb, daemon=daemons.start(kb.root), browser=browser)
    try:
        yield w
    finally:
        try:
            w.close()
        finally:
            if w.daemon is not None:
                w.daemon.stop()
