"""Single sign-on end to end (issue 29): headless Chromium logs in through a real OpenID
Connect provider (panva's certified oidc-provider under node: tools/oidc_provider.py) to the
real server (`chainlit run app.py`, the labelled stand-in engine: the model does not matter
here) with the password form turned off, and a sign-in proxy's header login beside it, taken
from the proxy's address only.

The provider's accounts: alice and boss at example.com (the domain let in; boss in the admin
group), mallory at other.org. Authorization codes live 5 s here, so that an expired one can
be shown refused."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from store import export
from tests.e2e.conftest import ASSISTANT, E2E_SHOTS, Visit, send
from tests.test_accounts import STAND_IN, store_command
from tools.chainlit_client import Server, free_port
from tools.oidc_provider import (LOGIN_FIELD, PASSWORD, PASSWORD_FIELD, SUBMIT, OidcProvider,
                                 log_in)

if shutil.which("npm") is None and not os.environ.get("VCHAT_REQUIRE_BROWSER"):
    pytest.skip("no node/npm for the OpenID Connect provider (Debian: nodejs npm; .ci/run "
                "installs them)", allow_module_level=True)

CLIENT_ID, CLIENT_SECRET = "vchat", "a client secret for the SSO tests"
ACCOUNTS = {
    "alice@example.com": {"name": "Alice", "groups": ["staff"]},
    "boss@example.com": {"name": "Boss", "groups": ["staff", "chat-admins"]},
    "mallory@other.org": {"name": "Mallory", "groups": ["staff", "chat-admins"]},
    "unverified@example.com": {"email_verified": False},
}
PROXY = "127.0.0.2"  # the sign-in proxy's address (any 127.x reaches the server on Linux)
CODE_TTL_S = 5


@dataclass
class SsoSite:
    server: Server
    provider: OidcProvider
    callback: str

    def accounts(self) -> dict[str, tuple[str, str]]:
        """`store users list`: name -> (role, kind)."""
        listed = store_command(self.server, "users", "list")
        rows = [line.split("\t") for line in listed.splitlines() if "\t" in line]
        return {row[0]: (row[1], row[2]) for row in rows}


@pytest.fixture(scope="module")
async def sso(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sso")
    port = free_port()
    callback = f"http://127.0.0.1:{port}/auth/oauth/generic/callback"
    provider = OidcProvider(folder / "oidc.log").start(
        client_id=CLIENT_ID, client_secret=CLIENT_SECRET, redirect_uris=[callback],
        accounts=ACCOUNTS, code_ttl=CODE_TTL_S)
    found = provider.discovery
    env = {**STAND_IN, "VCHAT_DATA_DIR": str(folder / "data"),
           "OAUTH_GENERIC_CLIENT_ID": CLIENT_ID, "OAUTH_GENERIC_CLIENT_SECRET": CLIENT_SECRET,
           "OAUTH_GENERIC_AUTH_URL": found["authorization_endpoint"],
           "OAUTH_GENERIC_TOKEN_URL": found["token_endpoint"],
           "OAUTH_GENERIC_USER_INFO_URL": found["userinfo_endpoint"],
           "OAUTH_GENERIC_SCOPES": "openid email profile groups",
           "VCHAT_SSO_DOMAINS": "example.com", "VCHAT_SSO_ADMIN_GROUPS": "chat-admins",
           "VCHAT_PASSWORD_LOGIN": "0"}
    server = Server(env, port=port)
    try:
        await server.wait_ready(timeout=120)
        yield SsoSite(server, provider, callback)
    finally:
        server.stop()
        provider.stop()


@pytest.fixture
async def page(browser):
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    yield await context.new_page()
    await context.close()


async def sign_in(page, sso: SsoSite, who: str) -> None:
    """From the app's login page through the provider's, back to the app."""
    await page.goto(sso.server.url)
    await page.get_by_role("button", name=re.compile("continue with", re.I)).click()
    await page.wait_for_selector(LOGIN_FIELD, timeout=30_000)
    await page.fill(LOGIN_FIELD, who)
    await page.fill(PASSWORD_FIELD, PASSWORD)
    await page.click(SUBMIT)


async def signed_in(page) -> None:
    await page.wait_for_selector("#chat-input:not([disabled])", timeout=60_000)
    await page.wait_for_load_state("networkidle")


async def refused(page) -> str:
    """The login page's error after a refused sign-in."""
    await page.wait_for_url(re.compile(r".*/login\?error=oauthSignin.*"), timeout=60_000)
    alert = page.get_by_text(re.compile("unable to sign in|sign in failed", re.I))
    await alert.wait_for(timeout=30_000)
    return await alert.inner_text()


async def test_a_user_of_the_allowed_domain_signs_in_and_chats(sso, page):
    await page.goto(sso.server.url)
    await page.get_by_role("button", name=re.compile("continue with", re.I)).wait_for()
    assert not await page.locator("input[type=password]").count()  # the form is off
    await page.screenshot(path=str(E2E_SHOTS / "sso-login.png"))
    await sign_in(page, sso, "alice@example.com")
    await signed_in(page)
    before = await send(Visit(page, sso.server.url), "Hello from single sign-on.")
    await page.wait_for_function(f"n => document.querySelectorAll('{ASSISTANT}').length > n",
                                 arg=before, timeout=60_000)
    assert sso.accounts()["alice@example.com"] == ("user", "sso")
    await page.wait_for_selector("#stop-button", state="detached", timeout=60_000)
    # Thumbs down with a comment, as the page gives them: stored with the reply.
    await page.locator("button.negative-feedback-off").last.click()
    await page.get_by_placeholder(re.compile("your feedback", re.I)).fill("Too long.")
    await page.get_by_role("button", name=re.compile("submit feedback", re.I)).click()
    await page.get_by_text(re.compile("feedback updated", re.I)).first.wait_for(timeout=30_000)
    # The header's Export menu downloads her chats (chat/downloads.py).
    await page.click("#export-button")
    await page.get_by_text("All my chats as JSON").wait_for()
    await page.screenshot(path=str(E2E_SHOTS / "export-menu.png"))
    async with page.expect_download() as download:
        await page.get_by_text("All my chats as JSON").click()
    saved = await (await download.value).path()
    (chat,) = export.read(Path(saved).read_bytes())
    assert chat.owner == "alice@example.com"
    assert "Hello from single sign-on." in [m.text for m in chat.messages]
    assert chat.messages[-1].feedback == {"thumbs": "down", "comment": "Too long."}
    async with httpx.AsyncClient(base_url=sso.server.url) as http:  # no form to post to
        posted = await http.post("/login", data={"username": "alice@example.com",
                                                 "password": "anything at all"})
    assert posted.status_code >= 400 and "access_token" not in posted.cookies


async def test_the_admin_group_makes_an_admin_and_other_domains_stay_out(sso, page, browser):
    await sign_in(page, sso, "boss@example.com")
    await signed_in(page)
    assert sso.accounts()["boss@example.com"] == ("admin", "sso")
    for outsider in ("mallory@other.org", "unverified@example.com"):
        context = await browser.new_context()
        other = await context.new_page()
        await sign_in(other, sso, outsider)
        assert "sign in" in (await refused(other)).lower()
        assert "access_token" not in {c["name"] for c in await context.cookies()}
        await context.close()
    assert not {"mallory@other.org", "unverified@example.com"} & set(sso.accounts())


async def callback(sso: SsoSite, who: str, change=lambda code: code,
                   wait_s: float = 0.0) -> httpx.Response:
    """A sign-in as the browser makes it, by HTTP: the app's redirect to the provider (and
    its state cookie), the provider's login, then the app's callback with the code the
    provider gave, changed by `change`, `wait_s` later."""
    async with httpx.AsyncClient(base_url=sso.server.url, timeout=60) as http:
        start = await http.get("/auth/oauth/generic")
        assert start.is_redirect, start.text
        state = parse_qs(urlsplit(start.headers["location"]).query)["state"][0]
        code = await log_in(sso.provider, who, sso.callback, CLIENT_ID, state=state)
        await asyncio.sleep(wait_s)
        return await http.get("/auth/oauth/generic/callback",
                              params={"code": change(code), "state": state})


def is_refused(answer: httpx.Response) -> bool:
    return answer.is_redirect and "error=oauthSignin" in answer.headers["location"] and \
        "access_token" not in answer.cookies


async def test_a_tampered_replayed_or_expired_code_is_refused(sso):
    """The provider refuses such a code at its token endpoint; the app then sends the
    browser back to its login page with no session."""
    good = await callback(sso, "alice@example.com")
    assert good.is_redirect and good.cookies.get("access_token"), good.headers
    flipped = await callback(sso, "alice@example.com",
                             change=lambda c: c[:-1] + ("A" if c[-1] != "A" else "B"))
    assert is_refused(flipped)
    assert is_refused(await callback(sso, "alice@example.com", change=lambda c: c + "x"))
    assert is_refused(await callback(sso, "alice@example.com", wait_s=CODE_TTL_S + 1.5))
    async with httpx.AsyncClient(base_url=sso.server.url) as http:  # no state cookie
        forged = await http.get("/auth/oauth/generic/callback",
                                params={"code": "anything", "state": "guessed"})
    assert is_refused(forged)
    assert "grant.error" in sso.provider.log()  # the provider's own refusals


async def test_a_tampered_session_cookie_is_refused(sso, page):
    await sign_in(page, sso, "alice@example.com")
    await signed_in(page)
    (cookie,) = [c for c in await page.context.cookies() if c["name"] == "access_token"]
    head, body, signature = cookie["value"].split(".")
    claims = json.loads(_unb64(body))
    claims["identifier"] = "boss@example.com"
    forged = f"{head}.{_b64(json.dumps(claims))}.{signature}"
    async with httpx.AsyncClient(base_url=sso.server.url) as http:
        for value in (forged, cookie["value"][:-4] + "AAAA"):
            r = await http.get("/user", cookies={"access_token": value})
            assert r.status_code == 401, r.text
        assert (await http.get("/user", cookies={"access_token": cookie["value"]})
                ).json()["identifier"] == "alice@example.com"


def _unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


@pytest.fixture(scope="module")
async def proxied(tmp_path_factory):
    """An app behind a sign-in proxy at PROXY, its password form on (its admin from the
    environment), the same domain and group rules."""
    env = {**STAND_IN, "VCHAT_DATA_DIR": str(tmp_path_factory.mktemp("proxied")),
           "VCHAT_ADMIN_USER": "root", "VCHAT_ADMIN_PASSWORD": "a password for root",
           "VCHAT_SSO_DOMAINS": "example.com", "VCHAT_SSO_ADMIN_GROUPS": "chat-admins",
           "VCHAT_HEADER_AUTH": "X-Forwarded-Email",
           "VCHAT_HEADER_AUTH_GROUPS": "X-Forwarded-Groups",
           "VCHAT_HEADER_AUTH_PROXIES": PROXY}
    server = Server(env)
    try:
        await server.wait_ready(timeout=120)
        yield SsoSite(server, None, "")
    finally:
        server.stop()


async def test_the_proxy_header_logs_in_only_from_the_proxy(proxied):
    """A header login from the proxy's address makes the account (its groups header can
    make an admin); the same header from elsewhere is refused, also when the request claims
    to be forwarded by the proxy (X-Forwarded-For) from an address uvicorn trusts."""
    headers = {"X-Forwarded-Email": "carol@example.com", "X-Forwarded-Groups": "chat-admins"}
    proxy = httpx.AsyncHTTPTransport(local_address=PROXY)
    async with httpx.AsyncClient(base_url=proxied.server.url, transport=proxy) as http:
        r = await http.post("/auth/header", headers=headers)
        assert r.status_code == 200 and r.cookies.get("access_token"), r.text
        me = await http.get("/user", cookies={"access_token": r.cookies["access_token"]})
        assert me.json()["identifier"] == "carol@example.com"
        outside = await http.post("/auth/header", headers={"X-Forwarded-Email": "x@other.org"})
        assert outside.status_code == 401 and "access_token" not in outside.cookies
    assert proxied.accounts()["carol@example.com"] == ("admin", "sso")
    async with httpx.AsyncClient(base_url=proxied.server.url) as http:  # from 127.0.0.1
        for extra in ({}, {"X-Forwarded-For": PROXY}):
            r = await http.post("/auth/header", headers={**headers, **extra,
                                                         "X-Forwarded-Email": "eve@example.com"})
            assert r.status_code == 403 and "access_token" not in r.cookies
    assert "eve@example.com" not in proxied.accounts()


async def test_the_provider_refuses_a_replayed_code_and_forged_tokens(sso):
    """The provider the tests rely on behaves as a real one: a code works once, and using
    it again revokes what it gave; a forged access token gets nothing."""
    endpoint, userinfo = (sso.provider.discovery[k] for k in ("token_endpoint",
                                                             "userinfo_endpoint"))
    code = await log_in(sso.provider, "alice@example.com", sso.callback, CLIENT_ID)
    exchange = {"grant_type": "authorization_code", "code": code,
                "redirect_uri": sso.callback, "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET}
    async with httpx.AsyncClient() as http:
        token = (await http.post(endpoint, data=exchange)).json()["access_token"]

        async def claims(token: str) -> httpx.Response:
            return await http.get(userinfo, headers={"Authorization": f"Bearer {token}"})

        assert (await claims(token)).json()["groups"] == ["staff"]
        assert (await claims(token[:-3] + "xyz")).status_code == 401
        assert (await http.post(endpoint, data=exchange)).status_code == 400
        assert (await claims(token)).status_code == 401  # revoked by the replay
