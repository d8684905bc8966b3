"""chat/stalls.py and service/: what would stop the event loop every chat session shares
(Chainlit's constructor pause, the collector), how it is watched, and the stored clock."""

import asyncio
import gc
import subprocess
import sys
import time
import weakref
from datetime import datetime

import chainlit.utils
import pytest
from chainlit.context import init_http_context
from chainlit.message import Message
from chainlit.step import Step

from chat import stalls
from chat import clock
from service import loop
from tools.chainlit_client import ROOT


@pytest.fixture
def sleeps(monkeypatch):
    """Chainlit as shipped (restored afterwards), and every call of the real time.sleep,
    recorded (and not slept)."""
    for module in stalls._modules():
        monkeypatch.setattr(module, "time", time)
        monkeypatch.setattr(module, "utc_now", chainlit.utils.utc_now)
    calls = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


async def test_chainlits_constructors_no_longer_block_the_event_loop(sleeps):
    init_http_context()
    Message(content="before")
    Step(name="before")
    assert sleeps == [stalls.CONSTRUCTOR_PAUSE_S] * 2, "Chainlit's pause, as measured"
    sleeps.clear()
    stalls.skip_constructor_pause()
    stalls.skip_constructor_pause()  # twice: the same replacements
    assert stalls.constructor_pause_skipped()
    for _ in range(100):
        Message(content="after")
        Step(name="after")
    assert sleeps == []
    # Any other sleep in those modules is still a real one.
    stalls._modules()[0].time.sleep(0.25)
    assert sleeps == [0.25]


def test_the_clock_never_repeats_itself_and_keeps_chainlits_format():
    ordered = clock.OrderedClock()
    times = [ordered.utc_now() for _ in range(5000)]  # far more than one per microsecond
    assert all(a < b for a, b in zip(times, times[1:])), "strictly increasing, as text"
    assert all(t.endswith("Z") and len(t) == len("2026-12-01T08:00:00.000000Z") for t in times)
    first = datetime.fromisoformat(times[0].removesuffix("Z"))
    assert abs((datetime.utcnow() - first).total_seconds()) < 60, "UTC, like Chainlit's"


async def test_steps_made_back_to_back_are_ordered_by_their_creation_time(sleeps):
    init_http_context()
    stalls.skip_constructor_pause()
    created = [Step(name=f"s{i}").created_at for i in range(2000)]
    assert all(a < b for a, b in zip(created, created[1:]))


class Cycle:
    pass


def test_the_long_lived_heap_is_left_out_of_collections():
    try:
        frozen = loop.freeze_heap()
        assert frozen > 10_000  # this process: pytest, chainlit...
        # Frozen objects may be freed at once by reference counting (another thread's
        # leftovers, say): the count only ever goes down from what was returned.
        assert 0.99 * frozen <= gc.get_freeze_count() <= frozen
        young = Cycle()
        young.itself, gone = young, weakref.ref(young)  # garbage only a collection finds
        del young
        gc.collect()
        assert gone() is None, "objects made later are collected as usual"
    finally:
        gc.unfreeze()  # the rest of the test session as it was


async def test_loop_lag_sees_a_blocked_loop_and_nothing_when_it_keeps_up():
    """The timer comes back on time while the loop is idle; blocked for 0.3 s, it comes
    back that late, and the lag says so."""
    seen: list[float] = []
    lag = loop.LoopLag(seen.append, every_s=0.02)
    lag.start()
    lag.start()  # idempotent: one watcher
    await asyncio.sleep(0.2)
    idle = list(seen)
    time.sleep(0.3)  # a callback that blocks the loop
    await asyncio.sleep(0.1)
    lag.stop()
    await asyncio.sleep(0.05)
    after = len(seen)
    await asyncio.sleep(0.1)
    assert 1 <= len(idle) <= 10  # one watcher, every 20 ms (two would make ~20)
    assert max(seen) >= 0.25 > max(idle)
    assert len(seen) == after  # stopped


def test_gc_pauses_times_every_collection_by_its_generation_until_stopped():
    """A full collection over many objects is timed as generation 2 (the stall a stack
    sampler cannot see), once per collection; stopped, nothing more."""
    seen: list[tuple[int, float]] = []
    pauses = loop.GcPauses(lambda generation, s: seen.append((generation, s)))
    pauses.start()
    pauses.start()  # idempotent: one callback
    try:
        held = [[i] for i in range(300_000)]  # containers the walk has to visit
        seen.clear()  # the collections that making them set off
        started = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - started
        full = [s for generation, s in seen if generation == 2]
        assert len(full) == 1 and 0 < full[0] <= took
        del held
    finally:
        pauses.stop()
    count = len(seen)
    gc.collect()
    assert len(seen) == count


def test_young_collections_come_after_the_given_number_of_new_objects():
    """The app's setting (VCHAT_GC_YOUNG_OBJECTS) is the collector's first threshold; the
    older generations' are Python's."""
    kept = gc.get_threshold()
    try:
        assert loop.collect_less_often(50_000) == (50_000, *kept[1:])
        gc.collect()
        made = [[] for _ in range(20_000)]  # fewer new containers than the threshold
        assert gc.get_count()[0] >= 20_000, "no young collection ran meanwhile"
        del made
    finally:
        gc.set_threshold(*kept)


def test_the_stack_sampler_counts_where_the_main_thread_is_and_writes_collapsed_stacks(
        tmp_path):
    """tools/stack_sampler.py, the diagnostic that the H200 runs load into the app: it
    samples the main thread inside its window and writes 'outer;inner count' lines."""
    from tools.stack_sampler import StackSampler

    def spin_for_the_sampler(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(100))

    sampler = StackSampler(str(tmp_path / "stacks"), start_s=0.0, stop_s=0.6, every_s=0.005)
    sampler.start()
    spin_for_the_sampler(0.8)
    time.sleep(0.1)  # the sampler's last write
    lines = (tmp_path / "stacks").read_text().splitlines()
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in lines}
    spinning = sum(n for stack, n in counts.items() if "spin_for_the_sampler" in stack)
    assert spinning >= 0.8 * sum(counts.values()) > 0
    assert all(";" in stack for stack in counts)  # whole stacks, outermost first


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_the_server_loop_runs_c_tasks_not_the_python_ones_chainlit_puts_in(kind):
    """Chainlit's command line applies nest_asyncio when imported (pure-Python Task and
    Future, a patched asyncio.run); own_loop, run as app.py runs it, undoes that and picks
    the loop. Then Chainlit's one re-entry of the running loop (a session's config, given
    the profile list's awaitable) is refused without stopping the loop."""
    script = f"""
import asyncio, chainlit.cli
assert asyncio.Task.__module__ == "asyncio.tasks", "nest_asyncio's Python tasks"
from service import loop
from chat.panel import Answered
print(loop.own_loop({kind!r}))
async def main():
    try:
        asyncio.get_event_loop().run_until_complete(Answered([1]))
    except RuntimeError:
        pass
    await asyncio.sleep(0.05)  # the loop is still running: nothing stopped it
    assert await Answered([2]) == [2]
    print(loop.running_loop())
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == [kind, f"{kind}, C tasks"], out.stdout
