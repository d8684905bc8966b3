"""The HTTP calls that name a chat session, sent to the front end that holds it, when the
app runs as several (launcher.py).

A chat session lives in the process whose socket the browser holds; a button's action and
a custom element's update are HTTP calls naming that session, and the kernel may hand their
connection to any front end. One that does not hold the session forwards the call to the
others in turn, over their Unix sockets, with the run's secret in `x-vchat-peer`; a front
end answers a forwarded call for a session it does not hold with 421 at once, and forwards
nothing itself. A call whose session none holds is answered here as by a lone app (404 in
words, chat/guard.py). Other requests, the sockets' traffic among them, pass untouched.

The answer says which front end handled the call (`x-vchat-front-end`) and, when it was
forwarded, which one forwarded it (`x-vchat-forwarded-by`).
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

import httpx
from chainlit.session import WebsocketSession
from starlette.responses import JSONResponse, Response

from service.front_ends import PEER_HEADER

ROUTED = ("/project/action", "/project/element", "/project/file")
NOT_HERE = 421  # Misdirected Request: the session is in another front end
MAX_BODY = 1 << 20  # what chat/guard.py's BodyLimit lets these routes take (but uploads)
DROPPED = {"host", "content-length", "connection", "transfer-encoding", "content-encoding",
           PEER_HEADER}


class SessionRouting:
    """ASGI middleware: see the module's docstring. `front`: service.front_ends.FrontEnd."""

    def __init__(self, app, front, upload_bytes: int = MAX_BODY):
        self.app, self.front = app, front
        self.max_body = max(MAX_BODY, upload_bytes)  # an attached file is forwarded whole
        self.index = str(front.index).encode()
        self._peers: dict[int, httpx.AsyncClient] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(ROUTED):
            return await self.app(scope, receive, send)
        chunks, whole = await _read(receive, self.max_body)
        replay = _replay(chunks, whole, receive)
        session = _session_named(scope, b"".join(chunks)) if whole else None
        if session is None or WebsocketSession.get_by_id(session) is not None:
            return await self.app(scope, replay, self._marked(send))
        if self.front.from_peer(dict(scope["headers"]).get(PEER_HEADER.encode())):
            answer = JSONResponse({"detail": "That chat session is not in this front end."},
                                  status_code=NOT_HERE)
            return await answer(scope, replay, send)
        for index, path in enumerate(self.front.peers):
            if index != self.front.index:
                answer = await self._forward(index, path, scope, b"".join(chunks))
                if answer is not None:
                    return await answer(scope, replay, send)
        return await self.app(scope, replay, self._marked(send))

    def _marked(self, send):
        async def marked(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-vchat-front-end", self.index)]}
            await send(message)
        return marked

    async def _forward(self, index: int, path: str, scope, body: bytes) -> Response | None:
        """The peer's answer, or None where it does not hold the session (or is away)."""
        client = self._peers.get(index)
        if client is None:
            client = self._peers[index] = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://front-end",
                timeout=30.0)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in DROPPED]
        headers.append((PEER_HEADER, self.front.secret))
        query = scope.get("query_string", b"").decode("latin-1")
        try:
            answer = await client.request(scope["method"], scope["path"] + (
                f"?{query}" if query else ""), headers=headers, content=body)
        except httpx.HTTPError:
            return None
        if answer.status_code == NOT_HERE:
            return None
        kept = {k: v for k, v in answer.headers.multi_items() if k.lower() not in DROPPED}
        kept["x-vchat-forwarded-by"] = str(self.front.index)
        return Response(answer.content, answer.status_code, headers=kept)


async def _read(receive, max_body: int) -> tuple[list[bytes], bool]:
    """The request's body up to `max_body` (and whether that is all of it)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return chunks, False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body"):
            return chunks, True
        if size > max_body:
            return chunks, False


def _replay(chunks: list[bytes], whole: bool, receive):
    """`receive` for the app: the chunks read here, then the rest from the client."""
    pending = list(chunks)

    async def replay():
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body,
                    "more_body": bool(pending) or not whole}
        return await receive()
    return replay


def _session_named(scope, body: bytes) -> str | None:
    """The chat session a call names: its query's `session_id` or its JSON's `sessionId`."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("session_id"):
        return query["session_id"][0]
    try:
        named = json.loads(body).get("sessionId") if body else None
    except (ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None
