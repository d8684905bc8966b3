"""What a demo's guests (store/invites.py) may keep, and when they go.

- A guest keeps at most `chats` chats: a message that would start another is refused in
  words before anything of it is stored. A guest sends at most `turns_per_minute` messages
  a minute; the guests who joined from one client address together at most
  `address_turns_per_minute`, and `address_tokens` a day (a script making guest after
  guest gets no more than that), besides each one's own quota. store/admission.py decides
  each turn by these `limits`, counting the turns under way.
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
from store.admission import GuestLimits
from store.invites import GUESTS_OF, Invites

log = logging.getLogger(__name__)

GUEST = "guest"  # the accounts' kind, and a guest login's token metadata "kind"
EXPIRE_EVERY_S = 3600.0

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
                 address_tokens: int | None = None,
                 turns_per_minute: int | None = None,
                 address_turns_per_minute: int | None = None):
        self.engine = engine
        self.chats = chats
        self.address_tokens = address_tokens
        self.turns_per_minute = turns_per_minute
        self.address_turns_per_minute = address_turns_per_minute
        self.retention_days = retention_days
        self._expiring: asyncio.Task | None = None

    @property
    def limits(self) -> GuestLimits:
        """What store/admission.py holds each guest's turns to."""
        return GuestLimits(self.chats, self.turns_per_minute, self.address_turns_per_minute,
                           self.address_tokens)

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
