"""Login sessions on Chainlit's server: a token works only while its session is live and
the session is the account's the token names (store/sessions.py), wherever it is presented
(a removed account's cookie must not read its chats, nor its socket get answers, nor POST
/auth/jwt renew it; a token naming alice with bob's live session must not get in).

- A login opens a session; its id rides in the token (the user's metadata, `session`:
  never stored with the user, chat/data_layer.py).
- Every HTTP route that asks Chainlit for the current user gets it from `current_user`
  here (FastAPI's dependency override): the token's signature and expiry as before, and its
  session live in the database and its account's.
- A socket connects only with a live session (chat/guard.py's connect check calls
  `live_token`), and each message is checked again before it is answered; `Sweeper` closes,
  once a second, the sockets whose session ended (logout, account removed, password
  changed, `python -m store users logout NAME`, lifetime over), from any process.
- POST /auth/jwt renews a token only for a live session, and the new token carries the same
  session: nothing outlives the session's lifetime. POST /logout ends the session.
- Logins from an address that keeps failing wait, whatever names it tries
  (`slow_failing_addresses`; each name's own failures wait too, store/accounts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from chainlit import auth as chainlit_auth
from chainlit import server as chainlit_server
from chainlit.auth import authenticate_user, clear_auth_cookie, get_token_from_cookies
from chainlit.auth.jwt import decode_jwt
from chainlit.session import WebsocketSession, ws_sessions_id
from fastapi import APIRouter, Depends, HTTPException, Request, Response

from chat.data_layer import SESSION_KEY
from store.sessions import Login, LoginSessions

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # how often open sockets' sessions are checked


def login_of(token: str | None) -> Login | None:
    """(session id, account identifier) of a validly signed, unexpired token, else None."""
    if not token:
        return None
    try:
        user = decode_jwt(token)
    except Exception:  # bad signature, expired, not a token: no session
        return None
    session = (user.metadata or {}).get(SESSION_KEY)
    return (session, user.identifier) if isinstance(session, str) and \
        isinstance(user.identifier, str) else None


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Logins:
    """The app's side of login sessions: `install` puts it in front of Chainlit's server."""

    def __init__(self, sessions: LoginSessions, lifetime_s: float):
        self.sessions = sessions
        self.lifetime_s = lifetime_s
        self.router = APIRouter()
        self.router.add_api_route("/logout", self.logout, methods=["POST"])
        self.router.add_api_route("/auth/jwt", self.refresh, methods=["POST"])
        self._sweeper: asyncio.Task | None = None

    async def open(self, identifier: str) -> dict:
        """A new session for a login that succeeded: the metadata its token carries."""
        return {SESSION_KEY: await self.sessions.open(identifier, self.lifetime_s)}

    async def live_token(self, token: str | None) -> bool:
        login = login_of(token)
        return login is not None and await self.sessions.is_live(*login)

    def install(self, http) -> None:
        """Chainlit's current-user dependency, for every route that has it."""
        http.dependency_overrides[chainlit_auth.get_current_user] = self.current_user

    async def current_user(self, token: str | None = Depends(chainlit_auth.reuseable_oauth)):
        if not await self.live_token(token):
            raise HTTPException(status_code=401, detail="Your login has ended: please log "
                                "in again.")
        return await authenticate_user(token)

    async def user_of(self, request: Request):
        """The logged-in user of a request (its cookie or bearer token), or None: the same
        check as `current_user`, for a page that also answers visitors."""
        try:
            return await self.current_user(get_token_from_cookies(request.cookies)
                                           or bearer(request))
        except HTTPException:
            return None

    async def refresh(self, request: Request):
        """Chainlit's token exchange, for a live session only."""
        if not await self.live_token(bearer(request)):
            raise HTTPException(status_code=401, detail="Invalid token")
        return await chainlit_server.jwt_auth(request)

    async def logout(self, request: Request, response: Response) -> dict:
        """The session of this browser's token ends (on every replica at once), its
        sockets close, and the cookie is cleared."""
        login = login_of(get_token_from_cookies(request.cookies) or bearer(request))
        if login is not None:
            await self.sessions.end(*login)
            await self.close_sockets(lambda s: login_of(s.token) == login)
        clear_auth_cookie(request, response)
        return {"success": True}

    # -- open sockets -------------------------------------------------------------------

    def start_sweeping(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except Exception:  # the database away for a moment: next time
                log.exception("checking the open sessions' logins failed")

    async def sweep(self) -> int:
        """Close the sockets whose login session is no longer live; how many."""
        held = {s.id: login_of(s.token) for s in list(ws_sessions_id.values())
                if s.token is not None}
        if not held:
            return 0
        live = await self.sessions.live(held.values())
        return await self.close_sockets(lambda s: s.id in held and held[s.id] not in live)

    async def close_sockets(self, ended) -> int:
        """End the Chainlit sessions `ended(session)` picks: their reply stops, their socket
        closes, and nothing of them is kept for a reconnect."""
        closing = [s for s in list(ws_sessions_id.values()) if ended(s)]
        for session in closing:
            await end_session(session)
        if closing:
            log.info("closed %d chat session(s) whose login ended", len(closing))
        return len(closing)


def slow_failing_addresses(http, throttle) -> None:
    """POST /login from an address that keeps failing waits (`throttle`, an
    AddressThrottle, in the database: every replica counts the same failures):
    Chainlit's login callback is not told the address, so this wraps
    its route."""

    @http.middleware("http")
    async def slowed(request, call_next):
        if request.method != "POST" or request.url.path != "/login":
            return await call_next(request)
        address = request.client.host if request.client else "unknown"
        await asyncio.sleep(await throttle.wait_s(address))
        response = await call_next(request)
        await throttle.record(address, ok=response.status_code < 400)
        return response


async def end_session(session: WebsocketSession) -> None:
    session.to_clear = True  # Chainlit's disconnect then clears it at once
    task = session.current_task
    if task is not None and not task.done():
        task.cancel()
    with contextlib.suppress(Exception):
        await chainlit_server.sio.disconnect(session.socket_id)
    if WebsocketSession.get_by_id(session.id) is session:  # not connected: clear it here
        with contextlib.suppress(Exception):
            await session.delete()
