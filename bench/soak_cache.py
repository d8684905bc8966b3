"""What slows a long soak: the engine's KV cache against the conversations' histories.

One preset's engine (no app), `--sessions` conversations at once, each `--turns` turns of
the soak test's short message with 8-token replies, every session sending its next turn
when its reply is done (tests/test_app.py's soak, minus the sockets). Prints, per stretch
of turns: the prompt length, the median time to first token, vLLM's prefix-cache hit rate
(the share of prompt tokens it did not have to compute again) and the requests it had to
preempt for lack of KV cache, for the KV cache size given.

    .venv/bin/python -m bench.soak_cache --kv-gib 0.5     # make test's size per engine
    .venv/bin/python -m bench.soak_cache --kv-gib 2       # the shipped size per engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.cli import whole_number
from engine import Message, TurnStats, load_config
from engine.history import fit_history
from engine.launch import GIB, Machine, engine_setup
from engine.llm import PresetEngine
from engine.model import resolve_model


async def session(engine: PresetEngine, i: int, turns: int, system: str, log: list) -> None:
    history = []
    for k in range(turns):
        new = Message("user", f"Soak {i}.{k}: name one colour.")
        prompt = fit_history(engine.formatter, history, new, system_prompt=system,
                             max_model_len=engine.max_model_len, max_tokens=8)
        reply, stats = [], None
        async for item in engine.stream(prompt, temperature=0.7, top_p=1.0):
            if isinstance(item, TurnStats):
                stats = item
            else:
                reply.append(item)
        history += [new, Message("assistant", "".join(reply))]
        log.append((k, prompt.prompt_tokens, stats.ttft_s or 0.0))


async def main(args) -> None:
    config = load_config()
    preset = config.presets[args.preset]
    setup = engine_setup(config, preset, resolve_model(config.model), Machine.here())
    engine = PresetEngine(preset.name, setup.with_args(
        max_model_len=2048, kv_cache_memory_bytes=int(args.kv_gib * GIB)))
    await engine.start()
    cache = engine.cache_config
    capacity = cache.num_gpu_blocks * cache.block_size
    system = next(p.system_prompt for p in config.profiles if p.preset == preset.name)
    log: list = []  # (turn, prompt tokens, ttft) of every finished turn
    rows, seen, mark = [], 0, (0, 0, 0)
    started = time.monotonic()
    try:
        tasks = [asyncio.create_task(session(engine, i, args.turns, system, log))
                 for i in range(args.sessions)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(args.every_s)
            stats = engine.step_stats
            counts = (stats.cache_queries, stats.cache_hits, stats.preempted)
            queries, hits, preempted = (now - then for now, then in zip(counts, mark))
            window, seen, mark = log[seen:], len(log), counts
            rows.append({
                "at_s": round(time.monotonic() - started), "turns_done": seen,
                "prompt_tokens": round(statistics.mean(p for _, p, _ in window)) if window
                else None,
                "ttft_p50_s": round(statistics.median(t for *_, t in window), 2) if window
                else None,
                "cache_hit_rate": round(hits / queries, 3) if queries else None,
                "preempted": preempted,
            })
            print(rows[-1], flush=True)
        for task in tasks:
            task.result()
    finally:
        engine.shutdown()
    print(json.dumps({"preset": preset.name, "kv_gib": args.kv_gib,
                      "kv_capacity_tokens": capacity, "sessions": args.sessions,
                      "turns": args.turns, "wall_s": round(time.monotonic() - started, 1),
                      "rows": rows}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="throughput-first")
    parser.add_argument("--kv-gib", type=float, default=0.5, help="this engine's KV cache")
    parser.add_argument("--sessions", type=whole_number, default=16)
    parser.add_argument("--turns", type=whole_number, default=32, help="per session")
    parser.add_argument("--every-s", type=float, default=20.0, help="seconds per report row")
    asyncio.run(main(parser.parse_args()))
