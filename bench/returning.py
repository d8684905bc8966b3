"""Returning chats with and without KV offloading to CPU memory (issue 59): the shared
engine as the app builds it (engine/pool.py, profiles.yaml), straight on its vLLM client,
once per `--offload-gib` value (0: none; memory.cpu_offload_gib). Each run:

1. `--chats` chats read a history of `--history` tokens each (random tokens, a chat's
   own) and reply `--reply` tokens: their prefixes are now in the GPU's cache;
2. `--others` other chats do the same, together more than the GPU's cache holds: the
   first chats' blocks are evicted from the GPU (with offloading, kept in CPU memory);
3. the first chats come back one at a time: their history and a new message of
   `--message` tokens; each one's time to first token and the tokens vLLM found cached.

The GPU's cache is made small enough for this to fit one call (`--gpu-memory-utilization`),
and `--others` is computed from it unless given. Figures per run: the returning chats'
TTFT (p50, p95) and cached share, the others' tokens per second in step 2, preemptions;
where the returning turns' first tokens went (the engine's legs: a history loaded back
waits in "queued"), and what vLLM's offloading connector loaded back for them (GiB, the
copies' own GPU time per chat, GB/s: the PCIe link's share of the TTFT).

    scripts/gpu_run.sh OUT returning --offload-gib 0 32               (on a GPU)
    scripts/gpu_run.sh OUT returning --offload-gib 0 32 --block-size 64   (larger blocks)
    scripts/gpu_run.sh OUT returning --offload-gib 0 32 --kv-cache-dtype fp8  (half the bytes)
    .venv/bin/python -m bench.returning --plan cpu                     (a CPU dry run: the
                                                  steps and figures, no offloading on a CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from bench.isolation import random_ids
from engine.llm import first_token_legs

SHARED = "latency-first+throughput-first"
PRIORITY = 1  # Throughput-first's class: a chat's turn as the app sends it
PROFILES = Path(__file__).resolve().parent.parent / "profiles.yaml"


def profiles_with(offload_gib: float | str, gpu_memory_utilization: float | None,
                  block_size: int | None = None, kv_cache_dtype: str | None = None) -> Path:
    """The shipped profiles.yaml with this run's memory: section (GiB, or "auto"), and
    vLLM's KV cache block size and dtype for every engine when given (tokens a block, and
    "fp8": half the bytes a token, so half a returning chat's load)."""
    raw = yaml.safe_load(PROFILES.read_text())
    raw["memory"]["cpu_offload_gib"] = offload_gib if offload_gib == "auto" \
        else float(offload_gib)
    if gpu_memory_utilization is not None:
        raw["memory"]["gpu_memory_utilization"] = gpu_memory_utilization
    if block_size:
        raw.setdefault("vllm", {})["block_size"] = block_size
    if kv_cache_dtype:
        raw.setdefault("vllm", {})["kv_cache_dtype"] = kv_cache_dtype
    path = Path(tempfile.mkdtemp(prefix="returning-")) / "profiles.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


async def ask(llm, ids: list[int], reply: int) -> dict:
    """One turn on vLLM's engine: its TTFT, tokens, time and cached prompt tokens."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=reply, ignore_eos=True, temperature=0.7, top_p=0.9,
                            output_kind=RequestOutputKind.DELTA)
    request_id = f"ret-{uuid.uuid4().hex}"
    start, first, legs, tokens, cached = time.monotonic(), None, None, 0, None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id,
                                  priority=PRIORITY):
        if first is None:
            first = time.monotonic()
            legs = first_token_legs(llm, request_id, start, first)
        tokens += len(out.outputs[0].token_ids)
        if out.num_cached_tokens is not None:
            cached = out.num_cached_tokens
    return {"ttft_s": first - start, "tokens": tokens, "s": time.monotonic() - start,
            "cached": cached or 0, "prompt": len(ids), "legs": legs}


def legs_p50_ms(turns: list[dict]) -> dict[str, float] | None:
    """Each leg of the turns' first tokens (stats.FIRST_TOKEN_LEGS), its median in ms.
    A history loaded back from CPU memory is in "queued": vLLM schedules a turn only
    once its blocks are back on the GPU; "prefill" is then the new message's."""
    legs = [t["legs"] for t in turns if t["legs"]]
    if not legs:
        return None
    return {leg: round(1000 * statistics.median(one[leg] for one in legs), 1)
            for leg in legs[0]}


def moved_back(before: dict, after: dict, chats: int) -> dict:
    """What vLLM's offloading connector loaded back while the chats returned: GiB, the
    copies' GPU time per chat, and their rate (GB/s); zeros without offloading."""
    loaded = after["loaded_bytes"] - before["loaded_bytes"]
    load_s = after["load_s"] - before["load_s"]
    return {"back_loaded_gib": round(loaded / 2**30, 3),
            "back_load_ms_per_chat": round(1000 * load_s / chats, 1),
            "back_load_gb_per_s": round(loaded / load_s / 1e9, 1) if load_s else None}


async def run(args, offload_gib: float) -> dict:
    from engine import Engines, load_config
    from engine.pool import offload_tokens

    os.environ["VCHAT_PROFILES"] = str(profiles_with(offload_gib, args.gpu_memory_utilization,
                                                     args.block_size, args.kv_cache_dtype))
    pool = Engines(load_config())
    await pool.start()
    try:
        engine = pool.engines[SHARED]
        llm = engine.llm
        rng = random.Random(args.seed)
        history = min(args.history, engine.max_model_len - args.message - args.reply - 8)
        others = args.others or math.ceil(1.3 * engine.kv_tokens / history)
        histories = [random_ids(history, rng) for _ in range(args.chats)]
        # The native connector keeps every computed block in CPU memory, least recently
        # used out first: the first chats stay there only if both sets fit in it.
        held = offload_tokens(engine.kv_offload_gib, engine.kv_bytes_per_token)
        figures = {"offload_gib": offload_gib, "block_size": engine.block_size,
                   "kv_tokens": engine.kv_tokens, "kv_bytes_per_token": engine.kv_bytes_per_token,
                   "kv_offload_gib": engine.kv_offload_gib, "offload_tokens": held,
                   "both_fit_in_cpu": (args.chats + others) * history <= held,
                   "history": history, "chats": args.chats, "others": others}
        print(json.dumps(figures), flush=True)
        await ask(llm, random_ids(64, rng), 4)  # sampling kernels
        preempted = engine.step_stats.preempted
        first = await asyncio.gather(*(ask(llm, h, args.reply) for h in histories))
        started = time.monotonic()
        second = await asyncio.gather(*(ask(llm, random_ids(history, rng), args.reply)
                                        for _ in range(others)))
        second_s = time.monotonic() - started
        moved = dict(engine.step_stats.offload)
        back = []
        for h in histories:  # one at a time, as people come back
            back.append(await ask(llm, h + random_ids(args.message, rng), args.reply))
            await asyncio.sleep(args.gap_s)
        ttfts = sorted(b["ttft_s"] for b in back)
        figures.update(
            first_ttft_p50_s=statistics.median(f["ttft_s"] for f in first),
            others_tokens_per_s=sum(s["tokens"] for s in second) / second_s,
            others_s=second_s,
            back_ttft_p50_s=statistics.median(ttfts),
            back_ttft_p95_s=ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            back_cached_share=sum(b["cached"] for b in back) / sum(b["prompt"] for b in back),
            back_cached=[b["cached"] for b in back],
            back_legs_ms_p50=legs_p50_ms(back),
            **moved_back(moved, engine.step_stats.offload, len(back)),
            preempted=engine.step_stats.preempted - preempted)
        print(json.dumps(figures), flush=True)
        return figures
    finally:
        pool.shutdown()


def compare(runs: list[dict]) -> dict:
    """The targets: returning TTFT p50 with offloading <= 0.3x without; the others' tok/s
    >= 0.95x."""
    off = next((r for r in runs if not r["offload_gib"]), None)
    on = [r for r in runs if r["offload_gib"]]
    if off is None or not on:
        return {}
    best = on[-1]
    ttft = best["back_ttft_p50_s"] / off["back_ttft_p50_s"]
    speed = best["others_tokens_per_s"] / off["others_tokens_per_s"]
    return {"back_ttft_p50_ratio": round(ttft, 3), "others_tokens_per_s_ratio": round(speed, 3),
            "targets": [
                {"what": "returning chats' TTFT p50, offloading / none", "target": "<= 0.3",
                 "value": round(ttft, 3), "met": ttft <= 0.3},
                {"what": "the others' tokens/s, offloading / none", "target": ">= 0.95",
                 "value": round(speed, 3), "met": speed >= 0.95}]}


async def main(args) -> dict:
    device = "CPU"
    try:
        import torch
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
    except ImportError:
        pass
    result = {"device": device, "args": vars(args), "runs": []}
    for repeat in range(args.repeats):
        for gib in args.offload_gib:
            figures = await run(args, gib)
            figures["repeat"] = repeat
            result["runs"].append(figures)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    result.update(compare(result["runs"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--offload-gib", type=float, nargs="+", default=[0.0, 32.0])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--others", type=int, default=0, help="0: from the GPU's cache")
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--message", type=int, default=64)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--gap-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=59)
    parser.add_argument("--block-size", type=int, default=0,
                        help="vLLM's KV cache block size in tokens for these runs (default: "
                             "vLLM's, 16 on a GPU): larger blocks are fewer, larger copies "
                             "when a history is loaded back from CPU memory")
    parser.add_argument("--kv-cache-dtype", choices=("fp8",),
                        help="vLLM's KV cache dtype for these runs (default: the model's, "
                             "bf16): fp8 halves the bytes a returning chat loads back, and "
                             "changes the model's numbers (a product decision, not a bench's)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.plan == "cpu":  # the steps at a CPU's size: no offloading there
        args.offload_gib, args.gpu_memory_utilization = [0.0], None
        args.chats, args.history, args.reply, args.message = 2, 600, 4, 16
        args.others = args.others or 8  # a dry run: too few to evict on a CPU's cache
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
