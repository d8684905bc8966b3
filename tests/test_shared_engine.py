"""One vLLM engine shared by both presets (`engines: shared`, the default on one GPU), on the
real CPU engine and the embedded model: priority classes, each preset's own seats, admission
by the KV cache, warm-up before ready."""

import asyncio
import os

import pytest

from engine import Engines, load_config
from tests.test_engine import collect, fitted

SHARED = "latency-first+throughput-first"


@pytest.fixture(scope="module")
async def shared():
    pool = Engines(load_config(env={**os.environ, "VCHAT_ENGINES": "shared"}))
    await pool.start()
    yield pool
    pool.shutdown()


@pytest.fixture
def requests_seen(shared):
    """What the engine core is handed (a spy on vLLM's real client; each request passes on)."""
    core = shared.engines[SHARED].llm.engine_core
    seen, real = [], core.add_request_async

    async def add(request):
        seen.append(request)
        return await real(request)

    core.add_request_async = add
    yield seen
    core.add_request_async = real


async def test_one_engine_schedules_by_priority_with_every_preset_seats(shared):
    assert list(shared.engines) == [SHARED]
    engine = shared.engines[SHARED]
    assert engine.scheduler_config.policy == "priority"
    # The engine seats both presets' turns at once; each preset keeps its own seats.
    assert engine.max_num_seqs == 12 + 128
    assert (shared.admission["latency-first"].running,
            shared.admission["throughput-first"].running) == (12, 128)
    assert shared.admission["latency-first"].line is shared.admission["throughput-first"].line
    # Its step budget is latency-first's (it bounds every step; here 24, raised to a token
    # a seat, vLLM's least), its memory both shares.
    assert engine.scheduler_config.max_num_batched_tokens == 140
    assert engine.setup.args["kv_cache_memory_bytes"] == 1 << 30
    health = await shared.health()
    assert health["status"] == "ok"
    assert health["engines"][SHARED]["warm_up_s"] is not None
    assert set(health["engines"][SHARED]["presets"]) == {"latency-first", "throughput-first"}


async def test_both_profiles_turns_run_together_each_with_its_class(shared, requests_seen):
    turns = [collect(shared.stream(fitted(shared, profile, max_tokens=8), profile,
                                   ignore_eos=True))
             for profile in ("Latency-first", "Throughput-first") * 3]
    done = await asyncio.gather(*turns)
    assert [stats.preset for _, _, stats in done] == ["latency-first", "throughput-first"] * 3
    assert all(stats.output_tokens == 8 for _, _, stats in done)
    assert sorted(r.priority for r in requests_seen) == [0, 0, 0, 1, 1, 1]


async def test_a_running_turn_holds_its_worst_case_in_the_cache(shared):
    line = shared.admission["throughput-first"].line
    engine = shared.engines[SHARED]
    assert line.kv_tokens == engine.kv_tokens > 0 and line.block_size == engine.block_size
    prompt = fitted(shared, "Throughput-first", max_tokens=200)
    stream = shared.stream(prompt, "Throughput-first", ignore_eos=True)
    first = await anext(stream)
    assert isinstance(first, str)
    worst = -(-(prompt.prompt_tokens + 200) // line.block_size) * line.block_size
    assert line.held == worst == shared.admission["throughput-first"].held
    health = await shared.health()
    assert health["engines"][SHARED]["kv_held"] == worst
    await stream.aclose()  # left early: the cache it held is free again
    assert line.held == 0


async def test_throughput_first_waits_for_cache_latency_first_keeps(shared):
    """Throughput-first may hold the cache only beside the room Latency-first keeps; past
    that its turns wait in line (told their place) rather than making vLLM preempt."""
    low = shared.admission["throughput-first"]
    line = low.line
    keep = shared.admission["latency-first"].keep_tokens
    assert keep == 12 * 2 * 512  # seats x twice the longest default reply
    per_turn = line.need(fitted(shared, "Throughput-first", max_tokens=1024).prompt_tokens
                         + 1024)
    fit = (line.kv_tokens - keep) // per_turn
    places = []

    async def told(place):
        places.append(place)

    streams = [shared.stream(fitted(shared, "Throughput-first", max_tokens=1024),
                             "Throughput-first", on_queued=told, ignore_eos=True)
               for _ in range(fit + 1)]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await asyncio.wait(firsts[:fit], timeout=120)
        await asyncio.sleep(0.5)
        assert low.inside == fit and low.waiting == 1 and places == [1]
        assert not firsts[fit].done()
        # Latency-first goes in at once beside them, into the room it keeps.
        text, _, stats = await collect(shared.stream(
            fitted(shared, "Latency-first", max_tokens=4), "Latency-first", ignore_eos=True))
        assert stats.output_tokens == 4 and low.waiting == 1
    finally:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for s in streams:
            await s.aclose()
    assert line.held == 0 and low.waiting == 0
    health = await shared.health()
    assert health["engines"][SHARED]["preempted"] == 0
