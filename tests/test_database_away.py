"""The database going away under the chat (issue 57): the app on SQLite whose folder's disk
fills up (a size-limited tmpfs, as a full disk), here, and on PostgreSQL stopped and
started again (tests/test_postgres.py), with the same checks: the replies stream on while
it is away, the chat's writes wait and go in once it is back, in order, nothing stored
lost or stored twice; a write still refused past VCHAT_DB_WAIT_S is said to the user, and
the database stays sound. The stand-in engine: this is about the store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chat.view import STAND_IN as STAND_IN_NOTE
from tests.test_accounts import STAND_IN, thread_steps, threads
from tools.chainlit_client import TEST_PASSWORD, TEST_USER, ChatClient, Server, serving

SLOW = {**STAND_IN, "VCHAT_STANDIN_TOKENS_PER_S": "25"}  # a reply of 150 tokens: 6 s
FIRST, SECOND = "Remember the word heliotrope.", "Tell me a long story about the sea."


async def writes_wait_while_the_database_is_away(srv: Server, away: Callable[[], None],
                                                 back: Callable[[], None], users: int = 3
                                                 ) -> list[ChatClient]:
    """Users mid-reply when the database goes `away()`, for a few seconds, then `back()`:
    every reply streams on and ends; nothing is said lost; each chat holds each message
    once and the reply as shown. Returns the users, connected, for more."""
    clients = [ChatClient(srv.url, "Throughput-first") for _ in range(users)]
    await asyncio.gather(*[c.connect() for c in clients])
    await asyncio.gather(*[c.settings(max_tokens=150, show_stats=False) for c in clients])
    firsts = await asyncio.gather(*[c.send(FIRST) for c in clients])
    assert all(r.shown and problems(r) == [] for r in firsts)
    starts = [len(c.events) for c in clients]
    for c in clients:
        await c.emit_message(SECOND)
    for c, start in zip(clients, starts):
        await c.wait_for_tokens(start, 3)
    away()
    went = time.monotonic()
    seconds = []
    for c, start in zip(clients, starts):  # each reply streams on to its end meanwhile
        end = await c.wait_for("task_end", since=start, timeout=120)
        reply = c.collect(start, end + 1)
        assert reply.shown and problems(reply) == [], reply.notes
        assert any(e.name == "stream_token" and e.at > went + 1 for e in c.events[start:end])
        seconds.append(reply)
    await asyncio.sleep(2)  # their last writes wait
    back()
    await asyncio.sleep(5)  # the writes' check runs after the turn: nothing said lost
    for c, start in zip(clients, starts):
        outputs = [e.data.get("output", "") for e in c.events[start:] if e.name == "new_message"]
        assert not [o for o in outputs if "could not be saved" in o], outputs
    for c, first, second in zip(clients, firsts, seconds):
        (chat,) = [t for t in await threads(srv, c) if t["id"] == chat_of(c)]
        steps = await thread_steps(c, chat["id"])
        asked = [s["output"] for s in steps if s["type"] == "user_message"]
        answered = [s["output"] for s in steps if s["type"] == "assistant_message"
                    and s["output"] != STAND_IN_NOTE]
        assert asked == [FIRST, SECOND], asked
        assert answered == [first.shown, second.shown], (answered, first.shown, second.shown)
    return clients


def problems(reply) -> list[str]:
    """A reply's notes but the one that says how far a long prompt has been read."""
    return [n for n in reply.notes if "Reading your message" not in n]


def chat_of(client: ChatClient) -> str:
    """The chat id the client's session writes to, from the steps the app sent it."""
    ids = {e.data.get("threadId") for e in client.events
           if e.name == "new_message" and isinstance(e.data, dict) and e.data.get("threadId")}
    assert len(ids) == 1, ids
    return ids.pop()


@contextlib.contextmanager
def small_disk(megabytes: int):
    """A folder on a filesystem of its own, `megabytes` in size (a tmpfs: needs root or
    sudo without a password, as .ci/run has)."""
    folder = Path(tempfile.mkdtemp(prefix="vchat-small-disk-"))
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    mounted = subprocess.run([*sudo, "mount", "-t", "tmpfs", "-o", f"size={megabytes}m",
                              "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited folder here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run([*sudo, "umount", "-l", str(folder)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def fill(folder: Path) -> Path:
    """Take every byte left on `folder`'s filesystem; the file that holds them."""
    filler = folder / "filler"
    # Unbuffered: a buffered file would keep the bytes that did not fit and raise "No space
    # left" again when it is closed.
    with filler.open("wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while out.write(b"\0" * 65536):
                pass
    return filler


async def test_a_full_disk_holds_the_chats_writes_until_there_is_room_then_says_a_loss():
    with small_disk(24) as disk:
        data = disk / "data"
        env = {**SLOW, "VCHAT_DATA_DIR": str(data), "VCHAT_DB_WAIT_S": "10",
               "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
        async with serving(env, timeout=120) as srv:
            filler = disk / "filler"
            clients = await writes_wait_while_the_database_is_away(
                srv, away=lambda: fill(disk), back=lambda: filler.unlink())
            log = srv.log_path.read_text(errors="replace")
            assert "database or disk is full" in log and "its writes wait, in order" in log
            # Full for longer than VCHAT_DB_WAIT_S: the reply is shown, its loss is said.
            c = clients[0]
            fill(disk)
            since = len(c.events)
            third = await c.send("And one more thing.")
            assert third.shown and problems(third) == [], third.notes
            note = await c.wait_for_note("could not be saved", since, timeout=60)
            assert "could not be saved" in note
            filler.unlink()
            again = await c.send("Still there?")
            assert again.shown and problems(again) == [], again.notes
            await asyncio.gather(*[x.close() for x in clients])
        with sqlite3.connect(data / "chat.db") as db:  # sound, whatever it went through
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            asked = [r[0] for r in db.execute(
                "SELECT output FROM steps WHERE type = 'user_message' ORDER BY createdAt")]
        assert asked.count(FIRST) == 3 and asked.count(SECOND) == 3
        assert asked[-1] == "Still there?" and "And one more thing." not in asked
