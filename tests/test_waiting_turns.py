"""A Latency-first turn that arrives while many Throughput-first turns run, on the shared
engine as shipped without a GPU (Latency-first's steps of 24 tokens in 12-token prompt
pieces, no pace): it is let in and answered while they still run. Before the step plan
left it room (engine/steps.py), 40 running Throughput-first turns took every token of
every step, and it got no first token in 60 s while they made 10,288 (BENCHMARKS.md,
"A waiting Latency-first turn"); the planner's own rule is tested in tests/test_steps.py.
It runs on the session's engines (conftest), which are that shared engine."""

import asyncio

import pytest

from tests.test_engine import fitted
from tools.engine_requests import generate

SHARED = "latency-first+throughput-first"  # the one engine both presets share
LOWER_TURNS = 40  # more than the 24 tokens of a Latency-first step


async def test_a_latency_first_turn_is_answered_while_throughput_first_turns_run(engines):
    engine = engines.engines[SHARED]
    promise = engine.llm.vllm_config.additional_config["vchat_step_classes"]["0"]
    if "max_num_batched_tokens" not in promise:
        pytest.skip(f"Latency-first's steps here are the engine's own ({promise}): "
                    "no smaller budget for the Throughput-first turns to fill")
    llm = engine.llm
    counts: dict = {}
    prompt = fitted(engines, "Throughput-first", max_tokens=400)
    low = [asyncio.ensure_future(generate(llm, prompt, 400, 1, counts, i))
           for i in range(LOWER_TURNS)]
    try:
        while len(counts) < LOWER_TURNS or min(counts.values()) < 3:
            await asyncio.sleep(0.05)
        before = sum(counts.values())
        lf = asyncio.ensure_future(generate(
            llm, fitted(engines, "Latency-first", max_tokens=16), 16, 0, counts, "lf"))
        async with asyncio.timeout(180):  # unplanned, it waited until they ended
            while not counts.get("lf"):
                assert not lf.done(), lf.exception()
                await asyncio.sleep(0.01)
        made = sum(counts[i] for i in range(LOWER_TURNS)) - before
        assert not any(task.done() for task in low), "it did not wait for them to end"
        # Its prompt goes in 12-token pieces, a step each; beside it the lower turns share
        # what the step leaves (each would make ~400 before ending).
        assert made < LOWER_TURNS * 20, f"they made {made} tokens before its first"
        await asyncio.wait_for(lf, 120)
        assert counts["lf"] == 16
    finally:
        for task in low:
            task.cancel()
        await asyncio.gather(*low, return_exceptions=True)
