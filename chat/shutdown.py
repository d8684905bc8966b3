"""Graceful shutdown: stop taking new turns, let the turns in flight finish within a grace
period, then end the rest cleanly.

No UI code here: app.py registers each turn with `turn()`, refuses new ones while
`closing`, and words what the users see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


class Shutdown:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.closing = False
        self._turns: set[asyncio.Task] = set()

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

    async def drain(self) -> tuple[int, int]:
        """Close to new turns, wait up to `grace_s` for the turns in flight, cancel those
        still running (each ends itself cleanly on cancellation) and wait for them to have
        done so. Returns (finished, cut)."""
        self.closing = True
        running = set(self._turns)
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
