"""API keys of accounts, for the OpenAI-compatible API (api/openai.py).

A key is `vck-<id>-<secret>`: the id names it in lists and when revoking; the whole key is
shown once, when made, and only its SHA-256 is stored (a random 192-bit secret needs no
slow hash: nobody can guess one to test against it). Removing an account removes its keys.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.accounts import AccountError

PREFIX = "vck"


@dataclass(frozen=True)
class ApiKey:
    id: str
    identifier: str  # the account it acts as
    label: str | None
    created_at: str


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def add(self, identifier: str, label: str | None = None) -> tuple[ApiKey, str]:
        """A new key for the account: (its record, the key itself, shown only now)."""
        key_id, secret = secrets.token_hex(4), secrets.token_urlsafe(24)
        key = f"{PREFIX}-{key_id}-{secret}"
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        async with self.engine.begin() as conn:
            kind = (await conn.execute(text(
                'SELECT "kind" FROM accounts WHERE "identifier" = :i'),
                {"i": identifier})).scalar_one_or_none()
            if kind is None:
                raise AccountError(f"no user {identifier!r}")
            if kind == "guest":  # a demo's guest (store/invites.py) chats on the page only
                raise AccountError(f"{identifier!r} is a guest: guests get no API key")
            await conn.execute(text(
                'INSERT INTO api_keys ("id", "keyHash", "identifier", "label", "createdAt") '
                "VALUES (:id, :h, :i, :l, :c)"),
                {"id": key_id, "h": _digest(key), "i": identifier, "l": label, "c": created})
        return ApiKey(key_id, identifier, label, created), key

    async def list(self, identifier: str | None = None) -> list[ApiKey]:
        where, params = ('WHERE "identifier" = :i', {"i": identifier}) if identifier else ("", {})
        async with self.engine.connect() as conn:
            rows = (await conn.execute(text(
                f'SELECT "id", "identifier", "label", "createdAt" FROM api_keys {where} '
                'ORDER BY "identifier", "createdAt"'), params)).all()
        return [ApiKey(*row) for row in rows]

    async def revoke(self, key_id: str) -> None:
        async with self.engine.begin() as conn:
            done = await conn.execute(text('DELETE FROM api_keys WHERE "id" = :id'),
                                      {"id": key_id})
        if done.rowcount == 0:
            raise AccountError(f"no API key {key_id!r}")

    async def account_of(self, key: str) -> str | None:
        """The account a presented key acts as, or None."""
        if not key.startswith(PREFIX + "-"):
            return None
        async with self.engine.connect() as conn:
            return (await conn.execute(text(
                'SELECT k."identifier" FROM api_keys k JOIN accounts a ON a."identifier" = '
                'k."identifier" WHERE k."keyHash" = :h AND a."kind" <> \'guest\''),
                {"h": _digest(key)})).scalar_one_or_none()
