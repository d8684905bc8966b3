"""Invite links for demo sessions (issue 32): the store's rules on a real SQLite database
(and PostgreSQL where installed), the operator's commands, and the invite page on the real
server (`chainlit run app.py`, the labelled stand-in engine: the model does not matter
here) over HTTP and Chainlit's socket."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from store.accounts import AccountError
from store.api_keys import ApiKeys
from store.invites import GUEST_NAME_CHARS, InviteError, Invites, parse_duration
from store.schema import connect, database_url, migrate
from tests.test_accounts import STAND_IN, add_user, store_command, store_run
from tools.chainlit_client import ChatClient, serving
from tools.postgres import Postgres, binaries

HOSTILE_NAMES = ["", "   ", "x" * 10_000, "x" * (GUEST_NAME_CHARS + 1), "bell\x07",
                 "nul\x00name", "right\u202eto-left", "zero\u200bwidth", None, 42]


@pytest.fixture
async def invites(tmp_path):
    engine = connect(database_url(tmp_path, env={}))
    await migrate(engine)
    yield Invites(engine)
    await engine.dispose()


async def used(invites: Invites, invite_id: str) -> int:
    return next(i.used for i in await invites.list() if i.id == invite_id)


async def test_a_link_lets_in_as_many_as_its_uses_and_nothing_after_its_end(invites):
    invite, token = await invites.add(2, parse_duration("2h"))
    first = await invites.redeem(token, "  Ada   Lovelace ")
    second = await invites.redeem(token, "Ada Lovelace")  # the same name: another guest
    assert first.name == second.name == "Ada Lovelace"
    assert first.identifier != second.identifier
    assert all(g.identifier.startswith("guest-") for g in (first, second))
    with pytest.raises(InviteError, match="as many times"):
        await invites.redeem(token, "Third")
    assert [(i.id, i.used, i.state()) for i in await invites.list()] == \
        [(invite.id, 2, "used up")]

    late, late_token = await invites.add(5, 60, now=time.time() - 120)
    with pytest.raises(InviteError, match="expired"):
        await invites.redeem(late_token, "Late")
    gone, gone_token = await invites.add(5, 3600)
    await invites.revoke(gone.id)
    with pytest.raises(InviteError, match="withdrawn"):
        await invites.redeem(gone_token, "After")
    for forged in ("A" * 22, token[:-1] + ("A" if token[-1] != "A" else "B"), "", None):
        with pytest.raises(InviteError, match="not valid"):
            await invites.redeem(forged, "Mallory")
    assert (await used(invites, late.id), await used(invites, gone.id)) == (0, 0)


async def test_a_bad_name_is_refused_in_words_and_uses_nothing(invites):
    invite, token = await invites.add(3, 3600)
    for name in HOSTILE_NAMES:
        with pytest.raises(InviteError) as refused:
            await invites.redeem(token, name)
        assert "name" in str(refused.value).lower(), name
    assert await used(invites, invite.id) == 0
    async with invites.engine.connect() as conn:
        from sqlalchemy import text
        assert (await conn.execute(text("SELECT COUNT(*) FROM accounts"))).scalar_one() == 0


async def race_for_the_last_uses(invites: Invites) -> None:
    """64 people opening a 50-use link at once: 50 guests, 14 refused in words."""
    invite, token = await invites.add(50, 3600)
    done = await asyncio.gather(*[invites.redeem(token, f"Person {n}") for n in range(64)],
                                return_exceptions=True)
    guests = [d for d in done if not isinstance(d, Exception)]
    refused = [d for d in done if isinstance(d, InviteError)]
    assert (len(guests), len(refused)) == (50, 14), [d for d in done if isinstance(d, Exception)
                                                    and not isinstance(d, InviteError)]
    assert len({g.identifier for g in guests}) == 50
    assert all("as many times" in str(r) for r in refused)
    assert await used(invites, invite.id) == 50


async def test_the_last_uses_of_a_link_go_to_as_many_people_as_it_allows(invites):
    await race_for_the_last_uses(invites)


async def test_the_last_uses_of_a_link_go_to_as_many_people_as_it_allows_on_postgresql():
    if binaries() is None and not os.environ.get("VCHAT_REQUIRE_POSTGRES"):
        pytest.skip("no PostgreSQL server installed here (Debian: postgresql)")
    with Postgres() as pg:
        engine = connect(database_url(None, env={"DATABASE_URL": pg.new_database()}))
        try:
            await migrate(engine)
            await race_for_the_last_uses(Invites(engine))
        finally:
            await engine.dispose()


async def test_a_guest_gets_no_api_key_and_a_key_of_one_opens_nothing(invites):
    _, token = await invites.add(1, 3600)
    guest = await invites.redeem(token, "Guest")
    keys = ApiKeys(invites.engine)
    with pytest.raises(AccountError, match="guest"):
        await keys.add(guest.identifier)
    async with invites.engine.begin() as conn:  # one written past the check, as if by hand
        from sqlalchemy import text
        await conn.execute(text(
            'INSERT INTO api_keys ("id", "keyHash", "identifier", "createdAt") '
            "VALUES ('k1', :h, :i, 'now')"),
            {"h": __import__("store.api_keys", fromlist=["_digest"])._digest("vchat-k1-x"),
             "i": guest.identifier})
    assert await keys.account_of("vchat-k1-x") is None


def test_durations_are_read_in_words_and_bounded():
    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200
    assert parse_duration("7d") == 7 * 86400
    for bad in ("", "2", "2x", "0h", "-1h", "31d", "1e9s", "2h; DROP TABLE invites"):
        with pytest.raises(InviteError, match="expiry"):
            parse_duration(bad)


# -- the page, on the real server -----------------------------------------------------

@pytest.fixture(scope="module")
async def server():
    async with serving(STAND_IN, timeout=120) as srv:
        yield srv


def link_token(printed: str) -> str:
    return printed.strip().splitlines()[-1].rsplit("/invite/", 1)[1]


async def join(server, token: str, name) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url) as http:
        return await http.post(f"/invite/{token}", data={"name": name} if name is not None
                               else None, timeout=60)


async def test_an_invite_link_opens_a_chat_for_a_guest_until_it_is_revoked(server):
    printed = store_command(server, "invites", "add", "--uses", "2", "--expires", "2h")
    token = link_token(printed)
    invite_id = printed.split()[1].rstrip(":")
    async with httpx.AsyncClient(base_url=server.url) as http:
        page = await http.get(f"/invite/{token}")
    assert page.status_code == 200 and '<form method="post">' in page.text

    joined = await join(server, token, "Grace <b>Hopper</b>")
    assert joined.status_code == 303 and joined.headers["location"] == "/"
    cookie = joined.cookies["access_token"]
    guest = ChatClient(server.url, "Latency-first")
    await guest.connect_with(cookie)
    reply = await guest.send("Hello from a guest")
    assert reply.reply is not None and reply.shown, reply.notes
    async with httpx.AsyncClient(base_url=server.url, cookies={"access_token": cookie}) as http:
        me = (await http.get("/user")).json()
    assert me["identifier"].startswith("guest-") and me["display_name"] == "Grace <b>Hopper</b>"
    listed = store_command(server, "users", "list")
    assert f"{me['identifier']}\tuser\tguest" in listed

    assert (await join(server, token, "Second")).status_code == 303
    full = await join(server, token, "Third")
    assert full.status_code == 410 and "as many times" in full.text and "<form" not in full.text

    revoked = store_command(server, "invites", "revoke", invite_id)
    assert "2 guest session(s) ended" in revoked, revoked  # both guests' logins
    deadline = time.monotonic() + 10
    while guest.sio.connected and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not guest.sio.connected, "revoking the link ends its guests' sessions"
    async with httpx.AsyncClient(base_url=server.url, cookies={"access_token": cookie}) as http:
        assert (await http.get("/user")).status_code == 401
        again = await http.get(f"/invite/{token}")
    assert again.status_code == 410 and "withdrawn" in again.text
    assert f"{invite_id}\trevoked\t2/2 used" in store_command(server, "invites", "list")


async def test_bad_links_and_names_get_the_page_in_words_and_change_nothing(server):
    printed = store_command(server, "invites", "add", "--uses", "5", "--expires", "1h")
    token, invite_id = link_token(printed), printed.split()[1].rstrip(":")
    accounts = store_command(server, "users", "list")
    for name in ["", "x" * 10_000, "bell\x07", "right\u202eto-left", None]:
        refused = await join(server, token, name)
        assert refused.status_code == 400, (name, refused.status_code)
        assert "name" in refused.text.lower() and "Traceback" not in refused.text
    for forged in ("A" * 22, "a.b", "x" * 500, "%3Cscript%3E"):
        async with httpx.AsyncClient(base_url=server.url) as http:
            shown = await http.get(f"/invite/{forged}")
        assert shown.status_code == 410, forged
        assert "not valid" in shown.text and "<script>" not in shown.text
        assert (await join(server, forged, "Mallory")).status_code == 410
    async with httpx.AsyncClient(base_url=server.url) as http:
        elsewhere = await http.post(f"/invite/{token}", data={"name": "Csrf"},
                                    headers={"Origin": "https://evil.example"})
    assert elsewhere.status_code == 403
    assert store_command(server, "users", "list") == accounts
    assert f"{invite_id}\topen\t0/5 used" in store_command(server, "invites", "list")


async def test_the_operators_invite_commands_refuse_bad_values_in_words(server):
    for args in (["--uses", "0", "--expires", "1h"], ["--uses", "5", "--expires", "soon"],
                 ["--uses", "100000", "--expires", "1h"]):
        done = store_run(server, "invites", "add", *args)
        assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr
        assert "Traceback" not in done.stderr
    done = store_run(server, "invites", "revoke", "nosuch")
    assert done.returncode == 1 and "no invite 'nosuch'" in done.stderr
    add_user(server, "keyless-check", "a long enough password")
    assert "API key" in store_command(server, "keys", "add", "keyless-check")
