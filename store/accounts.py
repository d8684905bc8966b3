"""Password accounts, in the same database as the chats (store/schema.py's `accounts`).

Passwords are kept only as argon2id hashes (argon2-cffi's defaults, RFC 9106's second
recommended set). A failed login answers the same whatever was wrong (no such user, wrong
password) and costs the same time (a dummy hash is checked for an unknown user); repeated
failures for one name are slowed down: the n-th failure in a row waits
min(0.25 * 2^(n-1), MAX_DELAY_S) before the next attempt is even checked. Failures from one
address are slowed the same way whatever names they try (`AddressThrottle`: one password
tried on many accounts).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.sessions import LoginSessions

HASHER = PasswordHasher()
MIN_PASSWORD_CHARS = 8
MAX_DELAY_S = 8.0
ACCOUNT_ROLES = ("admin", "user")
_DUMMY_HASH = HASHER.hash(secrets.token_urlsafe(16))
# What goes with an account (besides its sessions and the account itself), in this order.
_CHATS_OF = 'SELECT "id" FROM threads WHERE "userIdentifier" = :i'
_REMOVE_ACCOUNT_DATA = [
    'DELETE FROM api_keys WHERE "identifier" = :i',
    'DELETE FROM usage WHERE "identifier" = :i',
    'DELETE FROM documents WHERE "identifier" = :i',
    'DELETE FROM api_responses WHERE "identifier" = :i',
    'DELETE FROM shares WHERE "identifier" = :i',
    f'DELETE FROM feedbacks WHERE "threadId" IN ({_CHATS_OF})',
    f'DELETE FROM elements WHERE "threadId" IN ({_CHATS_OF})',
    f'DELETE FROM steps WHERE "threadId" IN ({_CHATS_OF})',
]
_NO_PASSWORD = {"sso": "single sign-on", "guest": "an invite (a demo's guest)"}
_REMOVE_THREADS = 'DELETE FROM threads WHERE "userIdentifier" = :i'


class AccountError(ValueError):
    """A request about accounts that cannot be done, said in words for the operator."""


@dataclass(frozen=True)
class Account:
    identifier: str
    role: str
    created_at: str
    kind: str = "password"  # or "sso": made by single sign-on, no password (chat/sso.py)
    daily_tokens: int | None = None  # its quota (store/usage.py); None: none
    display_name: str | None = None  # a guest's chosen name
    invite: str | None = None  # the invite a guest joined by (None: the open demo)


def failure_delay(failures: int) -> float:
    return 0.0 if failures <= 0 else min(0.25 * 2 ** (failures - 1), MAX_DELAY_S)


class AddressThrottle:
    """Failed logins in a row per client address, in the database (`login_failures`), so
    that every app process on it counts the same failures (a replica behind a proxy is
    no way around the wait): the next attempt from an address waits `failure_delay` of
    its failures, counted from the last one. A success from the address clears it; an hour
    without failures forgets it. Behind a reverse proxy the address is the forwarded one
    when the proxy is trusted (uvicorn trusts 127.0.0.1; FORWARDED_ALLOW_IPS names
    others), else every user shares the proxy's."""

    FORGET_S = 3600.0

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def wait_s(self, address: str, now: float | None = None) -> float:
        now = time.time() if now is None else now
        async with self.engine.connect() as conn:
            row = (await conn.execute(_ADDRESS_FAILURES, {"a": address})).first()
        if row is None or now - row.lastFailedAt > self.FORGET_S:
            return 0.0
        return max(0.0, failure_delay(row.failures) - (now - row.lastFailedAt))

    async def record(self, address: str, ok: bool, now: float | None = None) -> None:
        now = time.time() if now is None else now
        async with self.engine.begin() as conn:
            await conn.execute(_FORGET_ADDRESSES, {"before": now - self.FORGET_S})
            if ok:
                await conn.execute(_ADDRESS_CLEARED, {"a": address})
            else:
                await conn.execute(_ADDRESS_FAILED, {"a": address, "now": now,
                                                     "forget": self.FORGET_S})


_ADDRESS_FAILURES = text('SELECT "failures", "lastFailedAt" FROM login_failures '
                         'WHERE "address" = :a')
_FORGET_ADDRESSES = text('DELETE FROM login_failures WHERE "lastFailedAt" < :before')
_ADDRESS_CLEARED = text('DELETE FROM login_failures WHERE "address" = :a')
# One statement, so that two replicas' failures at once both count.
_ADDRESS_FAILED = text(
    'INSERT INTO login_failures ("address", "failures", "lastFailedAt") VALUES (:a, 1, :now) '
    'ON CONFLICT ("address") DO UPDATE SET "failures" = CASE WHEN :now - '
    'login_failures."lastFailedAt" > :forget THEN 1 ELSE login_failures."failures" + 1 END, '
    '"lastFailedAt" = :now')


def checked_name(identifier: str, role: str) -> str:
    """A new account's name, stripped, and its role; AccountError in words otherwise."""
    identifier = identifier.strip()
    if not identifier or len(identifier) > 200:
        raise AccountError("a user name needs 1 to 200 characters")
    if role not in ACCOUNT_ROLES:
        raise AccountError(f"role {role!r}: one of {', '.join(ACCOUNT_ROLES)}")
    return identifier


def generate_password() -> str:
    return secrets.token_urlsafe(15)  # 20 characters, ~120 bits


class Accounts:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def add(self, identifier: str, password: str, role: str = "user") -> Account:
        identifier = checked_name(identifier, role)
        if len(password) < MIN_PASSWORD_CHARS:
            raise AccountError(f"a password needs at least {MIN_PASSWORD_CHARS} characters")
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        hashed = await asyncio.to_thread(HASHER.hash, password)
        async with self.engine.begin() as conn:
            if await self._row(conn, identifier):
                raise AccountError(f"user {identifier!r} exists already")
            await conn.execute(text(
                'INSERT INTO accounts ("identifier", "passwordHash", "role", "createdAt") '
                "VALUES (:i, :h, :r, :c)"), {"i": identifier, "h": hashed, "r": role,
                                              "c": created})
        return Account(identifier, role, created)

    async def single_sign_on(self, identifier: str, role: str) -> Account | None:
        """The account of someone single sign-on let in (chat/sso.py): made at the first
        login, with no password (none can match it), its role set from the provider's word
        at every login. None when a password account has the name: it is not taken over."""
        identifier = checked_name(identifier, role)
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        async with self.engine.begin() as conn:
            await conn.execute(text(  # two first logins at once: one row
                'INSERT INTO accounts ("identifier", "passwordHash", "role", "createdAt", '
                """"kind") VALUES (:i, '', :r, :c, 'sso') ON CONFLICT ("identifier") """
                "DO NOTHING"), {"i": identifier, "r": role, "c": created})
            done = await conn.execute(text(
                """UPDATE accounts SET "role" = :r WHERE "identifier" = :i AND "kind" = 'sso'"""),
                {"i": identifier, "r": role})
            if done.rowcount == 0:
                return None
            row = await self._row(conn, identifier)
        return Account(row.identifier, row.role, row.createdAt, "sso")

    async def remove(self, identifier: str) -> int:
        """The account, its API keys, its login sessions (ended at once: store/sessions.py)
        and its chats go; how many chats went. The chats go with it so that an account
        added later under the same name starts with none of them."""
        async with self.engine.begin() as conn:
            await LoginSessions(self.engine).end_all(identifier, conn)
            # Its rows in the other tables first (SQLite enforces no foreign keys unless
            # told to).
            for sql in _REMOVE_ACCOUNT_DATA:
                await conn.execute(text(sql), {"i": identifier})
            chats = (await conn.execute(text(_REMOVE_THREADS), {"i": identifier})).rowcount
            await conn.execute(text('DELETE FROM users WHERE "identifier" = :i'),
                               {"i": identifier})
            done = await conn.execute(text('DELETE FROM accounts WHERE "identifier" = :i'),
                                      {"i": identifier})
            if done.rowcount == 0:
                raise AccountError(f"no user {identifier!r}")  # rolls it all back
        return chats

    async def set_password(self, identifier: str, password: str) -> int:
        """A new password; every session of the account ends. How many ended."""
        if len(password) < MIN_PASSWORD_CHARS:
            raise AccountError(f"a password needs at least {MIN_PASSWORD_CHARS} characters")
        hashed = await asyncio.to_thread(HASHER.hash, password)
        async with self.engine.begin() as conn:
            done = await conn.execute(text(
                'UPDATE accounts SET "passwordHash" = :h, "failedLogins" = 0 '
                """WHERE "identifier" = :i AND "kind" = 'password'"""),
                {"h": hashed, "i": identifier})
            if done.rowcount == 0:
                row = (await conn.execute(text('SELECT "kind" FROM accounts WHERE '
                                               '"identifier" = :i'), {"i": identifier})).first()
                raise AccountError(f"no user {identifier!r}" if row is None else
                                   f"{identifier} logs in by {_NO_PASSWORD.get(row[0], row[0])}"
                                   ", not with a password")
            return await LoginSessions(self.engine).end_all(identifier, conn)

    async def log_out_everywhere(self, identifier: str) -> int:
        """End every session of the account; how many ended."""
        async with self.engine.begin() as conn:
            if await self._row(conn, identifier) is None:
                raise AccountError(f"no user {identifier!r}")
            return await LoginSessions(self.engine).end_all(identifier, conn)

    async def list(self) -> list[Account]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(text(
                'SELECT "identifier", "role", "createdAt", "kind", "dailyTokens", "displayName", '
                '"invite" FROM accounts ORDER BY "identifier"'))).all()
        return [Account(*row) for row in rows]

    async def role(self, identifier: str) -> str | None:
        """The account's role now ("admin" or "user"), or None if there is no such account."""
        async with self.engine.connect() as conn:
            return (await conn.execute(text('SELECT "role" FROM accounts WHERE "identifier" = :i'),
                                       {"i": identifier})).scalar()

    async def count(self) -> int:
        async with self.engine.connect() as conn:
            return (await conn.execute(text("SELECT COUNT(*) FROM accounts"))).scalar_one()

    async def verify(self, identifier: str, password: str) -> Account | None:
        """The account if the password is right, else None (whatever was wrong). After
        failures in a row for this name, waits first (failure_delay)."""
        async with self.engine.connect() as conn:
            row = await self._row(conn, identifier)
        if row is not None and row.failedLogins:
            waited = time.time() - (row.lastFailedAt or 0)
            await asyncio.sleep(max(0.0, failure_delay(row.failedLogins) - waited))
        try:
            await asyncio.to_thread(HASHER.verify, row.passwordHash if row else _DUMMY_HASH,
                                    password)
            ok = row is not None
        except (VerificationError, InvalidHashError):
            ok = False
        if row is None:
            return None
        async with self.engine.begin() as conn:
            await conn.execute(text(
                'UPDATE accounts SET "failedLogins" = :n, "lastFailedAt" = :t '
                'WHERE "identifier" = :i'),
                {"n": 0 if ok else row.failedLogins + 1, "t": None if ok else time.time(),
                 "i": identifier})
        return Account(row.identifier, row.role, row.createdAt) if ok else None

    @staticmethod
    async def _row(conn, identifier: str):
        return (await conn.execute(text(
            'SELECT "identifier", "passwordHash", "role", "createdAt", "failedLogins", '
            '"lastFailedAt" FROM accounts WHERE "identifier" = :i'), {"i": identifier})).first()
