"""Login sessions, in the database, so that an account's access can end before its
token expires (issue 26: a removed account's cookie still read its chats).

Each login opens a session (a random id the login token carries); a token is good only
while its session is live: not ended, not past its lifetime, and its account still there.
Logging out ends that session; removing an account, changing its password or
`python -m store users logout NAME` ends all of the account's. The app checks the session
on every HTTP request, socket connection and message, and closes the sockets of ended ones
(chat/logins.py). Kept in the database, not in memory, so every app process on one
database (and the operator's commands, another process) sees the same.
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncEngine

FORGET_AFTER_S = 86_400.0  # ended or expired sessions are deleted a day later

_OPEN = text('INSERT INTO login_sessions ("id", "identifier", "createdAt", "expiresAt") '
             "VALUES (:id, :i, :now, :expires)")
_FORGET = text('DELETE FROM login_sessions WHERE "expiresAt" < :before OR "endedAt" < :before')
_LIVE = text('SELECT s."id" FROM login_sessions s JOIN accounts a '
             'ON a."identifier" = s."identifier" WHERE s."id" IN :ids '
             'AND s."endedAt" IS NULL AND s."expiresAt" > :now').bindparams(
    bindparam("ids", expanding=True))
_END = text('UPDATE login_sessions SET "endedAt" = :now WHERE "id" = :id '
            'AND "endedAt" IS NULL')
_END_ALL = text('UPDATE login_sessions SET "endedAt" = :now WHERE "identifier" = :i '
                'AND "endedAt" IS NULL')


def new_session_id() -> str:
    return secrets.token_urlsafe(18)


class LoginSessions:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def open(self, identifier: str, lifetime_s: float) -> str:
        """A new session for the account, good for `lifetime_s`; its id."""
        session_id, now = new_session_id(), time.time()
        async with self.engine.begin() as conn:
            await conn.execute(_FORGET, {"before": now - FORGET_AFTER_S})
            await conn.execute(_OPEN, {"id": session_id, "i": identifier, "now": now,
                                       "expires": now + lifetime_s})
        return session_id

    async def live(self, session_ids) -> set[str]:
        """Those of `session_ids` that are live now."""
        ids = [s for s in set(session_ids) if isinstance(s, str)]
        if not ids:
            return set()
        async with self.engine.connect() as conn:
            rows = await conn.execute(_LIVE, {"ids": ids, "now": time.time()})
            return {row[0] for row in rows}

    async def is_live(self, session_id) -> bool:
        return session_id in await self.live([session_id])

    async def end(self, session_id: str) -> bool:
        async with self.engine.begin() as conn:
            return (await conn.execute(_END, {"id": session_id, "now": time.time()})
                    ).rowcount > 0

    async def end_all(self, identifier: str, conn=None) -> int:
        """End every session of the account (in `conn`'s transaction when given)."""
        if conn is not None:
            return (await conn.execute(_END_ALL, {"i": identifier, "now": time.time()})
                    ).rowcount
        async with self.engine.begin() as conn:
            return await self.end_all(identifier, conn)
