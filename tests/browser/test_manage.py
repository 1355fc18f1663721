"""The Knowledge page manages attachments and grants exactly as the CLI does
(a real daemon, a real `kbd ui`, Debian's Chromium)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from playwright.sync_api import Page, expect

from tests.browser import worlds
from tests.browser.conftest import World
from tests.helpers import KbRoot, snapshot
from tests.integration import daemon as daemons

# The script a forged request runs inside the reader's own page: it has the
# cookie (the browser sends it) and reads the CSRF token as the page does, so
# only the operation's own check can refuse it.
FORGE = """async ([method, path, body]) => {
  const me = await (await fetch('/api/me')).json();
  const init = {method, headers: {'X-KBD-CSRF': me.csrf}};
  if (body !== null) { init.headers['Content-Type'] = 'application/json'; init.body = JSON.stringify(body); }
  const r = await fetch(path, init);
  let data = null; try { data = await r.json(); } catch (_) {}
  return {status: r.status, data};
}"""


def card(page: Page, alias: str) -> Any:
    return page.locator(f'[data-panel="sources"] [data-alias="{alias}"]')


def attach_in_page(page: Page, source: str, alias: str, access: str) -> None:
    panel = page.locator('[data-panel="attach"]')
    panel.get_by_label("Source workflow").select_option(source)
    panel.get_by_label("Alias").fill(alias)
    panel.locator(f'input[name="attach-access"][value="{access}"]').check()
    panel.locator('[data-action="attach"]').click()
    expect(card(page, alias)).to_be_visible()


def detach_in_page(page: Page, alias: str) -> None:
    card(page, alias).locator('[data-action="detach"]').click()
    card(page, alias).locator('[data-action="detach-confirm"]').click()
    expect(card(page, alias)).to_have_count(0)


def twin(tmp_path: Path) -> KbRoot:
    other = KbRoot.create(tmp_path / "twin")
    worlds.build(other)
    return other


def test_attach_access_and_detach_write_workflow_json_as_the_cli_does(world: World, tmp_path: Path) -> None:
    worlds.build(world.kb)
    cli = twin(tmp_path)
    assert worlds.manifest(world.kb) == worlds.manifest(cli)
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page

    attach_in_page(page, "wf_extra", "extra", "write")
    r = cli.cli(
        "sources", "attach", worlds.MAIN, "wf_extra", "--alias", "extra", "--access", "write", "--as", "alice"
    )
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb) == worlds.manifest(cli)
    expect(card(page, "extra")).to_contain_text("waiting for the owner's grant")

    card(page, "extra").locator('[data-action="access"]').click()
    expect(card(page, "extra").locator(".badge.read")).to_have_text("read")
    r = cli.cli("sources", "access", worlds.MAIN, "extra", "read", "--as", "alice")
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb) == worlds.manifest(cli)

    detach_in_page(page, "extra")
    detach_in_page(page, "gone")  # an unavailable attachment can be detached
    for alias in ("extra", "gone"):
        r = cli.cli("sources", "detach", worlds.MAIN, alias, "--as", "alice")
        assert r.code == 0, r.err
    assert worlds.manifest(world.kb) == worlds.manifest(cli)
    saved = worlds.doc(world.kb)
    assert saved["x_custom"] == worlds.CUSTOM["x_custom"], "an unknown field was not preserved"
    assert [s["alias"] for s in saved["knowledgebase_sources"]] == ["src", "cost", "private"]


def test_a_refused_attach_shows_code_message_and_hint_and_changes_nothing(world: World) -> None:
    worlds.build(world.kb)
    before = worlds.manifest(world.kb)
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    panel = page.locator('[data-panel="attach"]')
    panel.get_by_label("Source workflow").select_option("wf_extra")
    panel.get_by_label("Alias").fill("src")  # taken
    panel.locator('[data-action="attach"]').click()
    error = panel.locator(".error")
    expect(error).to_be_visible()
    expect(error.locator(".error-line code")).to_have_text("error[invalid-manifest]")
    expect(error).to_contain_text("src")
    assert worlds.manifest(world.kb) == before


def test_a_refused_change_keeps_its_error_after_the_page_refreshes(world: World) -> None:
    """The refresh that follows a refused action (and the change events after it) never erases the error."""
    worlds.build(world.kb)
    r = world.kb.cli("sources", "attach", worlds.MAIN, "wf_extra", "--alias", "extra", "--as", "alice")
    assert r.code == 0, r.err
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    expect(card(page, "extra").locator('[data-action="access"]')).to_be_visible()
    # Meanwhile the source narrows its audience: a changed entry must resolve now, so writing is refused.
    world.kb.edit(world.kb.workflows / "wf_extra", access={"owners": ["carol"]})
    before = worlds.manifest(world.kb)
    card(page, "extra").locator('[data-action="access"]').click()
    error = page.locator("#src-error .error")
    expect(error).to_be_visible()
    expect(card(page, "extra")).to_have_attribute("data-reason", "audience_denied")  # the refresh has run
    expect(error).to_be_visible()
    expect(error).to_contain_text("extra")
    assert worlds.manifest(world.kb) == before
    error.locator('[data-action="dismiss"]').click()
    expect(page.locator("#src-error .error")).to_have_count(0)


def test_writing_is_not_offered_where_no_owner_could_grant_it(world: World) -> None:
    """A legacy source (no owner) can never grant writing: its card offers no
    "Allow writing" (it was offered and always ended waiting for a grant), an
    owned source's card still does, and a write attachment can still be made
    read-only."""
    worlds.build(world.kb)
    world.kb.workflow("wf_old", label="Old KB")  # no access block: a legacy, account-visible workflow
    for source, alias in (("wf_old", "old"), ("wf_extra", "extra")):
        r = world.kb.cli("sources", "attach", worlds.MAIN, source, "--alias", alias, "--as", "alice")
        assert r.code == 0, r.err
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    old = card(page, "old")
    expect(old).to_be_visible()
    expect(old.locator('[data-note="not-grantable"]')).to_contain_text("no owner who could grant writing")
    expect(old.locator('[data-action="access"]')).to_have_count(0)
    expect(old.locator('[data-action="detach"]')).to_be_visible()
    expect(card(page, "extra").locator('[data-action="access"][data-to="write"]')).to_have_text(
        "Allow writing"
    )
    expect(card(page, "cost").locator('[data-action="access"][data-to="read"]')).to_have_text(
        "Make read-only"
    )
    r = world.kb.cli("sources", "list", worlds.MAIN, "--as", "alice", "--json")
    grantable = {a["alias"]: a.get("write_grantable") for a in r.json()["sources"]}
    assert grantable == {
        "src": True,
        "cost": True,
        "gone": None,
        "private": None,
        "old": False,
        "extra": True,
    }


def test_a_reader_sees_no_manage_controls_and_forged_changes_are_refused(world: World) -> None:
    worlds.build(world.kb)
    world.kb.workflow("wf_bobs", label="Bob's", access={"owners": ["bob"]})
    before = snapshot(world.root, skip=("state",))
    _, _, watched = world.open("bob", worlds.MAIN)
    page = watched.page

    expect(card(page, "src")).to_be_visible()
    expect(page.locator(".wf-head")).to_contain_text("read-only")
    for action in ("attach", "detach", "access", "grant", "revoke", "approve", "reject"):
        expect(page.locator(f'[data-action="{action}"]:visible')).to_have_count(0)
    for panel in ("attach", "writers", "pending"):
        expect(page.locator(f'[data-panel="{panel}"]')).to_be_hidden()

    main = f"/api/workflows/{worlds.MAIN}"
    forged = [
        ("POST", f"{main}/sources", {"workflow_id": "wf_extra", "alias": "extra", "access": "read"}),
        ("DELETE", f"{main}/sources/src", None),
        ("PATCH", f"{main}/sources/cost", {"access": "read"}),
        ("POST", "/api/workflows/wf_src/writers", {"workflow_id": "wf_bobs"}),
        ("DELETE", "/api/workflows/wf_cost/writers/wf_main", None),
        (
            "POST",
            "/api/workflows/wf_src/notes/review",
            {"path": "notes/router.md", "decision": "approve", "expected_version": "sha256:" + "0" * 64},
        ),
    ]
    for method, path, body in forged:
        answer = page.evaluate(FORGE, [method, path, body])
        assert answer["status"] in (403, 404), (method, path, answer)
        assert answer["data"]["error"]["code"] in ("permission-denied", "not-found", "workflow-not-found"), (
            answer
        )
    assert snapshot(world.root, skip=("state",)) == before, "a refused change touched the root"


def test_unavailable_cards_keep_their_reason(world: World) -> None:
    worlds.build(world.kb)
    _, _, watched = world.open("alice", worlds.MAIN)
    page = watched.page
    gone = page.locator('[data-alias="gone"][data-reason="not_found"]')
    expect(gone).to_be_visible()
    expect(gone).to_contain_text("no workflow with ID 'wf_gone' exists")
    expect(gone).to_contain_text("WORKFLOW_KB_GONE")
    expect(gone.locator(".facts")).to_contain_text("—")
    denied = page.locator('[data-alias="private"][data-reason="audience_denied"]')
    expect(denied).to_be_visible()
    expect(denied.locator(".reason-code")).to_have_text("audience_denied")
    ok = card(page, "src")
    expect(ok).not_to_have_attribute("data-reason", "not_found")
    assert ok.get_attribute("data-reason") is None
    expect(ok).to_contain_text("Source KB")
    expect(ok).to_contain_text("wf_src")
    expect(ok).to_contain_text("WORKFLOW_KB_SRC")
    expect(ok).to_contain_text(str(world.kb.workflows / "wf_src" / "knowledgebase"))
    expect(card(page, "cost")).to_contain_text("waiting for the owner's grant")


def test_the_grantor_grants_revokes_and_reviews_as_the_cli_does(world: World, tmp_path: Path) -> None:
    worlds.build(world.kb)
    cli = twin(tmp_path)
    _, _, watched = world.open("carol", "wf_cost")
    page = watched.page
    writers = page.locator('[data-panel="writers"]')
    expect(writers).to_be_visible()
    expect(page.locator('[data-panel="attach"]')).to_be_visible()  # carol owns wf_cost: she manages it too

    # carol cannot see wf_main (not in its audience): she names it by its ID.
    picker = writers.get_by_label("Consumer workflow")
    assert worlds.MAIN not in picker.locator("option").all_inner_texts()
    expect(writers.get_by_label("Its workflow ID")).to_be_hidden()
    picker.select_option(label="Another workflow, by its ID…")
    writers.get_by_label("Its workflow ID").fill(worlds.MAIN)
    writers.locator('[data-action="grant"]').click()
    expect(writers.locator(f'[data-writer="{worlds.MAIN}"]')).to_be_visible()
    r = cli.cli("writers", "grant", "wf_cost", worlds.MAIN, "--as", "carol")
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb, "wf_cost") == worlds.manifest(cli, "wf_cost")

    # A contribution from wf_main's session: pending for carol, approved in the page.
    sid = world.kb.open_session(worlds.MAIN, kind="execution", kb_access="read-write", actor="alice")
    r = world.kb.cli("notes", "write", sid, "cost", "from-main.md", input=b"# From main\nEgress is 62%.\n")
    assert r.code == 0, r.err
    pending = page.locator('[data-panel="pending"] [data-path="notes/from-main.md"]')
    expect(pending).to_be_visible()  # arrived live: note.written
    pending.locator('[data-action="approve"]').click()
    expect(pending).to_have_count(0)
    r = world.kb.cli("notes", "pending", "wf_cost", "--json", "--as", "carol")
    assert r.code == 0 and r.json()["pending"] == [], r.out

    r = world.kb.cli("notes", "write", sid, "cost", "spam.md", input=b"# Spam\nbuy now\n")
    assert r.code == 0, r.err
    spam = page.locator('[data-panel="pending"] [data-path="notes/spam.md"]')
    spam.locator('[data-action="reject"]').click()
    expect(spam).to_have_count(0)
    r = world.kb.cli("notes", "rejected", "wf_cost", "--json", "--as", "carol")
    assert r.code == 0, r.err
    assert "notes/spam.md" in r.out

    writers.locator(f'[data-writer="{worlds.MAIN}"] [data-action="revoke"]').click()
    # Revoking asks first, with what it would do (docs/knowledge-page.md "Why and requests").
    writers.locator(f'[data-writer="{worlds.MAIN}"] [data-action="revoke-confirm"]').click()
    expect(writers.locator(f'[data-writer="{worlds.MAIN}"]')).to_have_count(0)
    r = cli.cli("writers", "revoke", "wf_cost", worlds.MAIN, "--as", "carol")
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb, "wf_cost") == worlds.manifest(cli, "wf_cost")


def test_keyboard_alone_selects_a_workflow_and_attaches(world: World) -> None:
    worlds.build(world.kb)
    _, _, watched = world.open("alice", "wf_src")
    page = watched.page
    page.locator(f'[data-workflow="{worlds.MAIN}"]').focus()
    page.keyboard.press("Enter")
    expect(page.locator(".wf-head .wf-id")).to_have_text(worlds.MAIN)
    page.get_by_label("Source workflow").focus()
    page.keyboard.press("Tab")  # to the alias field (prefilled with a suggestion)
    page.keyboard.press("Control+a")
    page.keyboard.type("kbd_extra")
    page.keyboard.press("Tab")  # to the access radios: the focus ring is visible
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline == "solid", outline
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Enter")  # submits the form
    expect(card(page, "kbd_extra")).to_be_visible()
    doc: dict[str, Any] = worlds.doc(world.kb)
    assert {"workflow_id": "wf_extra", "alias": "kbd_extra", "access": "read"} in doc["knowledgebase_sources"]


def test_through_the_daemon_the_page_changes_workflow_json_as_the_cli_does(
    world: World, tmp_path: Path
) -> None:
    """`kbd ui --socket S --token-file F`: every action goes through the daemon as the token's principal."""
    worlds.build(world.kb)
    cli = twin(tmp_path)
    token_file = tmp_path / "alice.token"
    token_file.write_text(daemons.issue_tokens(world.root, ["alice"])["alice"])
    token_file.chmod(0o600)
    served = world.restart_daemon()
    args = ("--socket", str(served.sock), "--token-file", str(token_file))
    _, _, watched = world.open(None, worlds.MAIN, args=args)
    page = watched.page
    expect(page.locator("#who")).to_contain_text("alice")
    expect(page.locator("#who")).to_contain_text("through the daemon")
    expect(page.locator("#live")).to_have_attribute("data-live", "on")

    attach_in_page(page, "wf_extra", "extra", "read")
    r = cli.cli(
        "sources", "attach", worlds.MAIN, "wf_extra", "--alias", "extra", "--access", "read", "--as", "alice"
    )
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb) == worlds.manifest(cli)
    detach_in_page(page, "src")
    r = cli.cli("sources", "detach", worlds.MAIN, "src", "--as", "alice")
    assert r.code == 0, r.err
    assert worlds.manifest(world.kb) == worlds.manifest(cli)
