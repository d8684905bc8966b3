"""Files attached to messages (service/documents.py, service/extract.py, chat/attachments.py,
store/documents.py): each kind read to its text in a child process, each bad file refused
with its reason; then through the real server (the upload route and the socket, as the
page sends them) on the real engine: the prompt holds the files' text, follow-ups read it
from the prefix cache, a reopened chat shows and keeps them, the export holds them, they go
with the chat, and nobody else reaches them; and the limits, hit at once by many, on a
stand-in server of its own."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from base64 import b64encode
from pathlib import Path

import httpx
import openai
import pytest

from engine import Message
from service.documents import Document, Limits, Reader, Unreadable, with_documents
from store.accounts import Accounts
from store.documents import Documents, StorageFull
from store.schema import connect, database_url, migrate
from tests.test_accounts import add_user, store_command
from tests import test_app
from tests.conftest import API_KEY
from tests.test_app import client
from tests.test_invites import join, link_token
from tools import sample_files as sf
from tools.chainlit_client import ChatClient, serving

formatter = test_app.formatter  # the model's chat format, a fixture
LIMITS = Limits(max_bytes=20 << 20, guest_max_bytes=2 << 20, files=10, chars=1_000_000,
                pages=1000, storage_bytes=0, read_s=30, read_mb=1024)

# One file of each kind the chat reads, each naming its own fruit.
KINDS = {
    "notes.md": ("# Notes\nThe fruit of the day is **papaya**.\n".encode(), "papaya"),
    "plain.txt": ("Grüße: the fruit is lychee.\r\n".encode("utf-16"), "lychee"),
    "script.py": (b"def fruit():\n    return 'quince'\n", "quince"),
    "table.csv": (b"name,fruit\nann,mango\n", "ann,mango"),
    "rows.tsv": (b"name\tfruit\nbob\tguava\n", "bob\tguava"),
    "data.json": (b'{"fruit": "durian"}', '"durian"'),
    "page.html": (b"<html><head><title>Fruit</title><script>var hidden='kiwi';</script>"
                  b"</head><body><p>The fruit is <b>feijoa</b> &amp; more.</p></body></html>",
                  "The fruit is feijoa & more."),
    "report.pdf": (sf.pdf(["Page one: the fruit is rambutan.", "Page two (salak)."]),
                   "[Page 1]\nPage one: the fruit is rambutan.\n\n[Page 2]\nPage two (salak)."),
    "memo.docx": (sf.docx(["The fruit is tamarind."], [["fruit", "cherimoya"]]),
                  "The fruit is tamarind.\nfruit | cherimoya"),
}


@pytest.fixture(scope="module")
def reader():
    return Reader(LIMITS)


@pytest.mark.parametrize("name", list(KINDS))
async def test_each_kind_is_read_to_its_text(reader, name):
    data, expected = KINDS[name]
    document = await reader.read(name, data)
    assert expected in document.text and document.name == name and document.size == len(data)
    if name == "page.html":
        assert "kiwi" not in document.text, "a script is not the page's text"


BAD = {
    "secret.pdf": (sf.encrypted_pdf("hidden"), "encrypted"),
    "broken.pdf": (sf.pdf(["x"])[:200], "could not be read as a PDF"),
    "bomb.pdf": (sf.bomb_pdf(1024), "decompression bomb"),
    "huge.pdf": (sf.many_pages_pdf(10_000), "10,000 pages"),
    "scan.pdf": (sf.many_pages_pdf(2), "no text"),
    "bomb.docx": (sf.zip_bomb_docx(512), "decompression bomb"),
    "broken.docx": (b"PK\x03\x04 not a zip at all", "Word document"),
    "disguised.txt": (bytes(range(256)) * 40, "binary"),
    "latin1.csv": ("naïve,café\n".encode("latin-1"), "not UTF-8"),
    "empty.md": (b"", "empty"),
    "tool.exe": (b"MZ\x90\x00", ".exe files are not read here"),
    "../../etc/passwd.txt": (b"root", "names folders"),
    "C:\\temp\\a.txt": (b"x", "names folders"),
    "evil\u202eexe.txt": (b"x", "control or invisible"),
    "bell\x07.txt": (b"x", "control or invisible"),
}


@pytest.mark.parametrize("name", list(BAD))
async def test_a_bad_file_is_refused_with_the_reason(reader, name):
    data, reason = BAD[name]
    with pytest.raises(Unreadable, match=reason.replace("(", r"\(").replace(".", r"\.")):
        await reader.read(name, data)


async def test_a_file_over_the_time_limit_is_refused_and_files_are_read_a_few_at_once():
    slow = Reader(Limits(**{**LIMITS.__dict__, "pages": 100_000, "read_s": 1}))
    with pytest.raises(Unreadable, match="more time or memory"):
        await slow.read("long.pdf", sf.many_pages_pdf(60_000))
    many = await asyncio.gather(*(Reader(LIMITS, at_once=2).read(f"f{i}.txt", b"fine %d" % i)
                                  for i in range(8)))
    assert [d.text for d in many] == [f"fine {i}" for i in range(8)]


def test_the_model_gets_each_file_with_its_name_then_the_message():
    docs = [Document("1", "a.md", "text", 3, "AAA"), Document("2", "b.pdf", "pdf", 9, "BBB")]
    text = with_documents("Compare them.", docs)
    assert text == ('<document name="a.md">\nAAA\n</document>\n\n'
                    '<document name="b.pdf">\nBBB\n</document>\n\nCompare them.')
    assert with_documents("Compare them.", docs) == text, "the same text every turn"
    assert with_documents("", docs[:1]) == '<document name="a.md">\nAAA\n</document>'


async def storage_limit_holds(url: str, at_once: int = 24) -> None:
    """24 messages of 1,000 characters at once against a 10,000-byte limit: exactly 10 are
    kept; another account's files are its own."""
    engine = connect(url)
    await migrate(engine)
    store = Documents(engine, storage_bytes=10_000)

    async def one(i: int) -> bool:
        try:
            await store.add("ann", "t1", f"m{i}", [Document(f"d{i}", "x.txt", "text", 1000,
                                                            "x" * 1000)])
            return True
        except StorageFull as exc:
            assert "Delete chats" in str(exc)
            return False

    kept = await asyncio.gather(*(one(i) for i in range(at_once)))
    assert sum(kept) == 10
    await store.add("bob", "t2", "m", [Document("b", "y.txt", "text", 1000, "y" * 1000)])
    assert await store.one("b", "ann") is None and (await store.one("b", "bob")).text[:1] == "y"
    await engine.dispose()


async def test_an_accounts_storage_limit_holds_when_messages_race(tmp_path):
    """Store level, SQLite (tests/test_postgres.py: the same on PostgreSQL)."""
    await storage_limit_holds(database_url(tmp_path))


async def test_an_accounts_files_go_with_it(tmp_path):
    engine = connect(database_url(tmp_path))
    await migrate(engine)
    accounts, store = Accounts(engine), Documents(engine)
    for name in ("carl", "dora"):
        await accounts.add(name, "a-long-password")
        await store.add(name, f"chat-{name}", "m1", [Document(f"{name}1", "a.txt", "text",
                                                              1, "a")])
    await accounts.remove("carl")
    assert await store.one("carl1", "carl") is None and await store.one("dora1", "dora")
    await engine.dispose()


# -- through the real server, on the real engine ---------------------------------------------

async def attached(c: ChatClient, *names: str) -> list[str]:
    ids = []
    for name in names:
        answer = await c.attach(name, KINDS[name][0])
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["id"])
    return ids


def turn_lines(server) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines()
            if line.startswith("{") and '"event": "turn"' in line]


async def test_files_reach_the_model_and_come_back_with_the_chat(api_app, formatter, config):
    server, system = api_app, config.profile("Latency-first").system_prompt
    names = list(KINDS)  # every kind, in one message
    texts = [(await Reader(LIMITS).read(n, KINDS[n][0])) for n in names]
    c = await client(server, max_tokens=8)
    first = await c.send("Which fruits are named?", files=await attached(c, *names))
    asked = Message("user", with_documents("Which fruits are named?", texts))
    # The prompt holds each file's text with its name, as the engine counted it.
    assert first.reply["metadata"]["prompt_tokens"] == formatter.count([asked], system)
    shown = [e.data for e in c.events if e.name == "element"]
    assert [e["name"] for e in shown] == names and all(
        e["forId"] == c.last_message_id for e in shown)
    # A follow-up: the history (files included) is the same text, read from vLLM's cache.
    second = await c.send("And the first one?")
    history = [asked, Message("assistant", first.shown), Message("user", "And the first one?")]
    assert second.reply["metadata"]["prompt_tokens"] == formatter.count(history, system)
    line = next(t for t in reversed(turn_lines(server)) if t.get("outcome") == "finished"
                and t["prompt_tokens"] == second.reply["metadata"]["prompt_tokens"])
    assert line["cached_tokens"] >= formatter.count([asked], system) - 64, line
    await c.close()

    async with c.api() as http:
        chats = (await http.post("/project/threads", json={
            "pagination": {"first": 20}, "filter": {}})).json()["data"]
        thread = next(t for t in chats if t["name"].startswith("Which fruits"))
        stored = (await http.get(f"/project/thread/{thread['id']}")).json()
        assert [e["name"] for e in stored["elements"]] == names
        pdf = stored["elements"][names.index("report.pdf")]["url"]
        link = await http.get(pdf)
        assert link.status_code == 200 and "rambutan" in link.text
        exported = (await http.get(f"/export/chats/{thread['id']}")).json()
        asked_row = exported["chats"][0]["messages"][0]
        assert [d["name"] for d in asked_row["documents"]] == names
        assert "tamarind" in asked_row["documents"][names.index("memo.docx")]["text"]
        markdown = (await http.get(f"/export/chats/{thread['id']}",
                                   params={"format": "md"})).text
        assert "*Attached: report.pdf" in markdown

    # Reopened: the files are the message's again, and the next prompt holds them.
    again = ChatClient(server.url, "Latency-first")
    await again.connect(resume=thread["id"])
    await again.settings(max_tokens=8)
    third = await again.send("Thanks.")
    history += [Message("assistant", second.shown), Message("user", "Thanks.")]
    assert third.reply["metadata"]["prompt_tokens"] == formatter.count(history, system)
    await again.close()

    # Deleted with the chat: the link answers 404.
    async with c.api() as http:
        gone = await http.request("DELETE", "/project/thread", json={"threadId": thread["id"]})
        assert gone.status_code == 200
        assert (await http.get(pdf)).status_code == 404


async def test_a_file_alone_or_with_no_text_and_one_too_long_for_the_context(api_app):
    c = await client(api_app, max_tokens=8)
    only = await c.send("", files=await attached(c, "data.json"))
    assert only.reply is not None and only.reply["metadata"]["prompt_tokens"] > 5
    long = await c.attach("long.txt", ("word " * 3000).encode())
    refused = await c.send_refused("Summarize.", files=[long.json()["id"]])
    assert "tokens over" in refused and "long.txt" in refused and "at most 2,040 tokens" in refused
    assert "Traceback" not in refused
    # The refused message's file stays attachable; nothing of it was stored.
    after = await c.send("Still there?")
    assert after.reply is not None
    async with c.api() as http:
        chats = (await http.post("/project/threads", json={
            "pagination": {"first": 20}, "filter": {}})).json()["data"]
        mine = next(t for t in chats if t["id"] == only.reply["threadId"])
        stored = (await http.get(f"/project/thread/{mine['id']}")).json()
    assert [e["name"] for e in stored["elements"]] == ["data.json"]
    await c.close()


async def test_another_account_reaches_nothing_of_ones_files(api_app):
    add_user(api_app, "mallory", "mallory-password-1")
    alice = await client(api_app, max_tokens=8)
    (file_id,) = await attached(alice, "notes.md")
    mallory = ChatClient(api_app.url, "Latency-first", user="mallory",
                         password="mallory-password-1")
    await mallory.connect()
    # Not her session: no upload into it, no message naming its file.
    async with mallory.api() as http:
        into = await http.post("/project/file", params={"session_id": alice.session_id},
                               files={"file": ("x.txt", b"hello", "text/plain")})
        assert into.status_code == 403
    refused = await mallory.send_refused("Read it.", files=[file_id])
    assert "no longer on the server" in refused
    reply = await alice.send("What is the fruit?", files=[file_id])
    assert reply.reply is not None
    async with mallory.api() as http:
        assert (await http.get(f"/documents/{file_id}")).status_code == 404
        assert (await http.get("/documents/not-an-id")).status_code == 404
    async with httpx.AsyncClient(base_url=api_app.url) as anonymous:
        assert (await anonymous.get(f"/documents/{file_id}")).status_code == 401
    for c in (alice, mallory):
        await c.close()


# -- the limits, on a stand-in server of their own --------------------------------------------

LIMITED = {"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": "2000",
           "VCHAT_DOCUMENT_MAX_MB": "0.05", "VCHAT_DOCUMENT_STORAGE_MB": "0.01",
           "VCHAT_DOCUMENT_FILES": "3", "VCHAT_GUEST_DOCUMENT_MAX_MB": "0"}


@pytest.fixture(scope="module")
async def limited():
    async with serving(LIMITED, timeout=120) as srv:
        yield srv


def stored_rows(server) -> int:
    with sqlite3.connect(Path(server.env["VCHAT_DATA_DIR"]) / "chat.db") as db:
        return db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]


async def test_the_size_the_count_and_the_storage_limits_hold_for_many_at_once(limited):
    c = ChatClient(limited.url, "Latency-first")
    await c.connect()
    # Over the limit of 51 KB: refused as it arrives (the body), or by its size.
    big = await c.attach("big.txt", b"x" * (200 << 10))
    assert big.status_code == 413 and "over this chat's limit of 51 KB" in big.text, big.text
    big = await c.attach("big.txt", b"x" * (60 << 10))
    assert big.status_code == 413 and "big.txt is 60 KB" in big.text, big.text
    bad = await c.attach("fake.txt", bytes(range(256)) * 8)
    assert bad.status_code == 400 and "binary" in bad.json()["detail"]
    assert stored_rows(limited) == 0, "nothing of a refused file is kept"
    answers = await asyncio.gather(*(c.attach(f"n{i}.txt", b"note %d" % i) for i in range(8)))
    assert sorted(a.status_code for a in answers) == [200] * 3 + [400] * 5, "3 files a message"
    assert all("at most 3 files" in a.text for a in answers if a.status_code == 400)
    await c.close()
    # 12 users send a 2,000-character file each at once; the account keeps 10,485 bytes.
    users = [ChatClient(limited.url, "Latency-first") for _ in range(12)]
    await asyncio.gather(*(u.connect() for u in users))
    ids = await asyncio.gather(*(u.attach("part.txt", b"y" * 2000) for u in users))
    starts = [len(u.events) for u in users]
    await asyncio.gather(*(u.emit_message("Read this.", [i.json()["id"]])
                           for u, i in zip(users, ids)))
    outcomes = await asyncio.gather(*(u.refusal_since(s) for u, s in zip(users, starts)))
    refused = [o for o in outcomes if o is not None]
    assert len(refused) == 7 and all("over the 10 KB" in o and "Delete chats" in o
                                     for o in refused), outcomes
    assert stored_rows(limited) == 5
    for u in users:
        await u.close()


async def test_a_guest_may_not_attach_where_the_demo_says_so(limited):
    printed = store_command(limited, "invites", "add", "--uses", "1", "--expires", "1h")
    cookie = (await join(limited, link_token(printed), "Visitor")).cookies["access_token"]
    guest = ChatClient(limited.url, "Latency-first")
    await guest.connect_with(cookie)
    async with httpx.AsyncClient(base_url=limited.url,
                                 cookies={"access_token": cookie}) as http:
        answer = await http.post("/project/file", params={"session_id": guest.session_id},
                                 files={"file": ("a.txt", b"hello", "text/plain")})
    assert answer.status_code == 403 and "Guests of this demo" in answer.text
    await guest.close()


async def test_attaching_can_be_turned_off():
    async with serving({**LIMITED, "VCHAT_DOCUMENTS": "0"}, timeout=120) as srv:
        c = ChatClient(srv.url, "Latency-first")
        await c.connect()
        async with c.api() as http:
            settings = (await http.get("/project/settings?language=en-US")).json()
        assert settings["features"]["spontaneous_file_upload"]["enabled"] is False
        answer = await c.attach("a.txt", b"hello")
        assert answer.status_code == 404 and "turned off" in answer.text
        await c.close()


async def test_a_file_in_an_api_message_is_read_as_the_chat_reads_it(api_app, formatter, config):
    """OpenAI's file content part: the same text as an attached file, in the same place."""
    api = openai.AsyncOpenAI(base_url=api_app.url + "/v1", api_key=API_KEY, max_retries=0)
    data, question = KINDS["report.pdf"][0], "Which fruit is on page one?"
    part = {"type": "file", "file": {"filename": "report.pdf", "file_data":
                                     "data:application/pdf;base64," + b64encode(data).decode()}}
    reply = await api.chat.completions.create(
        model="Latency-first", max_tokens=4,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}])
    document = await Reader(LIMITS).read("report.pdf", data)
    asked = Message("user", with_documents(question, [document]))
    # An API request without a system message gets none (the model's template decides)
    assert reply.usage.prompt_tokens == formatter.count([asked], "")
    for bad, why in ((sf.encrypted_pdf("x"), "encrypted"), (b"MZ", "not read here")):
        name = "tool.exe" if bad == b"MZ" else "secret.pdf"
        refused = {**part, "file": {"filename": name, "file_data": b64encode(bad).decode()}}
        with pytest.raises(openai.BadRequestError, match=why):
            await api.chat.completions.create(model="Latency-first", max_tokens=4, messages=[
                {"role": "user", "content": [refused]}])
    with pytest.raises(openai.BadRequestError, match="Files API"):
        await api.chat.completions.create(model="Latency-first", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}])


async def test_regenerate_and_an_edit_keep_the_messages_files(api_app, formatter, config):
    system = config.profile("Latency-first").system_prompt
    c = await client(api_app, max_tokens=8)
    document = await Reader(LIMITS).read("notes.md", KINDS["notes.md"][0])
    first = await c.send("Which fruit?", files=await attached(c, "notes.md"))
    asked = formatter.count([Message("user", with_documents("Which fruit?", [document]))],
                            system)
    assert first.reply["metadata"]["prompt_tokens"] == asked
    [button] = c.actions(first.reply["id"])
    start = await c.press(button)
    again = c.collect(start, await c.wait_for("task_end", since=start) + 1)
    assert again.reply["metadata"]["prompt_tokens"] == asked, "Regenerate kept the file"
    edited = await c.edit(c.last_message_id, "Which fruit, in one word?")
    assert edited.reply["metadata"]["prompt_tokens"] == formatter.count(
        [Message("user", with_documents("Which fruit, in one word?", [document]))], system)
    await c.close()
