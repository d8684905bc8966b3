"""Streaming a reply to the browser without one socket event per token.

Chainlit sends one Socket.IO event per `stream_token` call. When the engine produces
tokens faster than a reader can follow (a GPU, or many tokens per step), those events cost
the server and the browser more than the text is worth. `Coalescer` sends text at most
once per `interval`: a token that arrives after a quiet spell goes out at once (so a slow
stream, or the first token, is never held back), tokens that arrive within the interval
are joined and sent when it ends, by a timer if nothing else arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# 25 updates a second reads as smooth text; fewer start to look like jumps.
DEFAULT_INTERVAL_S = 0.04


class Coalescer:
    """Joins streamed text pieces and hands them to `send`, in order, at a bounded rate."""

    def __init__(self, send: Callable[[str], Awaitable[None]],
                 interval: float = DEFAULT_INTERVAL_S):
        self._send = send
        self.interval = interval
        self._pending: list[str] = []
        self._last_sent = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._timed_flush: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # FIFO: pieces go out in the order they came

    async def add(self, text: str) -> None:
        self._pending.append(text)
        wait = self._last_sent + self.interval - time.monotonic()
        if wait <= 0:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._flush_later)

    def _flush_later(self) -> None:
        self._timer = None
        self._timed_flush = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        """Send everything pending now."""
        async with self._lock:
            if not self._pending:
                return
            text = "".join(self._pending)
            self._pending.clear()
            self._last_sent = time.monotonic()
            await self._send(text)

    async def close(self) -> None:
        """Send what is pending and stop the timer: the reply is complete."""
        self._cancel_timer()
        if self._timed_flush is not None:
            await self._timed_flush
        await self.flush()

    def discard(self) -> None:
        """Stop without sending what is pending (the reply was stopped)."""
        self._cancel_timer()
        if self._timed_flush is not None and not self._timed_flush.done():
            self._timed_flush.cancel()
        self._pending.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
