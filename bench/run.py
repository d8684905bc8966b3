"""`make bench`: batching and presets, measured on the engine path and the app path.

For each preset in turn (only one engine works at any time, so presets never share cores):
  1. engine path: chat and mixed workloads at each concurrency level, straight into engine/;
     for throughput-first (the batching preset) also the baseline: the 32-user chat
     requests served one at a time;
  2. app path: `chainlit run app.py` serving only that preset's profile, the chat workload
     (`--app-workloads` for more) through headless Socket.IO clients.
Each path starts with a warm-up at the top level. The 32-user chat runs of both paths and
the baseline (in parts) take turns, --repeats times (--repeats-other for the presets other
than the batching one). Then the presets' 32-user mixed runs take turns, --preset-repeats
times each, with every preset's engine up. The ratios are the medians of neighbouring runs'
ratios. Last, the app layer's own ceiling with the stand-in engine (bench/ui_ceiling.py).
Writes bench/results/latest.json and latest.png, and prints the headline figures.

    .venv/bin/python -m bench.run                                  # what `make bench` runs
    .venv/bin/python -m bench.run --levels 1 4 --min-requests 4 --output-len 16 \
        --skip-ui-ceiling --name smoke                             # a fast smoke run
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from bench import paths
from bench.cli import parse_args
from bench.metrics import summarize
from bench.workloads import SAMPLING, SYSTEM_PROMPT, WORKLOADS
from service.loop import freeze_heap
from engine import ChatError, load_config
from engine.config import Preset
from engine.launch import Machine, engine_setup
from engine.llm import PresetEngine
from engine.model import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
BATCHING_PRESET = "throughput-first"  # the preset whose promise is batching
SETTLE_S = 1.0
# The app path's server gets the environment this process started with: starting an engine
# in-process makes vLLM set variables (LD_PRELOAD, thread settings) that a server started
# by hand (`make run`) would not inherit, and that measurably change its engine's speed.
ENV_AT_START = dict(os.environ)


def single_preset_profiles(source: Path, preset: str, share: float = 1.0, users: int = 0
                           ) -> Path:
    """A profiles file holding only `preset` (`share` of the memory) and the profiles that
    use it, with the benchmark's sampling and system prompt, so both paths send the same
    requests. The app's line in front of the engine holds all `users` (a user beyond
    max_num_seqs + max_queued_turns would be told "busy": the product's choice, not the
    batching this measures)."""
    raw = yaml.safe_load(source.read_text())
    body = raw["presets"][preset]
    queued = max(body.get("max_queued_turns", Preset.max_queued_turns), users)
    raw["presets"] = {preset: {**body, "memory_share": share, "max_queued_turns": queued}}
    raw["profiles"] = [
        {**p, "system_prompt": SYSTEM_PROMPT, "sampling": {**p.get("sampling", {}), **SAMPLING}}
        for p in raw["profiles"] if p["preset"] == preset]
    out = Path(tempfile.mkdtemp()) / "profiles.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


async def sweep(args, workloads: list[str], label: str, bar, run, skip=()) -> dict:
    """Every workload at every concurrency level through `run(requests, level)`, except the
    (workload, level) runs in `skip`, which are interleaved with others elsewhere."""
    results = {}
    for workload in workloads:
        for level in levels(args, workload):
            if (workload, level) in skip:
                continue
            bar.set_description(f"{label} {workload} x{level}")
            results[f"{workload}@{level}"] = await run(requests(args, workload, level), level)
    return results


def levels(args, workload: str) -> list[int]:
    """The mixed workload stops at --mixed-max-users: at 64 users it alone took ~2.6 of
    the 20 minutes, and the presets are compared at 32."""
    if workload == "mixed":
        return [lv for lv in args.levels if lv <= args.mixed_max_users]
    return args.levels


def requests(args, workload: str, level: int, repeat: int = 0) -> list:
    """Each level and each repeat its own prompts: vLLM's prefix cache would skip the prefill
    of prompts an engine has seen (the app's engine cannot be reset from here)."""
    extra = {"long_words": tuple(args.long_words)} if workload == "mixed" else {}
    return WORKLOADS[workload](max(level, args.min_requests), args.output_len,
                               seed=level + 1000 * repeat, **extra)


async def headline_runs(args, repeats: int, label: str, bar, engine_run, app_run,
                        baseline_run) -> dict:
    """The runs the ratios come from, interleaved in time: engine path, app path and a part
    of the one-at-a-time baseline in turn, `repeats` times. This machine's speed
    drifts by 10-20% over minutes (shared hosts), so runs minutes apart are not comparable;
    neighbours in time are. Keeps the median run of each path, every repeat's figure, and
    the app/engine and batched/one-at-a-time ratios of each neighbouring pair."""
    level = headline_level(args)
    runs = {"engine": [], "app": []}
    base_timings, base_wall, speedups = [], 0.0, []
    async def settle():  # let the last run's aftermath (closing sessions) pass first
        await asyncio.sleep(SETTLE_S)

    for i in range(repeats):
        step = f"({i + 1}/{repeats})"
        reqs = requests(args, "chat", level, repeat=i)
        bar.set_description(f"{label} engine chat x{level} {step}")
        await settle()
        runs["engine"].append(await engine_run(reqs, level))
        if app_run:
            bar.set_description(f"{label} app chat x{level} {step}")
            await settle()
            runs["app"].append(await app_run(reqs, level))
        if baseline_run:  # this repeat's share of the requests, one at a time
            bar.set_description(f"{label} engine baseline (one at a time) {step}")
            await settle()
            timings, wall = await baseline_run(reqs[i::repeats])
            base_timings += timings
            base_wall += wall
            one_by_one = summarize(timings, wall)["tok_s"]
            speedups.append(round(runs["engine"][-1]["tok_s"] / one_by_one, 2))
    out = {}
    for route, done in runs.items():
        if done:
            out[route] = {**median_run(done), "repeats_tok_s": [r["tok_s"] for r in done]}
    if runs["app"]:
        out["app_over_engine"] = [round(a["tok_s"] / e["tok_s"], 3)
                                  for a, e in zip(runs["app"], runs["engine"])]
    if baseline_run:
        out["baseline"] = summarize(base_timings, base_wall)
        out["batching_speedup"] = speedups
    return out


async def warm_up(args, run) -> None:
    """Short requests at the top concurrency level first: the CPU kernels set themselves up
    for each new batch shape on first use, which cost the first 32-user run ~10%."""
    top = max(args.levels)
    await run(WORKLOADS["chat"](top, 8, seed=99), top)


def interleaved(args) -> bool:
    """The headline runs take turns (`headline_runs`) when the engine path runs chat (the
    CPU plan; --paired pairs the paths at every level instead)."""
    return "chat" in args.workloads and args.paired is None


def presets_interleaved(args, presets: list[str]) -> bool:
    """The presets' mixed runs at the headline level take turns (`preset_runs`) when more
    than one preset runs the mixed workload."""
    return (len(presets) > 1 and "mixed" in args.workloads
            and headline_level(args) in levels(args, "mixed"))


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the upper middle one of an even number)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def headline_skip(args) -> set:
    """The chat run at the headline level, when `headline_runs` interleaves it instead."""
    return {("chat", headline_level(args))} if interleaved(args) else set()


def engine_skip(args, presets: list[str]) -> set:
    """The engine path's runs that are interleaved with others instead of run in the sweep."""
    if args.paired is not None:  # every run in the sweep (the presets' turns come on top)
        return set()
    mixed = {("mixed", headline_level(args))} if presets_interleaved(args, presets) else set()
    return headline_skip(args) | mixed


def headline_repeats(args, batching: bool) -> int:
    """The batching preset carries the target figures; the others' app/engine ratio is for
    information and gets fewer repeats."""
    return args.repeats if batching else min(args.repeats, args.repeats_other)


def headline_level(args) -> int:
    return args.headline_users if args.headline_users in args.levels else max(args.levels)


async def paired_sweep(args, bar, label: str, runners: dict) -> tuple[dict, dict]:
    """Every workload at every level through each path in `runners` (route -> run), the
    paths one after the other on the same requests; --repeats times at the --paired levels.
    Returns the kept runs per route and each level's neighbouring-pair ratios."""
    kept = {route: {} for route in runners}
    pairs = {}
    for workload in args.workloads:
        for level in levels(args, workload):
            key = f"{workload}@{level}"
            done = {route: [] for route in runners}
            repeats = args.repeats if level in args.paired else 1
            for i in range(repeats):
                reqs = requests(args, workload, level, repeat=i)
                for route, run in runners.items():
                    if route == "raw" and workload != "chat":
                        continue  # the anchor is for the chat workload
                    if route.startswith("app") and workload not in args.app_workloads:
                        continue
                    bar.set_description(f"{label} {route} {key} ({i + 1}/{repeats})")
                    await asyncio.sleep(SETTLE_S)
                    done[route].append(await run(reqs, level))
            for route, runs in done.items():
                if runs:
                    kept[route][key] = {**median_run(runs),
                                        "repeats_tok_s": [r["tok_s"] for r in runs]}
            pairs[key] = {f"{a}_over_{b}": [round(x["tok_s"] / y["tok_s"], 3)
                                             for x, y in zip(done[a], done[b])]
                          for a, b in (("engine", "raw"), *((r, "engine") for r in done
                                                             if r.startswith("app")))
                          if done.get(a) and done.get(b)}
    return kept, pairs


async def bench_preset(args, config, preset_name: str, baseline: bool, bar,
                       engine: PresetEngine, skip: set, app_share: float = 1.0) -> dict:
    """One preset: its in-process engine (engine path) and, started beside it, the app
    serving only this preset (app path). Only one engine works at any time; an idle
    engine costs ~0.01 core here. `skip`: the engine path's runs done elsewhere."""
    preset = config.presets[preset_name]
    await engine.start()
    # This process drives every path (and holds the in-process engine): a collection that
    # walks its whole heap would stall the measurement, as it would stall the app without
    # the app's own freeze (service/loop.py).
    freeze_heap()
    result = {"engine": {}, "app": {}, "startup_s": round(engine.started_in_s, 1)}
    server = None
    try:
        def engine_run(reqs, level):
            return paths.run_engine(engine, reqs, level, bar)

        bar.set_description(f"{preset_name} engine warm-up")
        await warm_up(args, lambda reqs, level: paths.run_engine(engine, reqs, level))
        if args.paired is None:
            result["engine"] = await sweep(args, args.workloads, f"{preset_name} engine", bar,
                                           engine_run, skip)
        app_run = None
        if "app" in args.paths:
            from tools.chainlit_client import Server

            profiles = single_preset_profiles(Path(config.source), preset_name, app_share,
                                              max(args.levels))
            profile = next(p.name for p in config.profiles if p.preset == preset_name)
            kv_gib = config.memory.cpu_kv_cache_gib * preset.memory_share
            # The same context length on both paths without a GPU; on one, each engine fits
            # its own: the in-process engine's fitted length need not fit the app's slice
            # (vLLM counts the memory other processes hold at its start).
            fit = -1 if Machine.here().gpu else engine.max_model_len
            server = Server({"VCHAT_PROFILES": str(profiles), "VCHAT_BENCH_IGNORE_EOS": "1",
                             "VCHAT_KV_CACHE_GIB": str(kv_gib),
                             "VCHAT_MAX_MODEL_LEN": str(fit),
                             "VCHAT_ENFORCE_EAGER": "1" if engine.setup.args["enforce_eager"]
                             else "0"}, base_env=ENV_AT_START)
            bar.set_description(f"{preset_name} app starting")
            await server.wait_ready()

            def app_run(reqs, level, processes=args.app_client_processes[0]):
                return paths.run_app(server.url, profile, reqs, level, bar, processes)

            bar.set_description(f"{preset_name} app warm-up")
            await warm_up(args, lambda reqs, level: paths.run_app(
                server.url, profile, reqs, level, processes=args.app_client_processes[0]))
            if args.paired is None:
                result["app"] = await sweep(args, args.app_workloads, f"{preset_name} app",
                                            bar, app_run, headline_skip(args))
        if args.paired is not None:
            runners = {"raw": lambda reqs, level: paths.run_raw(engine, reqs, level, bar),
                       "engine": engine_run, "app": app_run}
            for n in args.app_client_processes[1:] if app_run else ():  # more app routes
                runners[f"app-{n}p"] = functools.partial(app_run, processes=n)
            kept, result["pairs"] = await paired_sweep(
                args, bar, preset_name,
                {r: run for r, run in runners.items() if r.partition("-")[0] in args.paths and run})
            result.update(kept)
        if interleaved(args):
            head = await headline_runs(
                args, headline_repeats(args, baseline), preset_name, bar, engine_run,
                app_run if "chat" in args.app_workloads else None,
                (lambda reqs: paths.drive_engine(engine, reqs, 1, bar)) if baseline else None)
            key = f"chat@{headline_level(args)}"
            result["engine"][key] = head["engine"]
            if "app" in head:
                result["app"][key] = head["app"]
                result["app_over_engine_pairs"] = head["app_over_engine"]
            if "baseline" in head:
                result["engine"]["baseline"] = head["baseline"]
                result["batching_speedup_pairs"] = head["batching_speedup"]
    finally:
        if server is not None:
            server.stop()
    return result


async def preset_runs(args, engines: dict[str, PresetEngine], bar) -> dict:
    """The presets' mixed runs at the headline level, taking turns in A B B A order (which
    also cancels a steady drift) `args.preset_repeats` times each, with all engines up and
    one working. The presets' ratios are the medians of the neighbouring runs' ratios."""
    level = headline_level(args)
    names = list(engines)
    done: dict[str, list] = {n: [] for n in names}
    top = max(args.levels)
    chat_top: dict[str, list] = {n: [] for n in names}
    for i in range(args.preset_repeats):
        reqs = requests(args, "mixed", level, repeat=i)
        for name in (names if i % 2 == 0 else names[::-1]):
            bar.set_description(f"{name} engine mixed x{level} ({i + 1}/{args.preset_repeats})")
            await asyncio.sleep(SETTLE_S)
            done[name].append(await paths.run_engine(engines[name], reqs, level, bar))
            if args.paired is not None:  # the batching promise at the top level too
                bar.set_description(f"{name} engine chat x{top} ({i + 1}/{args.preset_repeats})")
                await asyncio.sleep(SETTLE_S)
                chat_top[name].append(await paths.run_engine(
                    engines[name], requests(args, "chat", top, repeat=10 + i), top, bar))
    return done, chat_top


def headline(runs: dict, top: int, presets_pairs: dict | None = None) -> dict:
    """The figures the issue names, from the raw runs (batching ones on the batching preset).
    Both ratios are the median of the ratios of runs neighbouring in time."""
    main = BATCHING_PRESET if BATCHING_PRESET in runs else next(iter(runs))
    out = {"headline_preset": main}
    speedups = runs[main].get("batching_speedup_pairs")
    if speedups:
        out[f"batching_speedup_{top}"] = round(float(np.median(speedups)), 2)
    for name, r in runs.items():
        pairs = r.get("app_over_engine_pairs")
        if pairs:
            key = f"app_over_engine_{top}" if name == main else f"app_over_engine_{top}_{name}"
            out[key] = round(float(np.median(pairs)), 3)
    out["presets"] = {}
    for name, r in runs.items():
        m = r["engine"].get(f"mixed@{top}")
        if m:  # each figure the median over the repeats, if the run was repeated
            figures = m["repeats"] if "repeats" in m else [preset_figures(m)]
            out["presets"][name] = {k: round(float(np.median([f[k] for f in figures])), 2)
                                    for k in figures[0]}
    if presets_pairs:  # neighbouring runs' ratios (keep_preset_runs), their medians
        for key in ("itl_p95_ratio", "tok_s_ratio", "chat_top_tok_s_ratio"):
            if key in presets_pairs:
                out[f"presets_{key}"] = round(float(np.median(presets_pairs[key])), 3)
        out["presets_pairs"] = presets_pairs
    for name, r in runs.items():  # --paired: each level's ratios, medians of the pairs
        for key, ratios in (r.get("pairs") or {}).items():
            for what, values in ratios.items():
                if values:
                    out.setdefault("paired", {}).setdefault(name, {}).setdefault(key, {})[
                        what] = {"median": round(float(np.median(values)), 3),
                                 "pairs": len(values)}
    return out


def preset_figures(run: dict) -> dict:
    return {"tok_s": run["tok_s"], "ttft_p50_ms": run["ttft_ms"]["p50"],
            "ttft_p95_ms": run["ttft_ms"]["p95"], "itl_p50_ms": run["itl_ms"]["p50"],
            "itl_p95_ms": run["itl_ms"]["p95"]}


def keep_preset_runs(runs: dict, done: dict[str, list], top: int,
                     chat_top: dict[str, list] | None = None) -> dict | None:
    """Store the interleaved mixed runs: per preset the median run (by tokens/s) with every
    repeat's figures; for latency-first and throughput-first, each neighbouring pair's
    ITL p95 ratio (latency-first's over throughput-first's) and tokens/s ratio (the other
    way round)."""
    for name, repeats in done.items():
        runs[name]["engine"][f"mixed@{top}"] = {
            **median_run(repeats), "repeats": [preset_figures(r) for r in repeats]}
    fast, big = done.get("latency-first"), done.get("throughput-first")
    if not (fast and big):
        return None
    out = {"itl_p95_ratio": [round(f["itl_ms"]["p95"] / b["itl_ms"]["p95"], 3)
                             for f, b in zip(fast, big)],
           "tok_s_ratio": [round(b["tok_s"] / f["tok_s"], 3) for f, b in zip(fast, big)]}
    fast, big = (chat_top or {}).get("latency-first"), (chat_top or {}).get("throughput-first")
    if fast and big:
        out["chat_top_tok_s_ratio"] = [round(b["tok_s"] / f["tok_s"], 3)
                                       for f, b in zip(fast, big)]
        out["chat_top_tok_s"] = {"latency-first": [f["tok_s"] for f in fast],
                                 "throughput-first": [b["tok_s"] for b in big]}
    return out


def versions() -> dict:
    """The versions the figures were measured with (and the GPU, where there is one)."""
    import torch
    import vllm

    out = {"torch": torch.__version__, "vllm": vllm.__version__}
    if torch.cuda.is_available():
        out["gpu_name"] = torch.cuda.get_device_name(0)
    return out


def plot(runs: dict, levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for preset, r in runs.items():
        for route, style in (("raw", ":^"), ("engine", "-o"), ("app", "--s")):
            for workload in ("chat", "mixed"):
                pts = [(lv, r.get(route, {}).get(f"{workload}@{lv}")) for lv in levels]
                pts = [(lv, x) for lv, x in pts if x]
                if not pts:
                    continue
                label = f"{preset} {route} {workload}"
                ax1.plot([p[0] for p in pts], [p[1]["tok_s"] for p in pts], style, label=label)
                ax2.plot([p[0] for p in pts], [p[1]["itl_ms"]["p95"] for p in pts], style,
                         label=label)
    for ax, ylabel, title in ((ax1, "output tokens/s", "Throughput"),
                              (ax2, "ITL p95 (ms)", "Inter-token latency p95")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrent users", ylabel=ylabel, title=title)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args, config) -> None:
    presets = args.presets or [p.name for p in config.used_presets()]
    app_workloads = args.app_workloads if "app" in args.paths else []
    total = len(presets) * sum(max(lv, args.min_requests) for w in args.workloads + app_workloads
                               for lv in levels(args, w))
    top = headline_level(args)
    batching = BATCHING_PRESET if BATCHING_PRESET in presets else presets[0]
    if interleaved(args):  # the headline runs are repeated, on both paths; the baseline
        total += sum(max(top, args.min_requests) * (headline_repeats(args, name == batching) - 1)
                     * (1 + ("chat" in app_workloads)) for name in presets)
        total += max(top, args.min_requests)
    if presets_interleaved(args, presets):
        total += max(top, args.min_requests) * (args.preset_repeats - 1) * len(presets)
    started = time.monotonic()
    runs, engines, presets_pairs = {}, {}, None
    model, machine = resolve_model(config.model), Machine.here()
    # On a GPU every engine takes its slice of the GPU's memory: the presets' in-process
    # engines (all up at the end, for the presets' turns) and the app server's one.
    slices = len(presets) + ("app" in args.paths)
    gpu_share = 1.0 / slices if machine.gpu else 1.0
    with tqdm(total=total, unit="req") as bar:
        try:
            for name in presets:
                setup = engine_setup(config, config.presets[name], model, machine)
                if machine.gpu:
                    setup = setup.with_args(gpu_memory_utilization=round(
                        config.memory.gpu_memory_utilization * gpu_share, 4))
                engines[name] = PresetEngine(name, setup)
                runs[name] = await bench_preset(args, config, name, name == batching, bar,
                                                engines[name], engine_skip(args, presets),
                                                gpu_share)
                RESULTS.mkdir(exist_ok=True)  # what is done so far, should a later step fail
                (RESULTS / f"{args.name}.partial.json").write_text(json.dumps(runs) + "\n")
            if presets_interleaved(args, presets):
                done, chat_top = await preset_runs(args, engines, bar)
                presets_pairs = keep_preset_runs(runs, done, top, chat_top)
        finally:
            for engine in engines.values():
                engine.shutdown()
        ceiling = None
        if not args.skip_ui_ceiling:
            from bench.ui_ceiling import ceiling_runs

            bar.set_description("app layer ceiling (stand-in engine)")
            # The uncoalesced comparison is the CPU's story (BENCHMARKS.md); on a GPU machine
            # one run at the product's setting.
            ceiling = await ceiling_runs(args.ceiling_sessions, uncoalesced=not machine.gpu)
    result = {
        **headline(runs, top, presets_pairs),
        "ui_ceiling": ceiling,
        "machine": {"arch": platform.machine(), "cores": os.cpu_count(),
                    "gpu": machine.gpu, "python": platform.python_version(), **versions()},
        "model": model,
        "command": "python -m bench.run " + " ".join(sys.argv[1:]),
        "settings": {"levels": args.levels, "workloads": args.workloads,
                     "app_workloads": args.app_workloads,
                     "output_len": args.output_len, "min_requests": args.min_requests,
                     "repeats": args.repeats, "repeats_other": args.repeats_other,
                     "preset_repeats": args.preset_repeats,
                     "mixed_max_users": args.mixed_max_users, "paths": args.paths,
                     "long_words": args.long_words, "paired": args.paired,
                     "headline_users": args.headline_users,
                     "engine_gpu_memory_share": gpu_share if machine.gpu else None},
        "duration_s": round(time.monotonic() - started, 1),
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.name}.partial.json").unlink(missing_ok=True)  # superseded
    plot(runs, args.levels, RESULTS / f"{args.name}.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    try:
        config = load_config()
        gpu = Machine.here().gpu
        asyncio.run(main(parse_args(sys.argv[1:], config, __doc__.splitlines()[0], gpu), config))
    except ChatError as exc:  # the profiles file, the model, an engine that failed
        sys.exit(f"error: {exc}")
