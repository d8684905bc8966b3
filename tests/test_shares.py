"""Share links (chat/shares.py, store/shares.py): on the real server (the labelled stand-in
engine: the model does not matter here) over HTTP with real logins and the real SQLite
database, as an owner, another user, a guest, a logged-out visitor and another site use
them; and the page's Markdown drawn from escaped text.
(The same in a real browser: tests/e2e/test_chat_page.py.)"""

import asyncio
import re

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text

from chat.shares import NO_SUCH_LINK, SharePages, markdown_html
from store.schema import connect, database_url, migrate
from store.shares import ShareRefused, Shares
from tests.test_accounts import STAND_IN, add_user, store_command, threads
from tests.test_invites import join, link_token
from tools.chainlit_client import ChatClient, serving
from tools.polling import until

LINKS = 3  # the server's VCHAT_SHARE_LINKS
CHAT = "11111111-1111-4111-8111-111111111111"  # a chat of the store-level tests
HOSTILE = ('<script>alert(1)</script> <img src=x onerror="alert(2)"> '
           '[click](javascript:alert(3)) **bold** [docs](https://example.org/a?b=1&c=2)')


@pytest.fixture(scope="module")
async def server():
    async with serving({**STAND_IN, "VCHAT_SHARE_LINKS": str(LINKS)}, timeout=120) as srv:
        add_user(srv, "bea", "bea's long password")
        add_user(srv, "cal", "cal's long password")
        yield srv


async def a_chat(server, client: ChatClient, text: str) -> str:
    """The id of a new chat of `client`'s with one answered message, once it is stored."""
    await client.connect()
    await client.send(text)
    chat = (await threads(server, client))[0]["id"]

    async def stored() -> int:
        async with client.api() as http:
            found = (await http.get(f"/export/chats/{chat}?format=json")).json()
        return len(found["chats"][0]["messages"])

    await until(stored, lambda n: n >= 2, timeout=30)
    await client.close()
    return chat


async def share(client: ChatClient, chat: str, **headers) -> httpx.Response:
    async with client.api() as http:
        return await http.post(f"/share/chats/{chat}", headers=headers)


async def opened(server, url: str, client: ChatClient | None = None) -> httpx.Response:
    if client is None:
        async with httpx.AsyncClient() as http:
            return await http.get(url)
    async with client.api() as http:
        return await http.get(url)


async def test_a_link_shows_the_chat_as_it_was_to_logged_in_users_until_revoked(server):
    ann = ChatClient(server.url, "Latency-first")
    bea = ChatClient(server.url, "Latency-first", user="bea", password="bea's long password")
    chat = await a_chat(server, ann, "The lighthouse question")
    made = await share(ann, chat)
    assert made.status_code == 201, made.text
    link = made.json()
    assert re.fullmatch(r"[A-Za-z0-9_-]{32}", link["id"]) and link["url"].endswith(link["id"])

    seen = await opened(server, link["url"], bea)
    assert seen.status_code == 200 and "The lighthouse question" in seen.text
    assert seen.headers["content-security-policy"].startswith("default-src 'none'")
    assert seen.headers["referrer-policy"] == "no-referrer"
    assert "<script" not in seen.text  # the page runs nothing
    assert "Shared by tester" in seen.text  # the owner's name, no more of the account

    # A snapshot: the chat's next message does not reach the link.
    later = ChatClient(server.url, "Latency-first")
    await later.connect(resume=chat)
    await later.send("A later question")
    await later.close()
    assert "A later question" not in (await opened(server, link["url"], bea)).text

    # A visitor who is not logged in sees no chat (VCHAT_SHARE_VIEWERS=accounts).
    away = await opened(server, link["url"])
    assert away.status_code == 401 and "lighthouse" not in away.text

    # Others can neither share the owner's chat nor revoke the owner's link: the same
    # answer as for none.
    assert (await share(bea, chat)).status_code == 404
    assert (await share(bea, "00000000-0000-4000-8000-000000000000")).status_code == 404
    async with bea.api() as http:
        assert (await http.delete(f"/share/links/{link['id']}")).status_code == 404
        assert (await http.get("/share/links")).json() == {"links": []}
    # Another site cannot make or revoke links with a visitor's cookie.
    assert (await share(ann, chat, origin="https://elsewhere.example")).status_code == 403
    async with ann.api() as http:
        crossed = await http.delete(f"/share/links/{link['id']}",
                                    headers={"sec-fetch-site": "cross-site"})
        assert crossed.status_code == 403
        listed = (await http.get("/share/links")).json()["links"]
        assert [(x["id"], x["chat"]) for x in listed] == [(link["id"], chat)]
        page = await http.get("/share")
        assert page.status_code == 200 and link["url"] in page.text
        assert (await http.delete(f"/share/links/{link['id']}")).status_code == 204
    gone = await opened(server, link["url"], bea)
    assert gone.status_code == 404 and NO_SUCH_LINK in gone.text
    # An id never made reads the same as a revoked one.
    guessed = await opened(server, link["url"][:-32] + "A" * 32, bea)
    assert guessed.status_code == 404 and guessed.text == gone.text


async def test_a_shared_chats_html_and_script_show_as_text(server):
    ann = ChatClient(server.url, "Latency-first")
    chat = await a_chat(server, ann, HOSTILE)
    link = (await share(ann, chat)).json()
    page = (await opened(server, link["url"], ann)).text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img" not in page and "javascript:" not in page.split("[click]")[0]
    assert not re.search(r'href="javascript', page)
    assert '<a href="https://example.org/a?b=1&amp;c=2"' in page and "(example.org)" in page


async def test_an_account_holds_no_more_links_than_allowed_however_many_are_asked_at_once(
        server):
    cal = ChatClient(server.url, "Latency-first", user="cal", password="cal's long password")
    chat = await a_chat(server, cal, "Share me many times")
    answers = await asyncio.gather(*[share(cal, chat) for _ in range(10)])
    assert sorted(a.status_code for a in answers) == [201] * LINKS + [409] * (10 - LINKS)
    assert "revoke one" in next(a for a in answers if a.status_code == 409).json()["detail"]
    async with cal.api() as http:
        assert len((await http.get("/share/links")).json()["links"]) == LINKS
    # The links go with their chat.
    async with cal.api() as http:
        gone = await http.request("DELETE", "/project/thread", json={"threadId": chat})
        assert gone.status_code == 200, gone.text
        assert (await http.get("/share/links")).json() == {"links": []}


async def test_a_guest_may_open_a_link_but_share_nothing_by_default(server):
    ann = ChatClient(server.url, "Latency-first")
    link = (await share(ann, await a_chat(server, ann, "For the guests"))).json()
    token = link_token(store_command(server, "invites", "add", "--uses", "1",
                                     "--expires", "1h"))
    joined = await join(server, token, "Grace")
    cookie = {"access_token": joined.cookies["access_token"]}
    async with httpx.AsyncClient(base_url=server.url, cookies=cookie) as http:
        assert "For the guests" in (await http.get(link["url"])).text
        guest = ChatClient(server.url, "Latency-first")
        await guest.connect_with(cookie["access_token"])
        await guest.send("A guest's question")
        await guest.close()
        chat = (await http.post("/project/threads", json={"pagination": {"first": 5},
                                                          "filter": {}})).json()["data"][0]
        refused = await http.post(f"/share/chats/{chat['id']}")
        # ... and the page's menu is told so (it offers no share items then).
        assert (await http.get("/share/allowed")).json() == {"share": False}
    assert refused.status_code == 403 and "Guests" in refused.json()["detail"]
    async with ann.api() as http:
        assert (await http.get("/share/allowed")).json() == {"share": True}


async def share_cap_holds(url: str) -> None:
    """40 links asked for one chat at once through four engines (as four app processes
    would, each with its own connections) with room for 5: 5 made, 35 refused in words.
    Shared with tests/test_postgres.py."""
    engines = [connect(url) for _ in range(4)]
    try:
        await migrate(engines[0])
        async with engines[0].begin() as conn:
            await conn.execute(text('INSERT INTO threads ("id", "name", "userIdentifier") '
                                    "VALUES (:id, 'Raced', 'ann')"), {"id": CHAT})
        asked = [Shares(engines[n % 4], 5).create("ann", None, CHAT) for n in range(40)]
        done = await asyncio.gather(*asked, return_exceptions=True)
        refused = [d for d in done if isinstance(d, ShareRefused)]
        assert len(refused) == 35 and all("revoke one" in str(r) for r in refused), done
        assert len(await Shares(engines[1], 5).of("ann")) == 5
    finally:
        for engine in engines:
            await engine.dispose()


async def test_a_few_links_at_most_when_many_are_asked_at_once_through_several_engines(
        tmp_path):
    await share_cap_holds(database_url(tmp_path, env={}))


def test_markdown_is_drawn_from_escaped_text():
    drawn = markdown_html(HOSTILE + "\n```\n<b>code</b>\n```\n- `<i>` item\n# A <u>title</u>")
    assert re.findall(r"<(\w+)", drawn) and set(re.findall(r"<(\w+)", drawn)) <= {
        "p", "a", "span", "strong", "pre", "code", "ul", "li", "h3"}
    assert "&lt;b&gt;code&lt;/b&gt;" in drawn and "<h3>A &lt;u&gt;title&lt;/u&gt;</h3>" in drawn
    assert "[click](javascript:alert(3))" in drawn  # not a link: shown as written
    assert markdown_html("```\nleft open") == "<pre><code>left open</code></pre>"


@pytest.mark.parametrize("viewers", ["anyone", "off"])
async def test_who_may_open_a_link_is_a_setting(tmp_path, viewers):
    """VCHAT_SHARE_VIEWERS=anyone: a visitor with no login sees the chat (a public demo);
    off: no link route at all. (The routes alone, on a real SQLite database.)"""
    engine = connect(database_url(tmp_path, env={}))
    await migrate(engine)
    async with engine.begin() as conn:
        await conn.execute(text('INSERT INTO threads ("id", "name", "userIdentifier") VALUES '
                                "(:id, 'Shared', 'ann')"), {"id": CHAT})
    shares = Shares(engine, 5)
    link = await shares.create("ann", "Ann", CHAT)
    app = FastAPI()

    async def nobody(request):
        return None

    app.include_router(SharePages(shares, viewers, False, nobody).router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://app") as http:
        answer = await http.get(f"/shared/{link.id}")
        asked = await http.get("/share/allowed")  # (no login here: 401 while sharing is on)
    await engine.dispose()
    if viewers == "anyone":
        assert answer.status_code == 200 and "Shared by Ann" in answer.text
    else:
        assert answer.status_code == 404 and "Shared" not in answer.text
        assert asked.status_code == 404  # the page's menu offers no share items
