"""Invite links for demo sessions: an admin makes a link that lets up to N people
in until it expires; each picks a name and chats as a guest, with no password.

- A link carries a secret (`token`, ~128 bits); only its SHA-256 is stored, as for API keys,
  so the database alone lets nobody in. The link is refused, in words, once revoked, expired
  or used up; a use is counted in the same statement that checks all three, so two people
  opening the last use at once get one account between them.
- A guest is an account of kind "guest" (store/accounts.py's table) with a generated
  identifier (`guest-` and 8 random characters: a guest's chosen name never collides with
  an account or claims its chats) and the chosen name to show; it remembers its invite.
  Guests have no password (none can match an empty hash), get no API key, and their
  session cookie is their key.
- Revoking a link ends every session of its guests at once (their sockets close within a
  second, chat/logins.py's sweeper) and refuses it from then on.
- The open demo (VCHAT_DEMO=open) makes guests with no invite (`join_open`), up to a
  number whose login is live.

    .venv/bin/python -m store invites add --uses 50 --expires 2h [--profile NAME]
    .venv/bin/python -m store invites list | revoke ID | end ID | expire [--days N]
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.admission import locked
from store.sessions import LoginSessions

GUEST_NAME_CHARS = 40  # a guest's chosen name, at most
MAX_USES = 10_000
MAX_EXPIRY_S = 30 * 24 * 3600
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

_REDEEM = text(
    'UPDATE invites SET "used" = "used" + 1 WHERE "tokenHash" = :h AND "revokedAt" IS NULL '
    'AND "expiresAt" > :now AND "used" < "uses"')
_STATE = text('SELECT "id", "uses", "used", "expiresAt", "revokedAt", "profile" FROM invites '
              'WHERE "tokenHash" = :h')
# Guests of the open demo (no invite) whose login is live: "at once", as the cap counts;
# all of them, and those who joined from :address.
_OPEN_GUESTS = text(
    'SELECT COUNT(DISTINCT s."identifier"), COUNT(DISTINCT CASE WHEN a."address" = :address '
    'THEN s."identifier" END) FROM login_sessions s JOIN accounts a ON '
    'a."identifier" = s."identifier" WHERE a."kind" = \'guest\' AND a."invite" IS NULL '
    'AND s."endedAt" IS NULL AND s."expiresAt" > :now')
_ADD_GUEST = text(
    'INSERT INTO accounts ("identifier", "passwordHash", "role", "createdAt", "kind", '
    '"invite", "displayName", "dailyTokens", "address") '
    "VALUES (:i, '', 'user', :c, 'guest', :invite, :name, :tokens, :address)")
GUESTS_OF = text('SELECT "identifier" FROM accounts WHERE "kind" = \'guest\' '
                 'AND "invite" = :id')
_JOINED_FROM = text('SELECT COUNT(*) FROM accounts WHERE "kind" = \'guest\' '
                    'AND "address" = :address AND "createdAt" > :since')


class InviteError(ValueError):
    """An invite that cannot be used or made, said in words (for the page or operator)."""


class LinkRefused(InviteError):
    """The link itself will not do: unknown, withdrawn, expired or used up."""


class DemoFull(InviteError):
    """The open demo has as many guests as it takes."""


@dataclass(frozen=True)
class Invite:
    id: str
    uses: int
    used: int
    expires_at: float
    profile: str | None
    created_at: str
    revoked: bool = False

    def state(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        return ("revoked" if self.revoked else "expired" if self.expires_at <= now
                else "used up" if self.used >= self.uses else "open")


@dataclass(frozen=True)
class Guest:
    identifier: str
    name: str
    invite: str | None  # None: a guest of the open demo
    profile: str | None
    login: str = ""  # its login session (store/sessions.py), opened as it joined


@dataclass(frozen=True)
class Joiner:
    """Where a guest joins from (the client's address), how many guests one address may
    make in an hour (None: any number), and how long a guest's login lasts. A room's
    people often share one address (a company's or a venue's network): the limit is for a
    script making guest after guest, not for people."""
    address: str | None = None
    per_hour: int | None = None
    login_s: float = 12 * 3600.0

    async def check(self, conn, now: float) -> None:
        """Refused in words when the address made its hour's guests; the first statement
        of the joining transaction: the address's joins are decided one at a time."""
        await locked(conn, f"joins:{self.address}")
        if self.address is None or self.per_hour is None:
            return
        since = datetime.fromtimestamp(now - 3600, timezone.utc).isoformat(timespec="seconds")
        made = (await conn.execute(_JOINED_FROM, {"address": self.address,
                                                  "since": since})).scalar_one()
        if made >= self.per_hour:
            raise InviteError("Too many guests have joined from your network in the last "
                              "hour. Please try again later.")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_duration(value: str) -> float:
    """'90s', '30m', '2h', '7d' in seconds; InviteError in words otherwise."""
    found = re.fullmatch(r"\s*(\d{1,7})\s*([smhd])\s*", value or "")
    seconds = int(found.group(1)) * _UNITS[found.group(2)] if found else 0
    if not 0 < seconds <= MAX_EXPIRY_S:
        raise InviteError(f"expiry {value!r}: a number and s, m, h or d (e.g. 2h), at most "
                          f"{MAX_EXPIRY_S // 86400} days")
    return float(seconds)


def guest_name(value) -> str:
    """A guest's chosen name, stripped; InviteError in words when empty, too long, or
    holding control or invisible formatting characters."""
    if not isinstance(value, str):
        raise InviteError("Please type a name.")
    name = " ".join(value.split())
    if not name:
        raise InviteError("Please type a name.")
    if len(name) > GUEST_NAME_CHARS:
        raise InviteError(f"A name can have at most {GUEST_NAME_CHARS} characters.")
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in name):
        raise InviteError("A name can hold letters, digits, spaces and punctuation only.")
    return name


class Invites:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def add(self, uses: int, expires_s: float, profile: str | None = None,
                  now: float | None = None) -> tuple[Invite, str]:
        """A new invite and its secret token (shown once: only its hash is kept)."""
        if not isinstance(uses, int) or not 0 < uses <= MAX_USES:
            raise InviteError(f"uses: a whole number from 1 to {MAX_USES}")
        now = time.time() if now is None else now
        token = secrets.token_urlsafe(16)
        invite = Invite(secrets.token_hex(4), uses, 0, now + expires_s, profile,
                        datetime.now(timezone.utc).isoformat(timespec="seconds"))
        async with self.engine.begin() as conn:
            await conn.execute(text(
                'INSERT INTO invites ("id", "tokenHash", "uses", "used", "expiresAt", '
                '"profile", "createdAt") VALUES (:id, :h, :uses, 0, :exp, :profile, :c)'),
                {"id": invite.id, "h": token_hash(token), "uses": uses,
                 "exp": invite.expires_at, "profile": profile, "c": invite.created_at})
        return invite, token

    async def list(self) -> list[Invite]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(text(
                'SELECT "id", "uses", "used", "expiresAt", "profile", "createdAt", '
                '"revokedAt" FROM invites ORDER BY "createdAt", "id"'))).all()
        return [Invite(r[0], r[1], r[2], r[3], r[4], r[5], r[6] is not None) for r in rows]

    async def check(self, token, now: float | None = None) -> Invite:
        """The invite the token opens, if it may still be used; InviteError otherwise."""
        now = time.time() if now is None else now
        async with self.engine.connect() as conn:
            row = (await conn.execute(_STATE, {"h": token_hash(token)})).first() \
                if isinstance(token, str) else None
        return _usable(row, now)

    async def redeem(self, token, name, now: float | None = None,
                     daily_tokens: int | None = None, joiner: Joiner = Joiner()) -> Guest:
        """A guest account for `name` through the invite, one use counted, at most
        `daily_tokens` a day (None: no quota); InviteError in words (nothing changed) when
        the name, the invite or the joiner's address will not do."""
        name = guest_name(name)
        now = time.time() if now is None else now
        if not isinstance(token, str):
            raise LinkRefused(_NO_SUCH)
        hashed = token_hash(token)
        async with self.engine.begin() as conn:
            await joiner.check(conn, now)
            if (await conn.execute(_REDEEM, {"h": hashed, "now": now})).rowcount != 1:
                _usable((await conn.execute(_STATE, {"h": hashed})).first(), now)
                raise LinkRefused(_NO_SUCH)  # (_usable raised already for a known link)
            row = (await conn.execute(_STATE, {"h": hashed})).first()
            return await _add_guest(conn, name, row.id, row.profile, daily_tokens, joiner)

    async def join_open(self, name, most: int, now: float | None = None,
                        daily_tokens: int | None = None, joiner: Joiner = Joiner(),
                        per_address: int | None = None) -> Guest:
        """A guest of the open demo (no invite) for `name`, with its login, unless `most`
        guests of it have a live login, or `per_address` of those joined from the joiner's
        address (DemoFull), or the name or the joiner's address will not do (InviteError);
        nothing changed then. Counted and taken in one transaction, one join at a time:
        the login that makes a guest count is opened in it."""
        name = guest_name(name)
        now = time.time() if now is None else now
        async with self.engine.begin() as conn:
            await locked(conn, "open-demo")
            await joiner.check(conn, now)
            live, theirs = (await conn.execute(_OPEN_GUESTS, {
                "now": now, "address": joiner.address})).one()
            if live >= most:
                raise DemoFull("The demo is full right now. Please try again later.")
            if per_address is not None and theirs >= per_address:
                raise DemoFull("Your network has as many guests in this demo as it may "
                               "have right now. Please try again later.")
            return await _add_guest(conn, name, None, None, daily_tokens, joiner)

    async def revoke(self, invite_id: str, now: float | None = None) -> int:
        """The invite refused from now on and its guests' sessions ended; how many ended."""
        now = time.time() if now is None else now
        async with self.engine.begin() as conn:
            done = await conn.execute(text(
                'UPDATE invites SET "revokedAt" = COALESCE("revokedAt", :now) WHERE "id" = :id'),
                {"now": now, "id": invite_id})
            if done.rowcount == 0:
                raise InviteError(f"no invite {invite_id!r}")
            guests = (await conn.execute(GUESTS_OF, {"id": invite_id})).scalars().all()
            sessions = LoginSessions(self.engine)
            return sum([await sessions.end_all(g, conn) for g in guests])


_NO_SUCH = "This invite link is not valid. Ask the person running the demo for a new one."


async def _add_guest(conn, name: str, invite: str | None, profile: str | None,
                     daily_tokens: int | None, joiner: Joiner) -> Guest:
    """A new guest account and its login session, in the caller's transaction."""
    identifier = "guest-" + secrets.token_hex(4)
    await conn.execute(_ADD_GUEST, {
        "i": identifier, "c": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "invite": invite, "name": name, "tokens": daily_tokens, "address": joiner.address})
    login = await LoginSessions(conn.engine).open(identifier, joiner.login_s, conn)
    return Guest(identifier, name, invite, profile, login)


def _usable(row, now: float) -> Invite:
    if row is None:
        raise LinkRefused(_NO_SUCH)
    if row.revokedAt is not None:
        raise LinkRefused("This invite link has been withdrawn.")
    if row.expiresAt <= now:
        raise LinkRefused("This invite link has expired.")
    if row.used >= row.uses:
        raise LinkRefused("This invite link has been used as many times as it allows.")
    return Invite(row.id, row.uses, row.used, row.expiresAt, row.profile, "")
