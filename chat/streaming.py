"""Streaming a reply to the browser without one socket event per token.

Chainlit sends one Socket.IO event per `stream_token` call. When the engine produces
tokens faster than a reader can follow (a GPU, or many tokens per step), those events cost
the server and the browser more than the text is worth. `Coalescer.feed` sends text at
most once per interval: a piece that comes after a quiet spell goes out at once (so a slow
stream, or the first token, is never held back); otherwise it waits until the interval is
over, and the caller pulls the engine again only then, so the engine hands over what it
made meanwhile as one piece.

Before a reply's first piece the engine reads the prompt, saying nothing meanwhile: for a
long one, `Reading` says how far it is, by the clock against an estimate.

When many replies stream at once, a `Pace` shared by all of them lets the interval grow
with their number: every event costs the server about the same whatever it carries. How
many events a second all streams together may take before that depends on the machine:
without a GPU they take their time from the model (the app shares the CPU cores with it),
with one they do not (BENCHMARKS.md, "What it shows" and "GPU (H200)"). Replies of a
higher class (a profile whose preset has the lower `priority`, Latency-first) take their
share of those events first: their interval grows only when they alone would fill them,
and the classes below share what is left.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

# 25 updates a second reads as smooth text; fewer start to look like jumps.
DEFAULT_INTERVAL_S = 0.04
# At most this long between updates however busy the app is: 5 updates a second still read
# as a stream.
SLOWEST_INTERVAL_S = 0.2
# Events per second for all streams together before the interval grows. Without a GPU the
# app's events take CPU time from the model (2 cores: 32 streams get 0.2 s); with one, the
# app's core is its own: 64 streams keep 0.04 s, 256 get 0.128 s.
EVENTS_PER_S_CPU = 160
EVENTS_PER_S_GPU = 2000
# How often the progress of a long prompt's reading is said: it is seen moving, and costs
# one update a second.
READING_UPDATE_S = 1.0

log = logging.getLogger(__name__)


class Pace:
    """The longest interval between one reply's updates, from how many replies stream at
    once, class by class (`rank`: lower first): a class's `streams / events left`, kept
    within [fastest, slowest], where the events left are `events_per_s` less what the
    classes above take. One stream: `fastest`."""

    def __init__(self, fastest: float = DEFAULT_INTERVAL_S,
                 slowest: float = SLOWEST_INTERVAL_S, events_per_s: float = EVENTS_PER_S_CPU):
        self.fastest, self.slowest = fastest, max(slowest, fastest)
        self.events_per_s = events_per_s
        self.by_rank: collections.Counter[int] = collections.Counter()  # streams per class

    @classmethod
    def starting_at(cls, fastest: float, events_per_s: float = EVENTS_PER_S_CPU) -> "Pace":
        """The app's pace: `fastest` for few streams; 0 sends every piece, however many."""
        return cls(fastest, SLOWEST_INTERVAL_S if fastest > 0 else 0, events_per_s)

    @staticmethod
    def events_for(gpu: bool) -> int:
        return EVENTS_PER_S_GPU if gpu else EVENTS_PER_S_CPU

    @property
    def streams(self) -> int:
        return sum(self.by_rank.values())

    def interval(self, rank: int = 0) -> float:
        if self.slowest == 0:  # coalescing off: every piece goes out as it comes
            return 0.0
        left = float(self.events_per_s)
        for r in sorted(k for k, n in self.by_rank.items() if n > 0 and k < rank):
            left -= self.by_rank[r] / self._within(self.by_rank[r] / max(left, 1e-9))
        return self._within(self.by_rank[rank] / max(left, 1e-9))

    def _within(self, interval: float) -> float:
        return min(self.slowest, max(self.fastest, interval))


class Coalescer:
    """Joins streamed text pieces and hands them to `send`, in order, at a bounded rate:
    a fixed `interval`, or the shared `pace`'s for its class `rank` (counting this reply
    from its first piece until `close` or `discard`)."""

    def __init__(self, send: Callable[[str], Awaitable[None]],
                 interval: float = DEFAULT_INTERVAL_S, pace: Pace | None = None,
                 rank: int = 0):
        self._send = send
        self._fixed = interval
        self._pace = pace
        self._rank = rank
        self._counted = False
        self._pending: list[str] = []
        self._last_sent = float("-inf")

    @property
    def interval(self) -> float:
        return self._fixed if self._pace is None else self._pace.interval(self._rank)

    async def feed(self, text: str) -> None:
        """Take a piece and return once it is sent: at once when due, else after sleeping
        until it is. The caller pulls its next piece only then, so a source that joins
        pieces while nobody pulls (vLLM's per-request output collector; the stand-in)
        hands over everything it made meanwhile as one piece: one pull per update rather
        than one per engine step, through every layer between engine and socket
        (BENCHMARKS.md, "GPU (H200)").
        Cancelled while it sleeps (the user pressed Stop), it sends nothing."""
        if self._pace is not None and not self._counted:
            self._counted = True
            self._pace.by_rank[self._rank] += 1
        self._pending.append(text)
        wait = self._last_sent + self.interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        await self.flush()

    async def flush(self) -> None:
        """Send everything pending now."""
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self._last_sent = time.monotonic()
        await self._send(text)

    async def close(self) -> None:
        """Send what is pending: the reply is complete."""
        self._uncount()
        await self.flush()

    def discard(self) -> None:
        """Stop without sending what is pending (the reply was stopped)."""
        self._uncount()
        self._pending.clear()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._pace.by_rank[self._rank] -= 1


class Reading:
    """How far the engine has read a prompt, by the clock against `seconds`, the estimate
    of the whole: `say(percent)` once `start`ed, and again every `every` seconds, until
    `stop`. It stays below 100 (the reply's first piece says that reading is done), and
    past the estimate it is None: the estimate was short, and no figure is made up."""

    def __init__(self, say: Callable[[int | None], Awaitable[None]], seconds: float,
                 every: float = READING_UPDATE_S):
        self._say, self.seconds, self.every = say, seconds, every
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """From now (again after `stop`: a turn that waited in line is read once let in)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run(time.monotonic()))

    async def _run(self, started: float) -> None:
        try:
            while True:
                share = (time.monotonic() - started) / self.seconds
                await self._say(min(99, int(share * 100)) if share < 1 else None)
                await asyncio.sleep(self.every)
        except Exception as exc:  # the page went away: the turn itself goes on
            log.debug("reading progress not said: %r", exc)

    async def stop(self) -> None:
        """No more updates: when this returns, `say` is not running and will not run."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
