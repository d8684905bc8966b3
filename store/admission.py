"""May this account take a turn now: decided and taken in one step, where it is counted
(checked in one statement and taken in a later one, caps let bursts through: a guest capped
at 2 chats got 6 from 6 messages sent at once), for service/admission.py.

- The limits: an account's daily token quota (store/usage.py), and a demo guest's
  (store/guests.py): its chats, its messages a minute, and those of the guests who joined
  from its address, with that address's tokens a day.
- A turn that may go holds its place from that moment: a usage row marked `pending`, written
  in the same transaction as the checks, with what the turn may cost (its reply's room;
  for the API, its prompt's tokens and every reply's room) and the chat it is for. Every
  check counts the pending rows as turns, their tokens as spent and their chats as kept,
  so a burst is decided one turn after another. The turn's end turns its row into its
  cost (`Usage.record`), or takes it back when the turn cost nothing (`Usage.release`); a
  row still pending after `PENDING_S` (its process died mid-turn) no longer counts.
- One at a time per account (per address for a guest, whose address shares limits): on
  PostgreSQL a transaction-scoped advisory lock, across replicas; on SQLite the transaction
  writes first, which takes the database's one write lock at once.
- An account with none of these limits (no quota, not a guest) is one read by primary key,
  as before, and holds nothing: its turn's cost is written when it ends.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.schema import Reader
from store.usage import quota_message

PENDING_S = 3600.0  # a hold older than this is a turn whose process died: it counts no more

# A usage row counts while it is a cost, or a hold that is not stale.
_COUNTS = '(NOT u."pending" OR u."createdAt" > :fresh)'
_ACCOUNT = text('SELECT "dailyTokens", "kind", "address" FROM accounts WHERE "identifier" = :i')
_SPENT = text('SELECT COALESCE(SUM(u."promptTokens" + u."replyTokens"), 0) FROM usage u '
              f'WHERE u."identifier" = :i AND u."day" = :day AND {_COUNTS}')
# The chats a guest keeps, and those its turns under way are starting, but this one.
_CHATS = text(
    'SELECT COUNT(*) FROM (SELECT "id" FROM threads WHERE "userIdentifier" = :i UNION '
    'SELECT u."threadId" FROM usage u WHERE u."identifier" = :i AND u."pending" AND '
    'u."createdAt" > :fresh AND u."threadId" IS NOT NULL) held WHERE held."id" <> :thread')
# This guest's turns, and those of the guests who joined from its address, in the last minute.
_RECENT_TURNS = text(
    'SELECT COALESCE(SUM(CASE WHEN g."identifier" = :i THEN 1 ELSE 0 END), 0), COUNT(u."id") '
    'FROM accounts a JOIN accounts g ON g."kind" = \'guest\' AND (g."identifier" = '
    'a."identifier" OR g."address" = a."address") JOIN usage u ON u."identifier" = '
    f'g."identifier" AND u."day" >= :minute_day AND u."createdAt" > :since AND {_COUNTS} '
    'WHERE a."identifier" = :i')
# The tokens that the guests who joined from this guest's address spent today.
_ADDRESS_SPENT = text(
    'SELECT COALESCE(SUM(u."promptTokens" + u."replyTokens"), 0) FROM accounts a '
    'JOIN accounts g ON g."address" = a."address" AND g."kind" = \'guest\' '
    f'JOIN usage u ON u."identifier" = g."identifier" AND u."day" = :day AND {_COUNTS} '
    'WHERE a."identifier" = :i')
_HOLD = text(
    'INSERT INTO usage ("id", "identifier", "profile", "source", "day", "createdAt", '
    '"promptTokens", "replyTokens", "stopped", "threadId", "pending") VALUES (:id, :i, '
    ':profile, :source, :day, :created, 0, :reserve, :no, :thread, :yes)')
_PG_LOCK = text("SELECT pg_advisory_xact_lock(:k)")
_SQLITE_WRITE_FIRST = text("UPDATE schema_version SET version = version")


class Refused(Exception):
    """Said to the user whose turn may not start; nothing of it is stored."""


@dataclass(frozen=True)
class Hold:
    """A turn's place in its account's limits: its pending usage row."""
    id: str


@dataclass(frozen=True)
class GuestLimits:
    """A demo guest's limits (store/guests.py; None: no such limit)."""
    chats: int
    turns_per_minute: int | None = None
    address_turns_per_minute: int | None = None
    address_tokens: int | None = None


async def locked(conn, key: str) -> None:
    """`key` held by this transaction until it ends: the first statement of a transaction."""
    if conn.dialect.name == "postgresql":
        digest = hashlib.sha256(key.encode()).digest()
        await conn.execute(_PG_LOCK, {"k": int.from_bytes(digest[:8], "big", signed=True)})
    else:
        await conn.execute(_SQLITE_WRITE_FIRST)


class Admission:
    def __init__(self, engine: AsyncEngine, guests: GuestLimits, reader: Reader | None = None):
        self.engine = engine
        self.guests = guests
        self.reader = reader or Reader(engine, own=False)

    async def take(self, identifier: str | None, *, profile: str, source: str, reserve: int,
                   thread_id: str | None = None, starts_chat: bool = False) -> Hold | None:
        """The turn's Hold, or None where no limit applies (nothing held); Refused in words
        when a limit says no. `reserve`: the most tokens it may cost; `starts_chat`: its
        message would start the chat `thread_id`."""
        if identifier is None:  # the operator's API key: no account, no limits
            return None
        rows = await self.reader.rows(_ACCOUNT, {"i": identifier})
        if not rows:
            return None  # removed meanwhile: its login is refused wherever it is checked
        quota, kind, address = rows[0]
        guest = kind == "guest"
        if quota is None and not guest:
            return None
        now = datetime.now(timezone.utc)
        minute_ago = now - timedelta(minutes=1)
        values = {"i": identifier, "day": now.date().isoformat(), "thread": thread_id or "",
                  "fresh": (now - timedelta(seconds=PENDING_S)).isoformat(timespec="seconds"),
                  "since": minute_ago.isoformat(timespec="seconds"),
                  "minute_day": minute_ago.date().isoformat()}
        hold = Hold(str(uuid.uuid4()))
        async with self.engine.begin() as conn:
            await locked(conn, f"address:{address}" if guest and address
                         else f"account:{identifier}")
            if guest:
                refused = await self._guest_refusal(conn, values, starts_chat)
                if refused:
                    raise Refused(refused)
            if quota is not None:
                spent = int((await conn.execute(_SPENT, values)).scalar_one())
                if spent >= quota:
                    raise Refused(quota_message(quota, spent))
            await conn.execute(_HOLD, {
                "id": hold.id, "i": identifier, "profile": profile, "source": source,
                "day": values["day"], "created": now.isoformat(timespec="seconds"),
                "reserve": max(0, int(reserve)), "thread": thread_id, "no": False,
                "yes": True})
        return hold

    async def _guest_refusal(self, conn, values: dict, starts_chat: bool) -> str | None:
        limits = self.guests
        if starts_chat:
            held = (await conn.execute(_CHATS, values)).scalar_one()
            if held >= limits.chats:
                return (f"A guest can keep {limits.chats} chats at most: delete one in the "
                        "list of chats to start another, or go on in one of them.")
        if limits.turns_per_minute is not None or limits.address_turns_per_minute is not None:
            mine, theirs = (await conn.execute(_RECENT_TURNS, values)).one()
            if limits.turns_per_minute is not None and mine >= limits.turns_per_minute:
                return (f"A guest can send {limits.turns_per_minute} messages a minute at "
                        "most. Please wait a moment.")
            if limits.address_turns_per_minute is not None and \
                    theirs >= limits.address_turns_per_minute:
                return ("The guests on your network are sending many messages right now. "
                        "Please wait a moment.")
        if limits.address_tokens is not None:
            spent = (await conn.execute(_ADDRESS_SPENT, values)).scalar_one()
            if spent >= limits.address_tokens:
                return ("The guests on your network have used today's tokens for this demo. "
                        "Please try again tomorrow (UTC).")
        return None
