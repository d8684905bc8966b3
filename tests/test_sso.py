"""Single sign-on's rules and accounts without a browser (chat/sso.py, store/accounts.py);
the whole sign-in against a real OpenID Connect provider is tests/e2e/test_sso.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from chat.sso import HeaderLogin, Policy, SingleSignOn, claim_verified, groups_of
from engine import ConfigError
from store.accounts import Accounts
from store.schema import connect, migrate
from tools.chainlit_client import chainlit_command, side_by_side

POLICY = Policy(domains=("example.com",), groups=("staff", "contractors"),
                admin_groups=("chat-admins",))


def test_the_policy_lets_in_the_allowed_domain_and_groups_and_names_admins():
    assert POLICY.role("ann@example.com", ["staff"]) == ("user", "")
    assert POLICY.role("Ann@EXAMPLE.com", ["staff", "chat-admins"])[0] == "admin"
    for name, groups, verified, why in (
            ("ann@other.org", ["staff"], None, "domain 'other.org'"),
            ("ann@example.com.evil.org", ["staff"], None, "is not let in"),
            ("ann", ["staff"], None, "domain '(none)'"),
            ("ann@example.com", ["visitors"], None, "none of the groups"),
            ("ann@example.com", [], None, "none of the groups"),
            ("ann@example.com", ["staff"], False, "not verified"),
            (None, ["staff"], None, "no usable user name"),
            ("x" * 190 + "@example.com", ["staff"], None, "no usable user name")):
        role, said = POLICY.role(name, groups, verified)
        assert role is None and why in said, (name, said)
    assert Policy().role("anyone@anywhere.org") == ("user", "")  # nothing named: all in
    assert Policy.from_settings({"VCHAT_SSO_DOMAINS": " @Example.com, corp.example ",
                                 "VCHAT_SSO_ADMIN_GROUPS": "a,b"}) == Policy(
        ("example.com", "corp.example"), (), ("a", "b"), "groups")


def test_claims_are_read_as_providers_send_them():
    assert groups_of(["a", 2, "b"]) == ["a", "b"] and groups_of("a, b,,") == ["a", "b"]
    assert groups_of({"a": 1}) == [] and groups_of(None) == []
    assert [claim_verified({"email_verified": v}) for v in (True, "false", "True", None)] == \
        [True, False, True, None]


def test_a_header_login_needs_the_proxys_addresses():
    sso = SingleSignOn(None, None, POLICY)
    with pytest.raises(ConfigError, match="name the proxy's addresses"):
        HeaderLogin(sso, "X-Email", None, [])
    with pytest.raises(ConfigError, match="VCHAT_HEADER_AUTH_PROXIES"):
        HeaderLogin(sso, "X-Email", None, ["not-an-address"])
    login = HeaderLogin(sso, "X-Email", None, ["10.0.0.0/24", "127.0.0.2"])
    assert [login.trusted(a) for a in ("10.0.0.7", "127.0.0.2", "127.0.0.1", "", None,
                                       "10.0.1.1")] == [True, True, False, False, False, False]


async def test_single_sign_on_makes_one_account_follows_the_role_and_takes_over_none(tmp_path):
    engine = connect(f"sqlite+aiosqlite:///{tmp_path / 'chat.db'}")
    await migrate(engine)
    accounts = Accounts(engine)
    opened = []

    async def open_session(name):
        opened.append(name)
        return {"session": "s"}

    sso = SingleSignOn(accounts, open_session, POLICY)
    try:
        await accounts.add("ann@example.com", "a password of ann's")
        assert await sso.let_in("ann@example.com", ["staff"], True, "test") is None
        firsts = await asyncio.gather(*[accounts.single_sign_on("bo@example.com", "user")
                                        for _ in range(5)])  # first logins at once
        assert {a.identifier for a in firsts} == {"bo@example.com"}
        user = await sso.let_in("bo@example.com", ["staff", "chat-admins"], True, "test")
        assert user.identifier == "bo@example.com" and user.metadata["role"] == "admin"
        await sso.let_in("bo@example.com", ["staff"], True, "test")
        listed = {a.identifier: a for a in await accounts.list()}
        assert (listed["bo@example.com"].role, listed["bo@example.com"].kind) == ("user", "sso")
        assert listed["ann@example.com"].kind == "password"
        assert await accounts.verify("bo@example.com", "") is None  # no password opens it
        assert await sso.let_in("eve@other.org", ["staff"], True, "test") is None
        assert opened == ["bo@example.com"] * 2
    finally:
        await engine.dispose()


async def test_a_header_login_reads_the_proxys_utf8_names(tmp_path):
    """Regression (issue 52): Starlette reads a header's bytes as Latin-1, so the proxy's
    UTF-8 `jörg@example.com` logged in (and made the account) `jÃ¶rg@example.com`, and a
    group named in UTF-8 was not found. Through real requests from the proxy's address
    (the middleware `install` adds, and the callback given `request.headers` as Chainlit's
    POST /auth/header gives it), several at once: names and groups are read as UTF-8, and
    bytes that are not UTF-8 keep their Latin-1 reading."""
    import httpx
    from fastapi import FastAPI
    from starlette.responses import JSONResponse

    from chat.sso import HEADER_LOGIN_PATH

    engine = connect(f"sqlite+aiosqlite:///{tmp_path / 'chat.db'}")
    await migrate(engine)

    async def open_session(name):
        return {"session": "s"}

    sso = SingleSignOn(Accounts(engine), open_session,
                       Policy(domains=("example.com",), groups=("équipe",)))
    login = HeaderLogin(sso, "X-Email", "X-Groups", ["127.0.0.1"])
    app = FastAPI()
    login.install(app)

    async def header_auth(request):
        user = await login.login(request.headers)
        return JSONResponse({"identifier": user.identifier if user else None})

    app.add_route(HEADER_LOGIN_PATH, header_auth, methods=["POST"])

    sent = {"jörg@example.com".encode(): "jörg@example.com",
            "zoë.ĳssel@example.com".encode(): "zoë.ĳssel@example.com",
            b"ren\xe9@example.com": "rené@example.com"}  # Latin-1 bytes, not UTF-8
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            answers = await asyncio.gather(*[http.post(HEADER_LOGIN_PATH, headers=[
                (b"X-Email", name), (b"X-Groups", "équipe".encode())]) for name in sent])
        assert [r.json().get("identifier") for r in answers] == list(sent.values()), \
            [r.text for r in answers]
        assert {a.identifier for a in await Accounts(engine).list()} == set(sent.values())
    finally:
        await engine.dispose()


def test_the_app_refuses_to_start_with_no_way_to_log_in():
    env = {**os.environ, "VCHAT_PASSWORD_LOGIN": "0"}
    no_login, open_header = side_by_side(  # at once: each spends ~15 s importing vLLM
        (chainlit_command() + ["run", "app.py", "--headless", "--port", "0"], env),
        (chainlit_command() + ["run", "app.py", "--headless", "--port", "0"],
         {**env, "VCHAT_HEADER_AUTH": "X-Forwarded-Email"}))
    for done, said in ((no_login, "nobody can log in"),
                       (open_header, "name the proxy's addresses")):
        assert done.returncode != 0 and "Traceback" not in done.stdout + done.stderr
        assert "Configuration error" in done.stderr and said in done.stderr, done.stderr
