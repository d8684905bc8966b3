"""The app in a real browser: headless Chromium (Debian's, /usr/bin/chromium) driven by
Playwright, against one `chainlit run app.py` with the real embedded model, shared by every
test here. Each test gets a fresh browser context (no cookies: a new visitor) whose console
errors and requests to other origins are recorded. Screenshots go to E2E_SHOTS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tools.chainlit_client import ROOT, TEST_PASSWORD, TEST_USER, Server

CHROMIUM = os.environ.get("VCHAT_CHROMIUM", "/usr/bin/chromium")
# As the machine's notes advise for a closed network: no background connections of
# Chromium's own (they would be refused, many at a time), no sandbox as root.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
# Replies end within this many tokens. The embedded model streams ~9 tokens a second to one
# user on CI's 2 cores, so a reply that runs to the shipped 512 holds a test for a minute
# (one CI run had three of them in one test: 181 s instead of ~25).
REPLY_TOKENS = 128
E2E_SHOTS = Path(os.environ.get("E2E_SHOTS", ROOT / ".cache" / "e2e"))

if not Path(CHROMIUM).is_file() and not os.environ.get("VCHAT_REQUIRE_BROWSER"):
    pytest.skip(f"no Chromium at {CHROMIUM} (Debian: chromium; .ci/run installs it)",
                allow_module_level=True)


def pytest_collection_modifyitems(items):
    """The test marked `while_starting` needs the shared app before its engines are up: it
    runs first among the browser tests, whatever their files' order."""
    early = [item for item in items if item.get_closest_marker("while_starting")]
    if early:
        rest = [item for item in items if item not in early]
        at = next(n for n, item in enumerate(rest) if "e2e" in item.path.parts)
        items[:] = rest[:at] + early + rest[at:]


@pytest.fixture(scope="package")
async def app_server(tmp_path_factory):
    """One app for the browser tests, as soon as it answers HTTP (its engines still
    starting), stopped when they are done. The shipped profiles, replies capped at
    REPLY_TOKENS."""
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    for profile in raw["profiles"]:
        profile["sampling"]["max_tokens"] = min(profile["sampling"]["max_tokens"], REPLY_TOKENS)
    profiles = tmp_path_factory.mktemp("e2e") / "profiles.yaml"
    profiles.write_text(yaml.safe_dump(raw, sort_keys=False))
    server = Server({"VCHAT_PROFILES": str(profiles)})
    try:
        await server.wait_http()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package")
async def ready_server(app_server):
    await app_server.wait_ready(timeout=400)
    return app_server


@pytest.fixture(scope="package")
async def browser():
    from playwright.async_api import async_playwright

    E2E_SHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


@dataclass
class Visit:
    """One visitor's page, and what it did besides showing the app."""
    page: object
    origin: str
    console_errors: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # requests to other origins
    refused: list[str] = field(default_factory=list)  # "400 GET /path" for each 4xx/5xx


@pytest.fixture
async def visit(browser, ready_server):
    """A new visitor to the app once its engines are up."""
    async with visiting(browser, ready_server) as seen:
        yield seen


@pytest.fixture
async def early_visit(browser, app_server):
    """A new visitor to the app, maybe before its engines are up."""
    async with visiting(browser, app_server) as seen:
        yield seen


@contextlib.asynccontextmanager
async def visiting(browser, server: Server):
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    page = await context.new_page()
    seen = Visit(page, server.url)
    page.on("console", lambda m: seen.console_errors.append(m.text)
            if m.type == "error" else None)
    page.on("request", lambda r: seen.elsewhere.append(r.url)
            if not r.url.startswith(server.url) and not r.url.startswith("data:") else None)
    # The console names no URL for a failed load ("Failed to load resource: ... 400"):
    # which request it was comes from here, for the failure message.
    page.on("response", lambda r: seen.refused.append(
        f"{r.status} {r.request.method} {r.url.removeprefix(server.url)}")
        if r.status >= 400 else None)
    try:
        yield seen
    finally:
        await context.close()


async def log_in(visit: Visit, user: str = TEST_USER, password: str = TEST_PASSWORD) -> None:
    page = visit.page
    await page.goto(visit.origin)
    await page.fill("input:not([type=password])", user)
    await page.fill("input[type=password]", password)
    await page.click("button[type=submit]")
    await page.wait_for_selector("#chat-input:not([disabled])", timeout=60_000)
    await page.wait_for_load_state("networkidle")
    # Logged out, Chainlit's page asks for the user first and logs the 401 it gets as an
    # error (its way of finding that it must show the login form): counted from here on.
    visit.console_errors.clear()
    visit.refused.clear()


async def shot(visit: Visit, name: str) -> Path:
    path = E2E_SHOTS / f"{name}.png"
    await visit.page.screenshot(path=str(path))
    return path


ASSISTANT = '[data-step-type="assistant_message"] .message-content'
USER = '[data-step-type="user_message"]'


async def send(visit: Visit, text: str | None) -> int:
    """Type a message (None: the one in the box) and press Enter; how many replies the page
    showed before."""
    page = visit.page
    before, asked = await page.locator(ASSISTANT).count(), await page.locator(USER).count()
    if text is not None:
        await page.fill("#chat-input", text)
    # Chainlit's composer takes a message only while its session is connected and idle (the
    # chat's start is a task too): its send button says when, and a person waits for it.
    await page.wait_for_selector("#chat-submit:not([disabled])", timeout=30_000)
    sent = f"n => document.querySelectorAll('{USER}').length > n"
    await page.press("#chat-input", "Enter")
    try:  # the message is on the page: sent
        await page.wait_for_function(sent, arg=asked, timeout=10_000)
    except Exception:
        # Right after a page's first load, Enter was once taken while the composer was not
        # yet listening (the words stayed in the box, unsent: 1 fresh-clone run in ~6). A
        # person presses it again; so does the test, only while the words are still there.
        left = await page.locator("#chat-input").evaluate("e => e.value ?? e.innerText")
        if text is not None and left.strip() == text.strip():
            await page.press("#chat-input", "Enter")
        try:
            await page.wait_for_function(sent, arg=asked, timeout=30_000)
        except Exception:
            await shot(visit, "not-sent")
            raise
    return before


async def last_reply(visit: Visit) -> str:
    replies = visit.page.locator(ASSISTANT)
    count = await replies.count()
    return await replies.nth(count - 1).inner_text() if count else ""


async def watch_reply(visit: Visit, before: int, timeout: float = 180) -> list[str]:
    """The new reply's text each time it changes, until its turn has ended (no Stop)."""
    page, states = visit.page, []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = await page.locator(ASSISTANT).count() > before
        if shown:
            text = await last_reply(visit)
            if not states or text != states[-1]:
                states.append(text)
            if not await page.locator("#stop-button").count():
                break
        await asyncio.sleep(0.05)
    else:
        raise TimeoutError(f"no finished reply within {timeout} s: {states[-1:]}")
    # The turn has ended; its last update may still be on its way into the page.
    settle = time.monotonic() + 2
    while time.monotonic() < settle:
        text = await last_reply(visit)
        if text != states[-1]:
            states.append(text)
        await asyncio.sleep(0.05)
    return states


# A request of the socket's long-polling transport that Engine.IO's server answers 400 when
# it comes after the socket upgraded to a websocket or closed (the page reconnecting for a
# resumed chat): the client drops it and carries on, and the user sees nothing. CI once
# failed the resume test on a console 400 whose URL the console does not give (2026-12-03;
# not seen here in 9 runs of that test): this race is the likeliest cause. Any other refused
# request still fails a test, and the message lists every refused request by URL.
TRANSPORT_RACE = re.compile(r"^400 (GET|POST) /ws/socket\.io/\?.*transport=polling")
FAILED_LOAD = "Failed to load resource: the server responded with a status of "


def assert_clean(visit: Visit) -> None:
    """No request left the app's origin and the console holds no error, but for a failed
    load that was the socket transport's race (each excused by one such refused request)."""
    assert visit.elsewhere == [], f"requests left the app's origin: {visit.elsewhere}"
    races = sum(1 for r in visit.refused if TRANSPORT_RACE.match(r))
    errors = []
    for error in visit.console_errors:
        if races and error.startswith(FAILED_LOAD + "400"):
            races -= 1
        else:
            errors.append(error)
    assert errors == [], (errors, visit.refused)
