"""What a trial at work needs of stored chats (issue 29), through the real server (`chainlit
run app.py`, the labelled stand-in engine: the model does not matter here) on SQLite and on
PostgreSQL: thumbs with comments changed, withdrawn and kept across a restart; the sidebar's
search; export of one's own chats and the admin's export; usage per user and profile; and a
daily token quota for the chat and the API alike, kept across a restart."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import date, timedelta

import httpx
import pytest

from store import export
from tests.test_accounts import (STAND_IN, add_user, database_env, store_command, store_run,
                                 thread_steps, threads)
from tests.test_invites import join, link_token
from tools.chainlit_client import TEST_PASSWORD, TEST_USER, ChatClient, Server, serving
from tools.polling import until

ALICE, BOB, CAROL = ("alice", "alice's password"), ("bob", "bob's password"), \
    ("carol", "carol's password")


@dataclass
class Site:
    server: Server
    db: str

    async def restart(self) -> None:
        """The same database under a new server process."""
        env = dict(self.server.env)
        self.server.stop()
        self.server = Server(env)
        await self.server.wait_ready(timeout=120)


def client(site: Site, who: tuple[str, str]) -> ChatClient:
    return ChatClient(site.server.url, "Latency-first", user=who[0], password=who[1])


async def usage_of(site: Site, who: str, done) -> dict:
    """`store usage --json`'s lines for `who` by profile, once `done(lines)` holds (a turn's
    row is written as it ends, without holding it up)."""
    return await until(lambda: {
        line["profile"]: line for line in json.loads(store_command(site.server, "usage",
                                                                   "--json"))
        if line["identifier"] == who}, done)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
async def site(request, tmp_path_factory):
    env = {**STAND_IN, "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD,
           "VCHAT_DATA_DIR": str(tmp_path_factory.mktemp(f"trials-{request.param}"))}
    with database_env(request.param) as database:
        env.update(database)
        async with serving(env, timeout=120) as server:
            for name, password in (ALICE, BOB, CAROL):
                add_user(server, name, password)
            holder = Site(server, request.param)
            yield holder
            holder.server.stop()


async def chat(site: Site, who, *messages: str, max_tokens: int = 8) -> tuple[ChatClient, str]:
    """A new chat of `who` with these messages answered; the client (connected) and the
    chat's id."""
    c = client(site, who)
    await c.connect()
    await c.settings(max_tokens=max_tokens, show_stats=False)
    for text in messages:
        await c.send(text)
    return c, (await threads(site.server, c))[0]["id"]  # newest activity first


async def rate(c: ChatClient, reply_id: str, value: int, comment: str | None = None,
               feedback_id: str | None = None) -> httpx.Response:
    async with c.api() as http:
        return await http.put("/feedback", json={"sessionId": c.session_id, "feedback": {
            "forId": reply_id, "value": value, "comment": comment,
            **({"id": feedback_id} if feedback_id else {})}})


def replies(steps: list[dict]) -> list[dict]:
    """The model's replies (not the app's notices, such as the stand-in's)."""
    return [s for s in steps if s["type"] == "assistant_message"
            and "output_tokens" in (s.get("metadata") or {})]


# -- feedback, search ---------------------------------------------------------------------


async def test_thumbs_are_changed_withdrawn_and_kept_across_a_restart_with_the_quota(site):
    """A reply's thumbs and comment, changed (the same feedback), withdrawn and given again;
    after a restart the stored ones are there, and carol's quota (counted from stored
    turns) still refuses her, in the chat and the API, with nothing of the refused turn
    stored."""
    alice, thread = await chat(site, ALICE, "Tell me about otters.")
    reply = replies(await thread_steps(alice, thread))[0]
    first = await rate(alice, reply["id"], 1, "clear answer")
    assert first.status_code == 200, first.text
    fid = first.json()["feedbackId"]
    changed = await rate(alice, reply["id"], 0, "on second thought, wrong", feedback_id=fid)
    assert changed.status_code == 200 and changed.json()["feedbackId"] == fid
    assert replies(await thread_steps(alice, thread))[0]["feedback"] == {
        "id": fid, "forId": reply["id"], "value": 0, "comment": "on second thought, wrong"}
    async with alice.api() as http:
        withdrawn = await http.request("DELETE", "/feedback", json={"feedbackId": fid})
    assert withdrawn.status_code == 200
    assert replies(await thread_steps(alice, thread))[0]["feedback"] is None
    again = await rate(alice, reply["id"], 1, "kept")
    assert again.status_code == 200

    # carol may spend 1 token a day: her first turn goes (nothing spent yet), then no more.
    assert "at most 1 tokens a day" in store_command(site.server, "users", "quota", "carol", "1")
    carol, carol_thread = await chat(site, CAROL, "One question only.")
    await usage_of(site, "carol", lambda lines: lines.get("Latency-first", {}).get("turns"))
    stored = len(await thread_steps(carol, carol_thread))
    refused = await refused_turn(carol)
    assert "today's 1 tokens" in refused
    key = store_command(site.server, "keys", "add", "carol").strip().splitlines()[-1]
    assert (await api_turn(site, key)).status_code == 429
    # An account called "operator" (the name the operator key's turns are logged under)
    # is still an account: its quota holds.
    add_user(site.server, "operator", "the operator account's password")
    store_command(site.server, "users", "quota", "operator", "1")
    named = store_command(site.server, "keys", "add", "operator").strip().splitlines()[-1]
    assert (await api_turn(site, named)).status_code == 200
    await usage_of(site, "operator", lambda lines: lines)
    assert (await api_turn(site, named)).status_code == 429
    await alice.close()
    await carol.close()

    await site.restart()
    alice, carol = client(site, ALICE), client(site, CAROL)
    assert replies(await thread_steps(alice, thread))[0]["feedback"]["comment"] == "kept"
    await carol.connect(resume=carol_thread)
    assert "today's 1 tokens" in await refused_turn(carol)
    (button,) = carol.actions(replies(await thread_steps(carol, carol_thread))[-1]["id"])
    start = len(carol.events)  # Regenerate: refused too (429, told), the reply kept
    async with carol.api() as http:
        pressed = await http.post("/project/action", json={"sessionId": carol.session_id,
                                                            "action": button})
    assert pressed.status_code == 429 and "today's 1 tokens" in pressed.text
    toast = await carol.wait_for("toast", since=start, timeout=30)
    assert "today's 1 tokens" in carol.events[toast].data["message"]
    after = await thread_steps(carol, carol_thread)
    assert len(after) == stored  # the refused messages are nowhere, the reply still there
    refusal = await api_turn(site, key)
    assert refusal.status_code == 429 and refusal.json()["error"]["code"] == "quota_exceeded"
    store_command(site.server, "users", "quota", "carol", "none")
    answered = await carol.send("And now?")
    assert answered.tokens
    assert (await api_turn(site, key)).status_code == 200
    await carol.close()


async def test_ratings_sent_at_once_make_one_feedback_shown_exported_and_counted_once(site):
    """Regression (issue 52): six PUT /feedback at once on one's own reply, without a
    feedback id, made six rows: the chat as served held the reply once per row, the JSON
    export had 7 messages for 2 ids, `store usage` counted 6 thumbs down. Ten at once (no
    id, the id of the chat's other feedback, an unknown one) make the reply's one feedback;
    each answer names it, the other reply's feedback is left as it was, and the served
    chat, the export, `store usage` and `store feedback` each have every reply once."""
    add_user(site.server, "dana", "dana's password")
    dana, thread = await chat(site, ("dana", "dana's password"), "One.", "Two.")
    first, second = replies(await thread_steps(dana, thread))
    kept = (await rate(dana, first["id"], 1, "kept")).json()["feedbackId"]
    ids = [None, kept, str(uuid.uuid4())]
    async with dana.api() as http:
        answers = await asyncio.gather(*[http.put("/feedback", json={
            "sessionId": dana.session_id, "feedback": {
                "forId": second["id"], "value": 0, "comment": f"try {n}",
                **({"id": ids[n % 3]} if ids[n % 3] else {})}}) for n in range(10)])
        one = await http.get(f"/export/chats/{thread}")
    assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers]
    rated = {r.json()["feedbackId"] for r in answers}
    assert len(rated) == 1 and kept not in rated, rated
    steps = await thread_steps(dana, thread)
    assert len({s["id"] for s in steps}) == len(steps), "each step served once"
    assert [r["feedback"]["id"] for r in replies(steps)] == [kept, *rated]
    assert replies(steps)[0]["feedback"]["comment"] == "kept"
    (exported,) = export.read(one.content)
    assert sorted(m.id for m in exported.messages) == sorted(
        s["id"] for s in steps if s["type"] in export.ROLES), "each message exported once"
    lines = await usage_of(site, "dana", lambda lines: lines.get("Latency-first", {}).get(
        "thumbs_down"))
    assert (lines["Latency-first"]["thumbs_up"], lines["Latency-first"]["thumbs_down"]) == \
        (1, 1)
    said = [line.split("\t") for line in store_command(site.server, "feedback").splitlines()]
    assert sorted(r[3] for r in said if r[1] == "dana") == ["down", "up"]
    await dana.close()


async def refused_turn(c: ChatClient) -> str:
    """Send a message that the quota refuses: the toast's words (and no turn ran)."""
    start = len(c.events)
    await c.emit_message("Over my quota?")
    at = await c.wait_for("toast", since=start, timeout=30)
    assert not [e for e in c.events[start:] if e.name in ("stream_start", "task_start")]
    return c.events[at].data["message"]


async def api_turn(site: Site, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=site.server.url, timeout=60) as http:
        return await http.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
            "model": "Latency-first", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]})


async def test_messages_sent_at_once_get_no_more_turns_than_the_quota_holds(site):
    """Issue 52: the quota counted only turns that had ended, so messages sent at the same
    moment from several pages all ran past it. Each admitted turn now holds its reply's
    room (the settings' max tokens) from the moment it is admitted: with room for 3 such
    turns left, 3 of 8 sent at once run and 5 are told why, on either database."""
    erin = ("erin", "erin's password")
    add_user(site.server, *erin)
    store_command(site.server, "users", "quota", "erin", str(3 * 8 - 1))
    pages = [client(site, erin) for _ in range(8)]
    await asyncio.gather(*[p.connect() for p in pages])
    for page in pages:
        await page.settings(max_tokens=8, show_stats=False)
    starts = [len(p.events) for p in pages]
    await asyncio.gather(*[p.emit_message("One of many at once.") for p in pages])
    outcomes = await asyncio.gather(*[p.refusal_since(s) for p, s in zip(pages, starts)])
    assert outcomes.count(None) == 3, outcomes
    assert all("today's 23 tokens" in o for o in outcomes if o is not None)
    await asyncio.gather(*[p.close() for p in pages])


async def test_a_guest_starting_chats_at_once_gets_its_cap_on_either_database(site):
    """Issue 52's guest chat cap through the server on both databases (tests/test_invites.py
    has the rest of a guest's limits): 7 first messages of new chats at once from 7 pages
    of a guest who may keep 5 (the default): 5 run, 2 are told why."""
    token = link_token(store_command(site.server, "invites", "add", "--uses", "1",
                                     "--expires", "1h"))
    joined = await join(site.server, token, "Seven pages")
    pages = [ChatClient(site.server.url, "Latency-first") for _ in range(7)]
    await asyncio.gather(*[p.connect_with(joined.cookies["access_token"]) for p in pages])
    starts = [len(p.events) for p in pages]
    await asyncio.gather(*[p.emit_message(f"new chat {n}") for n, p in enumerate(pages)])
    outcomes = await asyncio.gather(*[p.refusal_since(s) for p, s in zip(pages, starts)])
    assert outcomes.count(None) == 5, outcomes
    assert all("5 chats at most" in o for o in outcomes if o is not None)
    await asyncio.gather(*[p.close() for p in pages])


async def test_search_finds_the_users_own_chats_by_their_words_and_no_one_elses(site):
    word = f"marmalade{uuid.uuid4().hex[:6]}"
    alice, with_word = await chat(site, ALICE, f"My cat is called {word}.")
    await alice.new_chat()
    await alice.send("Something else entirely.")
    bob, bobs = await chat(site, BOB, f"I like {word.upper()} too.")

    async def search(c: ChatClient, words: str) -> set[str]:
        async with c.api() as http:
            r = await http.post("/project/threads", json={
                "pagination": {"first": 20}, "filter": {"search": words}})
        assert r.status_code == 200, r.text
        return {t["id"] for t in r.json()["data"]}

    assert await search(alice, word) == {with_word}
    assert await search(alice, word[:-2].upper()) == {with_word}  # any case, part of a word
    assert await search(bob, word) == {bobs}
    assert await search(alice, "no such words anywhere") == set()
    assert len(await threads(site.server, alice)) >= 2  # the search narrowed the list
    await alice.close()
    await bob.close()


# -- export -------------------------------------------------------------------------------


async def test_a_user_exports_their_own_chats_as_json_and_markdown_and_no_one_elses(site):
    alice, thread = await chat(site, ALICE, "First question.", "Second question.")
    steps = await thread_steps(alice, thread)
    assert (await rate(alice, replies(steps)[-1]["id"], 1, "useful")).status_code == 200
    async with alice.api() as http:
        one = await http.get(f"/export/chats/{thread}", params={"format": "json"})
        every = await http.get("/export/chats")
        markdown = await http.get(f"/export/chats/{thread}", params={"format": "md"})
        wrong = await http.get(f"/export/chats/{thread}", params={"format": "xml"})
    assert one.status_code == 200 and "attachment" in one.headers["content-disposition"]
    (exported,) = export.read(one.content)
    assert exported.id == thread and exported.owner == "alice"
    assert exported.profile == "Latency-first"
    shown = [s for s in steps if s["type"] in export.ROLES]
    assert [(m.id, m.text) for m in exported.messages] == [(s["id"], s["output"]) for s in shown]
    assert [m.text for m in exported.messages if m.role == "user"] == [
        "First question.", "Second question."]
    assert exported.messages[-1].feedback == {"thumbs": "up", "comment": "useful"}
    assert exported.messages[-1].profile == "Latency-first"
    assert thread in {c.id for c in export.read(every.content)}
    assert {c.owner for c in export.read(every.content)} == {"alice"}
    assert markdown.status_code == 200 and "Second question." in markdown.text
    assert "thumbs up: useful" in markdown.text
    assert wrong.status_code == 400

    bob = client(site, BOB)
    async with bob.api() as http:
        answers = [await http.get(f"/export/chats/{tid}") for tid in
                   (thread, str(uuid.uuid4()), "not-a-chat-id", "' OR 1=1 --")]
        bobs_all = export.read((await http.get("/export/chats")).content)
    assert {a.status_code for a in answers} == {404}
    assert len({a.text for a in answers}) == 1  # another's chat looks like no chat at all
    assert thread not in {c.id for c in bobs_all}
    async with httpx.AsyncClient(base_url=site.server.url) as anonymous:
        assert (await anonymous.get("/export/chats")).status_code == 401
    await alice.close()


FORGED = ("## Assistant (2026-01-01T00:00:00; Latency-first)\n"
          "I am not what I seem. <script>alert(1)</script> <img src=x onerror=alert(2)>\n"
          "A heading by underline\n===\n"
          "```python\n# code stays as written: a < b & c\n```\n"
          "~~~\n<b>a code block left open</b>")


def markdown_structure(markdown: str) -> tuple[list[str], list[str], list[str]]:
    """A CommonMark reader's view of a Markdown export: its headings' texts, its raw HTML
    and its code blocks' contents."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(markdown)
    headings = ["".join(c.content for c in tokens[n + 1].children)
                for n, t in enumerate(tokens) if t.type == "heading_open"]
    html = [t.content for t in tokens if t.type == "html_block"] + [
        c.content for t in tokens for c in t.children or [] if c.type == "html_inline"]
    return headings, html, [t.content for t in tokens if t.type in ("fence", "code_block")]


async def test_a_messages_text_cannot_forge_the_markdown_exports_headings_or_html(site):
    """Regression (issue 52): the Markdown export pasted a message's text as it was: a line
    "## Assistant (...)" read as the export's own heading, and raw HTML (a script) was kept,
    in a file served without `nosniff`. Now a reader sees only the export's headings (the
    chat's, one per message) and no HTML, code blocks stay as written (one left open is
    closed with its message), the JSON export keeps the text exactly, and both downloads
    say `nosniff`."""
    alice, thread = await chat(site, ALICE, FORGED)
    async with alice.api() as http:
        markdown, one = await asyncio.gather(
            http.get(f"/export/chats/{thread}", params={"format": "md"}),
            http.get(f"/export/chats/{thread}", params={"format": "json"}))
    assert markdown.status_code == one.status_code == 200
    for download in (markdown, one):
        assert download.headers["x-content-type-options"] == "nosniff"
    (exported,) = export.read(one.content)
    assert [m.text for m in exported.messages if m.role == "user"] == [FORGED]
    headings, html, code = markdown_structure(markdown.text)
    assert len(headings) == 1 + len(exported.messages)
    assert [h.split(" (")[0] for h in headings[1:]] == [
        "You" if m.role == "user" else "Assistant" for m in exported.messages]
    assert html == [], html
    assert code == ["# code stays as written: a < b & c\n", "<b>a code block left open</b>\n"]
    assert "<script>" not in markdown.text and "&lt;script>" in markdown.text
    await alice.close()


def test_the_markdown_exports_own_text_is_escaped_too():
    """A chat's name, owner, profile and a feedback comment are the export's headings and
    notes: no HTML and no line breaks of theirs reach them."""
    message = export.ExportedMessage("m", "assistant", "fine", "t", "p", False,
                                     {"thumbs": "up", "comment": "<i>x</i>\n## You"})
    markdown = export.as_markdown([export.ExportedChat(
        "c", "<script>x</script>\n# Owned", "<b>o</b>", "t", "<p>", [message])])
    headings, html, _ = markdown_structure(markdown)
    assert html == [] and len(headings) == 2, (headings, html)
    assert headings[0] == "<script>x</script> # Owned"  # shown as text


async def test_the_admin_exports_every_chat_of_a_period(site, tmp_path):
    alice, thread = await chat(site, ALICE, "For the admin's export.")
    today = date.today()
    everything = export.read(store_command(site.server, "export", "--since", today.isoformat(),
                                      "--until", today.isoformat()))
    assert thread in {c.id for c in everything}
    assert {"alice"} <= {c.owner for c in everything}
    only = export.read(store_command(site.server, "export", "--user", "bob"))
    assert only == [] or {c.owner for c in only} == {"bob"}
    later = (today + timedelta(days=2)).isoformat()
    assert export.read(store_command(site.server, "export", "--since", later)) == []
    out = tmp_path / "all.md"
    assert "chat(s) written" in store_command(site.server, "export", "--format", "md", "--out", str(out))
    assert "For the admin's export." in out.read_text()
    for bad in (["--since", "2026-13-40"], ["--since", "yesterday"],
                ["--since", later, "--until", today.isoformat()]):
        done = store_run(site.server, "export", *bad)
        assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr
        assert "Traceback" not in done.stderr
    with pytest.raises(export.ExportError):
        export.read(json.dumps({"format": "something else"}))
    await alice.close()


# -- usage ----------------------------------------------------------------------------


async def test_usage_counts_turns_tokens_stopped_replies_and_thumbs_by_profile(site):
    def turns(lines: dict) -> int:
        return lines.get("Latency-first", {}).get("turns", 0)

    earlier = turns(await usage_of(site, "bob", lambda lines: True))
    bob, thread = await chat(site, BOB, "Count me.", "And me.")
    steps = await thread_steps(bob, thread)
    meta = [r["metadata"] for r in replies(steps)]
    assert (await rate(bob, replies(steps)[0]["id"], 0, "meh")).status_code == 200
    # The page's thumbs rate the turn's run, the step around its reply (as a browser does).
    run = next(s for s in steps if s["id"] == replies(steps)[1]["parentId"])
    assert run["type"] == "run" and (await rate(bob, run["id"], 1)).status_code == 200
    # Each turn's cost is written within FLUSH_S of its end: read once both turns' are in
    # (read before then, the stopped reply's count below took theirs in: seen in a run).
    before = (await usage_of(site, "bob", lambda lines: turns(lines) >= earlier + 2)
              ).get("Latency-first", {})

    # A long reply stopped after its first pieces: counted as stopped, its text's tokens.
    # The profile's longest (5 s at the stand-in's 200 tokens a second): with 400 a Stop
    # sent on a loaded machine came after the reply's end (a CI run).
    start = len(bob.events)
    await bob.settings(max_tokens=1024)
    await bob.emit_message("Write at length.")
    await bob.wait_for("stream_token", since=start, timeout=60)
    await bob.stop()
    await bob.wait_for("task_end", since=start, timeout=60)

    lines = await usage_of(site, "bob", lambda lines: lines.get("Latency-first", {}).get(
        "stopped", 0) > before.get("stopped", 0))
    line = lines["Latency-first"]
    assert line["stopped"] == before.get("stopped", 0) + 1
    assert line["turns"] == before.get("turns", 0) + 1
    assert 0 < line["reply_tokens"] - before["reply_tokens"] <= 1024  # at most its room
    assert before["prompt_tokens"] >= sum(m["prompt_tokens"] for m in meta)
    assert before["reply_tokens"] >= sum(m["output_tokens"] for m in meta)
    assert line["thumbs_down"] >= 1 and line["thumbs_up"] >= 1
    assert "?" not in lines  # each thumb counted under its reply's profile
    said = [line.split("\t") for line in store_command(site.server, "feedback").splitlines()]
    assert ["bob", "Latency-first", "down", f"chat {thread}", "meh"] in [r[1:] for r in said]
    assert ["bob", "Latency-first", "up", f"chat {thread}"] in [r[1:] for r in said]
    table = store_command(site.server, "usage", "--since", date.today().isoformat())
    assert "bob" in table and "Latency-first" in table and "prompt tokens" in table
    assert "no turns" in store_command(site.server, "usage", "--since",
                                  (date.today() + timedelta(days=1)).isoformat())
    for bad in (["usage", "--since", "12/01/2026"], ["users", "quota", "bob", "-1"],
                ["users", "quota", "bob", "lots"], ["users", "quota", "nobody", "10"]):
        done = store_run(site.server, *bad)
        assert done.returncode == 1 and done.stderr.startswith("error: "), (bad, done.stderr)
    await bob.close()
