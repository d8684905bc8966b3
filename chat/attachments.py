"""Files attached in the chat (the attach button, drag and drop), from upload to the stored
chat. Chainlit's page uploads each file to `POST /project/file` before the message is
sent, then names the files in the message (`fileReferences`). Here, in place of Chainlit's
route (which keeps the file's bytes in a folder):

- the upload is checked where it enters: the session is the caller's, attaching is on for
  the account (a demo's guests may have a smaller size limit, or none), the body is bounded
  while it arrives (chat/guard.py's BodyLimit, at the largest file allowed) and the file by
  its account's limit, the name and kind are ones the chat reads; its text is read at once,
  outside the event loop (service/documents.py), and a file that cannot be read is refused
  with the reason, which the page shows. Nothing of a refused file is kept.
- the text waits, in memory, with its session (`pending`: at most the files a message may
  carry) until a message names it: chat/guard.py takes it then (`take`), and the message's
  documents are stored with the chat before Chainlit stores the message (`keep`).
- `GET /documents/{id}` gives an owner the text the model read of one of their files (the
  page's link on a stored chat's message); anyone else gets 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import quote

from chainlit.auth import get_current_user
from chainlit.context import context
from chainlit.session import WebsocketSession
from fastapi import APIRouter, Depends, HTTPException, UploadFile
from sqlalchemy.exc import SQLAlchemyError
from starlette.responses import PlainTextResponse

from service.documents import Document, Reader, Unreadable, megabytes
from store.documents import Documents
from store.guests import is_guest
from store.rows import is_uuid
from store.schema import StoreError

log = logging.getLogger(__name__)

SESSION_WAIT_S = 5.0
WAITING_UPLOADS = 16
OFF = "Attaching files is turned off on this server."
GUESTS_OFF = "Guests of this demo cannot attach files."
GONE = ("An attached file is no longer on the server (the page was reloaded, or the "
        "message was sent already): attach it again.")


def element(document: Document | dict, thread_id: str, message_id: str) -> dict:
    """The file as Chainlit's page shows it under its message: its name, a link to its
    text."""
    found = document if isinstance(document, dict) else vars(document)
    return {"id": found["id"], "threadId": thread_id, "type": "file", "name": found["name"],
            "display": "inline", "forId": message_id, "url": f"/documents/{found['id']}",
            "mime": "text/plain", "size": None, "chainlitKey": None, "objectKey": None,
            "path": None, "language": None, "page": None, "props": {}, "autoPlay": None,
            "playerConfig": None}


class Attachments:
    def __init__(self, reader: Reader | None, store: Documents | None,
                 owned_session: Callable):
        self.reader = reader  # None: attaching is off
        self.store = store
        self.limits = reader.limits if reader is not None else None
        self.owned_session = owned_session  # chat/guard.py's: 404 gone, 403 another login's
        self._pending: dict[str, dict[str, Document]] = {}  # session id -> file id -> file
        self._reading: dict[str, int] = {}  # session id -> uploads being read
        self._waiting = 0  # uploads waiting for their session's socket
        self.router = APIRouter()
        self.router.add_api_route("/project/file", self.upload, methods=["POST"])
        self.router.add_api_route("/documents/{document_id}", self.text, methods=["GET"])

    @property
    def on(self) -> bool:
        return self.reader is not None and self.store is not None

    def max_bytes(self, user) -> int:
        return self.limits.guest_max_bytes if is_guest(user) else self.limits.max_bytes

    async def upload(self, session_id: str, file: UploadFile,
                     current_user=Depends(get_current_user)):
        try:
            session = await self._session(session_id, current_user)
            if not self.on:
                raise HTTPException(404, OFF)
            limit = self.max_bytes(session.user)
            if limit == 0:
                raise HTTPException(403, GUESTS_OFF)
            if file.size is not None and file.size > limit:
                raise HTTPException(413, f"{file.filename} is {megabytes(file.size)}; this chat "
                                         f"takes files up to {megabytes(limit)}.")
            pending = self._pending.setdefault(session.id, {})
            # Checked and counted with no await between: concurrent uploads of one session
            # cannot pass the limit together.
            if len(pending) + self._reading.get(session.id, 0) >= self.limits.files:
                raise HTTPException(400, f"A message takes at most {self.limits.files} "
                                         "files; send these first.")
            self._reading[session.id] = self._reading.get(session.id, 0) + 1
            try:
                document = await self.reader.read(file.filename, await file.read())
            except Unreadable as exc:
                raise HTTPException(400, str(exc)) from None
            finally:
                self._reading[session.id] -= 1
                if not self._reading[session.id]:
                    del self._reading[session.id]
            self._pending.setdefault(session.id, {})[document.id] = document
            log.info("session %s: %s read, %d characters", session.id, document.kind,
                     len(document.text))
            return {"id": document.id}
        finally:
            await file.close()

    async def _session(self, session_id: str, user):
        """The caller's chat session. A page connects its socket a moment after it loads,
        and a file dropped at once is uploaded before: its session is waited for a while
        (SESSION_WAIT_S), by a few uploads at a time."""
        if isinstance(session_id, str) and WebsocketSession.get_by_id(session_id) is None \
                and self._waiting < WAITING_UPLOADS:
            self._waiting += 1
            try:
                deadline = time.monotonic() + SESSION_WAIT_S
                while WebsocketSession.get_by_id(session_id) is None and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            finally:
                self._waiting -= 1
        return self.owned_session(session_id, user)

    def take(self, session_id: str, references: object) -> list[Document]:
        """The files a message names (its `fileReferences`), no longer pending; Unreadable
        when one is not this session's pending file. None named: []."""
        if not references:
            return []
        pending = self._pending.get(session_id, {})
        if not isinstance(references, list) or len(references) > max(len(pending), 1) or \
                not all(isinstance(r, dict) and r.get("id") in pending for r in references):
            raise Unreadable(GONE)
        ids = list(dict.fromkeys(r["id"] for r in references))
        return [pending.pop(i) for i in ids]

    def put_back(self, session_id: str, documents: list[Document]) -> None:
        """A refused message's files, pending again (the message may be sent again)."""
        for document in documents:
            self._pending.setdefault(session_id, {})[document.id] = document

    def drop(self, session_id: str) -> None:
        """The session ended: its unsent files go."""
        self._pending.pop(session_id, None)

    async def show(self, documents: list[Document], message_id: str) -> None:
        """A sent message's files under it on the page, as a stored chat shows them."""
        for document in documents:
            await context.emitter.send_element(
                element(document, context.session.thread_id, message_id))

    async def forget(self, message_id: str, owner: str | None) -> None:
        """The files of a message refused after they were stored (the app shutting down,
        the session's pace); a later message brings them again."""
        if owner is not None:
            with contextlib.suppress(StoreError, SQLAlchemyError):  # kept: shown, harmless
                await self.store.forget(message_id, owner)

    async def keep(self, owner: str, thread_id: str, message_id: str,
                   documents: list[Document]) -> None:
        """The message's files stored with its chat (store/documents.py: StorageFull past the
        account's limit)."""
        await self.store.add(owner, thread_id, message_id, documents)

    async def text(self, document_id: str, current_user=Depends(get_current_user)):
        found = None
        if self.store is not None and current_user is not None and is_uuid(document_id):
            found = await self.store.one(document_id, current_user.identifier)
        if found is None:
            raise HTTPException(404, "No such file in your chats.")
        return PlainTextResponse(found.text, headers={
            "Content-Disposition": f"inline; filename*=UTF-8''{_quoted(found.name)}.txt"})


def _quoted(name: str) -> str:
    return quote(name, safe="")
