"""Chainlit's data layer (users, chats, their steps and feedback) on store/schema.py's
tables: the adapter between Chainlit and store/, written here rather than inherited
(Chainlit 2.12's SQLAlchemy layer pasted thread ids into its SQL text, and a client picks a
new chat's id). Every statement is fixed text from store/queries.py with its values bound.

- What Chainlit's layer did and the app relies on is kept: a step or thread written twice
  keeps the values not given again, thread metadata is merged (a key set to None goes),
  steps, elements and their deletions wait for the chat's first user message
  (`queue_until_user_message`), an element is not stored without a storage provider (none
  is configured: attached files are the app's own, store/documents.py, and a chat's are
  listed with its elements, each a link to its text).
- Guarded, where Chainlit's was not: a step's id that is another chat's is refused (a
  client chooses its messages' ids), a step or element goes only from the session's own
  chat, a thread's owner never changes, feedback is written and deleted only by the owner
  of its chat, one per step (`upsert_feedback` / `delete_feedback` take the owner: the
  app's own routes, chat/guard.py, call them).
- A failed statement is rolled back, logged, counted (`failures`, shown by /ready) and
  raised (Chainlit's caught everything and only logged). Chainlit writes steps in tasks it
  does not await, so `settle(thread_id)` waits for a thread's writes and returns what
  failed, to tell the user.
- A chat's steps are written in its own line, one after another in the order they came,
  and a write the database cannot take for now (restarting, unreachable, its disk full) is
  tried again in its place for up to VCHAT_DB_WAIT_S: the replies stream on meanwhile,
  and a step's later version never lands before an earlier one. Each write is an upsert of
  a whole step: tried twice, it is stored once.
- JSON columns are written as JSON text and read back as lists and dicts on both
  databases; tag lists are TEXT[] on PostgreSQL, JSON text on SQLite. A thread known to
  exist is not read again before each step (half a turn's statements). Thread times are
  UTC (chat/clock.py's clock, as the app's messages and steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import uuid
from typing import Any

from chainlit.context import context
from chainlit.data.base import BaseDataLayer
from chainlit.data.utils import queue_until_user_message
from chainlit.session import WebsocketSession
from chainlit.types import Feedback, PageInfo, PaginatedResponse, Pagination, ThreadFilter
from chainlit.user import PersistedUser, User
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from chat.attachments import element
from chat.clock import CLOCK
from engine.settings import setting
from store import queries as q
from store import rows as rows_
from store.schema import Reader, StoreError, connect, failure_text

log = logging.getLogger(__name__)

KNOWN_THREADS = 50_000  # thread ids remembered as existing (update_thread)
USER_THREADS = 1000  # a user's chats the sidebar can page through, newest first
PAGE_MAX = 100  # chats per page at most, whatever a client asks
SEARCH_CHARS = 200  # a sidebar search's words beyond this are not used
SESSION_KEY = "session"  # a login's session id in the user's token (chat/logins.py): not stored
RETRY_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # between tries of a waiting write, then the last
_waiting = contextvars.ContextVar("waiting", default=False)  # a failure now is tried again


AWAY_STATES = ("08", "53", "57P")  # PostgreSQL's connection lost or refused, out of disk
# or memory, shut down or starting (its SQLSTATE classes)
AWAY_SQLITE = ("locked", "busy", "full", "disk i/o", "unable to open")  # in SQLite's words


def database_away(exc: BaseException | None) -> bool:
    """Whether a statement failed for a reason the database's return mends (it restarts, is
    unreachable, lost the connection, its disk is full, its file locked), not one that
    refuses the statement itself (a constraint, bad data, a missing table)."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig
    if str(getattr(exc, "sqlstate", None) or "").startswith(AWAY_STATES):
        return True
    if type(exc).__name__ == "OperationalError" and "sqlite" in type(exc).__module__:
        return any(words in str(exc).lower() for words in AWAY_SQLITE)
    return isinstance(exc, (OSError, asyncio.TimeoutError))


def _session_thread() -> str | None:
    """The chat of the Chainlit session this call runs in, if any."""
    with contextlib.suppress(Exception):  # no session context (an HTTP request, a test)
        return context.session.thread_id
    return None


def _socket_session_of(thread_id: str) -> str | None:
    """The id of the socket session this call runs in, when its chat is `thread_id`."""
    with contextlib.suppress(Exception):  # no session context (an HTTP request, a test)
        session = context.session
        if isinstance(session, WebsocketSession) and session.thread_id == thread_id:
            return session.id
    return None


class ChatDataLayer(BaseDataLayer):
    def __init__(self, url: str, wait_s: float | None = None):
        self.engine = connect(url)  # store/schema.py's: SQLite set up
        self.wait_s = setting("VCHAT_DB_WAIT_S") if wait_s is None else wait_s
        self.reader = Reader(self.engine)  # for checks that only read
        self.sqlite = url.startswith("sqlite")
        self._threads: set[str] = set()  # threads this process knows exist
        self.failures = 0
        self.last_failure: str | None = None
        self._writes: dict[str, set[asyncio.Task]] = {}  # thread id -> writes under way
        self._lines: dict[str, list] = {}  # thread id -> [its lock, writes in its line]
        self._failed: dict[str, list[str]] = {}  # thread id -> what failed, not yet told
        self._told_no_storage = False

    # -- running statements -------------------------------------------------------------

    async def execute_sql(self, query: str | list[str], parameters: dict
                          ) -> list[dict[str, Any]] | int:
        """One statement (rows, or the rows it changed), or several in one transaction."""
        statements = query if isinstance(query, list) else [query]
        try:
            async with self.engine.begin() as conn:  # rolled back if anything fails
                for sql in statements:
                    result = await conn.execute(text(sql), parameters)
                rows = [dict(r._mapping) for r in result.fetchall()] if result.returns_rows \
                    else None
        except Exception as exc:
            if _waiting.get() and database_away(exc):  # tried again: not a failure yet
                raise StoreError(failure_text(exc)) from exc
            self._fail(failure_text(exc), statements[0].split()[0])
            raise StoreError(self.last_failure) from exc
        return result.rowcount if rows is None else [rows_.decoded(r) for r in rows]

    async def _in_line(self, thread_id: str, write):
        """`write()` in the chat's line (after the chat's writes that came before it), tried
        again while the database is away, until `self.wait_s` after it came."""
        deadline = time.monotonic() + self.wait_s  # from when it came, however long its line
        line = self._lines.setdefault(thread_id, [asyncio.Lock(), 0])
        line[1] += 1
        try:
            async with line[0]:
                return await self._patiently(thread_id, write, deadline)
        finally:
            line[1] -= 1
            if not line[1]:
                self._lines.pop(thread_id, None)

    async def _patiently(self, thread_id: str, write, deadline: float):
        attempt = 0
        while True:
            token = _waiting.set(time.monotonic() < deadline)
            try:
                return await write()
            except StoreError as exc:
                if not _waiting.get() or not database_away(exc.__cause__):
                    raise
                if attempt == 0:
                    log.warning("chat %s: the database is away (%s); its writes wait, in "
                                "order, up to %.0f s", thread_id, exc, self.wait_s)
            finally:
                _waiting.reset(token)
            await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
            attempt += 1

    def _fail(self, what: str, statement: str = "write") -> None:
        self.failures += 1
        self.last_failure = what
        log.error("database statement failed (%s): %s", statement, what)

    def _refuse(self, what: str) -> None:
        self._fail(what)
        raise StoreError(what)

    async def get_current_timestamp(self) -> str:
        return CLOCK.utc_now()  # the same UTC clock as the app's messages and steps

    async def build_debug_url(self) -> str:
        return ""

    async def close(self) -> None:
        await self.reader.dispose()
        await self.engine.dispose()

    async def healthy(self) -> bool:
        """Whether the database answers (/ready), on a reading connection: not in the
        writes' line, and not counted as a failed write."""
        try:
            await self.reader.rows(text(q.HEALTH))
            return True
        except Exception:  # down, unreachable, refusing: what /ready says
            return False

    # -- users ------------------------------------------------------------------------

    async def get_user(self, identifier: str) -> PersistedUser | None:
        rows = await self.execute_sql(q.USER_BY_IDENTIFIER, {"identifier": identifier})
        if not rows:
            return None
        row = rows[0]
        return PersistedUser(id=row["id"], identifier=row["identifier"],
                             createdAt=row["createdAt"], metadata=row["metadata"] or {})

    async def create_user(self, user: User) -> PersistedUser | None:
        """Chainlit reads, then inserts the user of each login: two first logins at once
        both inserted, and one failed (256 sessions at once found it; two replicas race the
        same way). One statement here makes or updates it. A login's session id
        is the token's, never stored."""
        metadata = json.dumps({k: v for k, v in (user.metadata or {}).items()
                               if k != SESSION_KEY})
        await self.execute_sql(q.USER_UPSERT, {
            "id": str(uuid.uuid4()), "identifier": user.identifier, "metadata": metadata,
            "createdAt": await self.get_current_timestamp()})
        return await self.get_user(user.identifier)

    # -- threads ----------------------------------------------------------------------

    async def get_thread_author(self, thread_id: str) -> str:
        """The chat's owner, or "" when there is no such chat (Chainlit answers 404)."""
        if not rows_.is_uuid(thread_id):
            return ""
        rows = await self.execute_sql(q.THREAD_AUTHOR, {"id": thread_id})
        return (rows[0]["userIdentifier"] or "") if rows else ""

    async def update_thread(self, thread_id: str, name: str | None = None,
                            user_id: str | None = None, metadata: dict | None = None,
                            tags: list[str] | None = None) -> None:
        """Create or change a chat. Chainlit calls this before every step it writes, only
        to be sure the thread exists: for a thread written here before, that call is
        skipped. Its owner, once set, stays."""
        asked = (name, user_id, metadata, tags) != (None,) * 4
        if thread_id in self._threads and not asked:
            return
        rows = await self.execute_sql(q.THREAD_METADATA, {"id": thread_id})
        if rows and not asked:
            self._know(thread_id)
            return
        stored = (rows[0]["metadata"] if rows else None) or {}
        stored = stored if isinstance(stored, dict) else {}
        given = metadata or {}
        merged = {**{k: v for k, v in stored.items() if k not in given},
                  **{k: v for k, v in given.items() if v is not None}}
        identifier = None
        if user_id:
            found = await self.execute_sql(q.USER_IDENTIFIER_BY_ID, {"id": user_id})
            identifier = found[0]["identifier"] if found else None
        await self.execute_sql(q.THREAD_UPSERT, rows_.bound(self.sqlite, {
            "id": thread_id, "createdAt": None if rows else await self.get_current_timestamp(),
            "name": name if name is not None else (merged.get("name") if metadata else None),
            "userId": user_id, "userIdentifier": identifier, "tags": tags,
            "metadata": merged, "sessionId": _socket_session_of(thread_id)}))
        self._know(thread_id)

    def _know(self, thread_id: str) -> None:
        if len(self._threads) >= KNOWN_THREADS:
            self._threads.clear()  # re-read once each
        self._threads.add(thread_id)

    async def chat_of_session(self, session_id: str, identifier: str) -> str | None:
        """The stored chat that socket session `session_id` last wrote to, if it is
        `identifier`'s: a page whose replica went away reconnects to another one with
        its session id and no chat id (Chainlit's page sends the chat's id only for a chat
        it reopened), and this finds its chat again. Asked at every new chat's start: on
        the reading connection, not in the line of the chats' writes."""
        try:
            rows = await self.reader.rows(text(q.THREAD_OF_SESSION),
                                          {"session": session_id, "identifier": identifier})
        except Exception as exc:  # the database away: said as the writes' failures are
            raise StoreError(failure_text(exc)) from exc
        return rows[0].id if rows else None

    async def take_over(self, thread_id: str, session_id: str) -> None:
        """Socket session `session_id` now holds the chat (a reopened or taken-over one)."""
        await self.execute_sql(q.THREAD_TAKEN_OVER, {"id": thread_id, "session": session_id})

    async def end_run(self, step_id: str) -> None:
        """A turn's run step that its process never ended (cut_off_run) gets an end."""
        await self.execute_sql(q.STEP_ENDED, {"id": step_id,
                                              "end": await self.get_current_timestamp()})

    async def get_thread(self, thread_id: str) -> dict | None:
        if not isinstance(thread_id, str):
            return None
        rows = await self.execute_sql(q.THREAD_BY_ID, {"id": thread_id})
        if not rows:
            return None
        steps = await self.execute_sql(q.STEPS_OF_THREAD, {"thread_id": thread_id})
        elements = await self.execute_sql(q.ELEMENTS_OF_THREAD, {"thread_id": thread_id})
        files = await self.execute_sql(q.DOCUMENTS_OF_THREAD, {"thread_id": thread_id})
        return {**rows_.thread(rows[0]), "steps": [rows_.step(s) for s in steps],
                "elements": [dict(e) for e in elements] +
                [element(f, thread_id, f["messageId"]) for f in files]}

    async def list_threads(self, pagination: Pagination, filters: ThreadFilter
                           ) -> PaginatedResponse:
        """A page of the user's own chats, newest activity first, optionally those whose
        messages contain the search words or that have a feedback of the given value.
        (The sidebar reads a chat's steps when it opens it: a page holds none.)"""
        if not filters.userId:
            raise ValueError("userId is required")
        words = (filters.search or "").strip()[:SEARCH_CHARS]
        rows = await self.execute_sql(q.THREADS_OF_USER, {
            "user_id": filters.userId, "search": rows_.like(words) if words else None,
            "feedback": None if filters.feedback is None else int(filters.feedback),
            "limit": USER_THREADS})
        threads = [rows_.thread(r) for r in rows]
        start = next((i + 1 for i, t in enumerate(threads) if t["id"] == pagination.cursor), 0)
        end = start + min(max(pagination.first, 1), PAGE_MAX)
        page = threads[start:end]
        return PaginatedResponse(
            pageInfo=PageInfo(hasNextPage=len(threads) > end,
                              startCursor=page[0]["id"] if page else None,
                              endCursor=page[-1]["id"] if page else None),
            data=page)

    async def delete_thread(self, thread_id: str) -> None:
        self._threads.discard(thread_id)
        await self.execute_sql(q.THREAD_DELETE, {"id": thread_id})

    # -- steps ------------------------------------------------------------------------

    @queue_until_user_message()
    async def create_step(self, step_dict: dict) -> None:
        """Chainlit runs this in a task of its own; the task is tracked per thread."""
        thread_id = step_dict.get("threadId")
        task = asyncio.current_task()
        if thread_id and task is not None:
            self._writes.setdefault(thread_id, set()).add(task)
        try:
            try:
                row = rows_.step_row(step_dict, self.sqlite)
            except ValueError as exc:
                self._refuse(str(exc))

            async def write() -> int:
                await self.update_thread(thread_id)
                return await self.execute_sql(q.STEP_UPSERT, row)

            if await self._in_line(thread_id, write) == 0:
                self._refuse(f"step {row['id']!r} belongs to another chat: not written")
        except Exception as exc:
            self._failed.setdefault(thread_id, []).append(str(exc))
            raise
        finally:
            if thread_id and task is not None:
                self._writes.get(thread_id, set()).discard(task)

    @queue_until_user_message()
    async def update_step(self, step_dict: dict) -> None:
        await self.create_step(step_dict)

    @queue_until_user_message()
    async def delete_step(self, step_id: str, thread_id: str | None = None) -> None:
        """Only from the session's own chat (a client chooses its messages' ids)."""
        thread_id = thread_id or _session_thread()
        if thread_id is None:
            self._refuse(f"step {step_id!r}: no chat to delete it from")
        await self._in_line(thread_id, lambda: self.execute_sql(
            q.STEP_DELETE, {"id": step_id, "thread_id": thread_id}))

    async def get_favorite_steps(self, user_id: str) -> list[dict]:
        rows = await self.execute_sql(q.STEPS_OF_USER, {"user_id": user_id})
        return [rows_.step(r) for r in rows
                if isinstance(r.get("metadata"), dict) and r["metadata"].get("favorite")]

    async def settle(self, thread_id: str) -> list[str]:
        """Wait for the thread's writes under way; what failed since the last call."""
        pending = [t for t in self._writes.get(thread_id, ()) if t is not asyncio.current_task()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return self._failed.pop(thread_id, [])

    # -- feedback ---------------------------------------------------------------------

    async def upsert_feedback(self, feedback: Feedback, owner: str | None = None
                              ) -> str | None:
        """The step's one feedback, made or changed: its id (whatever id the client sent),
        or None when the step is not in a chat of `owner`: nothing is written then."""
        if owner is None:
            return None  # Chainlit's own route would write for anyone: the app's routes call
        written = await self.execute_sql(q.FEEDBACK_UPSERT, {
            "id": str(uuid.uuid4()), "for_id": feedback.forId, "owner": owner,
            "value": int(feedback.value), "comment": feedback.comment})
        return written[0]["id"] if written else None

    async def delete_feedback(self, feedback_id: str, owner: str | None = None) -> bool:
        if owner is None:
            return False
        return bool(await self.execute_sql(q.FEEDBACK_DELETE, {"id": feedback_id,
                                                               "owner": owner}))

    # -- elements (files; none are stored without a storage provider) ------------------

    @queue_until_user_message()
    async def create_element(self, element) -> None:
        if not self._told_no_storage:
            self._told_no_storage = True
            log.warning("no file storage is configured: elements are shown, not stored")

    async def get_element(self, thread_id: str, element_id: str) -> dict | None:
        rows = await self.execute_sql(q.ELEMENT_BY_ID, {"thread_id": thread_id,
                                                        "id": element_id})
        return rows[0] if rows else None

    @queue_until_user_message()
    async def delete_element(self, element_id: str, thread_id: str | None = None) -> None:
        thread_id = thread_id or _session_thread()
        if thread_id is not None:
            await self.execute_sql(q.ELEMENT_DELETE, {"id": element_id, "thread_id": thread_id})

