"""Login sessions, in the database, so that an account's access can end before its
token expires (a removed account's cookie must not read its chats).

Each login opens a session (a random id the login token carries, recorded with its
account's identifier); a token is good only while its session is live and its own: the
account the token names is the session's, the session is not ended, not past its lifetime,
and its account still there (a token naming alice with bob's live session id does not get
in).
Logging out ends that session; removing an account, changing its password or
`python -m store users logout NAME` ends all of the account's. The app checks the session
on every HTTP request, socket connection and message, and closes the sockets of ended ones
(chat/logins.py). Kept in the database, not in memory, so every app process on one
database (and the operator's commands, another process) sees the same.

The checks asked while one query runs share the next (`is_live`, a (session id, account)
pair each): a burst of messages (256 users pressing Enter together) costs two queries, not
256 in the database's line, each answer still read after its check was asked.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.schema import Reader

FORGET_AFTER_S = 86_400.0  # ended or expired sessions are deleted a day later

_OPEN = text('INSERT INTO login_sessions ("id", "identifier", "createdAt", "expiresAt") '
             "VALUES (:id, :i, :now, :expires)")
_FORGET = text('DELETE FROM login_sessions WHERE "expiresAt" < :before OR "endedAt" < :before')
_LIVE = text('SELECT s."id", s."identifier" FROM login_sessions s JOIN accounts a '
             'ON a."identifier" = s."identifier" WHERE s."id" IN :ids '
             'AND s."endedAt" IS NULL AND s."expiresAt" > :now').bindparams(
    bindparam("ids", expanding=True))
_END = text('UPDATE login_sessions SET "endedAt" = :now WHERE "id" = :id '
            'AND "identifier" = :i AND "endedAt" IS NULL')
_END_ALL = text('UPDATE login_sessions SET "endedAt" = :now WHERE "identifier" = :i '
                'AND "endedAt" IS NULL')


Login = tuple[str, str]  # (session id, the identifier of the account it is for)


def new_session_id() -> str:
    return secrets.token_urlsafe(18)


def _is_login(login) -> bool:
    return isinstance(login, tuple) and len(login) == 2 and \
        all(isinstance(part, str) for part in login)


class LoginSessions:
    def __init__(self, engine: AsyncEngine, reader: Reader | None = None):
        self.engine = engine
        self.reader = reader or Reader(engine, own=False)  # store/schema.py's
        self._asked: dict[Login, list[asyncio.Future]] = {}  # checks for the next query
        self._checking: asyncio.Task | None = None

    async def open(self, identifier: str, lifetime_s: float, conn=None) -> str:
        """A new session for the account, good for `lifetime_s`; its id. In `conn`'s
        transaction when given (a demo guest's login is opened with its place)."""
        if conn is None:
            async with self.engine.begin() as conn:
                return await self.open(identifier, lifetime_s, conn)
        session_id, now = new_session_id(), time.time()
        await conn.execute(_FORGET, {"before": now - FORGET_AFTER_S})
        await conn.execute(_OPEN, {"id": session_id, "i": identifier, "now": now,
                                   "expires": now + lifetime_s})
        return session_id

    async def live(self, logins) -> set[Login]:
        """Those of `logins`, (session id, account identifier) pairs, that are live now:
        each session live and the named account's own."""
        asked = {login for login in set(logins) if _is_login(login)}
        if not asked:
            return set()
        rows = await self.reader.rows(_LIVE, {"ids": list({s for s, _ in asked}),
                                              "now": time.time()})
        return asked & {(row[0], row[1]) for row in rows}

    async def is_live(self, session_id, identifier) -> bool:
        """Whether the session is live and `identifier`'s, from a query that began after
        this was asked; the checks asked meanwhile share one query."""
        login = (session_id, identifier)
        if not _is_login(login):
            return False
        answer = asyncio.get_running_loop().create_future()
        self._asked.setdefault(login, []).append(answer)
        if self._checking is None:
            self._checking = asyncio.create_task(self._check_asked())
        return await answer

    async def _check_asked(self) -> None:
        asked: dict[Login, list[asyncio.Future]] = {}
        try:
            while self._asked:
                asked, self._asked = self._asked, {}
                try:
                    live, failed = await self.live(asked), None
                except Exception as exc:  # each caller sees the database's failure
                    live, failed = set(), exc
                for login, answers in asked.items():
                    for answer in answers:
                        if answer.done():  # its caller went away
                            continue
                        if failed is not None:
                            answer.set_exception(failed)
                        else:
                            answer.set_result(login in live)
        finally:  # cancelled (shutdown): no caller waits for ever
            for answers in (*asked.values(), *self._asked.values()):
                for answer in answers:
                    answer.cancel()  # no-op where answered
            self._asked, self._checking = {}, None

    async def end(self, session_id: str, identifier: str) -> bool:
        """End the session, if it is `identifier`'s."""
        async with self.engine.begin() as conn:
            return (await conn.execute(_END, {"id": session_id, "i": identifier,
                                              "now": time.time()})).rowcount > 0

    async def end_all(self, identifier: str, conn=None) -> int:
        """End every session of the account (in `conn`'s transaction when given)."""
        if conn is not None:
            return (await conn.execute(_END_ALL, {"i": identifier, "now": time.time()})
                    ).rowcount
        async with self.engine.begin() as conn:
            return await self.end_all(identifier, conn)
