"""Attaching files on the chat page, in headless Chromium: a PDF attached through the page's
file input (what the attach button and a drop hand it) is uploaded, sent with a question,
answered, and shown under the message; a file the chat cannot read is refused with its
reason on the page, and nothing is sent."""

from __future__ import annotations

from tests.e2e.conftest import USER, assert_clean, log_in, send, shot, watch_reply
from tools import sample_files as sf


async def attach(visit, name: str, mime: str, data: bytes) -> int:
    """Hand the page's file input a file; the upload's status, once the page has taken it."""
    async with visit.page.expect_response(lambda r: "/project/file" in r.url,
                                          timeout=60_000) as answer:
        await visit.page.set_input_files("input[type=file]", files=[
            {"name": name, "mimeType": mime, "buffer": data}])
    status = (await answer.value).status
    if status == 200:  # the page takes the upload's answer in a moment; until then it
        # ignores Enter (Chainlit's composer is disabled while a file is uploading)
        await visit.page.wait_for_selector("#chat-submit:not([disabled])", timeout=30_000)
    return status


async def test_a_pdf_attached_on_the_page_is_read_and_shown_with_the_message(visit):
    await log_in(visit)
    page = visit.page
    assert await attach(visit, "lighthouse.pdf", "application/pdf",
                        sf.pdf(["The lighthouse keeper's cat is named Pepper."])) == 200
    states = await watch_reply(visit, await send(visit, "What is the cat's name?"))
    assert states and "tokens/s" in states[-1]
    message = page.locator(USER).last
    await message.get_by_text("lighthouse.pdf").wait_for(timeout=10_000)
    await shot(visit, "attached-document")
    assert_clean(visit)

    # A binary file under a text file's name: the page says why, and nothing is attached.
    assert await attach(visit, "notes.txt", "text/plain", bytes(range(256)) * 8) == 400
    await page.get_by_text("it is a binary file, not text").first.wait_for(timeout=30_000)
    visit.refused.clear()  # the upload's 400 carries that reason
    visit.console_errors.clear()
