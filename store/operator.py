"""What an operator does to accounts and invites, decided in one place for the command line
(store/__main__.py) and the admin page (chat/admin.py): each action checks the values it is
given (as typed: text), does the change through the store's classes, and says what it did
in one sentence, the same words on both. A value that will not do raises AccountError,
InviteError or ValueError in words, and nothing is changed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from store.accounts import Accounts, generate_password
from store.guests import Guests
from store.invites import MAX_USES, Invite, InviteError, Invites, parse_duration
from store.usage import Usage, parse_quota


@dataclass(frozen=True)
class Secret:
    """An action's sentence and the secret it made (a password, an invite's token), which
    is shown this once: only its hash is kept."""
    said: str
    secret: str
    invite: Invite | None = None


def utc_minute(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def parse_uses(value) -> int:
    """An invite's number of uses, from text or a number."""
    try:
        uses = int(str(value).strip().replace(",", "").replace("_", ""))
    except ValueError:
        uses = 0
    if not 0 < uses <= MAX_USES:
        raise InviteError(f"uses: a whole number from 1 to {MAX_USES:,}")
    return uses


class Operator:
    def __init__(self, engine: AsyncEngine, guest_chats: int, guest_retention_days: float):
        self.engine = engine
        self.accounts = Accounts(engine)
        self.invites = Invites(engine)
        self.guest_chats = guest_chats
        self.guest_retention_days = guest_retention_days

    # -- accounts ------------------------------------------------------------------------

    async def add_user(self, name: str, password: str | None, admin: bool) -> Secret:
        """A new account; with no password given, one is made (and shown once)."""
        made = password is None
        password = generate_password() if made else password
        account = await self.accounts.add(name, password, role="admin" if admin else "user")
        return Secret(f"added {account.identifier} ({account.role})", password if made else "")

    async def remove_user(self, name: str) -> str:
        chats = await self.accounts.remove(name)
        return f"removed {name} and its {chats} chat(s); its sessions ended"

    async def set_password(self, name: str, password: str | None) -> Secret:
        """A new password (made, and shown once, when none is given); every session ends."""
        made = password is None
        password = generate_password() if made else password
        ended = await self.accounts.set_password(name, password)
        return Secret(f"changed the password of {name}; {ended} session(s) ended",
                      password if made else "")

    async def log_out(self, name: str) -> str:
        ended = await self.accounts.log_out_everywhere(name)
        return f"{ended} session(s) of {name} ended"

    async def set_quota(self, name: str, tokens: str) -> str:
        quota = parse_quota(tokens)
        await Usage(self.engine).set_quota(name, quota)
        return (f"{name}: no quota" if quota is None
                else f"{name}: at most {quota:,} tokens a day (UTC)")

    # -- invites -------------------------------------------------------------------------

    async def add_invite(self, uses, expires: str, profile: str | None,
                         profiles: Sequence[str], site: str) -> Secret:
        """A new invite link at `site` (the app's address) for up to `uses` guests until
        `expires` (90m, 2h, 7d), in `profile` only if one is named (one of `profiles`)."""
        uses = parse_uses(uses)
        expires_s = parse_duration(expires)
        if profile is not None and profile not in profiles:
            raise ValueError(f"profile {profile!r}: one of {', '.join(profiles)}")
        invite, token = await self.invites.add(uses, expires_s, profile)
        return Secret(f"invite {invite.id}: {invite.uses} use(s) until "
                      f"{utc_minute(invite.expires_at)}", f"{site.rstrip('/')}/invite/{token}",
                      invite)

    async def revoke_invite(self, invite_id: str) -> str:
        ended = await self.invites.revoke(invite_id)
        return f"revoked invite {invite_id}; {ended} guest session(s) ended"

    async def end_invite(self, invite_id: str) -> str:
        removed = await self._guests(self.guest_retention_days).end_invite(invite_id)
        return f"revoked invite {invite_id}; {removed} guest(s) removed with their chats"

    async def expire_guests(self, days: float | None) -> str:
        days = self.guest_retention_days if days is None else days
        if not days > 0:
            raise ValueError("--days: more than 0")
        removed = await self._guests(days).expire()
        return f"{removed} guest(s) older than {days:g} day(s) removed with their chats"

    def _guests(self, days: float) -> Guests:
        return Guests(self.engine, self.guest_chats, days)
