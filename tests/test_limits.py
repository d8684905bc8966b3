"""Every cap decided where it is counted (issue 52), on SQLite and on PostgreSQL, hit by many
requests at the same moment: each test sends a burst at once (asyncio.gather, each its own
transaction on its own connection where the database has several) and counts what got in.

What broke: the open demo's cap counted guests with a live login and the login was opened
after the count (10 joins at once for one free place: all 10 got in); a guest's chats were
counted before the chat was written (6 new chats at once past a cap of 2); a guest's
messages a minute and an account's quota counted only turns that had ended (8 turns at once
past a limit of 3).

    .venv/bin/python -m pytest -q tests/test_limits.py
"""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from store.accounts import Accounts
from store.admission import PENDING_S, Admission, GuestLimits, Refused
from store.invites import InviteError, Invites, Joiner
from store.schema import connect, database_url, migrate
from store.usage import Spent, Usage
from tools.postgres import Postgres, binaries


@pytest.fixture(scope="module")
def postgres():
    if binaries() is None:
        if os.environ.get("VCHAT_REQUIRE_POSTGRES"):
            pytest.fail("VCHAT_REQUIRE_POSTGRES is set but PostgreSQL is not installed")
        pytest.skip("no PostgreSQL server installed here (Debian: postgresql)")
    with Postgres() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request, tmp_path):
    env = {} if request.param == "sqlite" else \
        {"DATABASE_URL": request.getfixturevalue("postgres").new_database()}
    engine = connect(database_url(tmp_path, env=env))
    await migrate(engine)
    yield engine
    await engine.dispose()


async def burst(count: int, take) -> tuple[list, list[str]]:
    """`take(i)` for i in range(count), all at once: (what was taken, the refusals' words)."""
    async def one(i):
        try:
            return await take(i), None
        except (Refused, InviteError) as exc:
            return None, str(exc)

    results = await asyncio.gather(*(one(i) for i in range(count)))
    return [r for r, _ in results if r is not None], [w for _, w in results if w is not None]


async def guest(invites: Invites, name: str, address: str = "203.0.113.5"):
    _, token = await invites.add(5, 3600)
    return await invites.redeem(token, name, joiner=Joiner(address))


async def rows(db, sql: str) -> list:
    async with db.connect() as conn:
        return (await conn.execute(text(sql))).all()


def turn(admission: Admission, identifier: str, reserve: int = 10, starts_chat=False):
    return admission.take(identifier, profile="Latency-first", source="chat", reserve=reserve,
                          thread_id=str(uuid.uuid4()), starts_chat=starts_chat)


async def test_a_guests_messages_a_minute_hold_against_a_burst(db):
    invites = Invites(db)
    chatty, neighbour = await guest(invites, "Chatty"), await guest(invites, "Neighbour")
    admission = Admission(db, GuestLimits(chats=100, turns_per_minute=3,
                                          address_turns_per_minute=5))
    taken, refused = await burst(8, lambda i: turn(admission, chatty.identifier))
    assert len(taken) == 3 and len(refused) == 5
    assert all("3 messages a minute" in words for words in refused)
    # The guests of its address share 5: two more for the neighbour, then none.
    taken, refused = await burst(8, lambda i: turn(admission, neighbour.identifier))
    assert len(taken) == 2 and all("your network" in words for words in refused)


async def test_a_guest_starts_no_more_chats_than_its_cap_from_a_burst(db):
    capped = await guest(Invites(db), "Capped")
    admission = Admission(db, GuestLimits(chats=2))
    taken, refused = await burst(6, lambda i: turn(admission, capped.identifier,
                                                   starts_chat=True))
    assert len(taken) == 2 and len(refused) == 4
    assert all("2 chats at most" in words for words in refused)
    # Those two chats are stored (the chat writes a chat as its first message comes) and
    # their turns ended: still two, no third.
    async with db.begin() as conn:
        await conn.execute(text(
            'INSERT INTO threads ("id", "userIdentifier", "createdAt") SELECT "threadId", '
            '"identifier", "createdAt" FROM usage WHERE "identifier" = :i'),
            {"i": capped.identifier})
    usage = Usage(db)
    for hold in taken:
        usage.record(Spent(capped.identifier, "Latency-first", "chat", 5, 5, False), hold)
    await usage.settle()
    assert (await burst(3, lambda i: turn(admission, capped.identifier, starts_chat=True))
            )[0] == []
    # A message in a chat it has is no new chat.
    assert len((await burst(2, lambda i: turn(admission, capped.identifier)))[0]) == 2


async def test_a_quota_counts_the_turns_under_way_and_each_turns_cost_replaces_its_hold(db):
    await Accounts(db).add("metered", "a long enough password")
    usage = Usage(db)
    await usage.set_quota("metered", 1000)
    admission = Admission(db, GuestLimits(chats=1))
    taken, refused = await burst(8, lambda i: turn(admission, "metered", reserve=300))
    assert len(taken) == 4, "0, 300, 600 and 900 held are under 1,000; 1,200 is not"
    assert all("1,000 tokens" in words for words in refused)
    # Three ended cheaply, one cost nothing: their room comes back.
    for hold in taken[:3]:
        usage.record(Spent("metered", "Latency-first", "chat", 20, 30, False), hold)
    usage.release(taken[3])
    await usage.settle()
    async with db.connect() as conn:
        rows = (await conn.execute(text(
            'SELECT "promptTokens" + "replyTokens", "pending" FROM usage WHERE '
            '"identifier" = \'metered\''))).all()
    assert sorted(int(r[0]) for r in rows) == [50, 50, 50] and not any(r[1] for r in rows)
    taken, _ = await burst(8, lambda i: turn(admission, "metered", reserve=300))
    assert len(taken) == 3, "150 spent: 150, 450, 750 held are under 1,000"
    report = await usage.report()
    assert [(line.turns, line.reply_tokens) for line in report] == [(3, 90)], \
        "a hold is no turn in the usage report"


async def test_a_hold_left_by_a_process_that_died_stops_counting(db):
    await Accounts(db).add("crashed", "a long enough password")
    usage = Usage(db)
    await usage.set_quota("crashed", 100)
    admission = Admission(db, GuestLimits(chats=1))
    await turn(admission, "crashed", reserve=100)
    with pytest.raises(Refused):
        await turn(admission, "crashed")
    old = datetime.now(timezone.utc) - timedelta(seconds=PENDING_S + 60)
    async with db.begin() as conn:
        await conn.execute(text('UPDATE usage SET "createdAt" = :at WHERE "identifier" = '
                                "'crashed'"), {"at": old.isoformat(timespec="seconds")})
    assert await turn(admission, "crashed") is not None


async def test_accounts_without_limits_hold_nothing(db):
    await Accounts(db).add("free", "a long enough password")
    admission = Admission(db, GuestLimits(chats=1))
    assert await turn(admission, "free") is None and await turn(admission, None) is None
    async with db.connect() as conn:
        assert (await conn.execute(text("SELECT COUNT(*) FROM usage"))).scalar_one() == 0


async def test_the_open_demo_takes_as_many_as_it_has_places_from_a_burst(db):
    invites = Invites(db)
    await invites.join_open("First", most=4, joiner=Joiner("198.51.100.1"))
    taken, refused = await burst(10, lambda i: invites.join_open(
        f"Visitor {i}", most=4, joiner=Joiner(f"203.0.113.{i + 1}")))
    assert len(taken) == 3 and len(refused) == 7
    assert all("full" in words for words in refused)
    assert all(g.login for g in taken), "each guest counts from the moment it joins"


async def test_one_address_takes_no_more_than_its_share_of_the_open_demo(db):
    invites = Invites(db)
    room = Joiner("198.51.100.7", per_hour=100)
    taken, refused = await burst(6, lambda i: invites.join_open(
        f"Script {i}", most=10, per_address=2, joiner=room))
    assert len(taken) == 2 and all("Your network" in words for words in refused)
    assert await invites.join_open("Elsewhere", most=10, per_address=2,
                                   joiner=Joiner("198.51.100.8"))


async def test_one_address_makes_no_more_guests_an_hour_from_a_burst(db):
    invites = Invites(db)
    _, token = await invites.add(50, 3600)
    script = Joiner("203.0.113.99", per_hour=3)
    taken, refused = await burst(8, lambda i: invites.redeem(token, f"Bot {i}",
                                                             joiner=script))
    assert len(taken) == 3 and all("from your network" in words for words in refused)


async def test_a_rooms_guests_asking_at_once_share_their_addresss_caps_exactly(db):
    """Turns asking together are decided in one transaction, the address's figures read once
    and counted on: 12 guests of one address at once against its 5 turns a minute, then
    against its tokens a day; and the next turns, in a later batch, see them stored."""
    invites = Invites(db)
    room = [await guest(invites, f"Seat {i}") for i in range(12)]
    admission = Admission(db, GuestLimits(chats=100, turns_per_minute=3,
                                          address_turns_per_minute=5))
    taken, refused = await burst(12, lambda i: turn(admission, room[i].identifier))
    assert len(taken) == 5 and all("your network" in words for words in refused)
    taken, refused = await burst(12, lambda i: turn(admission, room[i].identifier))
    assert not taken and len(refused) == 12, "the first batch's turns were stored"
    tokens = Admission(db, GuestLimits(chats=100, address_tokens=25))
    other = [await guest(invites, f"Other {i}", "203.0.113.77") for i in range(6)]
    taken, refused = await burst(6, lambda i: turn(tokens, other[i].identifier, reserve=10))
    assert len(taken) == 3, "0, 10, 20 of 25 spent: 3 go in, the 4th finds 30"
    assert all("today's tokens" in words for words in refused)


async def test_a_turn_whose_caller_left_while_it_was_decided_gives_its_place_back(db):
    invites = Invites(db)
    chatty = await guest(invites, "Leaves")
    admission = Admission(db, GuestLimits(chats=100, turns_per_minute=1))
    asked = asyncio.ensure_future(turn(admission, chatty.identifier))
    await asyncio.sleep(0)  # asked, not yet decided
    asked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asked
    for _ in range(100):  # its place, taken meanwhile, is deleted
        await asyncio.sleep(0.02)
        pending = (await rows(db, 'SELECT COUNT(*) FROM usage WHERE "pending"'))[0][0]
        if not pending:
            break
    assert pending == 0
    assert await turn(admission, chatty.identifier), "its one turn a minute is free again"
