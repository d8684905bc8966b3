"""Read-only links to a chat as it was when shared (chat/shares.py serves them).

A link is a copy of the chat's messages at that moment (what a later message or edit does
to the chat does not reach it), the names of the files attached to them (not their text),
the chat's name and the name its owner shows to others; never the owner's account name,
other chats, feedback or anything the page did not show. Its id is 32 random URL-safe
characters (192 bits): the link is the key, so it cannot be guessed, and a revoked or
unknown id is one and the same answer. The owner lists and revokes their links; an account
keeps at most `most` live ones, checked and taken in one transaction under the account's
lock (store/admission.py's `locked`), so links made at the same moment cannot pass it
together. The links go with their account (store/accounts.py) and their chat.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from engine import ChatError
from store import export
from store.admission import locked

ID_BYTES = 24  # 32 characters of base64url
_LIVE = text('SELECT COUNT(*) FROM shares WHERE "identifier" = :i AND "revokedAt" IS NULL')
_ADD = text('INSERT INTO shares ("id", "identifier", "threadId", "title", "snapshot", '
            '"createdAt") VALUES (:id, :i, :thread, :title, :snapshot, :created)')
_OF = text('SELECT "id", "threadId", "title", "createdAt" FROM shares '
           'WHERE "identifier" = :i AND "revokedAt" IS NULL ORDER BY "createdAt" DESC, "id"')
_ONE = text('SELECT "title", "snapshot", "createdAt" FROM shares '
            'WHERE "id" = :id AND "revokedAt" IS NULL')
_REVOKE = text('UPDATE shares SET "revokedAt" = :now '
               'WHERE "id" = :id AND "identifier" = :i AND "revokedAt" IS NULL')
NOT_YOURS = "No such chat among your chats."
NO_LINK = "No such link among your links."


class ShareRefused(ChatError):
    """A link not made or revoked (not the caller's chat or link, or none), in words."""


class TooManyLinks(ShareRefused):
    """The account holds `most` live links already; nothing was made."""


@dataclass(frozen=True)
class SharedMessage:
    role: str  # "user" or "assistant"
    text: str
    documents: list[str]  # the attached files' names


@dataclass(frozen=True)
class Shared:
    """What a link shows."""
    title: str
    by: str  # the owner's display name
    created_at: str
    messages: list[SharedMessage]


@dataclass(frozen=True)
class Link:
    """One of an owner's live links."""
    id: str
    thread_id: str
    title: str
    created_at: str


def display_name(identifier: str, shown: str | None) -> str:
    """The name a link says its chat is by: the one the account shows (a guest's), else its
    account name without an e-mail address's domain."""
    return (shown or identifier.split("@", 1)[0]).strip()[:80] or "a user"


class Shares:
    def __init__(self, engine: AsyncEngine, most: int):
        self.engine = engine
        self.most = most  # live links per account

    async def create(self, owner: str, shown_name: str | None, thread_id: str) -> Link:
        """A link to the owner's chat as it is now; ShareRefused if it is not theirs (or
        none), or they hold `most` live links already."""
        chat = await export.chat(self.engine, thread_id, owner)
        if chat is None:
            raise ShareRefused(NOT_YOURS)
        title = (chat.name or "A chat")[:200]
        snapshot = {"by": display_name(owner, shown_name), "messages": [
            {"role": m.role, "text": m.text, "documents": [d["name"] for d in m.documents]}
            for m in chat.messages]}
        link = Link(secrets.token_urlsafe(ID_BYTES), thread_id, title,
                    datetime.now(timezone.utc).isoformat(timespec="seconds"))
        async with self.engine.begin() as conn:
            await locked(conn, f"shares:{owner}")
            if (await conn.execute(_LIVE, {"i": owner})).scalar_one() >= self.most:
                raise TooManyLinks(f"You have {self.most} share links already: revoke one you "
                                   "no longer need, then share again.")
            await conn.execute(_ADD, {"id": link.id, "i": owner, "thread": thread_id,
                                      "title": title, "snapshot": json.dumps(snapshot),
                                      "created": link.created_at})
        return link

    async def of(self, owner: str) -> list[Link]:
        """The owner's live links, newest first."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_OF, {"i": owner})).all()
        return [Link(r.id, r.threadId, r.title, r.createdAt) for r in rows]

    async def revoke(self, owner: str, link_id: str) -> None:
        """The owner's link refused from now on; ShareRefused for another's or none."""
        async with self.engine.begin() as conn:
            done = await conn.execute(_REVOKE, {"id": link_id, "i": owner, "now": datetime.now(
                timezone.utc).isoformat(timespec="seconds")})
        if done.rowcount != 1:
            raise ShareRefused(NO_LINK)

    async def shown(self, link_id: str) -> Shared | None:
        """What a live link shows; None for a revoked or unknown one."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(_ONE, {"id": link_id})).first()
        if row is None:
            return None
        snapshot = json.loads(row.snapshot)
        return Shared(row.title, snapshot["by"], row.createdAt,
                      [SharedMessage(m["role"], m["text"], m["documents"])
                       for m in snapshot["messages"]])
