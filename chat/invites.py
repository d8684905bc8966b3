"""The pages by which a demo's guests join: GET /invite/TOKEN shows a form asking
for a name; POST makes the guest (store/invites.py), opens its login session as a password
login does (chat/logins.py), sets Chainlit's session cookie and sends the browser to the
chat. With the open demo (VCHAT_DEMO=open) /demo does the same with no link, up to a number
of guests (beyond it: "the demo is full"), and a visitor of the chat with no login is sent
there.

An expired, used-up, withdrawn or forged link, a name that will not do (empty, longer than
store/invites.py's GUEST_NAME_CHARS, control or invisible characters) or a form posted from
another site gets this page again with the reason in words, and changes nothing. Every
value shown is escaped.
"""

from __future__ import annotations

import html
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import chainlit as cl
from chainlit.auth import create_jwt
from chainlit.auth.cookie import get_token_from_cookies, set_auth_cookie
from chainlit.data import get_data_layer
from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, RedirectResponse

from chat.data_layer import SESSION_KEY
from store.guests import GUEST
from store.invites import (GUEST_NAME_CHARS, DemoFull, Guest, InviteError, Invites, Joiner,
                           LinkRefused)

log = logging.getLogger(__name__)

TOKEN = re.compile(r"[A-Za-z0-9_-]{16,64}")  # store/invites.py's tokens, 22 characters
FORM_BYTES = 4096  # a name's form, at most (the name itself: 40 characters)
NOT_FROM_HERE = "This form can only be sent from this site's own page."
TOO_LONG = f"A name can have at most {GUEST_NAME_CHARS} characters."
DEMO_PATH = "/demo"


def from_this_site(request: Request) -> bool:
    """Whether a form was posted from this site's own page, by what the browser says:
    `Origin` where it sends one, else `Sec-Fetch-Site`, else `Referer`. A post that says
    none of them (a script, not a browser holding someone's cookie) is let through: these
    forms make a new guest, they act for no one logged in."""
    here = f"{request.url.scheme}://{request.url.netloc}"
    origin = request.headers.get("origin")
    if origin and origin != "null":
        return origin.rstrip("/") == here
    site = request.headers.get("sec-fetch-site")
    if site:
        return site in ("same-origin", "none")
    if origin == "null":  # a sandboxed or privacy-stripped page: not ours
        return False
    referer = request.headers.get("referer")
    if referer:
        parts = urlsplit(referer)
        return f"{parts.scheme}://{parts.netloc}" == here
    return True


def shaped(token: str) -> str | None:
    """The token from the path if it has a token's shape (else None: no such link)."""
    return token if TOKEN.fullmatch(token) else None


@dataclass(frozen=True)
class OpenDemo:
    """VCHAT_DEMO=open: anyone who opens the page may join as a guest, up to `most`, and up
    to `per_address` from one client address."""
    most: int
    by: str | None = None  # who runs it, said on the page and the banner
    per_address: int | None = None

    def banner(self, retention_days: float) -> str:
        by = f"a demo run by {self.by}" if self.by else "a demo"
        return (f"This is {by}: chats are temporary (removed after {retention_days:g} "
                "days), so keep nothing here you need.")


class InvitePage:
    def __init__(self, invites: Invites, login_s: float, app_name: str,
                 daily_tokens: int | None = None, demo: OpenDemo | None = None,
                 joins_per_address: int | None = None):
        self.invites = invites
        self.joins_per_address = joins_per_address  # guests one address makes in an hour
        self.daily_tokens = daily_tokens  # each guest's quota (VCHAT_GUEST_DAILY_TOKENS)
        self.login_s = login_s  # how long a guest's login lasts (VCHAT_GUEST_LOGIN_HOURS)
        self.app_name = app_name
        self.demo = demo
        self.router = APIRouter()
        self.router.add_api_route("/invite/{token}", self.show, methods=["GET"])
        self.router.add_api_route("/invite/{token}", self.join, methods=["POST"])
        if demo is not None:
            self.router.add_api_route(DEMO_PATH, self.show_demo, methods=["GET"])
            self.router.add_api_route(DEMO_PATH, self.join_demo, methods=["POST"])

    async def show(self, token: str) -> HTMLResponse:
        try:
            await self.invites.check(shaped(token))
        except InviteError as exc:
            return self.page(str(exc), status=410, form=False)
        return self.page()

    async def join(self, token: str, request: Request):
        token = shaped(token)
        try:
            await self.invites.check(token)
        except InviteError as exc:
            return self.page(str(exc), status=410, form=False)
        return await self._join(request, lambda name: self.invites.redeem(
            token, name, daily_tokens=self.daily_tokens, joiner=self.joiner(request)))

    async def show_demo(self) -> HTMLResponse:
        return self.page()

    async def join_demo(self, request: Request):
        return await self._join(request, lambda name: self.invites.join_open(
            name, self.demo.most, daily_tokens=self.daily_tokens, joiner=self.joiner(request),
            per_address=self.demo.per_address))

    def joiner(self, request: Request) -> Joiner:
        return Joiner(request.client.host if request.client else "unknown",
                      self.joins_per_address, self.login_s)

    async def _join(self, request: Request, make: Callable[[object], Awaitable[Guest]]):
        """The form's name, a guest made of it by `make`, its login, the cookie: or the page
        again with the reason (nothing changed)."""
        if not from_this_site(request):
            return self.page(NOT_FROM_HERE, status=403, form=False)
        if int(request.headers.get("content-length") or 0) > FORM_BYTES:
            return self.page(TOO_LONG, status=400)
        try:
            name = (await request.form()).get("name")
        except Exception:  # not a form: said as a missing name
            name = None
        try:
            guest = await make(name)
        except DemoFull as exc:
            return self.page(str(exc), status=503, form=False)
        except LinkRefused as exc:  # its last use went meanwhile
            return self.page(str(exc), status=410, form=False)
        except InviteError as exc:  # the name
            return self.page(str(exc), status=400)
        user = cl.User(identifier=guest.identifier, display_name=guest.name,
                       metadata={"role": "user", "kind": GUEST, "profile": guest.profile,
                                 SESSION_KEY: guest.login})
        if (layer := get_data_layer()) is not None:
            await layer.create_user(user)
        log.info("guest %s joined through %s", guest.identifier,
                 f"invite {guest.invite}" if guest.invite else "the open demo")
        response = RedirectResponse("/", status_code=303)
        set_auth_cookie(request, response, create_jwt(user))
        return response

    def send_visitors_to_the_demo(self, http, live_token: Callable[[str | None], Awaitable[bool]]
                                  ) -> None:
        """The open demo: a visitor of the chat's page with no live login goes to the demo's
        page instead of the login form (an account's login form stays at /login)."""

        @http.middleware("http")
        async def to_the_demo(request: Request, call_next):
            if request.method == "GET" and request.url.path == "/" and \
                    not await live_token(get_token_from_cookies(request.cookies)):
                return RedirectResponse(DEMO_PATH, status_code=303)
            return await call_next(request)

    def page(self, said: str | None = None, status: int = 200, form: bool = True
             ) -> HTMLResponse:
        name = html.escape(self.app_name)
        note = f'<p class="said" role="alert">{html.escape(said)}</p>' if said else ""
        if self.demo is not None and self.demo.by:
            note = f'<p class="small">A demo run by {html.escape(self.demo.by)}.</p>' + note
        body = ('<form method="post"><label for="name">Your name</label>'
                f'<input id="name" name="name" maxlength="{GUEST_NAME_CHARS}" required autofocus '
                'autocomplete="nickname"><button type="submit">Start chatting</button></form>'
                '<p class="small">You join as a guest: no password, and your chats are '
                'temporary.</p>') if form else ""
        return HTMLResponse(
            f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>Join {name}</title><style>{_STYLE}</style></head><body><main>'
            f'<h1>Join {name}</h1>{note}{body}</main></body></html>', status_code=status)


_STYLE = ("body{font-family:system-ui,sans-serif;background:#f6f6f7;color:#1d1d1f;margin:0}"
          "main{max-width:26rem;margin:12vh auto;padding:2rem;background:#fff;"
          "border-radius:12px;box-shadow:0 2px 12px #0001}"
          "h1{font-size:1.4rem;margin:0 0 1rem}label{display:block;margin-bottom:.4rem}"
          "input{width:100%;box-sizing:border-box;padding:.6rem;font-size:1rem;"
          "border:1px solid #bbb;border-radius:8px}"
          "button{margin-top:1rem;width:100%;padding:.7rem;font-size:1rem;border:0;"
          "border-radius:8px;background:#2f6feb;color:#fff;cursor:pointer}"
          ".said{background:#fdecea;color:#8a1c12;padding:.6rem;border-radius:8px}"
          ".small{color:#666;font-size:.85rem}")
