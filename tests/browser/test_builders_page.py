"""What builders came to the Knowledge page for (docs/knowledge-page.md "Panels"):
note history and diffs, a preview of a contribution before deciding, rejected
notes restored, a writer picked by its label, paths that wrap at '/', and a
page that loads without one console error (its icon included). A real daemon,
a real `kbd ui`, Debian's Chromium."""

from __future__ import annotations

import httpx
from playwright.sync_api import Page, expect

from tests.browser import worlds
from tests.browser.conftest import World
from tests.browser.harness import NARROW
from tests.browser.test_browse import rich_world


def open_note(page: Page, path: str) -> None:
    browser = page.locator('[data-panel="browser"]')
    folder = path.rsplit("/", 1)[0]
    browser.locator(f'.entries [data-path="{folder}"]').click()
    browser.locator(f'.entries [data-path="{path}"]').click()


def test_a_notes_history_lists_its_versions_and_shows_each_ones_changes(world: World) -> None:
    wid = rich_world(world.kb)  # wf_cost: notes/egress.md written once by wf_main's session
    sid = world.kb.open_session(worlds.MAIN, kind="execution", kb_access="read-write", actor="alice")
    first = world.kb.cli("notes", "log", wid, "notes/egress.md", "--as", "carol", "--json").json()[
        "versions"
    ][0]
    r = world.kb.cli("notes", "write", sid, "cost", "notes/egress.md", "--expected-version", first["version"],
                     input=b"# SFU egress\nMeasured by wf_main: 58%.\n")  # fmt: skip
    assert r.code == 0, r.err
    _, _, watched = world.open("carol", wid)
    page = watched.page
    open_note(page, "notes/egress.md")
    page.locator('[data-action="history"]').click()
    versions = page.locator(".history .version")
    expect(versions).to_have_count(2)
    expect(versions.first).to_contain_text("write")
    versions.first.locator('[data-action="diff"]').click()
    diff = page.locator(".history pre.diff")
    expect(diff.locator(".del").filter(has_text="-Measured by wf_main: 62%.")).to_have_count(1)
    expect(diff.locator(".add").filter(has_text="+Measured by wf_main: 58%.")).to_have_count(1)
    # The oldest version's own changes: every line added.
    versions.last.locator('[data-action="diff"]').click()
    expect(diff.locator(".add").filter(has_text="+Measured by wf_main: 62%.")).to_have_count(1)
    expect(diff.locator(".del")).to_have_count(0)
    page.locator('[data-action="history-close"]').click()
    expect(page.locator(".history")).to_have_count(0)


def test_a_contribution_is_previewed_rejected_and_restored(world: World) -> None:
    wid = rich_world(world.kb)
    _, _, watched = world.open("carol", wid)
    page = watched.page
    row = page.locator('[data-panel="pending"] [data-path="notes/egress.md"]')
    row.locator('[data-action="preview"]').click()
    expect(row.locator("pre.diff .add").filter(has_text="+Measured by wf_main: 62%.")).to_have_count(1)
    row.locator('[data-action="preview"]').click()  # hides it again
    expect(row.locator("pre.diff")).to_have_count(0)
    row.locator('[data-action="reject"]').click()
    expect(row).to_have_count(0)
    rejected = page.locator("#rejected-list [data-rejected]")
    expect(rejected).to_have_count(1)
    expect(rejected).to_contain_text("notes/egress.md")
    expect(rejected).to_contain_text("rejected by carol")
    note = world.kb.workflows / wid / "knowledgebase" / "notes" / "egress.md"
    assert not note.exists()
    rejected.locator('[data-action="unreject"]').click()
    expect(page.locator('[data-panel="pending"] [data-path="notes/egress.md"]')).to_be_visible()
    expect(rejected).to_have_count(0)
    assert "62%" in note.read_text()


def test_a_writer_is_picked_by_its_label(world: World) -> None:
    worlds.build(world.kb)
    _, _, watched = world.open("alice", "wf_src")
    page = watched.page
    writers = page.locator('[data-panel="writers"]')
    picker = writers.get_by_label("Consumer workflow")
    expect(picker.locator("option", has_text="Extra KB (wf_extra)")).to_have_count(1)
    expect(picker.locator("option", has_text="Source KB")).to_have_count(0)  # not itself
    writers.locator('[data-action="grant"]').click()  # nothing chosen: said, nothing sent
    expect(page.locator("#writers-error")).to_contain_text("choose the workflow that may write")
    picker.select_option(label="Extra KB (wf_extra)")
    writers.locator('[data-action="grant"]').click()
    expect(writers.locator('[data-writer="wf_extra"]')).to_be_visible()
    expect(picker.locator("option", has_text="wf_extra")).to_have_count(0)  # granted: no longer offered
    assert world.kb.read_manifest(world.kb.workflows / "wf_src")["access"]["allowed_kb_writers"] == [
        "wf_extra"
    ]


def test_paths_wrap_at_slashes_and_the_page_loads_without_a_console_error(world: World) -> None:
    worlds.build(world.kb)
    ui, _, watched = world.open("alice", worlds.MAIN, viewport=NARROW)
    page = watched.page
    path = page.locator('[data-alias="src"] .facts code.path')
    expect(path).to_be_visible()
    text = path.text_content() or ""
    assert text == str(world.kb.workflows / "wf_src" / "knowledgebase")
    assert path.locator("wbr").count() == text.count("/")
    # At 400 px the path wraps inside its card, after a '/', never past the card's edge.
    fits = page.evaluate(
        """(el) => { const card = el.closest('[data-alias]');
                     return el.getBoundingClientRect().right <= card.getBoundingClientRect().right + 0.5; }""",
        path.element_handle(),
    )
    assert fits
    tops = page.evaluate(
        """(el) => { const r = document.createRange(); const tops = new Set();
                     for (const n of el.childNodes) if (n.nodeType === 3) { r.selectNodeContents(n);
                       for (const rect of r.getClientRects()) tops.add(Math.round(rect.top)); }
                     return tops.size; }""",
        path.element_handle(),
    )
    assert tops > 1, "a long path at 400 px takes more than one line"
    # Lines start right after a '/': some name (and its '/') begins a line of its own. (A name
    # may still break after a hyphen, or anywhere when it alone is wider than the line.)
    starts = page.evaluate(
        """(el) => { const left = el.getClientRects()[0].left; const r = document.createRange();
                     return [...el.childNodes].filter((n) => n.nodeType === 3).slice(1).filter((n) => {
                       r.selectNodeContents(n); const rect = [...r.getClientRects()].find((x) => x.width > 0.5);
                       return rect && Math.abs(rect.left - left) < 1; }).map((n) => n.textContent); }""",
        path.element_handle(),
    )
    assert starts, "no line of the wrapped path starts at a name"
    page.reload()
    expect(page.locator('[data-alias="src"]')).to_be_visible()
    assert watched.console_errors == [], watched.console_errors
    assert any(u.endswith("/assets/icon.svg") for u in watched.requests)
    icon = httpx.get(f"{ui.base}/favicon.ico", headers={"host": f"127.0.0.1:{ui.port}"})
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"


def test_a_manager_edits_the_own_kb_against_the_version_read_and_a_reader_cannot(world: World) -> None:
    worlds.build(world.kb)
    kb = world.kb.workflows / worlds.MAIN / "knowledgebase"
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    open_note(page, "notes/howto.md")
    page.locator('[data-action="edit"]').click()
    area = page.locator("textarea.editor")
    expect(area).to_have_value("# How to\nRun `make test` before you push.\n")
    area.fill("# How to\nRun `make check` first, then `make test`.\n")
    page.locator('[data-action="save"]').click()
    expect(page.locator("#viewer .md")).to_contain_text("make check")
    assert (kb / "notes" / "howto.md").read_text() == "# How to\nRun `make check` first, then `make test`.\n"
    log = world.kb.cli("notes", "log", worlds.MAIN, "notes/howto.md", "--as", "alice", "--json").json()
    newest = log["versions"][0]
    assert (newest["how"], newest["principal"]) == ("edit", "alice")

    # Changed on disk while the editor is open: the save is refused and the text is kept.
    page.locator('[data-action="edit"]').click()
    area.fill("# How to\nmine\n")
    (kb / "notes" / "howto.md").write_text("# How to\ntheirs\n")
    page.locator('[data-action="save"]').click()
    expect(page.locator("#browser-error")).to_contain_text("error[note-version-conflict]")
    expect(area).to_have_value("# How to\nmine\n")
    assert (kb / "notes" / "howto.md").read_text() == "# How to\ntheirs\n"
    page.locator('[data-action="edit-cancel"]').click()

    # A new file in context/.
    page.locator('.crumbs [data-path=""]').click()
    page.locator('.entries [data-path="context"]').click()
    page.locator("#new-file-name").fill("guide.md")
    page.locator('[data-action="new-file"]').click()
    page.locator("textarea.editor").fill("# Guide\nStart with `kbd doctor`.\n")
    page.locator('[data-action="save"]').click()
    expect(page.locator('.entries [data-path="context/guide.md"]')).to_be_visible()
    assert (kb / "context" / "guide.md").read_text() == "# Guide\nStart with `kbd doctor`.\n"

    # A reader sees no editor.
    _, _, reader = world.open("bob", worlds.MAIN)
    open_note(reader.page, "notes/howto.md")
    expect(reader.page.locator("#viewer")).to_contain_text("theirs")
    expect(reader.page.locator('[data-action="edit"]')).to_have_count(0)
    expect(reader.page.locator("#new-file-name")).to_have_count(0)
