"""The chat page in headless Chromium: log in, pick a profile, watch a reply stream, stop
one, follow up, reload and continue a stored chat. Every visit must stay on the app's own
origin and leave no errors in the browser's console."""

from __future__ import annotations

import asyncio
import re

from tests.e2e.conftest import (ASSISTANT, USER, assert_clean, log_in, send, shot, visiting,
                                watch_reply)
from tests.test_accounts import add_user


def tokens_in(stats_text: str) -> int:
    """The prompt's token count from a reply's stats line ("... 1,234 in / 56 out ...")."""
    return int(re.search(r"([\d,]+) in /", stats_text).group(1).replace(",", ""))


LONG_ENOUGH = 40  # tokens: a reply this long streams over several seconds on CI's cores


async def test_a_reply_streams_into_the_page_and_ends_with_its_stats(visit):
    """The model samples: now and then it ends after one sentence (15 tokens in one CI run,
    in two states). Such a reply says nothing about streaming: it is asked again, up to
    three times, for one long enough to watch."""
    await log_in(visit)
    for _ in range(3):
        states = await watch_reply(visit, await send(visit, "Write three sentences about "
                                                             "the sea, one after another."))
        growing = [s for s in states if s]
        out = re.search(r"([\d,]+) out", growing[-1]) if growing else None
        if out and int(out.group(1).replace(",", "")) >= LONG_ENOUGH:
            break
    assert len(set(growing)) >= 4, f"too few intermediate states: {growing}"
    # Each state extends the one before. Compared by letters only: markdown re-renders as
    # the text grows ("1. The" becomes a list item "The", "**bol" becomes "bold").
    letters = [re.sub(r"[^A-Za-z]", "", s) for s in growing]
    for before, after in zip(letters, letters[1:]):
        assert after.startswith(before[:-5]), (before, after)
    assert "tokens/s" in growing[-1], "the stats line under the finished reply"
    await shot(visit, "streamed-reply")
    assert_clean(visit)


async def test_each_profile_can_be_picked(visit):
    await log_in(visit)
    page = visit.page
    for profile in ("Throughput-first", "Latency-first"):
        await page.click("#chat-profiles")
        option = page.get_by_role("option", name=profile)
        if not await option.count():
            option = page.get_by_text(profile, exact=True).last
        if profile == "Throughput-first":  # the menu's opening animation ends first
            await option.wait_for()
            await page.wait_for_timeout(500)
            await shot(visit, "profile-picker")
        await option.click()
        confirm = page.get_by_role("button", name=re.compile("confirm", re.I))
        if await confirm.count():
            await confirm.click()
        await page.wait_for_function(
            "p => document.querySelector('#chat-profiles')?.innerText.includes(p)", arg=profile)
    assert_clean(visit)


async def test_stop_ends_a_long_reply_and_keeps_what_was_shown(visit):
    await log_in(visit)
    page = visit.page
    await send(visit, "Tell me a very long story about a lighthouse keeper and the sea.")
    await page.wait_for_selector("#stop-button", timeout=30_000)
    await page.wait_for_function(
        f"() => [...document.querySelectorAll('{ASSISTANT}')].pop()?.innerText.length > 40",
        timeout=120_000)
    await page.click("#stop-button")
    await page.wait_for_selector("#stop-button", state="detached", timeout=30_000)
    # The page hides Stop at once; the reply then ends, marked, with what was shown kept.
    await page.wait_for_function(
        f"() => [...document.querySelectorAll('{ASSISTANT}')].some("
        "r => r.innerText.trim().endsWith('Stopped.') && r.innerText.length > 40)",
        timeout=30_000)
    assert_clean(visit)


async def test_a_follow_up_uses_the_earlier_turn_and_the_chat_continues_after_a_reload(visit):
    await log_in(visit)
    page = visit.page
    first = (await watch_reply(visit, await send(visit, "My name is Ann.")))[-1]
    second = (await watch_reply(visit, await send(visit, "What is my name?")))[-1]
    assert tokens_in(second) > tokens_in(first), "the follow-up's prompt holds turn 1"

    await page.reload()
    await page.wait_for_selector("#thread-history a, #thread-history [role=button]",
                                 timeout=60_000)
    await page.locator("#thread-history").get_by_text("My name is Ann.").first.click()
    await page.wait_for_selector(USER, timeout=60_000)
    assert await page.locator(USER).count() == 2
    third = (await watch_reply(visit, await send(visit, "And what did I ask you?")))[-1]
    assert tokens_in(third) > tokens_in(second), "the resumed chat holds both turns"
    await shot(visit, "history")
    assert_clean(visit)


async def test_an_over_long_message_gets_the_clear_message(visit):
    """Refused before it is stored (issue 52: refused messages were kept all the same), so
    the page says why in a notice rather than in the chat."""
    await log_in(visit)
    page = visit.page
    before = await page.locator(ASSISTANT).count()
    await page.evaluate(  # typing 100,001 characters key by key would take minutes
        "t => { const box = document.querySelector('#chat-input');"
        " const set = Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, 'value').set;"
        " set.call(box, t); box.dispatchEvent(new Event('input', {bubbles: true})); }",
        "a" * 100_001)
    await page.press("#chat-input", "Enter")
    await page.locator("[data-sonner-toast]", has_text="characters long").wait_for(
        timeout=60_000)
    assert await page.locator(ASSISTANT).count() == before, "no turn was taken"
    assert_clean(visit)


async def test_two_users_at_once_see_only_their_own_chats(browser, ready_server, visit):
    add_user(ready_server, "second", "the second user's password")
    async with visiting(browser, ready_server) as other:
        await log_in(visit)
        await log_in(other, "second", "the second user's password")
        mine, theirs = "A question only the first user asks.", "The second user's own question."
        await asyncio.gather(watch_reply(visit, await send(visit, mine)),
                             watch_reply(other, await send(other, theirs)))
        for who, own, foreign in ((visit, mine, theirs), (other, theirs, mine)):
            history = who.page.locator("#thread-history")
            await history.get_by_text(own[:20]).first.wait_for(timeout=30_000)
            assert not await history.get_by_text(foreign[:20]).count()
            assert_clean(who)


async def test_a_chat_shared_by_link_opens_in_another_browser_until_revoked(
        browser, ready_server, visit):
    """The Export menu's "Share this chat": the link it shows opens the chat, read-only, for
    another logged-in user in another browser; revoked on the "My share links" page, the
    link shows nothing. (The routes' hostile cases: tests/test_shares.py.)"""
    add_user(ready_server, "colleague", "the colleague's password")
    page = visit.page
    await log_in(visit)
    await watch_reply(visit, await send(visit, "Shared question: what is a lighthouse?"))
    await page.wait_for_url(re.compile(r"/thread/[0-9a-f-]{36}"), timeout=60_000)
    await page.click("#export-button")
    await page.click("#share-chat")
    field = page.locator("#share-link")
    await field.wait_for(timeout=30_000)
    url = await field.input_value()
    assert re.fullmatch(re.escape(ready_server.url) + r"/shared/[A-Za-z0-9_-]{32}", url), url
    await shot(visit, "share-link")
    async with visiting(browser, ready_server) as other:
        await log_in(other, "colleague", "the colleague's password")
        await other.page.goto(url)
        await other.page.locator(".msg.user").get_by_text(
            "Shared question: what is a lighthouse?").wait_for()
        assert await other.page.locator(".msg.assistant").count() == 1
        assert await other.page.get_by_text("Shared by tester").count() == 1
        await shot(other, "shared-chat")
        await page.goto(ready_server.url + "/share")
        await page.get_by_role("button", name="Revoke").click()
        await page.get_by_text("You have no share links.").wait_for()
        await other.page.reload()
        await other.page.get_by_text("No such link").first.wait_for()
        assert other.elsewhere == []  # the shared page loads nothing from elsewhere
    assert visit.elsewhere == []
