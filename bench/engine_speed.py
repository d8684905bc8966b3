"""Engine figures for the record: start-up time and output tokens/s at 1 and N streams.

One preset's engine alone on the machine, the model from profiles.yaml (embedded without a
GPU), every stream `ignore_eos` so all replies have the same length.

    .venv/bin/python -m bench.engine_speed --preset throughput-first --eager
    .venv/bin/python -m bench.engine_speed --preset throughput-first          # compiled
"""

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

from bench.cli import whole_number
from bench.paths import one_message
from bench.workloads import SAMPLING
from engine import ChatError, TurnStats, load_config
from engine.launch import Machine, engine_setup
from engine.llm import PresetEngine
from engine.model import resolve_model


async def run_streams(engine: PresetEngine, n: int, tokens: int) -> dict:
    async def one(i):
        stats = None
        async for item in engine.stream(one_message(engine, f"Tell story {i}.", tokens, ""),
                                        ignore_eos=True, **SAMPLING):
            if isinstance(item, TurnStats):
                stats = item
        return stats

    started = time.monotonic()
    results = await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.monotonic() - started
    out = sum(s.output_tokens for s in results)
    return {"streams": n, "output_tokens": out, "wall_s": round(wall, 2),
            "tok_s": round(out / wall, 1)}


async def main(args, config) -> None:
    preset = config.presets[args.preset]
    model = resolve_model(config.model)
    setup = engine_setup(config, preset, model, Machine.here())
    engine = PresetEngine(preset.name, setup.with_args(enforce_eager=args.eager))
    await engine.start()
    try:
        await run_streams(engine, 2, 8)  # warm-up
        rows = [await run_streams(engine, n, args.tokens) for n in args.streams]
    finally:
        engine.shutdown()
    single = rows[0]["tok_s"]
    for row in rows:
        row["speedup_vs_1"] = round(row["tok_s"] / single, 1)
    # vLLM logs to stdout as well: the figures go to a file, and to stdout last.
    result = json.dumps({"preset": args.preset, "eager": args.eager, "model": model,
                      "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
                      "startup_s": round(engine.started_in_s, 1), "runs": rows}, indent=2)
    if args.out:
        Path(args.out).write_text(result + "\n")
    print(result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="throughput-first")
    parser.add_argument("--eager", action="store_true", help="skip torch.compile")
    parser.add_argument("--tokens", type=whole_number, default=128)
    parser.add_argument("--streams", type=whole_number, nargs="+", default=[1, 32])
    parser.add_argument("--out", help="also write the figures (JSON) to this file")
    args = parser.parse_args()
    try:
        config = load_config()
        if args.preset not in config.presets:
            parser.error(f"--preset: no preset {args.preset!r} in {config.source}; "
                         f"it has {', '.join(config.presets)}")
        asyncio.run(main(args, config))
    except ChatError as exc:  # the profiles file, the model, an engine that failed
        sys.exit(f"error: {exc}")
