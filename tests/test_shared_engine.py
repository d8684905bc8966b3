"""One vLLM engine shared by both presets (`engines: shared`, the default on one GPU), on the
real CPU engine and the embedded model: priority classes, each preset's own seats, admission
by the KV cache, warm-up before ready, and the steps of engine/steps.py (Latency-first's
step shape and pace while its turns run; Throughput-first's turns taking turns)."""

import asyncio
import dataclasses
import os

import pytest

from engine import Engines, load_config
from tests.test_engine import collect, fitted
from tools.engine_requests import generate as tokens_of

SHARED = "latency-first+throughput-first"
# Latency-first's pace on this CPU for these tests: shorter than any step here, so while
# its turns run Throughput-first's turns get the least share of the steps (one in 8).
TEST_PACE_MS = 0.001
# Throughput-first reads whole prompts; here, beside turns that decode, in pieces of 128
# tokens up to 128 tokens of context, smaller beyond (engine/steps.py, point 4).
TEST_PIECES = {"piece": 128, "context": 128}


@pytest.fixture(scope="module")
async def shared():
    config = load_config(env={**os.environ, "VCHAT_ENGINES": "shared"})
    fast, big = config.presets["latency-first"], config.presets["throughput-first"]
    config = dataclasses.replace(config, presets={
        **config.presets, fast.name: dataclasses.replace(
            fast, step_ms={"cpu": TEST_PACE_MS, "gpu": TEST_PACE_MS}),
        big.name: dataclasses.replace(big, long_prompts={"cpu": TEST_PIECES,
                                                         "gpu": TEST_PIECES})})
    pool = Engines(config)
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
    gpu = shared.gpu
    fast, big = (shared.config.presets[p].options(gpu)
                 for p in ("latency-first", "throughput-first"))
    assert engine.scheduler_config.policy == "priority"
    # The engine seats both presets' turns at once; each preset keeps its own seats
    # (without a GPU 12 and 128).
    assert engine.max_num_seqs == fast["max_num_seqs"] + big["max_num_seqs"]
    assert (shared.admission["latency-first"].running,
            shared.admission["throughput-first"].running) == (fast["max_num_seqs"],
                                                              big["max_num_seqs"])
    assert shared.admission["latency-first"].line is shared.admission["throughput-first"].line
    # Its steps are the larger preset's (Throughput-first's 8,192 tokens, whole prompts);
    # Latency-first's own (without a GPU 24 tokens in 12-token prompt pieces) and its pace
    # are applied by the planned scheduler while its turns run.
    assert engine.scheduler_config.max_num_batched_tokens == big["max_num_batched_tokens"]
    assert engine.scheduler_config.scheduler_cls.startswith("engine.scheduler.Planned")
    # Where they differ from the engine's own: on the H200 both presets take 8,192-token
    # steps, and Latency-first's promise is its pace alone.
    steps = engine.scheduler_config
    own = {key: fast[key] for key in ("max_num_batched_tokens", "long_prefill_token_threshold")
           if fast.get(key) and fast[key] != getattr(steps, key)}
    assert engine.llm.vllm_config.additional_config["vchat_step_classes"] == {
        "0": {**own, "step_ms": TEST_PACE_MS},
        "1": {"long_piece": TEST_PIECES["piece"], "long_context": TEST_PIECES["context"]}}
    if not gpu:  # its memory: both shares
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
    seats = shared.admission["latency-first"].running
    assert keep == seats * 2 * 512  # seats x twice the longest default reply
    per_turn = line.need(fitted(shared, "Throughput-first", max_tokens=1024).prompt_tokens
                         + 1024)
    fit = (line.kv_tokens - keep) // per_turn
    if fit >= low.running:
        pytest.skip(f"this device's cache holds {fit} such turns, more than the {low.running} "
                    "seats: the cache never binds here (it does on CPU, where CI runs)")
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


async def test_while_latency_first_runs_throughput_first_turns_take_turns(shared):
    """The planned scheduler in vLLM's engine process: while a Latency-first turn runs, a
    step holds it and only as many Throughput-first turns as keep its pace (here: the least
    share, one in 8), so it advances every step and they advance a few tokens each, all
    of them; with it gone they advance every step again."""
    llm = shared.engines[SHARED].llm
    prompt = fitted(shared, "Throughput-first", max_tokens=600)
    counts: dict = {}
    low = [asyncio.ensure_future(tokens_of(llm, prompt, 600, 1, counts, i)) for i in range(8)]
    try:
        while len(counts) < 8 or min(counts.values()) < 3:
            await asyncio.sleep(0.05)
        before = dict(counts)
        await tokens_of(llm, fitted(shared, "Latency-first", max_tokens=48), 48, 0, counts, "lf")
        during = {i: counts[i] - before[i] for i in range(8)}
        # Unplanned, each would have made ~48 (one token a step, as the Latency-first turn).
        assert sum(during.values()) <= 8 * 48 / 2, during
        assert min(during.values()) >= 2, f"every one of them keeps its share: {during}"
        mark = dict(counts)
        while counts[0] - mark[0] < 40:
            await asyncio.sleep(0.01)
        after = [counts[i] - mark[i] for i in range(8)]
        assert min(after) >= 30, f"alone, they run in every step again: {after}"
    finally:
        for task in low:
            task.cancel()
        await asyncio.gather(*low, return_exceptions=True)


async def test_beside_turns_that_decode_a_long_prompt_is_read_in_shrinking_pieces(shared):
    """The planned scheduler cuts a long prompt into pieces while other turns decode, each
    smaller as its context grows (Throughput-first's TEST_PIECES here): every step of its
    reading gives each of them a token. Without it the engine reads the prompt whole, in
    one step: the others would wait through it with no token (issue 53)."""
    llm = shared.engines[SHARED].llm
    short = fitted(shared, "Throughput-first", max_tokens=1200)
    counts: dict = {}
    low = [asyncio.ensure_future(tokens_of(llm, short, 1200, 1, counts, i)) for i in range(2)]
    long = shared.raw_prompt("Throughput-first", [1000 + i % 5000 for i in range(1800)], 1)
    try:
        while len(counts) < 2 or min(counts.values()) < 3:
            await asyncio.sleep(0.05)
        before = dict(counts)
        await tokens_of(llm, long, 1, 1, counts, "long")
        during = [counts[i] - before[i] for i in range(2)]
        # 128 + 128 tokens, then 128 x 128 / context, at least MIN_PIECE (64): ~28 steps
        # (28 in a run; without the pieces the others made 9 tokens meanwhile).
        assert min(during) >= 20, during
        assert all(not task.done() for task in low), "they were still decoding"
    finally:
        for task in low:
            task.cancel()
        await asyncio.gather(*low, return_exceptions=True)
