"""Share links (store/shares.py keeps them), from the page's Export menu
(public/export-menu.js):

    GET    /share/allowed                whether the caller may make links ({"share": bool})
    POST   /share/chats/{chat id}        a link to one of the caller's chats, as it is now
    GET    /share/links                  the caller's live links (JSON)
    DELETE /share/links/{link id}        one of them revoked
    GET    /share                        the same list as a page, each with a Revoke button
    POST   /share/links/{link id}/revoke that button (then back to /share)
    GET    /shared/{link id}             what a link shows: a page of its own

Who may open a link is VCHAT_SHARE_VIEWERS: anyone logged in (guests too; the default),
anyone with the link (a public demo), or nobody (`off`: the routes answer 404). Guests may
make links only with VCHAT_GUEST_SHARING. Another's chat or link, or none, is one and the
same 404. The actions come only from this site's own pages (chat/invites.py's
`from_this_site`), so another site cannot make or revoke links with a visitor's cookie.

A shared chat's page runs no script and loads nothing (its Content-Security-Policy says
so): the model's and the user's Markdown is drawn from escaped text (`markdown_html`), so
raw HTML shows as text, and each link says where it goes. It sends no Referer onward.
"""

from __future__ import annotations

import html
import logging
import re
from collections.abc import Awaitable, Callable

from chainlit.auth import get_current_user
from fastapi import APIRouter, Depends, HTTPException, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from chat.invites import from_this_site
from store.guests import is_guest
from store.shares import NO_LINK, Shared, ShareRefused, Shares, TooManyLinks

log = logging.getLogger(__name__)

LINK_ID = re.compile(r"[A-Za-z0-9_-]{32}")  # store/shares.py's ids
NO_SUCH_LINK = "This link does not exist, or its owner revoked it."
NOT_FROM_HERE = "Share links are made and revoked from this site's own pages only."
GUESTS_MAY_NOT = "Guests of this demo cannot share their chats."
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
    "X-Robots-Tag": "noindex", "Cache-Control": "no-store"}
STYLE = """body{font:15px/1.5 system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem;
color:#1b1b1b;background:#fff}@media(prefers-color-scheme:dark){body{color:#e8e8e8;
background:#161616}a{color:#8ab4f8}}.meta{color:#777;font-size:13px}.msg{margin:1rem 0;
padding:.6rem .9rem;border-radius:10px;border:1px solid rgba(128,128,128,.3)}.user{
background:rgba(128,128,128,.08)}.who{font-weight:600;font-size:13px;margin-bottom:.3rem}
pre{overflow-x:auto;padding:.6rem;background:rgba(128,128,128,.12);border-radius:6px}
code{font-size:13px}.to{color:#777;font-size:12px}.files{font-size:13px;color:#666}
table{border-collapse:collapse}td,th{border-bottom:1px solid rgba(128,128,128,.3);
padding:.3rem .6rem;text-align:left}"""


class SharePages:
    def __init__(self, shares: Shares, viewers: str, guests_share: bool,
                 viewer: Callable[[Request], Awaitable[object | None]]):
        self.shares = shares
        self.viewers = viewers  # VCHAT_SHARE_VIEWERS: accounts, anyone, off
        self.guests_share = guests_share
        self.viewer = viewer  # the logged-in user of a request, or None
        self.router = APIRouter()
        if viewers == "off":
            return
        self.router.add_api_route("/share/allowed", self.allowed, methods=["GET"])
        self.router.add_api_route("/share/chats/{thread_id}", self.create, methods=["POST"])
        self.router.add_api_route("/share/links", self.links, methods=["GET"])
        self.router.add_api_route("/share/links/{link_id}", self.revoke, methods=["DELETE"])
        self.router.add_api_route("/share", self.links_page, methods=["GET"])
        self.router.add_api_route("/share/links/{link_id}/revoke", self.revoke_from_page,
                                  methods=["POST"])
        self.router.add_api_route("/shared/{link_id}", self.show, methods=["GET"])

    # -- the owner's side ------------------------------------------------------------

    def _may_share(self, request: Request, user) -> None:
        if not from_this_site(request):
            raise HTTPException(403, NOT_FROM_HERE)
        if is_guest(user) and not self.guests_share:
            raise HTTPException(403, GUESTS_MAY_NOT)

    async def allowed(self, current_user=Depends(get_current_user)) -> dict:
        """Whether the caller may make links (the page's menu offers them only then)."""
        return {"share": not (is_guest(current_user) and not self.guests_share)}

    async def create(self, thread_id: str, request: Request,
                     current_user=Depends(get_current_user)) -> JSONResponse:
        self._may_share(request, current_user)
        try:
            link = await self.shares.create(current_user.identifier,
                                            getattr(current_user, "display_name", None),
                                            thread_id)
        except TooManyLinks as exc:
            raise HTTPException(409, str(exc)) from None
        except ShareRefused as exc:
            raise HTTPException(404, str(exc)) from None
        log.info("share link made for a chat of %s", current_user.identifier)
        return JSONResponse({"id": link.id, "url": _url(request, link.id),
                             "title": link.title, "created_at": link.created_at},
                            status_code=201)

    async def links(self, request: Request, current_user=Depends(get_current_user)) -> dict:
        return {"links": [{"id": link.id, "url": _url(request, link.id), "title": link.title,
                           "chat": link.thread_id, "created_at": link.created_at}
                          for link in await self.shares.of(current_user.identifier)]}

    async def revoke(self, link_id: str, request: Request,
                     current_user=Depends(get_current_user)) -> Response:
        await self._revoke(link_id, request, current_user)
        return Response(status_code=204)

    async def revoke_from_page(self, link_id: str, request: Request,
                               current_user=Depends(get_current_user)) -> Response:
        await self._revoke(link_id, request, current_user)
        return RedirectResponse(str(request.url_for("links_page")), status_code=303)

    async def _revoke(self, link_id: str, request: Request, user) -> None:
        if not from_this_site(request):
            raise HTTPException(403, NOT_FROM_HERE)
        try:
            await self.shares.revoke(user.identifier, link_id)
        except ShareRefused:
            raise HTTPException(404, NO_LINK) from None

    async def links_page(self, request: Request,
                         current_user=Depends(get_current_user)) -> HTMLResponse:
        rows = "".join(
            f'<tr><td><a href="{html.escape(_url(request, link.id))}">'
            f'{html.escape(link.title)}</a></td><td class="meta">'
            f'{html.escape(link.created_at)}</td><td><form method="post" action="'
            f'{html.escape(str(request.url_for("revoke_from_page", link_id=link.id)))}">'
            f'<button type="submit">Revoke</button></form></td></tr>'
            for link in await self.shares.of(current_user.identifier))
        body = (f"<table><tr><th>Chat</th><th>Shared (UTC)</th><th></th></tr>{rows}</table>"
                if rows else "<p>You have no share links.</p>")
        return html_page("Your share links", "<h1>Your share links</h1><p class=meta>Each link "
                         "shows its chat as it was when shared. Revoked, it shows nothing.</p>"
                         + body)

    # -- a link opened -----------------------------------------------------------------

    async def show(self, link_id: str, request: Request) -> HTMLResponse:
        if self.viewers == "accounts" and await self.viewer(request) is None:
            return html_page("Log in to see this chat", "<h1>Log in to see this chat</h1><p>"
                             "Chats shared here are for this site's users. <a href=\"/login\">"
                             "Log in</a>, then open the link again.</p>", status=401)
        shared = await self.shares.shown(link_id) if LINK_ID.fullmatch(link_id) else None
        if shared is None:
            return html_page("No such link", f"<h1>No such link</h1><p>{NO_SUCH_LINK}</p>",
                             status=404)
        return html_page(shared.title, _chat_html(shared))


def _url(request: Request, link_id: str) -> str:
    return str(request.url_for("show", link_id=link_id))


def html_page(title: str, body: str, status: int = 200, style: str = STYLE,
              headers: dict = PAGE_HEADERS) -> HTMLResponse:
    """A page of the app's own that runs no script (also the admin page's, chat/admin.py)."""
    return HTMLResponse(
        f"<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport "
        f"content=\"width=device-width,initial-scale=1\"><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{body}</body></html>", status_code=status,
        headers=headers)


def _chat_html(shared: Shared) -> str:
    parts = [f"<h1>{html.escape(shared.title)}</h1><p class=meta>Shared by "
             f"{html.escape(shared.by)} on {html.escape(shared.created_at[:10])}: a copy of "
             "the chat as it was then.</p>"]
    for m in shared.messages:
        who = html.escape(shared.by) if m.role == "user" else "Assistant"
        files = "".join(f"<div>Attached: {html.escape(name)}</div>" for name in m.documents)
        parts.append(f'<div class="msg {m.role}"><div class=who>{who}</div>'
                     f'{markdown_html(m.text)}'
                     f'{f"<div class=files>{files}</div>" if files else ""}</div>')
    return "".join(parts)


# -- Markdown, from escaped text ---------------------------------------------------------

_HEADING = re.compile(r"#{1,6}\s+(.*)")
_ITEM = re.compile(r"\s*(?:[-*+]|\d{1,3}[.)])\s+(.*)")
_LINK = re.compile(r"\[([^\]\n]{1,500})\]\((https?://[^\s()*]{1,2000})\)")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_ITALIC = re.compile(r"(?<![*\w])\*(?=\S)([^*]+?)(?<=\S)\*(?![*\w])")


def markdown_html(source: str) -> str:
    """The common Markdown of chat replies (fenced code, headings, lists, bold, italics,
    inline code, links) as HTML, every character of `source` escaped first: no tag or
    attribute of the text's own can come through. A link keeps its text and says where it
    goes; only http(s) links are made links."""
    out: list[str] = []
    para: list[str] = []
    items: list[str] = []
    code: list[str] | None = None

    def flush() -> None:
        if para:
            out.append("<p>" + "<br>".join(para) + "</p>")
            para.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
            items.clear()

    for line in source.split("\n"):
        if line.lstrip().startswith("```"):
            if code is None:
                flush()
                code = []
            else:
                out.append("<pre><code>" + html.escape("\n".join(code)) + "</code></pre>")
                code = None
            continue
        if code is not None:
            code.append(line)
        elif not line.strip():
            flush()
        elif heading := _HEADING.fullmatch(line):
            flush()
            out.append(f"<h3>{_inline(heading[1])}</h3>")
        elif item := _ITEM.fullmatch(line):
            if para:
                flush()
            items.append(_inline(item[1]))
        else:
            if items:
                flush()
            para.append(_inline(line))
    if code is not None:  # a block left open ends with its message
        out.append("<pre><code>" + html.escape("\n".join(code)) + "</code></pre>")
    flush()
    return "".join(out)


def _inline(text: str) -> str:
    pieces = text.split("`")
    out = []
    for n, piece in enumerate(pieces):
        if n % 2 and n < len(pieces) - 1:  # between two backticks: code
            out.append(f"<code>{html.escape(piece)}</code>")
            continue
        if n % 2:  # an odd backtick out: as written
            piece = "`" + piece
        escaped = html.escape(piece)
        escaped = _LINK.sub(lambda m: f'<a href="{m[2]}" rel="nofollow noopener noreferrer" '
                                      f'target="_blank">{m[1]}</a> <span class=to>'
                                      f'({_host(m[2])})</span>', escaped)
        escaped = _BOLD.sub(r"<strong>\1</strong>", escaped)
        out.append(_ITALIC.sub(r"<em>\1</em>", escaped))
    return "".join(out)


def _host(url: str) -> str:
    """Where an escaped http(s) URL goes: its host (already escaped)."""
    return url.split("://", 1)[1].split("/", 1)[0]
