"""Responses the API keeps for a client to fetch again or build on (api/responses.py):
OpenAI's `store` and `previous_response_id`. Each row is one response as it was answered,
with the conversation it ended (the messages a follow-up continues), its owner (an
account's id, or the operator) and its status; a background response's row is written
queued and rewritten as it ends, unless it was cancelled meanwhile.

An owner keeps at most `keep` responses and `max_chars` characters of them (each response's
JSON and its conversation's, so a long chain of follow-ups, each holding the conversation so
far, cannot fill the database): the oldest go as a new one is stored, in the same
transaction under the owner's lock (store/admission.py `locked`), so requests at the same
moment cannot keep more; one larger than `max_chars` alone is not kept. They go with their
account too (store/accounts.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.admission import locked

_PUT = text(
    'INSERT INTO api_responses ("id", "identifier", "createdAt", "status", "response", '
    '"messages") VALUES (:id, :i, :created, :status, :response, :messages)')
_REWRITE = text(
    'UPDATE api_responses SET "status" = :status, "response" = :response, '
    '"messages" = :messages WHERE "id" = :id AND "identifier" = :i AND "status" <> '
    "'cancelled'")
_SIZES = text(
    'SELECT "id", LENGTH("response") + LENGTH("messages") AS "size" FROM api_responses '
    'WHERE "identifier" = :i ORDER BY "createdAt" DESC, "id" DESC')
_DROP = text('DELETE FROM api_responses WHERE "id" = :id')
_ONE = text('SELECT "status", "response", "messages" FROM api_responses '
            'WHERE "id" = :id AND "identifier" = :i')
_CANCEL = text(
    'UPDATE api_responses SET "status" = \'cancelled\', "response" = :response '
    'WHERE "id" = :id AND "identifier" = :i AND "status" IN (\'queued\', \'in_progress\')')
_FORGET = text('DELETE FROM api_responses WHERE "id" = :id AND "identifier" = :i')


@dataclass(frozen=True)
class Stored:
    status: str  # OpenAI's: queued, in_progress, completed, incomplete, cancelled, failed
    response: dict  # the response object as answered (or as it stands: queued)
    messages: list  # the conversation it ended, in chat-completion messages


class StoredResponses:
    def __init__(self, engine: AsyncEngine, keep: int = 1000, max_chars: int = 100_000_000):
        self.engine = engine
        self.keep = keep  # per owner; the oldest go first
        self.max_chars = max_chars  # per owner, of the rows' JSON

    async def put(self, owner: str, response: dict, messages: list) -> None:
        """A new response stored (its id is the response's), the owner's oldest beyond
        `keep` or `max_chars` dropped in the same transaction."""
        row = {"id": response["id"], "i": owner, "created": time.time(),
               "status": response["status"], "response": json.dumps(response),
               "messages": json.dumps(messages)}
        async with self.engine.begin() as conn:
            await locked(conn, f"responses:{owner}")
            await conn.execute(_PUT, row)
            kept, chars, gone = 0, 0, []
            for stored, size in (await conn.execute(_SIZES, {"i": owner})).all():
                if kept < self.keep and chars + size <= self.max_chars:
                    kept, chars = kept + 1, chars + size
                else:
                    gone.append({"id": stored})
            if gone:
                await conn.execute(_DROP, gone)

    async def rewrite(self, owner: str, response: dict, messages: list) -> bool:
        """A background response's end written over its row; False where it was cancelled
        (or dropped) meanwhile: nothing written."""
        async with self.engine.begin() as conn:
            done = await conn.execute(_REWRITE, {
                "id": response["id"], "i": owner, "status": response["status"],
                "response": json.dumps(response), "messages": json.dumps(messages)})
        return done.rowcount == 1

    async def get(self, response_id: str, owner: str) -> Stored | None:
        """The owner's response; None for another owner's, or none."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(_ONE, {"id": response_id, "i": owner})).first()
        if row is None:
            return None
        return Stored(row.status, json.loads(row.response), json.loads(row.messages))

    async def cancel(self, response_id: str, owner: str, response: dict) -> bool:
        """A queued or running response marked cancelled (its row now `response`); False
        where it has ended already."""
        async with self.engine.begin() as conn:
            done = await conn.execute(_CANCEL, {"id": response_id, "i": owner,
                                                "response": json.dumps(response)})
        return done.rowcount == 1

    async def forget(self, response_id: str, owner: str) -> bool:
        async with self.engine.begin() as conn:
            done = await conn.execute(_FORGET, {"id": response_id, "i": owner})
        return done.rowcount == 1
