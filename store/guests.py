"""What a demo's guests (store/invites.py) may keep, and when they go.

- A guest keeps at most `chats` chats: a message that would start another is refused in
  words before anything of it is stored (chat/guard.py asks `turn_refusal`). A guest sends
  at most `turns_per_minute` messages a minute; the guests who joined from one client
  address together at most `address_turns_per_minute`, and `address_tokens` a day (a
  script making guest after guest gets no more than that), besides each one's own quota.
- A guest's daily token quota is set when it joins (store/usage.py enforces it, chat and
  nothing else: guests get no API key).
- After the retention (VCHAT_GUEST_RETENTION_DAYS, 7 by default) a guest goes, with its
  chats, sessions and costs' rows (store/accounts.py's `remove`): the app does this every
  hour, `python -m store invites expire` at once. `end_invite` does it for every guest of
  one invite now, and revokes the link.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.accounts import AccountError, Accounts
from store.invites import GUESTS_OF, Invites
from store.schema import Reader
from store.usage import today

log = logging.getLogger(__name__)

GUEST = "guest"  # the accounts' kind, and a guest login's token metadata "kind"
EXPIRE_EVERY_S = 3600.0

_CHATS = text('SELECT COUNT(*) FROM threads WHERE "userIdentifier" = :i')
# This guest's turns, and those of the guests who joined from its address, since `since`
# (a turn counts once its cost row is written: store/usage.py, within FLUSH_S of its end).
_RECENT_TURNS = text(
    'SELECT COALESCE(SUM(CASE WHEN g."identifier" = :i THEN 1 ELSE 0 END), 0), COUNT(u."id") '
    'FROM accounts a JOIN accounts g ON g."kind" = \'guest\' AND (g."identifier" = a."identifier" '
    'OR g."address" = a."address") '
    'JOIN usage u ON u."identifier" = g."identifier" AND u."day" >= :day AND '
    'u."createdAt" > :since WHERE a."identifier" = :i')
# The tokens that the guests who joined from this guest's address spent on `day`.
_ADDRESS_SPENT = text(
    'SELECT COALESCE(SUM(u."promptTokens" + u."replyTokens"), 0) FROM accounts a '
    'JOIN accounts g ON g."address" = a."address" AND g."kind" = \'guest\' '
    'JOIN usage u ON u."identifier" = g."identifier" AND u."day" = :day '
    'WHERE a."identifier" = :i')
_OLD_GUESTS = text('SELECT "identifier" FROM accounts WHERE "kind" = \'guest\' '
                   'AND "createdAt" < :before')


def is_guest(user) -> bool:
    metadata = getattr(user, "metadata", None)
    return isinstance(metadata, dict) and metadata.get("kind") == GUEST


def invited_profile(user) -> str | None:
    """The one chat profile a guest's invite allows, if it names one."""
    profile = user.metadata.get("profile") if is_guest(user) else None
    return profile if isinstance(profile, str) else None


class Guests:
    def __init__(self, engine: AsyncEngine, chats: int, retention_days: float,
                 reader: Reader | None = None, address_tokens: int | None = None,
                 turns_per_minute: int | None = None,
                 address_turns_per_minute: int | None = None):
        self.engine = engine
        self.reader = reader or Reader(engine, own=False)  # checks on every guest message
        self.chats = chats
        self.address_tokens = address_tokens
        self.turns_per_minute = turns_per_minute
        self.address_turns_per_minute = address_turns_per_minute
        self.retention_days = retention_days
        self._expiring: asyncio.Task | None = None

    async def turn_refusal(self, user, starts_chat: bool) -> str | None:
        """Why this login may not take a turn now (`starts_chat`: its first message would
        start a chat), or None; anyone but a guest: None, with no query."""
        if not is_guest(user):
            return None
        if starts_chat:
            held = (await self.reader.rows(_CHATS, {"i": user.identifier}))[0][0]
            if held >= self.chats:
                return (f"A guest can keep {self.chats} chats at most: delete one in the list "
                        "of chats to start another, or go on in one of them.")
        if self.turns_per_minute is not None or self.address_turns_per_minute is not None:
            now = datetime.now(timezone.utc)
            mine, theirs = (await self.reader.rows(_RECENT_TURNS, {
                "i": user.identifier, "day": (now - timedelta(minutes=1)).date().isoformat(),
                "since": (now - timedelta(minutes=1)).isoformat(timespec="seconds")}))[0]
            if self.turns_per_minute is not None and mine >= self.turns_per_minute:
                return (f"A guest can send {self.turns_per_minute} messages a minute at most. "
                        "Please wait a moment.")
            if self.address_turns_per_minute is not None and \
                    theirs >= self.address_turns_per_minute:
                return ("The guests on your network are sending many messages right now. "
                        "Please wait a moment.")
        if self.address_tokens is not None:
            spent = (await self.reader.rows(_ADDRESS_SPENT, {"i": user.identifier,
                                                              "day": today()}))[0][0]
            if spent >= self.address_tokens:
                return ("The guests on your network have used today's tokens for this demo. "
                        "Please try again tomorrow (UTC).")
        return None

    async def expire(self, now: datetime | None = None) -> int:
        """Guests older than the retention removed with their chats; how many."""
        now = now or datetime.now(timezone.utc)
        before = (now - timedelta(days=self.retention_days)).isoformat(timespec="seconds")
        async with self.engine.connect() as conn:
            old = (await conn.execute(_OLD_GUESTS, {"before": before})).scalars().all()
        return await self._remove(old)

    def start_expiring(self, every_s: float = EXPIRE_EVERY_S) -> None:
        """`expire` now and every `every_s` in the running loop (idempotent)."""
        if self._expiring is None:
            self._expiring = asyncio.create_task(self._expire_forever(every_s))

    async def _expire_forever(self, every_s: float) -> None:
        while True:
            try:
                if gone := await self.expire():
                    log.info("%d demo guest(s) past the retention removed, with their chats",
                             gone)
            except Exception:  # the database away for a moment: next time
                log.exception("removing demo guests past the retention failed")
            await asyncio.sleep(every_s)

    async def end_invite(self, invite_id: str) -> int:
        """The invite revoked and every guest of it removed with its chats; how many."""
        await Invites(self.engine).revoke(invite_id)
        async with self.engine.connect() as conn:
            guests = (await conn.execute(GUESTS_OF, {"id": invite_id})).scalars().all()
        return await self._remove(guests)

    async def _remove(self, identifiers) -> int:
        accounts, removed = Accounts(self.engine), 0
        for identifier in identifiers:
            try:
                await accounts.remove(identifier)
                removed += 1
            except AccountError:  # gone meanwhile (another app process's hourly run)
                pass
        return removed
