"""What a demo's guests (store/invites.py) may keep, and when they go.

- A guest keeps at most `chats` chats: a message that would start another is refused in
  words before anything of it is stored (chat/guard.py asks `new_chat_refusal`).
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
from store.invites import Invites

log = logging.getLogger(__name__)

GUEST = "guest"  # the accounts' kind, and a guest login's token metadata "kind"
EXPIRE_EVERY_S = 3600.0

_CHATS = text('SELECT COUNT(*) FROM threads WHERE "userIdentifier" = :i')
_OLD_GUESTS = text('SELECT "identifier" FROM accounts WHERE "kind" = \'guest\' '
                   'AND "createdAt" < :before')
_GUESTS_OF = text('SELECT "identifier" FROM accounts WHERE "kind" = \'guest\' '
                  'AND "invite" = :id')


def is_guest(user) -> bool:
    metadata = getattr(user, "metadata", None)
    return isinstance(metadata, dict) and metadata.get("kind") == GUEST


def invited_profile(user) -> str | None:
    """The one chat profile a guest's invite allows, if it names one."""
    profile = user.metadata.get("profile") if is_guest(user) else None
    return profile if isinstance(profile, str) else None


class Guests:
    def __init__(self, engine: AsyncEngine, chats: int, retention_days: float):
        self.engine = engine
        self.chats = chats
        self.retention_days = retention_days
        self.retention = timedelta(days=retention_days)
        self._expiring: asyncio.Task | None = None

    async def new_chat_refusal(self, user) -> str | None:
        """Why this login may not start another chat now, or None."""
        if not is_guest(user):
            return None
        async with self.engine.connect() as conn:
            held = (await conn.execute(_CHATS, {"i": user.identifier})).scalar_one()
        if held < self.chats:
            return None
        return (f"A guest can keep {self.chats} chats at most: delete one in the list of "
                "chats to start another, or go on in one of them.")

    async def expire(self, now: datetime | None = None) -> int:
        """Guests older than the retention removed with their chats; how many."""
        now = now or datetime.now(timezone.utc)
        before = (now - self.retention).isoformat(timespec="seconds")
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
            guests = (await conn.execute(_GUESTS_OF, {"id": invite_id})).scalars().all()
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
