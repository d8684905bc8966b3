"""How long a Latency-first turn waits for its first token when it arrives while many
Throughput-first turns run, on the shared engine (`engines: shared`) with the shipped
presets: the case engine/steps.py leaves room for (issue 27). Straight on the engine's
vLLM client (no app), the embedded model without a GPU; each run: one Latency-first reply
alone, then --lower Throughput-first replies of --lower-reply tokens, and once each has
made 3 tokens, one Latency-first reply of 16 tokens beside them.

    .venv/bin/python -m bench.waiting_turn --runs 3 --out bench/results/waiting-turn-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from engine import Engines, Message, load_config
from tools.engine_requests import generate

SHARED = "latency-first+throughput-first"
LF_TOKENS = 16


def prompt_of(pool: Engines, profile: str, max_tokens: int):
    return pool.fit(profile, [], Message("user", "Tell me about the sea."), max_tokens=max_tokens,
                    system_prompt=pool.config.profile(profile).system_prompt)


async def one_run(pool: Engines, lower: int, lower_reply: int, give_up_s: float) -> dict:
    llm = pool.engines[SHARED].llm
    lf_prompt = prompt_of(pool, "Latency-first", LF_TOKENS)
    counts: dict = {}
    started = time.monotonic()
    await generate(llm, lf_prompt, LF_TOKENS, 0, counts, "alone")
    run = {"lf_alone_s": round(time.monotonic() - started, 3)}
    tf_prompt = prompt_of(pool, "Throughput-first", lower_reply)
    low = [asyncio.ensure_future(generate(llm, tf_prompt, lower_reply, 1, counts, i))
           for i in range(lower)]
    try:
        while sum(1 for i in range(lower) if counts.get(i, 0) >= 3) < lower:
            await asyncio.sleep(0.05)
        base, started = sum(counts[i] for i in range(lower)), time.monotonic()
        lf = asyncio.ensure_future(generate(llm, lf_prompt, LF_TOKENS, 0, counts, "lf"))
        while not counts.get("lf") and time.monotonic() - started < give_up_s:
            await asyncio.sleep(0.01)
        first = time.monotonic() - started
        run.update(lf_first_token_s=round(first, 3) if counts.get("lf") else None,
                   lower_tokens_before_it=sum(counts[i] for i in range(lower)) - base,
                   lower_still_running=sum(1 for t in low if not t.done()))
        if counts.get("lf"):
            await asyncio.wait_for(lf, give_up_s)
            run["lf_reply_s"] = round(time.monotonic() - started, 3)
        else:
            lf.cancel()
    finally:
        for task in low:
            task.cancel()
        await asyncio.gather(*low, return_exceptions=True)
    return run


async def main(args) -> dict:
    config = load_config(env={**os.environ, "VCHAT_ENGINES": "shared"})
    pool = Engines(config)
    await pool.start()
    try:
        engine = pool.engines[SHARED]
        runs = []
        for n in range(args.runs):
            runs.append(await one_run(pool, args.lower, args.lower_reply, args.give_up_s))
            print(f"run {n + 1}/{args.runs}: {runs[-1]}", flush=True)
        firsts = [r["lf_first_token_s"] for r in runs if r["lf_first_token_s"] is not None]
        return {
            "command": "python -m bench.waiting_turn " + " ".join(args.argv),
            "device": "gpu" if pool.gpu else "cpu", "model": engine.setup.args.get("model"),
            "latency_first_steps": engine.llm.vllm_config.additional_config.get(
                "vchat_step_classes"),
            "lower_turns": args.lower, "lower_reply_tokens": args.lower_reply,
            "lf_first_token_s_median": statistics.median(firsts) if firsts else None,
            "runs_without_a_first_token": len(runs) - len(firsts), "give_up_s": args.give_up_s,
            "runs": runs}
    finally:
        pool.shutdown()


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lower", type=int, default=40, help="Throughput-first turns running")
    parser.add_argument("--lower-reply", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--give-up-s", type=float, default=60.0,
                        help="how long to wait for the first token")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = asyncio.run(main(args))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
