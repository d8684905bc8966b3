"""Keeping the event loop that every session shares from stalling (besides Chainlit's own
pause, chat/stalls.py), and seeing when it does.

One process serves every session, so anything that blocks its event loop delays every
user at once:

1. Python's collector now and then walks every object in the process (Chainlit, the
   tokenizer, vLLM's front end: hundreds of thousands), during which no session moves.
   `freeze_heap()` moves what the process keeps for its whole life out of those walks
   (gc.freeze).
2. What remains is still walked by every full collection, and full collections came every
   few seconds under load: a young collection ran every 700 new objects, and at thousands
   of streamed tokens a second each one caught the objects of the updates in flight,
   which then moved up a generation and counted towards the next full collection, though
   they were gone a moment later. `collect_less_often()` lets far more objects be made
   between young collections (VCHAT_GC_YOUNG_OBJECTS), so that such objects are freed
   before one sees them (BENCHMARKS.md, "Both profiles at once").

3. Chainlit's command line calls nest_asyncio.apply() when it is imported (to let a
   running loop be entered again), which swaps asyncio's Task and Future for their
   pure-Python versions: every await of every session then runs through Python code.
   `own_loop()`, called when app.py is imported (Chainlit imports it, then starts its
   server with asyncio.run), puts the C versions back: more tokens/s and a shorter first
   token at 256 chat streams on the H200 (BENCHMARKS.md). VCHAT_EVENT_LOOP=uvloop runs
   uvloop's loop instead, which measured slower there.

What is left shows: `LoopLag` sets a timer now and then and measures how late the loop
runs it (`vchat_event_loop_lag_seconds`), so a slow first token can be told apart from a
slow engine, and `GcPauses` times each collection (`vchat_gc_pause_seconds` by
generation): a stall no sampler of stacks can see, since the walk holds the interpreter.
"""

from __future__ import annotations

import asyncio
import asyncio.futures
import asyncio.runners
import asyncio.tasks
import gc
import sys
import time
from collections.abc import Callable

def own_loop(kind: str) -> str:
    """Before the server's loop starts: asyncio's C Task and Future in place of the
    pure-Python ones nest_asyncio put there, asyncio.run as Python has it (nest_asyncio's
    runs a loop patched to be entered again), and the loop `kind` makes ("uvloop" where it
    is installed, else asyncio's). Returns the kind the server will run on.

    Chainlit enters its running loop again in one place: a session's config, to read a
    chat profile's config_overrides (the app's profiles have none). On either loop that
    now fails at once (a running loop is not entered again) and Chainlit falls back to its
    global config, as it does for any failure there; chat/panel.py's profile list is an
    awaitable already answered, so nothing is left unawaited or stops the loop."""
    import _asyncio

    asyncio.Task = asyncio.tasks.Task = asyncio.tasks._CTask = _asyncio.Task
    asyncio.Future = asyncio.futures.Future = asyncio.futures._CFuture = _asyncio.Future
    asyncio.run = asyncio.runners.run
    if kind != "uvloop":
        return "asyncio"
    if "uvloop" in sys.modules:  # it took asyncio's Task when imported: perhaps Python's
        raise RuntimeError("own_loop() must run before uvloop is imported")
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def running_loop() -> str:
    """What the running loop and its tasks are, for the log: "uvloop, C tasks"."""
    loop = asyncio.get_running_loop()
    tasks = "C" if type(asyncio.current_task()).__module__ == "_asyncio" else "Python"
    return f"{'uvloop' if type(loop).__module__.startswith('uvloop') else 'asyncio'}, " \
           f"{tasks} tasks"


def freeze_heap() -> int:
    """Collect what is garbage now, then leave every object still alive out of the
    collector's later walks. Call once the process holds what it keeps (the app imported,
    the engines started); objects made afterwards are collected as usual. Returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def timed(call: Callable[[], object]) -> tuple[object, float]:
    """What `call()` returns, and the seconds it took."""
    began = time.perf_counter()
    return call(), time.perf_counter() - began


def collect_less_often(young: int) -> tuple[int, int, int]:
    """Python's young collections after `young` new objects instead of 700; returns the
    thresholds now in force (2. above)."""
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


INLINE_BYTES = 64 * 1024  # larger requests and messages are read and fitted in a thread


async def off_the_loop(size: int, work, *args, **kwargs):
    """`work(*args, **kwargs)`, in a worker thread when `size` (a request's or message's
    bytes) is large: reading and fitting megabytes on the event loop stalls every user's
    stream."""
    if size <= INLINE_BYTES:
        return work(*args, **kwargs)
    return await asyncio.to_thread(work, *args, **kwargs)
