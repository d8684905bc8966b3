"""Keeping the event loop that every chat session shares from stalling.

One process serves every session, so anything that blocks its event loop delays every
user at once. Two such things were found on the app path (BENCHMARKS.md, "GPU (H200)";
with 256 users sending at once nobody saw a first token for about a second):

1. Chainlit 2.12's `Message` and `Step` constructors each call `time.sleep(0.001)`, so
   that two objects made one after the other get different `created_at` times; a turn
   makes at least three (the user's message, Chainlit's `on_message` step, the reply).
   Upstream: Chainlit/chainlit pull request #1374 (closed, not merged).
   `skip_constructor_pause()` keeps what the sleep was for without the wait: those two
   modules get a clock that never repeats itself (each `utc_now()` at least a microsecond
   after the one before, in Chainlit's format) and a `time` whose `sleep` returns at once
   for that one millisecond; any other use of `time` is the real module's.
2. Python's collector now and then walks every object in the process (~780,000 here once
   Chainlit and the tokenizer are loaded, more with vLLM's front end): ~0.4 s on this
   machine, during which no session moves. `freeze_heap()` moves what the process keeps
   for its whole life out of those walks (gc.freeze).
3. What remains is still walked by every full collection: on the H200 with ~350 chat
   sessions, ~370,000 objects, 0.3-0.4 s each time, and one came every 3-5 s. They came
   that often because a young collection ran every 700 new objects: at thousands of
   streamed tokens a second, each one caught the objects of the updates in flight, which
   then moved up a generation and counted towards the next full collection, though they
   were gone a moment later. `collect_less_often()` lets far more objects be made between
   young collections (VCHAT_GC_YOUNG_OBJECTS), so that such objects are freed before one
   sees them (BENCHMARKS.md, "Both profiles at once").

What is left shows as lag: `LoopLag` sets a timer now and then and measures how late the
loop runs it; the app exports that as `vchat_event_loop_lag_seconds` (/metrics), so a slow
first token can be told apart from a slow engine. `GcPauses` times each of the collector's
walks (`vchat_gc_pause_seconds` by generation): a stall no sampler of stacks can see, since
the walk holds the interpreter throughout.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

CONSTRUCTOR_PAUSE_S = 0.001  # the sleep in Message.__init__ and Step.__init__


def _modules() -> list:
    # By module path: the package's own `chainlit.step` is the @step decorator, not the
    # module. Imported here, not above: the benchmarks use freeze_heap without Chainlit.
    return [importlib.import_module(f"chainlit.{name}") for name in ("message", "step")]


class OrderedClock:
    """`utc_now()` as Chainlit writes it (naive UTC, ISO 8601, "Z"), strictly increasing."""

    def __init__(self):
        self._last = datetime.min

    def utc_now(self) -> str:
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        if now <= self._last:
            now = self._last + timedelta(microseconds=1)
        self._last = now
        # Always with microseconds: isoformat() leaves them out when they are 0, and such a
        # time would sort after the later ones of the same second.
        return now.isoformat(timespec="microseconds") + "Z"


class _TimeWithoutPause:
    """The `time` module, except that the constructors' pause does not block."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds != CONSTRUCTOR_PAUSE_S:
            time.sleep(seconds)


CLOCK = OrderedClock()


def skip_constructor_pause() -> None:
    """Idempotent: the modules point at the same replacements however often it runs."""
    for module in _modules():
        module.time = _TimeWithoutPause()
        module.utc_now = CLOCK.utc_now


def constructor_pause_skipped() -> bool:
    return all(getattr(m.utc_now, "__self__", None) is CLOCK
               and isinstance(m.time, _TimeWithoutPause) for m in _modules())


def freeze_heap() -> int:
    """Collect what is garbage now, then leave every object still alive out of the
    collector's later walks. Call once the process holds what it keeps (the app imported,
    the engines started); objects made afterwards are collected as usual. Returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_less_often(young: int) -> tuple[int, int, int]:
    """Python's young collections after `young` new objects instead of 700; returns the
    thresholds now in force (3. above)."""
    gc.set_threshold(young, *gc.get_threshold()[1:])
    return gc.get_threshold()


class GcPauses:
    """Every collection's time (`observe(generation, seconds)`), from gc.callbacks."""

    def __init__(self, observe: Callable[[int, float], None]):
        self.observe = observe
        self._began = 0.0

    def start(self) -> None:
        """Idempotent."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.observe(info["generation"], time.perf_counter() - self._began)


class LoopLag:
    """Every `every_s`, how long after its time the event loop ran a timer that was due
    (`observe(seconds)`). A loop that keeps up runs it within a millisecond; a busy one
    runs it after every callback queued before it, and every session waits as long for
    each step it takes."""

    def __init__(self, observe: Callable[[float], None], every_s: float = 0.1):
        self.observe, self.every_s = observe, every_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Idempotent; in the running loop, until `stop`."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.every_s
            await asyncio.sleep(self.every_s)
            self.observe(max(0.0, loop.time() - due))
