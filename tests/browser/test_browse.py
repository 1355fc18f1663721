"""The knowledge browser and the search, and a screenshot of each panel."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, expect

from tests.browser import worlds
from tests.browser.conftest import World
from tests.browser.harness import NARROW, WIDE
from tests.helpers import KbRoot

PANELS = ("workflows", "sources", "attach", "writers", "pending", "browser", "search")


def test_the_browser_shows_own_and_shared_kbs_read_only(world: World) -> None:
    worlds.build(world.kb)
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    browser = page.locator('[data-panel="browser"]')
    # The compact selector: own, each attachment (unavailable ones disabled), status above the content.
    expect(browser.locator('[data-kb="own"]')).to_have_attribute("aria-pressed", "true")
    expect(browser.locator('[data-kb="gone"]')).to_be_disabled()
    expect(browser.locator("#kb-status")).to_contain_text("read-only")
    expect(browser.locator("#kb-status")).to_contain_text("own knowledge base")
    browser.locator('.entries [data-path="notes"]').click()
    browser.locator('.entries [data-path="notes/howto.md"]').click()
    # Markdown is rendered (from text: never HTML) and shown as text on request.
    expect(browser.locator(".md h3")).to_have_text("How to")
    expect(browser.locator(".md p code")).to_have_text("make test")
    browser.locator('[data-action="render"]').click()
    expect(browser.locator(".file-text")).to_have_text("# How to\nRun `make test` before you push.\n")

    browser.locator('[data-kb="src"]').click()
    expect(browser.locator("#kb-status")).to_contain_text("shared from Source KB")
    expect(browser.locator(".file-text")).to_have_count(0)
    browser.locator('.entries [data-path="context"]').click()
    browser.locator('.entries [data-path="context/about.md"]').click()
    expect(browser.locator(".file-text")).to_have_text("about wf_src\n")
    browser.locator('.crumbs [data-path=""]').click()
    expect(browser.locator('.entries [data-path="notes"]')).to_be_visible()
    # The write attachment says whether the owner granted it.
    browser.locator('[data-kb="cost"]').click()
    expect(browser.locator("#kb-status")).to_contain_text("waiting for the owner's grant")


def search(page: Page, query: str) -> None:
    page.locator("#search-q").fill(query)
    page.locator('[data-action="search"]').click()


def test_search_labels_each_hit_with_its_trust_and_review(world: World) -> None:
    worlds.build(world.kb)
    r = world.kb.cli("writers", "grant", "wf_cost", worlds.MAIN, "--as", "carol")
    assert r.code == 0, r.err
    (world.kb.workflows / "wf_cost" / "knowledgebase" / "notes" / "budget.md").write_text(
        "# Budget\nrouter spend\n"
    )
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    search(page, "router")
    hits = page.locator('[data-panel="search"] .hit')
    expect(hits).to_have_count(2)
    src = page.locator('.hit:has(code:text-is("notes/router.md"))')
    expect(src).to_have_attribute("data-trust", "source")
    expect(src).to_have_attribute("data-review", "own")
    expect(src).to_contain_text("source's own")
    expect(page.locator("#search-note")).to_contain_text("2 hits")
    # A hit opens in the browser.
    src.locator('[data-action="open"]').click()
    expect(page.locator("#viewer")).to_contain_text("9000 bytes")
    expect(page.locator('[data-kb="src"]')).to_have_attribute("aria-pressed", "true")
    # Narrowed to one attachment.
    page.locator("#search-alias").select_option("cost")
    search(page, "router")
    expect(hits).to_have_count(1)
    expect(hits.first).to_contain_text("cost")
    # A bad query: the error's code, message and hint.
    search(page, "?! --")  # no word to search for
    error = page.locator('#search-error .error[data-code="usage"]')
    expect(error).to_be_visible()
    expect(error.locator(".error-line")).to_contain_text("has no word to search for")
    expect(error.locator(".hint")).to_contain_text("hint: ")


def test_unreviewed_contributions_are_found_only_when_asked_for(world: World) -> None:
    """The search box's "include unreviewed contributions" (as `kbd search
    --include-unreviewed`): a grantor reviewing contributions finds them, labelled."""
    worlds.build(world.kb)
    r = world.kb.cli("writers", "grant", "wf_cost", worlds.MAIN, "--as", "carol")
    assert r.code == 0, r.err
    sid = world.kb.open_session(worlds.MAIN, kind="execution", kb_access="read-write", actor="alice")
    r = world.kb.cli(
        "notes", "write", sid, "cost", "quokka.md", "--as", "alice", input=b"# Quokka\nquokka spend\n"
    )
    assert r.code == 0, r.err
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    hits = page.locator('[data-panel="search"] .hit')
    search(page, "quokka")
    expect(page.locator("#search-note")).to_contain_text("0 hits")
    page.locator("#search-unreviewed").check()
    search(page, "quokka")
    expect(hits).to_have_count(1)
    expect(hits.first).to_have_attribute("data-trust", "contributed-unreviewed")
    expect(hits.first).to_have_attribute("data-review", "unreviewed")


def rich_world(kb: KbRoot) -> str:
    """A world worth a picture: a grantor (carol) with writers, a pending contribution, attachments of every status."""
    worlds.build(kb)
    r = kb.cli("writers", "grant", "wf_cost", worlds.MAIN, "--as", "carol")
    assert r.code == 0, r.err
    notes = kb.workflows / "wf_cost" / "knowledgebase" / "notes"
    (notes / "budget.md").write_text("# Budget\nSFU egress is 62% of spend; the router's share is 9%.\n")
    audience = {"owners": ["carol"], "readers": ["alice", "bob"]}
    kb.workflow("wf_platform", label="RTS platform", access=audience)
    kb.workflow("wf_research", label="Research notes", access=audience)
    kb.workflow("wf_forecast", label="Forecasts", access=audience)  # a candidate to attach
    (kb.workflows / "wf_platform" / "knowledgebase" / "notes" / "services.md").write_text(
        "# Services\nrouter, sfu\n"
    )
    r = kb.cli("sources", "attach", "wf_cost", "wf_platform", "--alias", "platform", "--as", "carol")
    assert r.code == 0, r.err
    r = kb.cli(
        "sources",
        "attach",
        "wf_cost",
        "wf_research",
        "--alias",
        "research",
        "--access",
        "write",
        "--as",
        "carol",
    )
    assert r.code == 0, r.err
    # An attachment whose source has since gone (saved by hand: kbd keeps and shows it).
    folder = kb.workflows / "wf_cost"
    doc = kb.read_manifest(folder)
    doc["knowledgebase_sources"].append({"workflow_id": "wf_archived", "alias": "archive", "access": "read"})
    kb.write_manifest(folder, doc)
    sid = kb.open_session(worlds.MAIN, kind="execution", kb_access="read-write", actor="alice")
    r = kb.cli("notes", "write", sid, "cost", "egress.md", input=b"# SFU egress\nMeasured by wf_main: 62%.\n")
    assert r.code == 0, r.err
    return "wf_cost"


def shoot(page: Page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 5_000, f"{path} is (nearly) empty"
    return path


def test_screenshots_of_every_panel_wide_and_narrow(world: World, shots: Path) -> None:
    wid = rich_world(world.kb)
    _, _, watched = world.open("carol", wid)
    page = watched.page
    expect(page.locator('[data-panel="pending"] [data-path="notes/egress.md"]')).to_be_visible()
    page.locator('[data-panel="browser"] .entries [data-path="notes"]').click()
    page.locator('[data-panel="browser"] .entries [data-path="notes/budget.md"]').click()
    expect(page.locator("#viewer .md")).to_contain_text("62%")
    page.locator("#search-q").fill("egress")
    page.locator('[data-action="search"]').click()
    expect(page.locator(".hit").first).to_be_visible()

    page.evaluate("window.scrollTo(0, 0)")
    page.locator("#search-q").blur()
    shoot(page, shots, "knowledge-page")  # the top of the page at 1280x800: the README's picture
    for panel in PANELS:
        locator = page.locator(f'[data-panel="{panel}"]')
        expect(locator).to_be_visible()
        locator.scroll_into_view_if_needed()
        path = shots / f"panel-{panel}.png"
        locator.screenshot(path=str(path))
        assert path.stat().st_size > 2_000, path
    # The reviewer's tools (README): a contribution previewed before deciding, and a note's history.
    pending = page.locator('[data-panel="pending"]')
    pending.locator('[data-path="notes/egress.md"] [data-action="preview"]').click()
    expect(pending.locator("pre.diff")).to_be_visible()
    pending.scroll_into_view_if_needed()
    pending.screenshot(path=str(shots / "review.png"))
    page.locator('[data-panel="browser"] .entries [data-path="notes/egress.md"]').click()
    # budget.md's viewer has a History button too: wait until egress.md is the file shown.
    expect(page.locator("#viewer .md")).to_contain_text("Measured by wf_main")
    page.locator('[data-action="history"]').click()
    page.locator(".history .version").first.locator('[data-action="diff"]').click()
    expect(page.locator(".history pre.diff")).to_be_visible()
    browser = page.locator('[data-panel="browser"]')
    browser.scroll_into_view_if_needed()
    browser.screenshot(path=str(shots / "history.png"))
    page.set_viewport_size(NARROW)  # type: ignore[arg-type]
    page.locator('[data-panel="sources"]').scroll_into_view_if_needed()
    shoot(page, shots, "narrow-400")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= NARROW["width"], f"the narrow page scrolls sideways ({width}px)"
    page.set_viewport_size(WIDE)  # type: ignore[arg-type]
    page.evaluate("window.scrollTo(0, 0)")
    # The reader's view of the same workflow: no manage controls.
    _, _, reader = world.open("bob", worlds.MAIN)
    shoot(reader.page, shots, "reader-view")
