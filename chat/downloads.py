"""A user's chats as files (store/export.py's JSON or Markdown), from the page's Export menu
(public/export-menu.js):

    GET /export/chats?format=json|md                every chat of the logged-in user
    GET /export/chats/{chat id}?format=json|md      one of them

Only the caller's own chats: another's, or none, is the same 404, so that nobody learns
which chats exist. The login is checked as on every route (chat/logins.py). A file is
never taken for another type (`nosniff`: a browser does not run a Markdown file as HTML).
"""

from __future__ import annotations

from datetime import datetime, timezone

from chainlit.auth import get_current_user
from fastapi import APIRouter, Depends, HTTPException
from starlette.responses import Response

from store import export

KINDS = {"json": ("application/json", export.as_json),
         "md": ("text/markdown; charset=utf-8", export.as_markdown)}
NOT_YOURS = "No such chat among your chats."


class Downloads:
    def __init__(self, engine):
        self.engine = engine
        self.router = APIRouter()
        self.router.add_api_route("/export/chats", self.all_chats, methods=["GET"])
        self.router.add_api_route("/export/chats/{thread_id}", self.one_chat, methods=["GET"])

    async def all_chats(self, format: str = "json", current_user=Depends(get_current_user)):
        kind = _kind(format)
        chats = await export.chats_of(self.engine, current_user.identifier)
        return _file(chats, kind, "chats")

    async def one_chat(self, thread_id: str, format: str = "json",
                       current_user=Depends(get_current_user)):
        kind = _kind(format)
        found = await export.chat(self.engine, thread_id, current_user.identifier)
        if found is None:
            raise HTTPException(404, NOT_YOURS)
        return _file([found], kind, f"chat-{thread_id[:8]}")


def _kind(name: str) -> str:
    if name not in KINDS:
        raise HTTPException(400, f"format {name[:20]!r}: json or md")
    return name


def _file(chats: list, kind: str, stem: str) -> Response:
    media, render = KINDS[kind]
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return Response(render(chats), media_type=media, headers={
        "Content-Disposition": f'attachment; filename="{stem}-{day}.{kind}"',
        "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
