"""Checks on what clients send, where it enters Chainlit's server (a hostile client with an
ordinary account must neither read other accounts' data nor meet a 500).

- Socket connections: the auth's ids are UUIDs (a chat id is pasted nowhere, but a
  client picks it), the login session is live (chat/logins.py); the page's origin is this
  server's or one the operator listed (`allowed_origins`).
- Socket messages: a new message is a user message with a UUID id and text, nothing else
  from the client is kept (type, metadata: a client could forge stored replies); an edit
  names a message of this chat. Each is refused with a notice, and only while the login
  session is live is it answered.
- HTTP routes that take a chat session's id (actions, custom elements) answer 404 for an
  unknown session and 403 for another account's, in words; feedback is written only for
  the caller's own messages (chat/data_layer.py checks it in the statement); sharing a
  chat is refused while Chainlit's `allow_thread_sharing` is off.
- Request bodies are bounded before anything reads them (`BodyLimit`): the OpenAI API's
  by VCHAT_API_MAX_BODY_MB, an attached file's by VCHAT_DOCUMENT_MAX_MB, every other
  route's by OTHER_BODY_BYTES; Socket.IO bounds its own (engine.io's max_http_buffer_size,
  1 MB).
- Attached files (chat/attachments.py): uploaded to the caller's own session only, named by
  a message of that session only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from chainlit import server as chainlit_server
from chainlit.auth import get_current_user
from chainlit.chat_context import chat_contexts
from chainlit.context import init_ws_context
from chainlit.session import WebsocketSession
from chainlit.socket import _get_token
from chainlit.types import CallActionRequest, DeleteFeedbackRequest, ElementRequest
from chainlit.types import ShareThreadRequest, UpdateFeedbackRequest
from chainlit.user_session import user_sessions
from fastapi import APIRouter, Depends, HTTPException
from socketio import exceptions as socketio_errors
from sqlalchemy.exc import SQLAlchemyError
from starlette.responses import JSONResponse

from chat.attachments import Attachments
from chat.data_layer import ChatDataLayer
from chat.logins import Logins, end_session
from chat.session import Conversation
from engine import ChatError
from service.admission import Gate, Refusal
from service.documents import Document, Unreadable, megabytes
from service.loop import off_the_loop
from service.turn_metrics import Arrival
from store.admission import Hold
from store.rows import is_uuid
from store.schema import StoreError

log = logging.getLogger(__name__)

OTHER_BODY_BYTES = 1 << 20  # any route but the API: Chainlit's bodies are small JSON
UPLOAD_OVERHEAD = 64 << 10  # a file's multipart wrapping, on top of its size
FEEDBACK_CHARS = 10_000  # a feedback's comment
NAME_CHARS = 200  # a message's author name, a chat profile's name
ACTION_FIELDS = {"name", "payload", "label", "tooltip", "icon", "forId", "id"}
NOT_READ = "This message could not be read, so it was not sent. Please reload the page."
NOT_KEPT = "Your attached files could not be stored just now, so the message was not sent."
LOGIN_ENDED = "Your login has ended: please log in again."


def conversation_of(session: WebsocketSession) -> Conversation | None:
    """The chat state of a Chainlit session, from outside its context."""
    conv = user_sessions.get(session.id, {}).get("conversation")
    return conv if isinstance(conv, Conversation) else None


class Refused(socketio_errors.ConnectionRefusedError):
    """A socket connection refused; its text reaches the client."""


def allowed_origins(listed: list[str]):
    """engine.io's origin check: the server's own host (as the browser reached it, through
    a proxy too), or an origin the operator listed. Clients without an Origin (scripts)
    are not checked: the check protects browsers' cookies."""
    listed = {o.rstrip("/") for o in listed}

    def allowed(origin: str | None, environ: dict) -> bool:
        if not origin:  # asked for the answer's headers too, where there is no Origin
            return False
        if origin.rstrip("/") in listed:
            return True
        hosts = {environ.get("HTTP_HOST", "")}
        hosts |= {h.strip() for h in environ.get("HTTP_X_FORWARDED_HOST", "").split(",")}
        return bool(urlsplit(origin).netloc) and urlsplit(origin).netloc in hosts - {""}

    return allowed


def user_message(payload) -> dict | None:
    """What Chainlit needs of a new message, from a client's payload; None if it is not
    one (the browser always sends one)."""
    message = payload.get("message") if isinstance(payload, dict) else None
    if not isinstance(message, dict) or not is_uuid(message.get("id")) or \
            not isinstance(message.get("output"), str):
        return None
    name = message.get("name")
    created = message.get("createdAt")
    return {"message": {
        "id": message["id"], "threadId": "", "type": "user_message",
        "name": name[:NAME_CHARS] if isinstance(name, str) else "User",
        "output": message["output"], "createdAt": created if isinstance(created, str) else "",
    }, "fileReferences": []}


class Guard:
    def __init__(self, logins: Logins, store: ChatDataLayer, sharing: bool, gate: Gate,
                 release: Callable[[Hold], None], attachments: Attachments | None = None):
        self.logins, self.store, self.sharing = logins, store, sharing
        self.release = release  # a place held for a turn that will not run, given back
        # Files attached to messages (chat/attachments.py); the files of the message each
        # session's turn is about to answer, until its turn takes them (`documents`).
        self.attachments = attachments or Attachments(None, None, self.owned_session)
        self._documents: dict[str, list[Document]] = {}
        # May this session's turn start (service/admission.py): its message, asked before
        # Chainlit stores it, and its place in the account's limits, taken here.
        self.gate = gate
        # The places taken for each session's turns, until its turn takes them (`hold`).
        self._holds: dict[str, list[Hold]] = {}
        # When each session's last message reached the server, until its turn takes it
        # (`arrival`): a turn's first token is timed from there (service/turn_metrics.py).
        self._arrived: dict[str, Arrival] = {}
        self.router = APIRouter()
        route = self.router.add_api_route
        route("/project/action", self.action, methods=["POST"])
        route("/project/element", self.element, methods=["PUT", "DELETE"])
        route("/feedback", self.feedback, methods=["PUT"])
        route("/feedback", self.delete_feedback, methods=["DELETE"])
        route("/project/thread/share", self.share, methods=["PUT"])
        route("/project/share/{thread_id}", self.shared, methods=["GET"])

    # -- the socket -----------------------------------------------------------------------

    def install(self, http, sio, origins: list[str], api_body_bytes: int) -> None:
        """In front of Chainlit's server: the login checks (chat/logins.py), the routes
        here (the caller puts them before Chainlit's), the body limit, and the socket's
        origin check and event handlers."""
        if "*" in origins:
            raise ValueError(
                ".chainlit/config.toml: allow_origins = [\"*\"] lets any web site read "
                "its visitors' chats here with their logins; list the origins that may "
                "embed the chat, or leave it empty (this server's own origin only)")
        self.logins.install(http)
        http.include_router(self.logins.router)
        http.include_router(self.router)
        http.include_router(self.attachments.router)
        http.add_middleware(BodyLimit, api_bytes=api_body_bytes,
                            socket_path=chainlit_server.SOCKET_IO_PATH,
                            upload_bytes=self.upload_bytes)
        self._install_socket(sio, origins)

    def _install_socket(self, sio, origins: list[str]) -> None:
        sio.eio.cors_allowed_origins = allowed_origins(origins)
        handlers = sio.handlers["/"]
        self._connect, self._message, self._edit = (
            handlers["connect"], handlers["client_message"], handlers["edit_message"])
        sio.on("connect", self.connect)
        sio.on("client_message", self.message)
        sio.on("edit_message", self.edit)

    async def connect(self, sid, environ, auth=None):
        if not isinstance(auth, dict) or not is_uuid(auth.get("sessionId")):
            raise Refused("invalid session id")
        if auth.get("threadId") and not is_uuid(auth["threadId"]):
            raise Refused("invalid thread id")
        profile = auth.get("chatProfile")
        if profile is not None and (not isinstance(profile, str) or len(profile) > NAME_CHARS):
            raise Refused("invalid chat profile")
        if not await self.logins.live_token(_get_token(environ)):
            raise Refused("authentication failed")
        return await self._connect(sid, environ, auth)

    async def message(self, sid, payload=None):
        arrived = time.monotonic()
        session = await self._live_session(sid)
        if session is None:
            return
        checked = user_message(payload)
        if checked is None:
            await self._tell(session, NOT_READ)
            return
        try:
            documents = self.attachments.take(session.id, payload.get("fileReferences"))
        except Unreadable as exc:
            await self._tell(session, str(exc))
            return
        if refused := await self._refusal(session, checked["message"]["output"],
                                          starts_chat=not session.has_first_interaction,
                                          documents=documents) \
                or await self._keep(session, checked["message"]["id"], documents):
            self.attachments.put_back(session.id, documents)
            await self._tell(session, refused)
            return
        if documents:
            self._documents[session.id] = documents
        self._arrived[session.id] = Arrival(arrived, checked=time.monotonic())
        return await self._message(sid, checked)

    async def _keep(self, session: WebsocketSession, message_id: str,
                    documents: list[Document]) -> str | None:
        """The message's files stored with its chat, before Chainlit stores the message;
        why not (the account's storage is full, the database away), its place given back."""
        if not documents:
            return None
        try:
            await self.attachments.keep(session.user.identifier, session.thread_id,
                                        message_id, documents)
        except (ChatError, StoreError, SQLAlchemyError) as exc:
            if held := self.hold(session.id):
                self.release(held)
            if isinstance(exc, ChatError):
                return str(exc)
            log.error("storing attached files failed: %s", exc)
            return NOT_KEPT
        return None

    def documents(self, session_id: str) -> list[Document]:
        """The files of the message now being answered in this session (taken)."""
        return self._documents.pop(session_id, [])

    @property
    def upload_bytes(self) -> int:
        """The largest upload's body."""
        limits = self.attachments.limits
        return limits.max_bytes + UPLOAD_OVERHEAD if limits is not None else OTHER_BODY_BYTES

    def arrival(self, session_id: str) -> Arrival | None:
        """When the message now being answered in this session reached the server and
        passed the checks here, with now as when the app's handler got it (called there);
        None for one that did not come through the socket."""
        arrival = self._arrived.pop(session_id, None)
        if arrival is not None:
            arrival.handled = time.monotonic()
        return arrival

    async def edit(self, sid, payload=None):
        session = await self._live_session(sid)
        if session is None:
            return
        message = payload.get("message") if isinstance(payload, dict) else None
        known = {m.id for m in chat_contexts.get(session.id, [])}
        if not isinstance(message, dict) or message.get("id") not in known or \
                not isinstance(message.get("output"), str):
            await self._tell(session, NOT_READ)
            return
        if refused := await self._refusal(session, message["output"]):
            await self._tell(session, refused)
            return
        return await self._edit(sid, {"message": {"id": message["id"],
                                                  "output": message["output"]}})

    async def _live_session(self, sid) -> WebsocketSession | None:
        """The socket's Chainlit session while its login is live; else it is closed."""
        session = WebsocketSession.get(sid)
        if session is None:
            return None
        if not await self.logins.live_token(session.token):
            await self._tell(session, LOGIN_ENDED)
            await end_session(session)
            return None
        return session

    async def _refusal(self, session: WebsocketSession, text: str | None,
                       starts_chat: bool = False, documents: list[Document] = ()
                       ) -> str | None:
        """Why this session's turn may not start, asked of the gate before Chainlit sees its
        message (so a refused one is not stored): the message (`text`; None for a button's
        turn) and the account's limits. None: it may, its place held for it (`hold`)."""
        conv = conversation_of(session)
        user = getattr(session.user, "identifier", None)
        try:
            if conv is not None and text is not None:
                # A long message or its files is tokenized to see whether it fits: in a
                # worker thread, as the turn's own fitting is (service/loop.py).
                await off_the_loop(len(text) + sum(len(d.text) for d in documents),
                                   self.gate.message, text, conv.profile, user=user,
                                   system_prompt=conv.settings.system_prompt,
                                   max_tokens=conv.settings.max_tokens, documents=documents)
            # The profile the turn runs in (a guest's invite may fix it), not the one the
            # page asked for: its cost is counted there.
            hold = await self.gate.place(
                user, profile=conv.profile.name if conv is not None
                else session.chat_profile or "?", source="chat",
                reserve=conv.settings.max_tokens if conv is not None else 0,
                thread_id=session.thread_id, starts_chat=starts_chat)
        except Refusal as exc:
            return str(exc)
        if hold is not None:
            self._holds.setdefault(session.id, []).append(hold)
        return None

    def hold(self, session_id: str) -> Hold | None:
        """The place held for the session's next turn (taken: the turn gives it back or
        turns it into its cost, store/usage.py), or None where no limit applies."""
        held = self._holds.get(session_id)
        if not held:
            return None
        hold = held.pop(0)
        if not held:
            del self._holds[session_id]
        return hold

    @staticmethod
    async def _tell(session: WebsocketSession, text: str) -> None:
        await init_ws_context(session).emitter.send_toast(text, "error")

    # -- HTTP routes that name a chat session, a message or a chat ------------------------

    @staticmethod
    def owned_session(session_id: str, user) -> WebsocketSession:
        session = WebsocketSession.get_by_id(session_id) if isinstance(session_id, str) \
            else None
        if session is None:
            raise HTTPException(404, "This chat session has ended: reload the page.")
        if session.user is None or user is None or session.user.identifier != user.identifier:
            raise HTTPException(403, "This chat session belongs to another login.")
        return session

    async def action(self, payload: CallActionRequest, current_user=Depends(get_current_user)):
        session = self.owned_session(payload.sessionId, current_user)
        action = payload.action
        if set(action) - ACTION_FIELDS or not isinstance(action.get("name"), str) or \
                not isinstance(action.get("payload"), dict):
            raise HTTPException(400, "This button's data could not be read.")
        # A button's turn (Regenerate) is held to the account's limits as a message is.
        if refused := await self._refusal(session, None):
            await self._tell(session, refused)
            raise HTTPException(429, refused)
        return await chainlit_server.call_action(payload, current_user)

    async def element(self, payload: ElementRequest, current_user=Depends(get_current_user)):
        self.owned_session(payload.sessionId, current_user)
        element = payload.element
        if not all(isinstance(element.get(k), str) for k in ("id", "name", "display", "type")):
            raise HTTPException(400, "This element's data could not be read.")
        return {"success": False}  # the app has no custom elements to change

    async def feedback(self, update: UpdateFeedbackRequest,
                       current_user=Depends(get_current_user)):
        fb = update.feedback
        if fb.comment is not None and len(fb.comment) > FEEDBACK_CHARS:
            raise HTTPException(400, f"A comment may be at most {FEEDBACK_CHARS:,} characters.")
        if not is_uuid(fb.forId) or (fb.id is not None and not is_uuid(fb.id)):
            raise HTTPException(404, "No such message in your chats.")
        feedback_id = await self.store.upsert_feedback(fb, owner=current_user.identifier)
        if feedback_id is None:
            raise HTTPException(404, "No such message in your chats.")
        return JSONResponse({"success": True, "feedbackId": feedback_id})

    async def delete_feedback(self, payload: DeleteFeedbackRequest,
                              current_user=Depends(get_current_user)):
        if not await self.store.delete_feedback(payload.feedbackId,
                                                owner=current_user.identifier):
            raise HTTPException(404, "No such feedback in your chats.")
        return JSONResponse({"success": True})

    async def share(self, payload: ShareThreadRequest, current_user=Depends(get_current_user)):
        if not self.sharing:
            raise HTTPException(404, "Sharing chats is turned off on this server.")
        return await chainlit_server.share_thread(None, payload, current_user)

    async def shared(self, thread_id: str, current_user=Depends(get_current_user)):
        if not self.sharing:
            raise HTTPException(404, "Sharing chats is turned off on this server.")
        return await chainlit_server.get_shared_thread(None, thread_id, current_user)


API_PATHS = ("/v1/", "/invocations", "/tokenize", "/detokenize")  # api/openai.py's routes
UPLOAD_PATH = "/project/file"  # chat/attachments.py's


class BodyLimit:
    """ASGI middleware: a request body over its route's limit is answered 413 before the
    route reads it (by Content-Length, or counted as it arrives), in the API's error shape
    on the API's routes and Chainlit's ({"detail"}) elsewhere. The Socket.IO mount bounds
    its own."""

    def __init__(self, app, api_bytes: int, socket_path: str,
                 upload_bytes: int = OTHER_BODY_BYTES):
        self.app, self.api_bytes, self.socket_path = app, api_bytes, socket_path
        self.upload_bytes = upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(self.socket_path):
            return await self.app(scope, receive, send)
        api = scope["path"].startswith(API_PATHS)
        limit = self.api_bytes if api else self.upload_bytes \
            if scope["path"] == UPLOAD_PATH else OTHER_BODY_BYTES
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, api, limit, scope["path"] == UPLOAD_PATH)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, api, limit, scope["path"] == UPLOAD_PATH)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # then only a disconnect can come
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, api: bool, limit: int, upload: bool = False) -> None:
        text = f"The file is over this chat's limit of {megabytes(limit - UPLOAD_OVERHEAD)}." \
            if upload else f"The request body is over this server's limit of {limit:,} bytes."
        payload = {"error": {"message": text, "type": "invalid_request_error",
                             "code": "request_too_large"}} if api else {"detail": text}
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
