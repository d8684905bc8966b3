"""Admission control in front of one engine: a bounded, first-come-first-served queue.

At most `running` turns are inside the engine at once (the preset's max_num_seqs, so vLLM
never has to hold turns back itself and our queue is the one users see). Up to `queued`
more wait in order and are told their place whenever it changes; beyond that a turn is
refused at once with a `ChatError` saying so. A waiting turn that is cancelled (Stop, a
closed browser) leaves the queue and the turns behind it move up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from .errors import Busy


class _Waiter:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.admitted = loop.create_future()
        self.moved = asyncio.Event()


class Admission:
    def __init__(self, running: int, queued: int):
        self.running, self.queued = running, queued
        self.inside = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def slot(self, on_queued: Callable[[int], Awaitable[None]] | None = None
                   ) -> AsyncIterator[None]:
        """Hold a place in the engine for the body; wait in line first if it is full.

        `on_queued(place)` is awaited when the turn has to wait (place 1 = next in line)
        and again each time it moves up.
        """
        if self.inside < self.running and not self._queue:
            self.inside += 1
        else:
            await self._wait(on_queued)
        try:
            yield
        finally:
            self._leave()

    async def _wait(self, on_queued) -> None:
        if len(self._queue) >= self.queued:
            raise Busy(f"This chat is busy right now: {self.inside} replies are being "
                            f"written and {len(self._queue)} messages are waiting. Please try "
                            "again in a minute; your message was not sent.")
        waiter = _Waiter(asyncio.get_running_loop())
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
                self._leave()  # admitted just as it was cancelled: give the place on
            else:
                waiter.admitted.cancel()
                self._queue.remove(waiter)
                self._tell_moved()
            raise

    def _leave(self) -> None:
        """A turn left the engine: the next in line takes its place."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.admitted.done():
                waiter.admitted.set_result(None)  # the place passes on; `inside` unchanged
                self._tell_moved()
                return
        self.inside -= 1

    def _tell_moved(self) -> None:
        for waiter in self._queue:
            waiter.moved.set()
