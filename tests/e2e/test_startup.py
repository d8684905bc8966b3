"""A visitor who arrives while the model starts: the page says so above the chat, what they
type stays in the box while the engines come up, and the line goes once they are ready.

Regressions (issue 16): the "still starting" note was a chat message, which switched
Chainlit's page from its welcome view to the chat view under the input (typed text lost),
and a page could keep showing it after the model was ready."""

from __future__ import annotations

import asyncio
import time

import pytest

from chat.view import STARTING
from tests.e2e.conftest import ASSISTANT, USER, assert_clean, log_in, send, shot, watch_reply

TYPED = "A question typed while the model starts."


@pytest.mark.while_starting
async def test_what_a_visitor_types_during_start_up_stays_and_the_notice_goes(
        early_visit, app_server):
    visit, page = early_visit, early_visit.page
    await log_in(visit)
    status, health = await app_server.ready_state()
    assert status == 503 and health["status"] == "starting", (
        "this test runs first among the browser tests, while the shared app starts")
    notice = page.locator("#model-status")
    await notice.wait_for(timeout=10_000)
    assert await notice.inner_text() == STARTING
    await page.type("#chat-input", TYPED, delay=10)  # key by key, as a person types
    assert (await app_server.ready_state())[0] == 503, "typed before the model was ready"
    await shot(visit, "starting")

    # Until the engines are up and a while after, the box keeps the text and the chat
    # shows no message of its own (no view switch under the input).
    deadline = time.monotonic() + 400
    while (await app_server.ready_state())[0] != 200:
        assert time.monotonic() < deadline, "the engines did not start"
        assert await page.input_value("#chat-input") == TYPED
        await asyncio.sleep(0.5)
    await notice.wait_for(state="detached", timeout=10_000)  # the page polls every 2 s
    assert await page.input_value("#chat-input") == TYPED
    assert await page.locator(ASSISTANT).count() == 0

    states = await watch_reply(visit, await send(visit, None))
    assert await page.locator(USER).last.inner_text() == TYPED
    assert "tokens/s" in states[-1]
    assert "still starting" not in await page.inner_text("body")
    assert_clean(visit)
