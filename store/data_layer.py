"""Chainlit's SQLAlchemy data layer on store/schema.py's tables, with its traps handled.

- SQLite binds no Python lists or dicts, and Chainlit passes thread and step `tags` (lists)
  and step `modes` (a dict) as they are: on SQLite they are written as JSON text. JSON
  columns come back from SQLite as text (thread metadata among them, which the UI and a
  resumed chat read as a dict): on SQLite they are read back as lists and dicts.
- Chainlit's `execute_sql` catches every error, logs a warning and returns None, so a failed
  INSERT loses data without a trace. Here a failed statement is rolled back, logged as an
  error, counted (`failures`, shown by the app's /ready) and raised. Chainlit writes steps
  in tasks it does not await, so the app asks `settle(thread_id)` after a turn (in a task
  of its own: the turn does not wait): it waits for that thread's writes and returns what
  failed, to tell the user.
- Chainlit reads the thread before every step it writes; a thread known to exist is not
  read again. SQLite gets one connection in WAL mode (store/schema.py's `connect`).
- Thread times are written in UTC by chat/stalls.py's clock, as the app's messages and
  steps are (Chainlit writes local time with a "Z").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from chainlit.data.sql_alchemy import SQLAlchemyDataLayer
from sqlalchemy import text

from chat.stalls import CLOCK
from store.schema import connect

log = logging.getLogger("store")

# Columns (and the aliases Chainlit reads them under) that hold lists or dicts, which
# SQLite hands back as text. Not "props": Chainlit decodes that one itself.
STRUCTURED = {"tags", "thread_tags", "step_tags", "modes", "metadata", "thread_metadata",
              "step_metadata", "generation", "step_generation", "playerConfig"}


KNOWN_THREADS = 50_000  # thread ids remembered as existing (update_thread)


class StoreError(RuntimeError):
    """A write or read the database refused."""


class ChatDataLayer(SQLAlchemyDataLayer):
    def __init__(self, url: str):
        super().__init__(conninfo=url, storage_provider=None)
        self.engine = connect(url)  # not Chainlit's: store/schema.py's, SQLite set up
        self.sqlite = url.startswith("sqlite")
        self._threads: set[str] = set()  # threads this process knows exist
        self._users = asyncio.Lock()
        self.failures = 0
        self.last_failure: str | None = None
        self._writes: dict[str, set[asyncio.Task]] = {}  # thread id -> writes under way
        self._failed: dict[str, list[str]] = {}  # thread id -> what failed, not yet told

    async def execute_sql(self, query: str, parameters: dict) -> list[dict[str, Any]] | int:
        if self.sqlite:
            parameters = {k: json.dumps(v) if isinstance(v, (list, dict)) else v
                          for k, v in parameters.items()}
        try:
            async with self.engine.begin() as conn:  # rolled back if anything fails
                result = await conn.execute(text(query), parameters)
                rows = [dict(r._mapping) for r in result.fetchall()] if result.returns_rows \
                    else None
        except Exception as exc:
            self.failures += 1
            self.last_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            log.error("database statement failed (%s): %s", query.split()[0], self.last_failure)
            raise StoreError(self.last_failure) from exc
        return result.rowcount if rows is None else self.clean_result(rows)

    async def update_thread(self, thread_id: str, name: str | None = None,
                            user_id: str | None = None, metadata: dict | None = None,
                            tags: list[str] | None = None) -> None:
        """Chainlit calls this before every step it writes, only to be sure the thread
        exists (a read, and an insert the first time): for a thread written here before,
        that call is skipped, which halves a turn's statements."""
        if thread_id in self._threads and (name, user_id, metadata, tags) == (None,) * 4:
            return
        await super().update_thread(thread_id, name, user_id, metadata, tags)
        if len(self._threads) >= KNOWN_THREADS:
            self._threads.clear()  # re-read once each
        self._threads.add(thread_id)

    async def create_user(self, user):
        """Chainlit reads, then inserts the user of each login: two first logins at once
        both inserted, and one failed (bench/burst.py's 256 sessions found it). One at a
        time here; logins are few. (Two app processes on one database can still race.)"""
        async with self._users:
            return await super().create_user(user)

    async def delete_thread(self, thread_id: str) -> None:
        self._threads.discard(thread_id)
        await super().delete_thread(thread_id)

    def clean_result(self, obj):
        obj = super().clean_result(obj)
        if self.sqlite and isinstance(obj, list):
            for row in obj:
                for key in STRUCTURED & row.keys():
                    if isinstance(row[key], str):
                        with contextlib.suppress(ValueError):  # not JSON: as it was
                            row[key] = json.loads(row[key])
        return obj

    async def get_current_timestamp(self) -> str:
        return CLOCK.utc_now()  # the same UTC clock as the app's messages and steps

    async def create_step(self, step_dict) -> None:
        """Chainlit runs this in a task of its own; the task is tracked per thread."""
        thread_id = step_dict.get("threadId")
        task = asyncio.current_task()
        if thread_id and task is not None:
            self._writes.setdefault(thread_id, set()).add(task)
        try:
            await super().create_step(step_dict)
        except Exception as exc:
            self._failed.setdefault(thread_id, []).append(str(exc))
            raise
        finally:
            if thread_id and task is not None:
                self._writes.get(thread_id, set()).discard(task)

    async def settle(self, thread_id: str) -> list[str]:
        """Wait for the thread's writes under way; what failed since the last call."""
        pending = [t for t in self._writes.get(thread_id, ()) if t is not asyncio.current_task()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return self._failed.pop(thread_id, [])

    async def healthy(self) -> bool:
        try:
            await self.execute_sql("SELECT 1", {})
            return True
        except StoreError:
            return False
