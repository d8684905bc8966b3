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
- Turns that ask at the same moment are decided together, one after another in one
  transaction (every lock they need taken first, in order): a room of 1,000 guests asking at
  once made 1,000 transactions on the database's one write lock, ~5 ms each on 2 cores, and
  the last waited seconds before its turn began. In it, the figures (each account's tokens
  today, a guest's chats and turns this minute, those of its address's guests) are read
  once for all its turns, a few statements, and counted on as each turn takes its place;
  the places taken are written together (one statement per figure per turn made a batch of
  64 take ~200 ms on 2 cores).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.schema import Reader
from store.usage import quota_message

BATCH = 64  # turns decided in one transaction at most
PENDING_S = 3600.0  # a hold older than this is a turn whose process died: it counts no more

# A usage row counts while it is a cost, or a hold that is not stale.
_COUNTS = '(NOT u."pending" OR u."createdAt" > :fresh)'
_ACCOUNT = text('SELECT "dailyTokens", "kind", "address" FROM accounts WHERE "identifier" = :i')
# Per account, for every account of a batch at once (`ids`):
_SPENT = text('SELECT u."identifier", COALESCE(SUM(u."promptTokens" + u."replyTokens"), 0) '
              f'FROM usage u WHERE u."identifier" IN :ids AND u."day" = :day AND {_COUNTS} '
              'GROUP BY u."identifier"').bindparams(bindparam("ids", expanding=True))
# the chats each guest keeps, and those its turns under way are starting;
_CHATS = text(
    'SELECT "userIdentifier", "id" FROM threads WHERE "userIdentifier" IN :ids UNION '
    'SELECT u."identifier", u."threadId" FROM usage u WHERE u."identifier" IN :ids AND '
    'u."pending" AND u."createdAt" > :fresh AND u."threadId" IS NOT NULL'
).bindparams(bindparam("ids", expanding=True))
# each guest's own turns in the last minute.
_MY_RECENT_TURNS = text(
    'SELECT u."identifier", COUNT(*) FROM usage u WHERE u."identifier" IN :ids AND '
    f'u."day" >= :minute_day AND u."createdAt" > :since AND {_COUNTS} GROUP BY u."identifier"'
).bindparams(bindparam("ids", expanding=True))
# Per address: the turns in the last minute of the guests who joined from guest :i's
# address, and (below) the tokens they spent today.
_RECENT_TURNS = text(
    'SELECT COUNT(u."id") FROM accounts a JOIN accounts g ON g."kind" = \'guest\' AND '
    '(g."identifier" = a."identifier" OR g."address" = a."address") JOIN usage u ON '
    'u."identifier" = g."identifier" AND u."day" >= :minute_day AND u."createdAt" > :since '
    f'AND {_COUNTS} WHERE a."identifier" = :i')
_ADDRESS_SPENT = text(
    'SELECT COALESCE(SUM(u."promptTokens" + u."replyTokens"), 0) FROM accounts a '
    'JOIN accounts g ON g."address" = a."address" AND g."kind" = \'guest\' '
    f'JOIN usage u ON u."identifier" = g."identifier" AND u."day" = :day AND {_COUNTS} '
    'WHERE a."identifier" = :i')
_HOLD = text(
    'INSERT INTO usage ("id", "identifier", "profile", "source", "day", "createdAt", '
    '"promptTokens", "replyTokens", "stopped", "threadId", "pending") VALUES (:id, :i, '
    ':profile, :source, :day, :created, 0, :reserve, :no, :thread, :yes)')
_RELEASE = text('DELETE FROM usage WHERE "id" = :hold AND "pending" = :yes')
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
    await locked_all(conn, [key])


async def locked_all(conn, keys) -> None:
    """Every one of `keys` held by this transaction until it ends (in one order everywhere,
    so that two transactions never wait for each other's): its first statements."""
    if conn.dialect.name == "postgresql":
        for key in sorted(set(keys)):
            digest = hashlib.sha256(key.encode()).digest()
            await conn.execute(_PG_LOCK, {"k": int.from_bytes(digest[:8], "big", signed=True)})
    else:
        await conn.execute(_SQLITE_WRITE_FIRST)


@dataclass
class _Ask:
    """One turn asking for its place, and the answer it waits for."""
    identifier: str
    quota: int | None
    guest: bool
    key: str  # its lock: its guests' address, or its account
    hold_row: dict  # its place, written once taken (the batch's time added)
    starts_chat: bool
    answer: asyncio.Future = field(repr=False)

    @property
    def thread(self) -> str:
        return self.hold_row["thread"] or ""


@dataclass
class _Figures:
    """An account's or an address's figures in a batch's transaction: read once for the
    batch, then counted on as its turns take their places (only this transaction can add
    to them: it holds their locks)."""
    turns: int = 0  # in the last minute
    tokens: int = 0  # today
    chats: set[str] = field(default_factory=set)  # a guest's, kept or being started

    def count(self, ask: _Ask) -> None:
        self.turns += 1
        self.tokens += ask.hold_row["reserve"]
        if ask.thread:
            self.chats.add(ask.thread)


class Admission:
    def __init__(self, engine: AsyncEngine, guests: GuestLimits, reader: Reader | None = None):
        self.engine = engine
        self.guests = guests
        self.reader = reader or Reader(engine, own=False)
        self._asks: list[_Ask] = []  # waiting for the next batch
        self._deciding: asyncio.Task | None = None

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
        hold = Hold(str(uuid.uuid4()))
        ask = _Ask(identifier, quota, guest, f"address:{address}" if guest and address
                   else f"account:{identifier}", {
                       "id": hold.id, "i": identifier, "profile": profile, "source": source,
                       "reserve": max(0, int(reserve)), "thread": thread_id, "no": False,
                       "yes": True}, starts_chat, asyncio.get_running_loop().create_future())
        self._asks.append(ask)
        if self._deciding is None or self._deciding.done():
            self._deciding = asyncio.ensure_future(self._decide_asks())
        try:
            refused = await asyncio.shield(ask.answer)
        except asyncio.CancelledError:  # its caller gone: a place taken meanwhile goes back
            ask.answer.add_done_callback(lambda answer: self._give_back(answer, hold.id))
            raise
        if refused:
            raise Refused(refused)
        return hold

    async def _decide_asks(self) -> None:
        """Every turn that asked meanwhile, decided in one transaction; again while more
        ask."""
        while self._asks:  # (at most BATCH at a time: the first hear sooner)
            asks, self._asks = self._asks[:BATCH], self._asks[BATCH:]
            try:
                answers = await self._decide(asks)
            except asyncio.CancelledError:
                for ask in asks:
                    ask.answer.cancel()
                raise
            except Exception as exc:  # the database's failure is each one's
                for ask in asks:
                    ask.answer.set_exception(exc)
                continue
            for ask, refused in zip(asks, answers):
                ask.answer.set_result(refused)

    async def _decide(self, asks: list[_Ask]) -> list[str | None]:
        """Each ask's refusal (None: its place taken), one after another as they came."""
        now = datetime.now(timezone.utc)
        minute_ago = now - timedelta(minutes=1)
        values = {"day": now.date().isoformat(),
                  "fresh": (now - timedelta(seconds=PENDING_S)).isoformat(timespec="seconds"),
                  "since": minute_ago.isoformat(timespec="seconds"),
                  "minute_day": minute_ago.date().isoformat()}
        answers: list[str | None] = []
        async with self.engine.begin() as conn:
            await locked_all(conn, [ask.key for ask in asks])
            accounts, addresses = await self._figures(conn, asks, values)
            taken = []
            for ask in asks:
                mine = accounts[ask.identifier]
                refused = self._guest_refusal(ask, mine, addresses.get(ask.key)) \
                    if ask.guest else None
                if refused is None and ask.quota is not None and mine.tokens >= ask.quota:
                    refused = quota_message(ask.quota, mine.tokens)
                if refused is None:
                    taken.append({**ask.hold_row, "day": values["day"],
                                  "created": now.isoformat(timespec="seconds")})
                    mine.count(ask)
                    if ask.key in addresses:
                        addresses[ask.key].count(ask)
                answers.append(refused)
            if taken:
                await conn.execute(_HOLD, taken)
        return answers

    async def _figures(self, conn, asks: list[_Ask], values: dict
                       ) -> tuple[dict[str, _Figures], dict[str, _Figures]]:
        """The figures the batch's limits need: each account's, each guests' address's."""
        limits = self.guests
        accounts = {ask.identifier: _Figures() for ask in asks}

        async def each(query, asking: list[_Ask]) -> list:
            ids = sorted({ask.identifier for ask in asking})
            return (await conn.execute(query, {**values, "ids": ids})).all() if ids else []

        for identifier, spent in await each(_SPENT, [a for a in asks if a.quota is not None]):
            accounts[identifier].tokens = int(spent)
        guests = [ask for ask in asks if ask.guest]
        for identifier, thread in await each(_CHATS, [a for a in guests if a.starts_chat]):
            accounts[identifier].chats.add(thread)
        if limits.turns_per_minute is not None:
            for identifier, turns in await each(_MY_RECENT_TURNS, guests):
                accounts[identifier].turns = int(turns)
        addresses: dict[str, _Figures] = {}
        if limits.address_turns_per_minute is None and limits.address_tokens is None:
            return accounts, addresses
        for ask in guests:
            if ask.key in addresses:
                continue
            at = {**values, "i": ask.identifier}
            addresses[ask.key] = _Figures(
                turns=int((await conn.execute(_RECENT_TURNS, at)).scalar_one()),
                tokens=int((await conn.execute(_ADDRESS_SPENT, at)).scalar_one())
                if limits.address_tokens is not None else 0)
        return accounts, addresses

    def _guest_refusal(self, ask: _Ask, mine: _Figures, address: _Figures | None
                       ) -> str | None:
        limits = self.guests
        if ask.starts_chat and len(mine.chats - {ask.thread}) >= limits.chats:
            return (f"A guest can keep {limits.chats} chats at most: delete one in the "
                    "list of chats to start another, or go on in one of them.")
        if limits.turns_per_minute is not None and mine.turns >= limits.turns_per_minute:
            return (f"A guest can send {limits.turns_per_minute} messages a minute at "
                    "most. Please wait a moment.")
        if address is None:
            return None
        if limits.address_turns_per_minute is not None and \
                address.turns >= limits.address_turns_per_minute:
            return ("The guests on your network are sending many messages right now. "
                    "Please wait a moment.")
        if limits.address_tokens is not None and address.tokens >= limits.address_tokens:
            return ("The guests on your network have used today's tokens for this demo. "
                    "Please try again tomorrow (UTC).")
        return None

    def _give_back(self, answer: asyncio.Future, hold_id: str) -> None:
        """A place taken for a turn whose caller left before hearing so: deleted."""
        if answer.cancelled() or answer.exception() is not None or answer.result():
            return
        asyncio.ensure_future(self._release(hold_id))

    async def _release(self, hold_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(_RELEASE, {"hold": hold_id, "yes": True})
