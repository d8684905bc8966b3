"""Demo sessions in headless Chromium (issue 32): a guest opens an invite link, types a
name and chats on the real model; the open demo (VCHAT_DEMO=open, on a server with the
labelled stand-in engine) sends a visitor from the chat's address to its page and shows
its banner. The screenshots are README's (docs/screenshots/invite-page.png,
demo-banner.png)."""

from __future__ import annotations

from tests.e2e.conftest import ASSISTANT, assert_clean, send, shot, visiting, watch_reply
from tests.test_accounts import STAND_IN, store_command
from tools.chainlit_client import serving


async def test_a_guest_opens_the_invite_link_types_a_name_and_chats(browser, ready_server):
    printed = store_command(ready_server, "invites", "add", "--uses", "3", "--expires", "1h")
    link = printed.strip().splitlines()[-1].rsplit("/invite/", 1)[1]
    async with visiting(browser, ready_server) as visit:
        page = visit.page
        await page.goto(f"{visit.origin}/invite/{link}")
        await page.fill("#name", "Ada")
        await shot(visit, "invite-page")
        await page.click("button[type=submit]")
        await page.wait_for_selector("#chat-input:not([disabled])", timeout=60_000)
        await page.wait_for_load_state("networkidle")
        visit.console_errors.clear()
        visit.refused.clear()
        states = await watch_reply(visit, await send(visit, "Say hello to the room."))
        assert states and states[-1], "a reply for the guest"
        assert await page.locator(ASSISTANT).count() == 1
        assert_clean(visit)
    async with visiting(browser, ready_server) as again:  # the same link, a spent name
        await again.page.goto(f"{again.origin}/invite/{link}")
        await again.page.fill("#name", "x" * 40)
        await again.page.evaluate("document.getElementById('name').value = 'bell\\u0007'")
        await again.page.click("button[type=submit]")
        assert "letters, digits" in await again.page.inner_text("main")


async def test_the_open_demo_sends_a_visitor_to_its_page_and_shows_its_banner(browser):
    env = {**STAND_IN, "VCHAT_DEMO": "open", "VCHAT_DEMO_BY": "the platform team"}
    async with serving(env, timeout=120) as demo:
        async with visiting(browser, demo) as visit:
            page = visit.page
            await page.goto(visit.origin)
            assert page.url.endswith("/demo")
            assert "A demo run by the platform team" in await page.inner_text("main")
            await page.fill("#name", "Grace")
            await page.click("button[type=submit]")
            await page.wait_for_selector("#chat-input:not([disabled])", timeout=60_000)
            # As after a log-in (conftest.log_in): a message typed while the page is still
            # setting up its session was cleared unsent once (1 CI run in 3).
            await page.wait_for_load_state("networkidle")
            banner = page.locator("#model-status")
            await banner.wait_for(timeout=30_000)
            # The stand-in's label in the same line, not in the chat: a message at the chat's
            # start switched Chainlit's view and lost what the guest had typed (CI, stop 70).
            assert "a demo run by the platform team" in await banner.inner_text()
            assert "Benchmark mode" in await banner.inner_text()
            assert await page.locator(ASSISTANT).count() == 0
            await watch_reply(visit, await send(visit, "Hello, demo"))
            await shot(visit, "demo-banner")
            # A guest may not share (VCHAT_GUEST_SHARING off): the menu offers no links.
            await page.click("#export-button")
            await page.get_by_text("All my chats as JSON").wait_for()
            await page.wait_for_load_state("networkidle")
            assert await page.locator("#share-links, #share-chat").count() == 0
            # The line covers the chat's top: closed, it stays closed in this tab (its words
            # unchanged), a reload and the page's next look at /notice included.
            await page.keyboard.press("Escape")  # the Export menu closed first
            await page.click("#model-status-close")
            await banner.wait_for(state="detached", timeout=5_000)
            async with page.expect_response(lambda r: r.url.endswith("/notice")):
                await page.reload()
            await page.wait_for_selector("#chat-input", timeout=60_000)
            await page.wait_for_timeout(1_000)  # its answer applied
            assert await banner.count() == 0
