"""A chat session's messages leave the process with the session.

Chainlit 2.12 keeps every session's messages in `chat_contexts` (session id -> its
`Message` objects) and never removes the entry: deleting a session (a browser's "New
chat", a closed tab after `session_timeout`, a login that ended) drops the session and
its user session, not its messages. So every chat ever opened stayed in memory, and
Python's full garbage collections, which stop every session, walked all of them
(BENCHMARKS.md, "Both profiles at once", 2026-12-03).

`install()` makes a deleted session take its messages and its user session along,
whichever way it was deleted (chat/logins.py's `end_session` deletes one directly).
"""

from __future__ import annotations

from chainlit.chat_context import chat_contexts
from chainlit.session import WebsocketSession, ws_sessions_id
from chainlit.user_session import user_sessions


def install() -> None:
    """Idempotent."""
    delete = WebsocketSession.delete
    if getattr(delete, "forgets", False):
        return

    async def delete_and_forget(session: WebsocketSession) -> None:
        try:
            await delete(session)
        finally:
            chat_contexts.pop(session.id, None)
            user_sessions.pop(session.id, None)

    delete_and_forget.forgets = True
    WebsocketSession.delete = delete_and_forget


def installed() -> bool:
    return getattr(WebsocketSession.delete, "forgets", False)


def held() -> dict[str, int]:
    """Chat sessions in memory and their message lists (never more lists once installed)."""
    return {"sessions": len(ws_sessions_id), "message_lists": len(chat_contexts)}


def report_to(gauge) -> None:
    """`held()` as a Prometheus gauge labelled by `what`, read at each scrape."""
    for what in ("sessions", "message_lists"):
        gauge.labels(what).set_function(lambda what=what: held()[what])
