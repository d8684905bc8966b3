"""Waiting for an event in tests, not for the clock: read a value again and again until it
says the event happened, up to a deadline (as vLLM's tests wait for a server's health).

    rows = await until(lambda: stored_turns(db, "bob"), lambda r: len(r) > before)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

EVERY_S = 0.2


async def until(read: Callable[[], Any], done: Callable[[Any], bool],
                timeout: float = 30.0) -> Any:
    """`read()` (awaited where it returns an awaitable) every EVERY_S until `done` holds for
    its value or `timeout` seconds pass; the last value either way (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if inspect.isawaitable(value):
            value = await value
        if done(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(EVERY_S)
