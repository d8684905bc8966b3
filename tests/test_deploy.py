"""Past one machine, on this one (tools/deployment.py): two app replicas started together on
an empty PostgreSQL database, behind HAProxy with the shipped deploy/haproxy-app.cfg; their
presets on two `vllm serve` processes (the CPU build, the embedded model) behind a second
HAProxy that hashes each chat's session key (deploy/haproxy-models.cfg). Each model server
records the headers of every request it gets (tools/header_log.py, loaded by its own
--middleware option), which shows where each chat's turns went and with what key.

What takes more than one machine (the replicas' and servers' own hosts, the network between
them) is the same configuration with other addresses; it is not exercised here.

    .venv/bin/python -m pytest -q tests/test_deploy.py
"""

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from sqlalchemy import text

from engine.remote import BROKEN_OFF
from store.accounts import failure_delay
from store.schema import SCHEMA_VERSION, connect, database_url
from tests.test_accounts import add_user, store_command, thread_steps, threads
from chat.view import CUT_OFF
from tools.chainlit_client import TEST_USER, ChatClient
from tools.deployment import Deployment, haproxy_binary
from tools.header_log import read
from tools.polling import until
from tools.postgres import Postgres, binaries

# Skipped only where one is missing and not required (.ci/run installs Debian's postgresql
# and haproxy and requires both: there a missing one fails these tests).
pytestmark = pytest.mark.skipif(
    (binaries() is None and not os.environ.get("VCHAT_REQUIRE_POSTGRES"))
    or (haproxy_binary() is None and not os.environ.get("VCHAT_REQUIRE_PROXY")),
    reason="needs Debian's postgresql and haproxy")

OPERATOR_KEY = "operator-key-for-the-deploy-test"
# A reply long enough to kill a process under it: the embedded model's sampled replies to
# "a very long story" are often 20-60 tokens, over in a second (one ended before the kill
# on CI); greedy, on Throughput-first after a greeting, it writes past 1,500 (measured with
# vLLM's LLM on this machine: the lighthouse and the harbour both).
GREEDY = {"temperature": 0}
# Over one CPU KV block (128 tokens) once templated: a chat's next turn can find it cached.
LONG_FIRST = ("Here is some background on our team. " * 30).strip() + " Say hello."


@pytest.fixture(scope="module")
async def site(tmp_path_factory):
    with Postgres() as pg:
        async with Deployment(tmp_path_factory.mktemp("deploy"), pg.new_database(),
                              extra_env={"VCHAT_API_KEY": OPERATOR_KEY}) as deployment:
            add_user(deployment.replicas[0], "alice", "alice's password")
            add_user(deployment.replicas[1], "bob", "bob's password")
            yield deployment


@pytest.fixture(scope="module")
async def db(site):
    engine = connect(database_url(None, env={"DATABASE_URL": site.database_url}))
    yield engine
    await engine.dispose()


async def rows(db, sql: str, **params) -> list:
    async with db.connect() as conn:
        return (await conn.execute(text(sql), params)).all()


def client(site, replica: int, user: str = "alice", profile: str = "Latency-first"
           ) -> ChatClient:
    """A browser whose proxy cookie sends it to replica `replica`."""
    return ChatClient(site.url, profile, user=user, password=f"{user}'s password",
                      cookies=site.pin(replica))


def requests_of(site, key: str) -> dict[int, int]:
    """How many completions with session key `key` each model server got."""
    found = {}
    for i, log in enumerate(site.header_logs):
        n = sum(1 for r in read(log) if r["path"] == "/v1/completions"
                and r["headers"].get("x-session-id") == key)
        if n:
            found[i] = n
    return found


async def prefix_hits(site, server: int) -> float:
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(site.models[server].url + "/metrics", timeout=10)).text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$",
                                            metrics, re.M))


async def test_replicas_started_together_on_an_empty_database_set_it_up_once(site, db):
    assert (await rows(db, "SELECT version FROM schema_version"))[0][0] == SCHEMA_VERSION
    assert [r[0] for r in await rows(db, 'SELECT "identifier" FROM accounts '
                                         "ORDER BY 1")] == ["alice", "bob", TEST_USER]
    logs = [r.log_path.read_text() for r in site.replicas]
    assert sum("database schema brought from version 0" in log for log in logs) == 1
    assert sum("created the admin account" in log for log in logs) == 1
    assert not any("Traceback" in log for log in logs), logs


async def test_a_chat_through_the_proxy_is_there_on_either_replica_and_not_for_others(site):
    alice = client(site, 0)
    await alice.connect()
    first = await alice.send("Hello, who are you?")
    second = await alice.send("And what can you do?")
    assert first.shown and second.shown
    await alice.close()
    chats = {}
    for replica in (0, 1):  # a reload served by either replica
        reader = client(site, replica)
        listed = await threads(None, reader)
        assert len(listed) == 1
        steps = await thread_steps(reader, listed[0]["id"])
        chats[replica] = [s["output"] for s in steps if s["type"].endswith("_message")]
    assert chats[0] == chats[1]
    assert chats[0][:1] == ["Hello, who are you?"] and "And what can you do?" in chats[0]
    chat_id = listed[0]["id"]
    # Its turns reached one model server, each with the chat's id as the session key.
    assert sum(requests_of(site, chat_id).values()) == 2
    assert len(requests_of(site, chat_id)) == 1
    bob = client(site, 1, user="bob")
    assert await threads(None, bob) == []
    async with bob.api() as http:
        assert (await http.get(f"/project/thread/{chat_id}")).status_code in (401, 404)
    # Another user sending alice's socket session id (as a reconnecting page would) gets
    # a chat of his own: hers is found by session id only for her.
    add_user(site.replicas[1], "mallory", "mallory's password")
    mallory = client(site, 1, user="mallory")
    mallory.session_id = alice.session_id
    await mallory.connect()
    assert (await mallory.send("What did I say before?")).shown
    await mallory.close()
    assert f"chat {chat_id} taken over" not in site.replicas[1].log()
    [own] = await threads(None, mallory)
    assert own["id"] != chat_id
    assert [s["output"] for s in await thread_steps(mallory, own["id"])
            if s["type"] == "user_message"] == ["What did I say before?"]


async def test_each_chat_stays_on_one_model_server_which_caches_its_history(site):
    await chats_kept_on_one_server(site, lambda n: client(site, n % 2))


async def chats_kept_on_one_server(site, client_for) -> None:
    """Chats (of `client_for(n)`) until both servers have one: every chat's turns on one
    server, and its second turn found its first turn's prompt in that server's prefix
    cache. (Also tests/test_router.py's, behind vLLM Router.)"""
    used = set()
    for n in range(12):
        c = client_for(n)
        await c.connect()
        await c.send(LONG_FIRST)
        chat_id = (await threads(None, c))[0]["id"]
        server = next(iter(requests_of(site, chat_id)))
        hits = await prefix_hits(site, server)
        await c.send("Thanks. One more thing?")
        await c.send("And a last one?")
        await c.close()
        assert requests_of(site, chat_id) == {server: 3}, "a chat's turns on one server"
        assert await prefix_hits(site, server) > hits, "its history came from the cache"
        used.add(server)
        if used == {0, 1}:
            break
    assert used == {0, 1}, "the router spread chats over both servers"


async def test_the_api_passes_the_callers_session_key_on_and_refuses_a_bad_one(site):
    async with httpx.AsyncClient(base_url=site.url, timeout=120, headers={
            "Authorization": f"Bearer {OPERATOR_KEY}"}) as http:
        body = {"model": "Latency-first", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(2):
            ok = await http.post("/v1/chat/completions", json=body,
                                 headers={"X-Session-Id": "script-42"})
            assert ok.status_code == 200, ok.text
        bad = await http.post("/v1/chat/completions", json=body,
                              headers={"X-Session-Id": "has spaces"})
    assert sum(requests_of(site, "script-42").values()) == 2
    assert len(requests_of(site, "script-42")) == 1
    assert bad.status_code == 400 and "X-Session-Id" in bad.json()["error"]["message"]


async def test_first_logins_slow_downs_and_quotas_hold_across_replicas(site, db):
    """State in the database, not in one process: first logins of one account on both
    replicas at once make one user; failed logins counted by both; a quota spent on one
    replica refuses on the other."""
    add_user(site.replicas[0], "crowd", "crowd's password")
    crowd = [client(site, n % 2, user="crowd") for n in range(12)]
    await asyncio.gather(*(c.connect() for c in crowd))
    await asyncio.gather(*(c.close() for c in crowd))
    assert len(await rows(db, "SELECT 1 FROM users WHERE \"identifier\" = 'crowd'")) == 1

    async with httpx.AsyncClient(base_url=site.url, timeout=60) as http:
        for n in range(3):  # three names, one address, two replicas
            r = await http.post("/login", cookies=site.pin(n % 2),
                                data={"username": f"guess-{n}", "password": "Winter2026!"})
            assert r.status_code == 401
        started = time.monotonic()
        r = await http.post("/login", cookies=site.pin(1),
                            data={"username": "bob", "password": "bob's password"})
        waited = time.monotonic() - started
    assert r.status_code == 200
    assert waited >= failure_delay(3) - 0.5, "the other replica's failures counted here"

    assert "at most 1 tokens a day" in store_command(site.replicas[1], "users", "quota",
                                                     "bob", "1")
    try:
        stored = len(await stored_turns(db, "bob"))
        spender = client(site, 0, user="bob")
        await spender.connect()
        assert (await spender.send("Spend my tokens.")).shown
        await spender.close()
        # The replica writes what turns cost within a second.
        assert len(await until(lambda: stored_turns(db, "bob"),
                               lambda done: len(done) > stored)) > stored, "never stored"
        other = client(site, 1, user="bob")
        await other.connect()
        start = len(other.events)
        await other.emit_message("Over my quota?")
        at = await other.wait_for("toast", since=start, timeout=30)
        assert "quota" in other.events[at].data["message"]
        await other.close()
    finally:
        store_command(site.replicas[1], "users", "quota", "bob", "none")


async def stored_turns(db, who: str) -> list:
    """The account's turns whose cost is written (not the pending rows of turns running)."""
    return await rows(db, 'SELECT 1 FROM usage WHERE "identifier" = :i AND NOT "pending"',
                      i=who)


async def turns_of(db, chat_id: str, count: int) -> list:
    """The chat's finished turns' token counts, as stored, once `count` of them are (each
    replica writes its turns' costs within a second)."""
    async def finished() -> list:
        used = await rows(db, 'SELECT "promptTokens", "replyTokens", "stopped" FROM usage '
                              'WHERE "threadId" = :t ORDER BY "createdAt"', t=chat_id)
        return [u for u in used if not u.stopped]

    return await until(finished, lambda done: len(done) >= count)


async def test_in_a_browser_the_page_of_a_killed_replica_goes_on_with_its_chat(site, db):
    """Chainlit's own page, in headless Chromium, through the proxy: its replica is killed
    between two turns; the page reconnects through the proxy to the other replica, and the
    next turn there has the whole chat. Then the replica is started again and serves."""
    from tests.e2e.conftest import (CHROMIUM, CHROMIUM_ARGS, USER, Visit, log_in, send,
                                    watch_reply)
    from playwright.async_api import async_playwright

    add_user(site.replicas[0], "erin", "erin's password")
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = await browser.new_context()
        await context.add_cookies([{"name": name, "value": value, "url": site.url}
                                   for name, value in site.pin(1).items()])
        page = await context.new_page()
        visit = Visit(page, site.url)
        await log_in(visit, "erin", "erin's password")
        assert (await watch_reply(visit, await send(visit, "Hello from the browser.")))[-1]
        chat_id = (await rows(db, """SELECT "id" FROM threads WHERE "userIdentifier" = 'erin'"""
                              ))[0][0]
        os.killpg(site.replicas[1].proc.pid, signal.SIGKILL)
        site.replicas[1].proc.wait()
        # Socket.IO's own reconnect, through the proxy. The page carries the chat's id
        # once it has moved to /thread/ID after the first reply, so Chainlit resumes it
        # there (a client that never does is taken over: the next test).
        deadline = time.monotonic() + 60
        while f"chat {chat_id} resumed with 1 turns" not in site.replicas[0].log():
            assert time.monotonic() < deadline, "the page did not reconnect to the other"
            await asyncio.sleep(0.5)
        await page.wait_for_selector("#chat-input:not([disabled])", timeout=30_000)
        assert (await watch_reply(visit, await send(visit, "Tell me more.")))[-1]
        assert await page.locator(USER).count() == 2, "the page kept the first turn"
        await browser.close()
    first, second = await turns_of(db, chat_id, 2)
    assert second.promptTokens > first.promptTokens + first.replyTokens
    await site.restart_replica(1)
    again = client(site, 1, user="erin")
    await again.connect()
    assert (await again.send("Back?")).shown, "the restarted replica serves"
    await again.close()


async def test_a_replica_killed_mid_reply_its_page_goes_on_with_the_chat_on_the_other(site, db):
    add_user(site.replicas[0], "carol", "carol's password")
    carol = client(site, 0, user="carol", profile="Throughput-first")
    await carol.connect()
    await carol.settings(**GREEDY)
    first = await carol.send("Hello there.")
    assert first.shown
    chat_id = (await threads(None, carol))[0]["id"]
    # Its cost stored before the kill: a replica writes costs once a second, and a kill
    # within that second loses them (the README says so), which is not what this tests.
    assert len(await turns_of(db, chat_id, 1)) == 1
    await carol.settings(max_tokens=2000)
    start = len(carol.events)
    await carol.emit_message("Write a very long story about a lighthouse, in many chapters.")
    await carol.wait_for("stream_token", since=start, timeout=120)
    os.killpg(site.replicas[0].proc.pid, signal.SIGKILL)  # the replica holding the socket
    site.replicas[0].proc.wait()
    await carol.reconnect()  # the page's socket comes back through the proxy
    note = await carol.wait_for_note("went away", since=start, timeout=60)
    assert note == CUT_OFF
    third = await carol.send("Just say hi again.")
    assert third.shown, third.notes
    assert (await threads(None, carol))[0]["id"] == chat_id
    steps = [s["output"] for s in await thread_steps(carol, chat_id)
             if s["type"] == "user_message"]
    assert steps[0] == "Hello there." and steps[-1] == "Just say hi again."
    assert "taken over by this process with 1 turns" in site.replicas[1].log()
    # The next turn had the whole history: its prompt holds the first turn's.
    first, third = await turns_of(db, chat_id, 2)
    assert third.promptTokens > first.promptTokens + first.replyTokens
    await carol.close()


async def test_a_model_server_killed_mid_reply_moves_its_chats_to_the_other(site):
    add_user(site.replicas[1], "dave", "dave's password")
    await killed_mid_reply_then_moved(site, client(site, 1, user="dave",
                                                   profile="Throughput-first"))


async def killed_mid_reply_then_moved(site, dave: ChatClient) -> None:
    """dave's chat: its model server killed while it writes a long reply; the reply ends
    saying so, and the chat's next turn goes to the other server. (Also
    tests/test_router.py's, behind vLLM Router.)"""
    await dave.connect()
    await dave.settings(**GREEDY)
    await dave.send("Hello.")
    chat_id = (await threads(None, dave))[0]["id"]
    [server] = requests_of(site, chat_id)
    await dave.settings(max_tokens=2000)
    start = len(dave.events)
    await dave.emit_message("Write a very long story about a harbour, in many chapters.")
    await dave.wait_for("stream_token", since=start, timeout=120)
    os.killpg(site.models[server].proc.pid, signal.SIGKILL)
    site.models[server].proc.wait()
    end = await dave.wait_for("task_end", since=start, timeout=120)
    assert BROKEN_OFF in dave.collect(start, end + 1).notes
    await dave.settings(max_tokens=24)
    again = await dave.send("Please say hello again.")
    assert again.shown, again.notes
    assert requests_of(site, chat_id).get(1 - server) == 1, "its next turn on the other"
    await dave.close()
