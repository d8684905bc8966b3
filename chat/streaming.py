"""Streaming a reply to the browser without one socket event per token.

Chainlit sends one Socket.IO event per `stream_token` call. When the engine produces
tokens faster than a reader can follow (a GPU, or many tokens per step), those events cost
the server and the browser more than the text is worth. `Coalescer` sends text at most
once per interval: a token that arrives after a quiet spell goes out at once (so a slow
stream, or the first token, is never held back), tokens that arrive within the interval
are joined and sent when it ends, by a timer if nothing else arrives.

When many replies stream at once, a `Pace` shared by all of them lets the interval grow
with their number, but only up to about two of the engine's pieces per update (a fast
stream keeps the short interval; a slow one sends every other piece): every event costs
about the same whatever it carries, so many slow streams cost as much as a few fast ones,
and on a small machine that time is taken from the model (BENCHMARKS.md, "What it shows").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# 25 updates a second reads as smooth text; fewer start to look like jumps.
DEFAULT_INTERVAL_S = 0.04
# At most this long between updates however busy the app is: 5 updates a second still read
# as a stream.
SLOWEST_INTERVAL_S = 0.2
# Events per second for all streams together before the interval grows (32 streams: 0.2 s).
EVENTS_PER_S = 160


class Pace:
    """The longest interval between one reply's updates, from how many replies stream at
    once: `streams / events_per_s`, kept within [fastest, slowest]. One stream: `fastest`."""

    def __init__(self, fastest: float = DEFAULT_INTERVAL_S,
                 slowest: float = SLOWEST_INTERVAL_S, events_per_s: float = EVENTS_PER_S):
        self.fastest, self.slowest = fastest, max(slowest, fastest)
        self.events_per_s = events_per_s
        self.streams = 0

    @classmethod
    def starting_at(cls, fastest: float) -> "Pace":
        """The app's pace: `fastest` for few streams; 0 sends every piece, however many."""
        return cls(fastest, SLOWEST_INTERVAL_S if fastest > 0 else 0)

    @property
    def interval(self) -> float:
        return min(self.slowest, max(self.fastest, self.streams / self.events_per_s))


class Coalescer:
    """Joins streamed text pieces and hands them to `send`, in order, at a bounded rate:
    a fixed `interval`, or one from the shared `pace` (counting this reply from its first
    piece until `close` or `discard`) but at most twice the last gap between pieces."""

    def __init__(self, send: Callable[[str], Awaitable[None]],
                 interval: float = DEFAULT_INTERVAL_S, pace: Pace | None = None):
        self._send = send
        self._fixed = interval
        self._pace = pace
        self._counted = False
        self._gap, self._last_piece = 0.0, None
        self._pending: list[str] = []
        self._last_sent = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._timed_flush: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # FIFO: pieces go out in the order they came

    @property
    def interval(self) -> float:
        if self._pace is None:
            return self._fixed
        return min(self._pace.interval, max(self._pace.fastest, 2 * self._gap))

    async def add(self, text: str) -> None:
        """Take a piece: sent at once when due, else held and sent by a timer."""
        now = self._take(text)
        wait = self._last_sent + self.interval - now
        if wait <= 0:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._flush_later)

    async def feed(self, text: str) -> None:
        """Take a piece and return once it is sent: at once when due, else after sleeping
        until it is. The caller pulls its next piece only then, so a source that joins
        pieces while nobody pulls (vLLM's per-request output collector; the stand-in)
        hands over everything it made meanwhile as one piece: one pull per update rather
        than one per engine step, through every layer between engine and socket. With
        many streams every stream, fast or slow, then updates at the shared pace (on an
        H200 at 256 streams: one pull per ~8 ms step each before; BENCHMARKS.md)."""
        wait = self._last_sent + self.interval - self._take(text)
        if wait > 0:
            await asyncio.sleep(wait)
        await self.flush()

    def _take(self, text: str) -> float:
        now = time.monotonic()
        if self._last_piece is not None:
            self._gap = now - self._last_piece
        self._last_piece = now
        if self._pace is not None and not self._counted:
            self._counted = True
            self._pace.streams += 1
        self._pending.append(text)
        return now

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
        self._uncount()
        if self._timed_flush is not None:
            await self._timed_flush
        await self.flush()

    def discard(self) -> None:
        """Stop without sending what is pending (the reply was stopped)."""
        self._cancel_timer()
        self._uncount()
        if self._timed_flush is not None and not self._timed_flush.done():
            self._timed_flush.cancel()
        self._pending.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._pace.streams -= 1
