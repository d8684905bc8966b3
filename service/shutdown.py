"""Graceful shutdown: on SIGTERM or Ctrl+C stop taking new turns, let the turns in flight
finish within a grace period, end the rest cleanly, then let the server stop.

No UI code here: app.py calls `handle_signals` once the server runs and refuses new turns
while `closing`; chat/turns.py registers each turn with `turn()` and words what the users
see.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal

log = logging.getLogger(__name__)


class Shutdown:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.closing = False
        self._turns: set[asyncio.Task] = set()
        self._after: set[asyncio.Task] = set()  # turns' work after their reply (finish_later)
        self._drain: asyncio.Task | None = None  # held: the loop keeps only a weak reference

    @property
    def turns(self) -> int:
        """Turns being answered (or waiting for an engine) right now."""
        return len(self._turns)

    @contextlib.contextmanager
    def turn(self):
        """Count the current task as a turn in flight until the block ends."""
        task = asyncio.current_task()
        self._turns.add(task)
        try:
            yield
        finally:
            self._turns.discard(task)

    def finish_later(self, work) -> asyncio.Task:
        """Run the coroutine `work` past the end of the current turn (the turn's last
        writes to the database): a shutdown waits for it as for a turn in flight."""
        task = asyncio.create_task(work)
        self._after.add(task)
        task.add_done_callback(self._after.discard)
        return task

    async def drain(self) -> tuple[int, int]:
        """Close to new turns, wait up to `grace_s` for the turns in flight, cancel those
        still running (each ends itself cleanly on cancellation) and wait for them to have
        done so. Returns (finished, cut)."""
        self.closing = True
        running = self._turns | self._after
        if not running:
            return 0, 0
        log.info("stopping: finishing %d turn(s) in flight, at most %g s (signal again to "
                 "stop at once)", len(running), self.grace_s)
        done, pending = await asyncio.wait(running, timeout=self.grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        return len(done), len(pending)

    def handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Put the drain in front of the server's own SIGTERM/SIGINT handling (uvicorn's,
        which closes every connection at once): the first signal stops new turns and gives
        the turns in flight `grace_s`, then the server's handler runs as before; a second
        signal runs it at once."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            server_handler = signal.getsignal(sig)
            if callable(server_handler):  # else no server handles it: leave it alone
                signal.signal(sig, functools.partial(self._on_signal, loop, server_handler))

    def _on_signal(self, loop, server_handler, signum, frame) -> None:
        if self.closing:
            server_handler(signum, frame)
            return
        self.closing = True
        loop.call_soon_threadsafe(self._start_drain, server_handler, signum, frame)

    def _start_drain(self, server_handler, signum, frame) -> None:
        self._drain = asyncio.get_running_loop().create_task(
            self._drain_then(server_handler, signum, frame))

    async def _drain_then(self, server_handler, signum, frame) -> None:
        finished, cut = await self.drain()
        if finished or cut:
            log.info("stopping: %d turn(s) finished, %d cut short", finished, cut)
            await asyncio.sleep(0.5)  # let the last messages leave before connections close
        server_handler(signum, frame)
