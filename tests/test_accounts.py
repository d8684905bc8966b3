"""Login and stored chats on the real server (`chainlit run app.py`, the labelled stand-in
engine: the model does not matter here), over Chainlit's real HTTP API and socket, with
the real SQLite database in the server's data folder."""

import asyncio
import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import time

import chainlit as cl
import httpx
import pytest

from store.accounts import failure_delay
from tools.chainlit_client import ROOT, TEST_PASSWORD, TEST_USER, ChatClient, Server, serving
from tools.postgres import Postgres, binaries

STAND_IN = {"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": "200"}


def store_run(server: Server, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`python -m store ARGS` on the server's database (its environment: its data folder,
    or its DATABASE_URL)."""
    return subprocess.run([sys.executable, "-m", "store", *args], input=stdin,
                          env=dict(server.env), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def store_command(server: Server, *args: str, stdin: str = "") -> str:
    """What `python -m store ARGS` printed, once it succeeded."""
    done = store_run(server, *args, stdin=stdin)
    assert done.returncode == 0, done.stderr
    return done.stdout


def add_user(server: Server, name: str, password: str) -> None:
    store_command(server, "users", "add", name, "--stdin", stdin=password + "\n")


@contextlib.contextmanager
def database_env(kind: str):
    """The environment that puts the app on `kind`'s database: {} for "sqlite" (the data
    folder's), DATABASE_URL of a new database on a throwaway server for "postgres". Skips
    the test when no server is installed here, unless one is required
    (VCHAT_REQUIRE_POSTGRES, as .ci/run sets it: then it fails)."""
    if kind == "sqlite":
        yield {}
        return
    if binaries() is None and not os.environ.get("VCHAT_REQUIRE_POSTGRES"):
        pytest.skip("no PostgreSQL server installed here (Debian: postgresql)")
    with Postgres() as server:
        yield {"DATABASE_URL": server.new_database()}


async def threads(server: Server, client: ChatClient) -> list[dict]:
    async with client.api() as http:
        r = await http.post("/project/threads",
                            json={"pagination": {"first": 20}, "filter": {}})
    assert r.status_code == 200, r.text
    return r.json()["data"]


async def thread_steps(client: ChatClient, thread_id: str) -> list[dict]:
    async with client.api() as http:
        return (await http.get(f"/project/thread/{thread_id}")).json()["steps"]


@pytest.fixture(scope="module")
async def server():
    async with serving(STAND_IN, timeout=120) as srv:
        yield srv


async def test_a_wrong_login_is_refused_alike_and_no_socket_without_one(server):
    async with httpx.AsyncClient() as http:
        wrong = await http.post(server.url + "/login",
                                data={"username": TEST_USER, "password": "wrong password"})
        nobody = await http.post(server.url + "/login",
                                 data={"username": "nobody", "password": TEST_PASSWORD})
    assert wrong.status_code == nobody.status_code == 401
    assert wrong.json() == nobody.json(), "the refusal does not say which part was wrong"
    assert "access_token" not in wrong.cookies
    stranger = ChatClient(server.url, "Latency-first")
    with pytest.raises(Exception):
        await stranger.sio.connect(server.url, socketio_path="/ws/socket.io",
                                   transports=["websocket"],
                                   auth={"sessionId": "x", "clientType": "webapp",
                                         "userEnv": "{}", "chatProfile": "Latency-first"})
    assert not stranger.sio.connected


async def test_failures_from_one_address_are_slowed_whatever_names_they_try(server):
    """One password tried on many names (each name failing once) still slows down: the
    4th attempt from the address waits for the 3rd failure's delay, counted from it."""
    async with httpx.AsyncClient(timeout=60) as http:
        for n in range(3):
            r = await http.post(server.url + "/login",
                                data={"username": f"sprayed-{n}", "password": "Spring2026!"})
            assert r.status_code == 401
        started = time.monotonic()
        r = await http.post(server.url + "/login",
                            data={"username": "sprayed-3", "password": "Spring2026!"})
        waited = time.monotonic() - started
    assert r.status_code == 401 and waited >= failure_delay(3) - 0.3
    await ChatClient(server.url, "Latency-first").login()  # a success clears the address


async def test_many_first_logins_of_one_account_at_once_all_get_in(server):
    """Regression: the first logins of one account at once (256 sessions at once)
    raced to create its user in Chainlit's table, and some were refused."""
    add_user(server, "crowd", "a crowd of one")
    crowd = [ChatClient(server.url, "Latency-first", user="crowd", password="a crowd of one")
             for _ in range(32)]
    tokens = await asyncio.gather(*[c.login() for c in crowd], return_exceptions=True)
    assert [t for t in tokens if not isinstance(t, str)] == []
    assert "UNIQUE constraint failed" not in server.log_path.read_text()


async def held(server: Server) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(server.url + "/metrics")).text
    return {what: float(value) for what, value in re.findall(
        r'^vchat_chat_sessions_held\{what="(\w+)"\} (\S+)$', text, re.M)}


async def test_a_chat_left_for_a_new_one_leaves_nothing_in_memory(server):
    """Regression (issue 27): Chainlit 2.12 kept every session's messages after the session
    was gone, so every chat ever opened stayed in the app's memory and in each full garbage
    collection's walk (0.5-1 s stalls on the H200 within minutes of 240 users). Six chats
    opened one after another as the browser's "New chat" opens them: the app holds the
    last one, its messages, and nothing of the five before."""
    before = await held(server)
    client = ChatClient(server.url, "Latency-first")
    await client.connect()
    await client.settings(max_tokens=4, show_stats=False)
    for n in range(6):
        if n:
            await client.new_chat()
        assert (await client.send(f"Chat number {n}.")).tokens
    for _ in range(50):  # a closed session is cleared as its socket's end is handled
        now = await held(server)
        if now["sessions"] <= before["sessions"] + 1:
            break
        await asyncio.sleep(0.1)
    assert now["sessions"] <= before["sessions"] + 1
    assert now["message_lists"] <= now["sessions"], now
    await client.close()


async def test_a_chat_is_stored_listed_for_its_user_only_and_survives_a_restart(tmp_path):
    data = str(tmp_path / "data")
    env = {**STAND_IN, "VCHAT_DATA_DIR": data, "VCHAT_ADMIN_USER": TEST_USER,
           "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
    async with serving(env, timeout=120) as srv:
        add_user(srv, "other", "the other user's password")
        alice = ChatClient(srv.url, "Latency-first")
        await alice.connect()
        await alice.settings(max_tokens=12, show_stats=False)
        reply = await alice.send("Remember the word heliotrope.")
        assert reply.reply["metadata"]["output_tokens"] == 12
        await alice.close()
        mine = await threads(srv, ChatClient(srv.url, "Latency-first"))
        assert len(mine) == 1
        other = ChatClient(srv.url, "Latency-first", user="other",
                           password="the other user's password")
        assert await threads(srv, other) == [], "another user's list is their own"
        async with other.api() as http:
            peek = await http.get(f"/project/thread/{mine[0]['id']}")
            delete = await http.request("DELETE", "/project/thread",
                                        json={"threadId": mine[0]["id"]})
        assert peek.status_code in (401, 403, 404) and delete.status_code in (401, 403, 404)
    async with serving(env, timeout=120) as again:  # the same data folder: a restart
        listed = await threads(again, ChatClient(again.url, "Latency-first"))
        assert [t["id"] for t in listed] == [mine[0]["id"]], "nothing lost in a restart"
        steps = sorted(await thread_steps(ChatClient(again.url, "Latency-first"), mine[0]["id"]),
                       key=lambda step: step["createdAt"])
        said = [(s["type"], s["output"]) for s in steps
                if s["type"] in ("user_message", "assistant_message")]
        # The turn: both messages, in order (the stand-in's label is the page's, not the chat's).
        assert said == [("user_message", "Remember the word heliotrope."),
                        ("assistant_message", reply.reply["output"])]


async def test_without_an_admin_configured_the_first_start_prints_one_password(tmp_path):
    # A data folder of our own: the launcher then sets no admin of its own either.
    base = {k: v for k, v in os.environ.items() if not k.startswith("VCHAT_ADMIN_")}
    async with serving({**STAND_IN, "VCHAT_DATA_DIR": str(tmp_path / "data")}, base,
                       timeout=120) as srv:
        found = re.search(r"log in as 'admin' with the password '([^']+)'", srv.log())
        assert found, srv.log()[-2000:]
        admin = ChatClient(srv.url, "Latency-first", user="admin", password=found.group(1))
        await admin.login()
    async with serving({**STAND_IN, "VCHAT_DATA_DIR": str(tmp_path / "data")}, base,
                       timeout=120) as srv:  # a restart: the account is there, no new one
        assert "log in as" not in srv.log_path.read_text()
        await ChatClient(srv.url, "Latency-first", user="admin",
                         password=found.group(1)).login()
    assert (tmp_path / "data" / "auth-secret").is_file()


async def test_a_resumed_chat_continues_with_the_same_context_after_a_restart(tmp_path):
    """Turn 1 in a chat, the server restarted, the chat resumed, turn 2: the model's prompt
    holds turn 1 exactly as a live chat's would (same token count as turn 2 of a live chat
    with the same turn 1; the stats line shown under replies is not part of it)."""
    env = {**STAND_IN, "VCHAT_DATA_DIR": str(tmp_path / "data"),
           "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
    first, second = "Remember the word heliotrope.", "Which word did I ask you to remember?"

    async def turn(client: ChatClient, text: str) -> dict:
        reply = await client.send(text)
        assert reply.reply is not None, reply.notes
        return reply.reply["metadata"]

    async with serving(env, timeout=120) as srv:
        before = ChatClient(srv.url, "Throughput-first")
        await before.connect()
        await before.settings(max_tokens=12, show_stats=True)
        await turn(before, first)
        await before.close()
        (stored,) = await threads(srv, ChatClient(srv.url, "Throughput-first"))
    async with serving(env, timeout=120) as srv:  # a restart
        resumed = ChatClient(srv.url, "Throughput-first")
        await resumed.connect(resume=stored["id"])
        await resumed.settings(max_tokens=12, show_stats=True)
        steps = sorted(await thread_steps(resumed, stored["id"]), key=lambda s: s["createdAt"])
        first_id = next(s["id"] for s in steps if s["type"] == "user_message")
        last_reply = [s["id"] for s in steps if s["type"] == "assistant_message"][-1]
        await resumed.wait_for("action", since=0, timeout=30)
        assert len(resumed.actions(last_reply)) == 1, "Regenerate, under the resumed reply"
        after_resume = await turn(resumed, second)
        # An edit of the resumed first message: Chainlit holds the resumed messages too, so
        # the prompt is that one edited message, as in a new chat.
        edited = (await resumed.edit(first_id, second)).reply["metadata"]
        live = ChatClient(srv.url, "Throughput-first")
        await live.connect()
        await live.settings(max_tokens=12, show_stats=True)
        await turn(live, first)
        live_second = await turn(live, second)
        fresh = ChatClient(srv.url, "Throughput-first")
        await fresh.connect()
        await fresh.settings(max_tokens=12, show_stats=True)
        alone = await turn(fresh, second)
        for c in (resumed, live, fresh):
            await c.close()
    assert after_resume["profile"] == "Throughput-first"
    assert after_resume["prompt_tokens"] == live_second["prompt_tokens"]
    assert after_resume["prompt_tokens"] > alone["prompt_tokens"], "turn 1 is in the prompt"
    assert edited["prompt_tokens"] == alone["prompt_tokens"]


async def test_a_reply_cut_off_by_a_closed_browser_is_stored_as_shown(server):
    user = ChatClient(server.url, "Latency-first")
    await user.connect()
    await user.settings(max_tokens=400, show_stats=False)  # 2 s at 200 tokens/s
    start = len(user.events)
    await user.emit_message("Write a very long essay about the sea.")
    first = await user.wait_for("stream_token", since=start)
    await user.wait_for("stream_token", since=first + 1)
    await user.close()  # mid-reply
    for _ in range(100):  # the app ends the turn and stores what was shown
        owner = ChatClient(server.url, "Latency-first")
        (thread, *_) = await threads(server, owner)
        steps = await thread_steps(owner, thread["id"])
        cut = [s for s in steps if (s.get("metadata") or {}).get("stopped")]
        if cut:
            break
        await asyncio.sleep(0.1)
    assert cut, steps
    assert cut[0]["output"].lstrip().startswith("stand-in text")
    assert cut[0]["output"].endswith("*Stopped.*")
    assert any(s["type"] == "user_message" and s["output"].startswith("Write a very long")
               for s in steps)


async def test_a_write_the_database_refuses_is_told_to_the_user(tmp_path):
    env = {**STAND_IN, "VCHAT_DATA_DIR": str(tmp_path / "data"),
           "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
    async with serving(env, timeout=120) as srv:
        user = ChatClient(srv.url, "Latency-first")
        await user.connect()
        await user.settings(max_tokens=8, show_stats=False)
        assert (await user.send("Hello.")).notes == []
        # The database loses the table replies go to (as a full disk or a broken schema
        # would refuse the write): the next reply is shown, and the user is told.
        with sqlite3.connect(tmp_path / "data" / "chat.db") as db:
            db.execute("ALTER TABLE steps RENAME TO steps_gone")
        since = len(user.events)
        reply = await user.send("Hello again.")
        assert reply.reply["metadata"]["output_tokens"] == 8
        # The turn ends without waiting for the database; the note follows its writes.
        await user.wait_for_note("could not be saved", since)
        assert "database statement failed" in srv.log_path.read_text()
        _, health = await srv.ready_state()
        assert health["store"]["failed_writes"] >= 1
        assert "steps" in health["store"]["last_failure"]
        await user.close()


async def test_an_edited_message_replaces_its_turn_and_drops_the_later_ones(server):
    user = ChatClient(server.url, "Throughput-first")
    await user.connect()
    await user.settings(max_tokens=10, show_stats=False)
    await user.send("My name is Ann.")
    first_id = user.last_message_id
    await user.send("What is my name?")
    edited = await user.edit(first_id, "My name is Bob, and I like long names.")
    fresh = ChatClient(server.url, "Throughput-first")
    await fresh.connect()
    await fresh.settings(max_tokens=10, show_stats=False)
    alone = await fresh.send("My name is Bob, and I like long names.")
    # The model's prompt after the edit: the edited text and nothing of the dropped turns,
    # token for token what a new chat with that one message sends.
    assert edited.reply is not None, edited.notes
    assert edited.reply["metadata"]["prompt_tokens"] == alone.reply["metadata"]["prompt_tokens"]
    follow = await user.send("What is my name?")
    first_follow = alone.reply["metadata"]["prompt_tokens"]
    assert follow.reply["metadata"]["prompt_tokens"] > first_follow
    # The stored chat as the page shows it: the edited message, its reply, the follow-up.
    thread_id = next(e.data["thread_id"] for e in user.events if e.name == "first_interaction")
    steps = await thread_steps(user, thread_id)
    said = [s["output"] for s in sorted(steps, key=lambda s: s["createdAt"])
            if s["type"] == "user_message"]
    assert said == ["My name is Bob, and I like long names.", "What is my name?"]
    for c in (user, fresh):
        await c.close()


async def test_the_last_reply_can_be_written_again_and_only_the_last(server):
    user, same = (ChatClient(server.url, "Throughput-first") for _ in range(2))
    for c in (user, same):
        await c.connect()
        await c.settings(max_tokens=10, show_stats=False)
    first = await user.send("Name a colour.")
    second = await user.send("Name another one.")
    old = second.reply["id"]
    assert user.actions(first.reply["id"]) == [], "the button is under the last reply only"
    [button] = user.actions(old)
    # What the page gets is Chainlit's own dict of the action (the app makes it field by
    # field: chat/turns.py's RegenerateButton).
    assert button == cl.Action(**button).to_dict()
    # A button of an older reply (a page left open): refused, the chat unchanged.
    since = await user.press({**button, "forId": first.reply["id"]})
    await user.wait_for_note("Only the last reply can be written again", since)

    start = await user.press(button)
    again = user.collect(start, await user.wait_for("task_end", since=start) + 1)
    assert again.reply is not None and again.reply["id"] != old and again.tokens
    assert any(e.name == "delete_message" and e.data["id"] == old for e in again.events)
    assert again.reply["metadata"]["prompt_tokens"] == second.reply["metadata"]["prompt_tokens"]
    assert user.actions(old) == [] and len(user.actions(again.reply["id"])) == 1
    # The history holds the new reply in place of the old: the next prompt is as long as
    # in a chat where nothing was written again (the stand-in's replies are alike).
    follow = await user.send("And a third?")
    for text in ("Name a colour.", "Name another one."):
        await same.send(text)
    assert follow.reply["metadata"]["prompt_tokens"] == (
        await same.send("And a third?")).reply["metadata"]["prompt_tokens"]
    # The stored chat as the page shows it: the old reply is gone.
    thread_id = next(e.data["thread_id"] for e in user.events if e.name == "first_interaction")
    replies = [s["id"] for s in await thread_steps(user, thread_id)
               if s["type"] == "assistant_message"]
    assert old not in replies and {first.reply["id"], again.reply["id"]} <= set(replies)
    for c in (user, same):
        await c.close()
