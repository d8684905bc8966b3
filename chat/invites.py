"""The invite page of a demo session (issue 32): GET /invite/TOKEN shows a form asking for a
name; POST makes the guest (store/invites.py), opens its login session as a password login
does (chat/logins.py), sets Chainlit's session cookie and sends the browser to the chat.

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

import chainlit as cl
from chainlit.auth import create_jwt
from chainlit.auth.cookie import set_auth_cookie
from chainlit.data import get_data_layer
from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, RedirectResponse

from store.invites import GUEST_NAME_CHARS, InviteError, Invites

log = logging.getLogger(__name__)

TOKEN = re.compile(r"[A-Za-z0-9_-]{16,64}")  # store/invites.py's tokens, 22 characters
FORM_BYTES = 4096  # a name's form, at most (the name itself: 40 characters)
NOT_FROM_HERE = "This form can only be sent from this site's own page."
TOO_LONG = f"A name can have at most {GUEST_NAME_CHARS} characters."


class InvitePage:
    def __init__(self, invites: Invites, open_session: Callable[[str], Awaitable[dict]],
                 app_name: str):
        self.invites = invites
        self.open_session = open_session  # Logins.open: the metadata a token carries
        self.app_name = app_name
        self.router = APIRouter()
        self.router.add_api_route("/invite/{token}", self.show, methods=["GET"])
        self.router.add_api_route("/invite/{token}", self.join, methods=["POST"])

    async def show(self, token: str) -> HTMLResponse:
        try:
            await self.invites.check(token if TOKEN.fullmatch(token) else None)
        except InviteError as exc:
            return self.page(str(exc), status=410, form=False)
        return self.page()

    async def join(self, token: str, request: Request):
        token = token if TOKEN.fullmatch(token) else None
        origin = request.headers.get("origin")
        if origin and origin.rstrip("/") != f"{request.url.scheme}://{request.url.netloc}":
            return self.page(NOT_FROM_HERE, status=403, form=False)
        try:
            await self.invites.check(token)
        except InviteError as exc:
            return self.page(str(exc), status=410, form=False)
        if int(request.headers.get("content-length") or 0) > FORM_BYTES:
            return self.page(TOO_LONG, status=400)
        try:
            name = (await request.form()).get("name")
        except Exception:  # not a form: said as a missing name
            name = None
        try:
            guest = await self.invites.redeem(token, name)
        except InviteError as exc:  # the name; or the link's last use went meanwhile
            return self.page(str(exc), status=400)
        user = cl.User(identifier=guest.identifier, display_name=guest.name,
                       metadata={"role": "user", "kind": "guest",
                                 **await self.open_session(guest.identifier)})
        if (layer := get_data_layer()) is not None:
            await layer.create_user(user)
        log.info("guest %s joined through invite %s", guest.identifier, guest.invite)
        response = RedirectResponse("/", status_code=303)
        set_auth_cookie(request, response, create_jwt(user))
        return response

    def page(self, said: str | None = None, status: int = 200, form: bool = True
             ) -> HTMLResponse:
        name = html.escape(self.app_name)
        note = f'<p class="said" role="alert">{html.escape(said)}</p>' if said else ""
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
