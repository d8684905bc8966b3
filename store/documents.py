"""Files attached to messages, kept with their chat: the text the model read of each, its
name, the message it came with and its owner (service/documents.py reads them). They go
with their message, their chat (store/queries.py's deletes) and their account
(store/accounts.py), and a guest's with the guest.

An account keeps at most `storage_bytes` of such text (UTF-8): checked and taken in one
transaction, under the account's lock (store/admission.py's `locked`), so messages sent at
the same moment cannot pass the limit together.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from engine import ChatError
from store.admission import locked

_STORED = text('SELECT COALESCE(SUM("stored"), 0) FROM documents WHERE "identifier" = :i')
_ADD = text(
    'INSERT INTO documents ("id", "threadId", "messageId", "identifier", "position", "name", '
    '"kind", "size", "stored", "text", "createdAt") VALUES (:id, :thread, :message, :i, '
    ':position, :name, :kind, :size, :stored, :text, :created)')
_OF_THREAD = text(
    'SELECT "id", "messageId", "name", "kind", "size", "text" FROM documents '
    'WHERE "threadId" = :thread AND "identifier" = :i ORDER BY "messageId", "position"')
_ONE = text('SELECT "id", "name", "kind", "size", "text" FROM documents '
            'WHERE "id" = :id AND "identifier" = :i')
_FORGET = text('DELETE FROM documents WHERE "messageId" = :message AND "identifier" = :i')


@dataclass(frozen=True)
class Document:
    """One attached file as the model reads it (service/documents.py reads it)."""
    id: str
    name: str
    kind: str  # service/extract.py's reader: text, html, pdf, docx
    size: int  # bytes as attached
    text: str


def megabytes(size: int) -> str:
    """A size in words: "51 KB", "20.0 MB"."""
    return f"{size / 1024:,.0f} KB" if size < 1 << 20 else f"{size / (1 << 20):,.1f} MB"


class StorageFull(ChatError):
    """The account's documents would pass its storage limit; nothing was stored."""


class Documents:
    def __init__(self, engine: AsyncEngine, storage_bytes: int = 0):
        self.engine = engine
        self.storage_bytes = storage_bytes  # 0: no limit

    async def add(self, owner: str, thread_id: str, message_id: str,
                  documents: list[Document]) -> None:
        """The message's documents stored, all or none (StorageFull)."""
        sizes = [len(d.text.encode()) for d in documents]
        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        async with self.engine.begin() as conn:
            await locked(conn, f"documents:{owner}")
            if self.storage_bytes:
                kept = (await conn.execute(_STORED, {"i": owner})).scalar_one()
                if kept + sum(sizes) > self.storage_bytes:
                    raise StorageFull(
                        f"Your attached files' text would come to {megabytes(kept + sum(sizes))}, "
                        f"over the {megabytes(self.storage_bytes)} this server keeps for an "
                        f"account ({megabytes(kept)} kept now). Delete chats with files you no "
                        "longer need, then attach again. Nothing was sent.")
            await conn.execute(_ADD, [
                {"id": d.id, "thread": thread_id, "message": message_id, "i": owner,
                 "position": n, "name": d.name, "kind": d.kind, "size": d.size,
                 "stored": size, "text": d.text, "created": now}
                for n, (d, size) in enumerate(zip(documents, sizes))])

    async def of_thread(self, thread_id: str, owner: str) -> dict[str, list[Document]]:
        """The chat's documents by the message they came with, in their order there."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_OF_THREAD, {"thread": thread_id, "i": owner})).all()
        out: dict[str, list[Document]] = {}
        for r in rows:
            out.setdefault(r.messageId, []).append(
                Document(r.id, r.name, r.kind, r.size, r.text))
        return out

    async def one(self, document_id: str, owner: str) -> Document | None:
        """One of the owner's documents; None for another account's or none."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(_ONE, {"id": document_id, "i": owner})).first()
        return None if row is None else Document(row.id, row.name, row.kind, row.size,
                                                 row.text)

    async def forget(self, message_id: str, owner: str) -> None:
        """The documents of a message that was not answered after all."""
        async with self.engine.begin() as conn:
            await conn.execute(_FORGET, {"message": message_id, "i": owner})
