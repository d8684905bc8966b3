"""The admin page (chat/admin.py) in headless Chromium on the real model: an admin makes an
invite on the page, a guest in another browser joins by its link and chats, and the admin's
usage chart shows that guest's turn; a user and a logged-out visitor get no page. The
screenshots are README's (docs/screenshots/admin-invite.png, admin-usage.png). (Every
route's hostile cases: tests/test_admin.py.)"""

from __future__ import annotations

import re

from tests.e2e.conftest import log_in, send, shot, visiting, watch_reply
from tests.test_accounts import add_user


async def test_an_admin_makes_an_invite_a_guest_joins_and_the_usage_chart_shows_the_turn(
        browser, ready_server, visit):
    page = visit.page
    await log_in(visit)  # the test server's admin
    await page.click("#export-button")
    await page.click("#admin-page")  # the menu offers an admin the page
    await page.get_by_role("heading", name="Invites").wait_for()
    await page.fill("input[name=uses]", "5")
    await page.fill("input[name=expires]", "1h")
    await page.get_by_role("button", name="Create invite").click()
    link = (await page.locator("#invite-link").inner_text()).strip()
    assert re.fullmatch(re.escape(visit.origin) + r"/invite/[A-Za-z0-9_-]{22}", link), link
    await page.get_by_role("img", name="QR code of the invite link").wait_for()
    said = await page.get_by_role("status").inner_text()
    invite = re.match(r"invite ([0-9a-f]{8}):", said)[1]
    await shot(visit, "admin-invite")

    async with visiting(browser, ready_server) as guest:
        await guest.page.goto(link)
        await guest.page.fill("#name", "Lin")
        await guest.page.click("button[type=submit]")
        await guest.page.wait_for_selector("#chat-input:not([disabled])", timeout=60_000)
        await guest.page.wait_for_load_state("networkidle")
        states = await watch_reply(guest, await send(guest, "Hello from the back row."))
        assert states and states[-1], "a reply for the guest"

    # The guest's turn in the chart (its cost is written within a second of its end) and
    # the guest under its invite.
    bar = page.locator("svg title", has_text=re.compile(r"^Lin \(guest [0-9a-f]{8}\): .* "
                                                        r"1 turn\(s\)$"))
    for _ in range(20):
        await page.goto(f"{visit.origin}/admin")
        if await bar.count():
            break
        await page.wait_for_timeout(500)
    assert await bar.count() == 1
    await page.mouse.wheel(0, 380)  # the charts in view
    await page.wait_for_timeout(300)
    await shot(visit, "admin-usage")
    row = page.locator("tr", has_text=invite)  # (other tests' invites may have guests too)
    await row.get_by_text("1 guest(s)").click()
    await row.get_by_text(re.compile(r"^Lin")).wait_for()
    assert visit.elsewhere == []  # the page loads nothing from elsewhere


async def test_a_user_and_a_visitor_get_no_admin_page(browser, ready_server):
    add_user(ready_server, "plain", "plain user's password")
    async with visiting(browser, ready_server) as user:
        await log_in(user, "plain", "plain user's password")
        await user.page.click("#export-button")
        await user.page.get_by_text("My share links").wait_for()
        await user.page.wait_for_load_state("networkidle")
        assert await user.page.locator("#admin-page").count() == 0  # not offered
        answer = await user.page.goto(f"{user.origin}/admin")
        assert answer.status == 404 and "Accounts" not in await user.page.content()
    async with visiting(browser, ready_server) as visitor:
        answer = await visitor.page.goto(f"{visitor.origin}/admin")
        assert answer.status == 401 and "Log in first" in await visitor.page.content()
