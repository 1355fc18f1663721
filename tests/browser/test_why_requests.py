"""The Knowledge page closes the loop of docs/access.md "Why", "Access requests" and "Previews"
(a real daemon, real `kbd ui` servers, Debian's Chromium): a card that says no says why and
what would allow it, its manager asks the source's owner from the card, the owner approves
in her own page, and every confirmation shows what the change would do before it is made."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.browser import worlds
from tests.browser.conftest import World
from tests.browser.test_manage import card


def test_why_ask_approve_and_the_card_turns_writable(world: World) -> None:
    worlds.build(world.kb)
    _, _, alice = world.open("alice", worlds.MAIN)
    page = alice.page
    cost = card(page, "cost")
    expect(cost).to_contain_text("waiting for the owner's grant")
    cost.locator('[data-action="why"]').click()
    why = page.locator('[data-why="cost"]')
    expect(why).to_contain_text("write_not_granted")
    expect(why).to_contain_text("kbd writers grant wf_cost wf_main --as carol")
    expect(why).to_contain_text("(by carol)")
    why.locator('[data-action="ask"]').click()
    requests = page.locator('[data-panel="requests"]')
    expect(requests.locator('[data-request="1"]')).to_have_attribute("data-state", "pending")
    expect(requests.locator('[data-action="approve-request"]')).to_have_count(0)  # alice asked; carol decides

    # carol, wf_cost's owner, approves in her own page, with a message.
    _, _, carol = world.open("carol", "wf_cost")
    row = carol.page.locator('[data-panel="requests"] [data-request="1"]')
    expect(row).to_contain_text("write")
    row.get_by_label("Message for request 1").fill("welcome")
    row.locator('[data-action="approve-request"]').click()
    expect(row).to_have_attribute("data-state", "approved")
    assert world.kb.read_manifest(world.kb.workflows / "wf_cost")["access"]["allowed_kb_writers"] == [
        worlds.MAIN
    ]
    # alice's page follows the change feed: the request is approved, the card writable.
    expect(requests.locator('[data-request="1"]')).to_have_attribute("data-state", "approved")
    expect(cost).to_contain_text("write granted")


def test_an_unavailable_card_says_why_and_names_no_one_it_may_not(world: World) -> None:
    worlds.build(world.kb)
    _, _, alice = world.open("alice", worlds.MAIN)
    page = alice.page
    private = card(page, "private")  # wf_private is dave's alone: alice may not see it
    private.locator('[data-action="why"]').click()
    why = page.locator('[data-why="private"]')
    expect(why).to_contain_text("attachment_unavailable")
    expect(why).to_contain_text("only the source's owners")
    expect(why).not_to_contain_text("dave")
    expect(why.locator('[data-action="ask"]')).to_have_count(0)  # nothing to ask of a source she cannot see
    gone = card(page, "gone")
    gone.locator('[data-action="why"]').click()
    expect(page.locator('[data-why="gone"]')).to_contain_text("not_found")
    gone.locator('[data-action="why"]').click()  # "Hide why"
    expect(page.locator('[data-why="gone"]')).to_have_count(0)


def test_confirmations_show_what_the_change_would_do_and_cancel_changes_nothing(world: World) -> None:
    worlds.build(world.kb)
    sid = world.kb.open_session(worlds.MAIN, kind="execution", kb_access="read", actor="alice")
    before = worlds.manifest(world.kb)
    _, _, alice = world.open("alice", worlds.MAIN)
    page = alice.page
    src = card(page, "src")
    src.locator('[data-action="detach"]').click()
    preview = src.locator('[data-preview="true"]')
    expect(preview).to_contain_text(f"session {sid} ({worlds.MAIN}) loses read")
    expect(preview).to_contain_text("wf_src/knowledgebase")
    expect(preview).to_contain_text(f"{worlds.MAIN}'s src would be detached")
    src.locator('[data-action="detach-cancel"]').click()
    assert worlds.manifest(world.kb) == before
    # The grantor's revoke: carol's page, after granting wf_main.
    assert world.kb.cli("writers", "grant", "wf_cost", worlds.MAIN, "--as", "carol").code == 0
    _, _, carol = world.open("carol", "wf_cost")
    row = carol.page.locator(f'[data-writer="{worlds.MAIN}"]')
    row.locator('[data-action="revoke"]').click()
    # carol may not see wf_main (alice's and bob's): its session is counted, never named.
    expect(row.locator('[data-preview="true"]')).to_contain_text("more in workflows you cannot see")
    row.locator('[data-action="revoke-confirm"]').click()
    expect(carol.page.locator(f'[data-writer="{worlds.MAIN}"]')).to_have_count(0)
    assert world.kb.read_manifest(world.kb.workflows / "wf_cost")["access"]["allowed_kb_writers"] == []
