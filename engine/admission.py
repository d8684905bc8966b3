"""Admission control in front of an engine: bounded lines, seats, and the KV cache.

Each preset has an `Admission`: at most `running` of its turns are inside the engine at once
(its seats), up to `queued` more wait in order and are told their place whenever it
changes; beyond that a turn is refused at once with a `ChatError` saying so. A waiting turn
that is cancelled (Stop, a closed browser) leaves the line and the turns behind it move up.

The presets that run on one engine share its `Line`, which counts the engine's KV cache:
each turn holds its worst case (prompt + max tokens, in whole cache blocks) from admission to
its end, and a turn is let in only when that fits, so vLLM never runs out of cache and never
preempts (recomputes) a running turn. Presets are served by priority (lower first, vLLM's
convention): a turn of a lower class waits while one of a higher class waits for cache, and
lower classes may not take the cache a higher one keeps (`keep_tokens`), so a
Latency-first turn finds room at once even when Throughput-first's turns fill the rest.
Seats are each preset's own (the engine runs the sum), so they are never taken from another.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from .errors import Busy


class _Waiter:
    def __init__(self, loop: asyncio.AbstractEventLoop, tokens: int):
        self.tokens = tokens
        self.admitted = loop.create_future()
        self.moved = asyncio.Event()


class Line:
    """One engine's KV cache (`kv_tokens`; None: not counted here, as for a remote server),
    shared by the presets' `Admission`s that run on it."""

    def __init__(self, kv_tokens: int | None = None, block_size: int = 1):
        self.kv_tokens = kv_tokens
        self.block_size = max(1, block_size)
        self.classes: list[Admission] = []  # by priority, highest first

    @property
    def held(self) -> int:
        """Tokens the turns inside hold, every class's together."""
        return sum(g.held for g in self.classes)

    def need(self, tokens: int) -> int:
        """A turn's worst case in the cache, in tokens of whole blocks (0 when not counted)."""
        if self.kv_tokens is None:
            return 0
        return -(-max(tokens, 1) // self.block_size) * self.block_size

    def join(self, gate: "Admission") -> None:
        self.classes.append(gate)
        self.classes.sort(key=lambda g: g.priority)

    def cap_for(self, gate: "Admission") -> int | None:
        """The most cache `gate`'s turns may hold with everyone else's: all of it, less what
        higher classes keep."""
        if self.kv_tokens is None:
            return None
        kept = sum(g.keep_tokens for g in self.classes if g.priority < gate.priority)
        return max(0, self.kv_tokens - kept)

    def fits(self, gate: "Admission", tokens: int) -> bool:
        cap = self.cap_for(gate)
        if cap is None or self.held == 0:  # a turn alone always goes in (vLLM checked that
            return True                    # the context fits the cache at start)
        return self.held + tokens <= cap

    def admit(self) -> None:
        """Let in every waiter that now fits, highest class first; a class whose first turn
        waits for cache holds back the classes below it."""
        for gate in self.classes:
            while gate._queue and gate.inside < gate.running:
                waiter = gate._queue[0]  # a withdrawn waiter has left the queue already
                if not self.fits(gate, waiter.tokens):
                    return
                gate._queue.popleft()
                gate._enter(waiter.tokens)
                waiter.admitted.set_result(None)
                gate._tell_moved()


class Admission:
    def __init__(self, running: int, queued: int, *, line: Line | None = None,
                 priority: int = 0, keep_tokens: int = 0):
        self.running, self.queued = running, queued
        self.priority, self.keep_tokens = priority, keep_tokens
        self.line = line or Line()
        self.line.join(self)
        self.inside = 0
        self.held = 0  # the cache this class's turns inside hold
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def slot(self, on_queued: Callable[[int], Awaitable[None]] | None = None,
                   tokens: int = 0) -> AsyncIterator[None]:
        """Hold a seat, and `tokens` of the cache (the turn's prompt + max tokens), for the
        body; wait in line first if either is taken.

        `on_queued(place)` is awaited when the turn has to wait (place 1 = next in line)
        and again each time it moves up.
        """
        need = self.line.need(tokens)
        if self.inside < self.running and not self._queue and not self._held_back() \
                and self.line.fits(self, need):
            self._enter(need)
        else:
            await self._wait(on_queued, need)
        try:
            yield
        finally:
            self._leave(need)

    def _held_back(self) -> bool:
        """A higher class's turn waits for cache (not for a seat of its own): this one may
        not go before it."""
        return any(g._queue and g.inside < g.running
                   for g in self.line.classes if g.priority < self.priority)

    def _enter(self, need: int) -> None:
        self.inside += 1
        self.held += need

    def _leave(self, need: int) -> None:
        self.inside -= 1
        self.held -= need
        self.line.admit()

    async def _wait(self, on_queued, need: int) -> None:
        if len(self._queue) >= self.queued:
            raise Busy(f"This chat is busy right now: {self.inside} replies are being "
                       f"written and {len(self._queue)} messages are waiting. Please try "
                       "again in a minute; your message was not sent.")
        waiter = _Waiter(asyncio.get_running_loop(), need)
        self._queue.append(waiter)
        try:
            while not waiter.admitted.done():
                if on_queued is not None:
                    await on_queued(self._queue.index(waiter) + 1)
                waiter.moved.clear()
                moved = asyncio.ensure_future(waiter.moved.wait())
                try:
                    await asyncio.wait({waiter.admitted, moved},
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
        except BaseException:
            if waiter.admitted.done() and not waiter.admitted.cancelled():
                self._leave(need)  # admitted just as it was cancelled: give the place on
            else:
                waiter.admitted.cancel()
                self._queue.remove(waiter)
                self._tell_moved()
                self.line.admit()  # it may have held back others
            raise

    def _tell_moved(self) -> None:
        for waiter in self._queue:
            waiter.moved.set()
