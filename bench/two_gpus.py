"""Two GPUs, measured (issue 18), on the engine path with every engine up at once and one
layout working at a time, in neighbouring pairs (A B, B A, ...):

  placement      latency-first's inter-token gaps alone and while throughput-first is
                 saturated, the two presets sharing GPU 0 against each on its own GPU.
                 Target: on their own GPUs, latency-first's gap p95 does not grow.
  data-parallel  throughput-first on one GPU against the same preset on two
                 (data_parallel_size 2), tok/s at each of --levels users. Target: >= 1.8x.

Each layout's presets are the shipped ones (profiles.yaml) with `gpus:` and an equal memory
share, so the layouts differ in placement only. Needs two GPUs (the nvidia-h200-x2 device
kind); started anywhere else it says so and starts nothing.

    VCHAT_MODEL=qwen3-4b-dummy python -m bench.two_gpus placement
    VCHAT_MODEL=qwen3-4b-dummy python -m bench.two_gpus data-parallel --levels 256 512
    scripts/gpu_run.sh OUT two-gpus placement    # through the device tool
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.cli import whole_number
from bench.serve_compare import RESULTS, SETTLE_S, ratios, take_turns
from bench.workloads import chat

TARGETS = {"own_gpu_itl_p95_growth": 1.0, "data_parallel_tok_s_ratio": 1.8}
# Every engine of a layout file at once: shares that fit GPU 0 with all of them on it.
SHARES = {"placement": 0.3, "data-parallel": 0.45}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["placement", "data-parallel"])
    p.add_argument("--pairs", type=whole_number, default=3, help="neighbouring pairs")
    p.add_argument("--users", type=whole_number, default=64,
                   help="placement: latency-first's users (the probe)")
    p.add_argument("--load-users", type=whole_number, default=512,
                   help="placement: throughput-first's users while it is saturated")
    p.add_argument("--levels", type=whole_number, nargs="+", default=[256, 512],
                   help="data-parallel: users at once")
    p.add_argument("--output-len", type=whole_number, default=256)
    p.add_argument("--name", default=None, help="bench/results/NAME.json "
                   "(default: two-gpus-placement or two-gpus-data-parallel)")
    args = p.parse_args(argv)
    args.name = args.name or f"two-gpus-{args.what}"
    if Path(args.name).name != args.name:
        p.error("--name must be a plain file name")
    return args


def layout_profiles(source: Path, what: str) -> Path:
    """A profiles file with each layout's presets (the shipped bodies, `gpus:` set, equal
    shares) and a profile for each, named as its preset."""
    raw = yaml.safe_load(source.read_text())
    shipped, share = raw["presets"], SHARES[what]

    def placed(name: str, gpus: list[int], **gpu_options) -> dict:
        body = yaml.safe_load(yaml.safe_dump(shipped[name]))
        body.setdefault("vllm_gpu", {}).update(gpu_options)
        return {**body, "gpus": gpus, "memory_share": share}

    if what == "placement":
        parts = {"shared-latency": ("latency-first", [0]),
                 "shared-throughput": ("throughput-first", [0]),
                 "own-latency": ("latency-first", [0]),
                 "own-throughput": ("throughput-first", [1])}
        presets = {part: placed(name, gpus) for part, (name, gpus) in parts.items()}
    else:
        presets = {"one-gpu": placed("throughput-first", [0]),
                   "two-gpus": placed("throughput-first", [0, 1], data_parallel_size=2)}
    for body in presets.values():  # the benchmark's users all wait in line, none is refused
        body["max_queued_turns"] = 4096
    template = raw["profiles"][0]
    raw["presets"] = presets
    raw["profiles"] = [{**template, "name": name, "preset": name, "default": False,
                        "starters": []} for name in presets]
    out = Path(tempfile.mkdtemp()) / "profiles.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


def itl_p95(run: dict) -> float:
    return run["itl_ms"]["p95"]


def placement_figures(pairs: list[dict]) -> dict:
    """Per layout: latency-first's gap p95 busy over alone, the median over the pairs."""
    out = {}
    for layout in ("shared", "own"):
        growth = [round(itl_p95(p[layout]["busy"]) / itl_p95(p[layout]["alone"]), 3)
                  for p in pairs]
        out[layout] = {"itl_p95_growth": growth,
                       "itl_p95_growth_median": round(statistics.median(growth), 3)}
    return out


def data_parallel_figures(pairs: dict[int, list[dict]]) -> dict:
    """Per level: two GPUs' tok/s over one's (and TTFT p95's), medians over the pairs."""
    return {str(level): ratios(runs, "two-gpus", "one-gpu") for level, runs in pairs.items()}


async def saturated(engine, users: int, output_len: int):
    """Keep `engine` busy with `users` users until cancelled (their turns are withdrawn)."""
    from bench import paths

    while True:
        await paths.run_engine(engine, chat(users * 4, output_len, seed=7), users)


async def measure_placement(args, engines: dict) -> list[dict]:
    from bench import paths

    pairs = []
    for i in range(args.pairs):
        order = ("shared", "own") if i % 2 == 0 else ("own", "shared")
        pair = {"order": list(order)}
        for layout in order:
            latency, load = engines[f"{layout}-latency"], engines[f"{layout}-throughput"]
            probe = chat(args.users * 2, args.output_len, seed=100 + i)
            await asyncio.sleep(SETTLE_S)
            alone = await paths.run_engine(latency, probe, args.users)
            busy_task = asyncio.create_task(saturated(load, args.load_users, args.output_len * 4))
            try:
                await asyncio.sleep(10 * SETTLE_S)  # its prompts in, its steps full
                busy = await paths.run_engine(latency, probe, args.users)
            finally:
                busy_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await busy_task
            pair[layout] = {"alone": alone, "busy": busy}
            print(f"  pair {i + 1}/{args.pairs} {layout}: latency-first gap p95 "
                  f"{itl_p95(alone)} ms alone, {itl_p95(busy)} ms beside a saturated "
                  f"throughput-first", flush=True)
        pairs.append(pair)
    return pairs


async def measure_data_parallel(args, engines: dict) -> dict[int, list[dict]]:
    from bench import paths

    pairs = {}
    for level in args.levels:
        print(f"  {level} users", flush=True)
        pairs[level] = await take_turns(args.pairs, lambda name, i: paths.run_engine(
            engines[name], chat(level * 2, args.output_len, seed=200 + i), level),
            ("one-gpu", "two-gpus"))
    return pairs


async def main(args) -> dict:
    from bench import paths  # loads vLLM: not for --help
    from bench.run import ENV_AT_START, versions
    from service.loop import freeze_heap
    from engine import load_config
    from engine.launch import Machine, engine_setup
    from engine.llm import PresetEngine
    from engine.model import resolve_model

    machine = Machine.here()
    if not machine.gpu or machine.gpus < 2:
        have = f"{machine.gpus} GPU" if machine.gpu else "no GPU"
        raise SystemExit(f"error: bench.two_gpus needs two GPUs; this machine has {have}")
    path = layout_profiles(Path(load_config().source), args.what)
    config = load_config(path, env=ENV_AT_START)
    model, engines, started = resolve_model(config.model), {}, time.monotonic()
    try:
        for preset in config.used_presets():  # one after another: vLLM measures free memory
            engines[preset.name] = PresetEngine(preset.name, engine_setup(
                config, preset, model, machine))
            await engines[preset.name].start()
        freeze_heap()
        warm = chat(8, 8, seed=99)
        for engine in engines.values():
            await paths.run_engine(engine, warm, 8)
        if args.what == "placement":
            pairs = await measure_placement(args, engines)
            figures = placement_figures(pairs)
        else:
            pairs = await measure_data_parallel(args, engines)
            figures = data_parallel_figures(pairs)
    finally:
        for engine in engines.values():
            engine.shutdown()
    result = {"targets": TARGETS, "figures": figures, "model": model,
              "machine": {"gpus": machine.gpus, "cores": machine.cores, **versions()},
              "command": "python -m bench.two_gpus " + " ".join(sys.argv[1:]),
              "settings": vars(args),
              "presets": {p.name: {"gpus": list(config.gpus_of(p)),
                                   "memory_share": p.memory_share} for p in config.used_presets()},
              "duration_s": round(time.monotonic() - started, 1), "pairs": pairs}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    from engine import ChatError

    try:
        asyncio.run(main(parse_args(sys.argv[1:])))
    except ChatError as exc:  # the profiles file, the model, an engine that failed
        sys.exit(f"error: {exc}")
