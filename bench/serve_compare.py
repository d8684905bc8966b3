"""The app measured against the alternatives, with clients nobody here wrote (issue 17):

(a) api:  the app's OpenAI API (/v1/chat/completions of `chainlit run app.py`) against
          vLLM's own OpenAI server, both driven by vLLM's benchmark client (`vllm bench
          serve`: backend openai-chat, dataset random, fixed lengths, --ignore-eos).
(b) chat: the app's chat path against the usual Chainlit + vLLM deployment
          (bench/baseline_app.py in front of that same vLLM server), both driven by the
          headless Socket.IO client (tools/chainlit_client.py) with the same chat turns.

The app serves one preset (bench.run.single_preset_profiles: its memory share 1.0) and the
plain vLLM server gets exactly that engine's arguments (engine/launch.py engine_setup,
checked through the server's own parser: tools/vllm_server.py), so the only difference is
the serving layer. All servers stay up; one side runs at a time (an idle engine costs
~0.01 core). The sides take turns in neighbouring pairs, A B, B A, A B, ...; each pair gives
a ratio, and the figure is the median of the pairs' ratios. Writes
bench/results/serve-compare-NAME.json (every run) and prints a table.

    .venv/bin/python -m bench.serve_compare                      # `make bench-compare`
    .venv/bin/python -m bench.serve_compare --pairs 1 --num-prompts 32 --output-len 16 \
        --name smoke                                             # a quick smoke run
    scripts/gpu_run.sh OUT compare                               # the H200 (dummy Qwen3-4B)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path

from bench.cli import whole_number

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"api_tok_s_ratio": 0.95, "chat_tok_s_ratio": 1.0}  # and a lower chat TTFT p95
SETTLE_S = 1.0
WARMUP_OUTPUT_LEN = 8


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="cpu", help="bench/results/serve-compare-NAME.json")
    p.add_argument("--compare", nargs="+", choices=["api", "chat"], default=["api", "chat"])
    p.add_argument("--pairs", type=whole_number, default=3, help="neighbouring pairs each")
    p.add_argument("--num-prompts", type=whole_number, default=64, help="requests per run")
    p.add_argument("--concurrency", type=whole_number, default=32, help="users at once")
    p.add_argument("--input-len", type=whole_number, default=128,
                   help="api: the random prompts' length in tokens")
    p.add_argument("--output-len", type=whole_number, default=64,
                   help="every reply's length in tokens (both comparisons)")
    p.add_argument("--preset", default="throughput-first")
    p.add_argument("--max-model-len", type=whole_number, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="each engine's, no GPU")
    p.add_argument("--gpu-memory", type=float, default=0.4,
                   help="each engine's share of the GPU (both are up at once)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.input_len + args.output_len + 64 > args.max_model_len:
        p.error(f"--input-len + --output-len (+64 for the template) must fit "
                f"--max-model-len {args.max_model_len}")
    if not 0 < args.gpu_memory <= 0.45:
        p.error("--gpu-memory: each of the two engines' share, above 0 and at most 0.45")
    if args.kv_cache_gib <= 0:
        p.error("--kv-cache-gib must be above 0")
    return args


def api_summary(r: dict) -> dict:
    """vLLM's benchmark result, in bench/metrics.py's terms."""
    return {"tok_s": round(r["output_throughput"], 2),
            "req_s": round(r["request_throughput"], 3),
            "completed": r["completed"], "failed": r.get("failed", 0),
            "output_tokens": r["total_output_tokens"], "wall_s": round(r["duration"], 3),
            "input_tokens": r["total_input_tokens"],  # as the server counted them (its usage)
            "ttft_ms": {"p50": round(r["p50_ttft_ms"], 2), "p95": round(r["p95_ttft_ms"], 2)},
            "itl_ms": {"p50": round(r["p50_itl_ms"], 2), "p95": round(r["p95_itl_ms"], 2)},
            "tpot_ms": {"p50": round(r["p50_tpot_ms"], 2)},
            "e2e_ms": {"p95": round(r["p95_e2el_ms"], 2)},
            # e.g. the app has no /tokenize, so the client's prompt alignment is skipped there
            "client_warnings": [line for line in r["log"].splitlines()
                                if line.startswith("WARNING")]}


class Sides:
    """The servers: the app (one preset), vLLM's plain server with the app engine's
    arguments, and the baseline Chainlit app in front of that plain server."""

    def __init__(self, args):
        from bench.run import ENV_AT_START, single_preset_profiles
        from engine import load_config
        from engine.launch import Machine, engine_setup
        from engine.model import resolve_model

        self.args, self.base_env = args, ENV_AT_START
        config = load_config()
        if args.preset not in config.presets:
            raise SystemExit(f"error: no preset {args.preset!r} in {config.source}")
        self.profile = next(p for p in config.profiles if p.preset == args.preset)
        if args.output_len > self.profile.limits.max_tokens:
            raise SystemExit(f"error: --output-len is over {self.profile.name}'s "
                             f"limits.max_tokens ({self.profile.limits.max_tokens})")
        self.machine = Machine.here()
        profiles = single_preset_profiles(Path(config.source), args.preset, 1.0,
                                          args.concurrency)
        # What the app reads; the same read here gives the same engine arguments.
        self.overrides = {"VCHAT_PROFILES": str(profiles),
                          "VCHAT_MAX_MODEL_LEN": str(args.max_model_len)}
        if self.machine.gpu:
            self.overrides["VCHAT_GPU_MEMORY"] = str(args.gpu_memory)
        else:
            self.overrides["VCHAT_KV_CACHE_GIB"] = str(args.kv_cache_gib)
        config = load_config(env={**ENV_AT_START, **self.overrides})
        self.model = resolve_model(config.model)
        self.setup = engine_setup(config, config.presets[args.preset], self.model,
                                  self.machine, ENV_AT_START)
        self.api_key = secrets.token_urlsafe(24)
        self.app = self.plain = self.baseline = None

    async def start(self) -> None:
        """One after the other: on a GPU vLLM measures free memory at start."""
        from tools.vllm_server import VllmServer
        from tools.chainlit_client import TEST_PASSWORD, Server

        eager = "1" if self.setup.args.get("enforce_eager") else "0"
        self.app = Server({**self.overrides, "VCHAT_ENFORCE_EAGER": eager,
                           "VCHAT_BENCH_IGNORE_EOS": "1", "VCHAT_API_KEY": self.api_key},
                          base_env=self.base_env)
        await self.app.wait_ready(timeout=900)
        self.plain = VllmServer(self.setup.args, {**self.base_env, **self.setup.env,
                                                  "HF_HUB_OFFLINE": "1"})
        self.plain.start()
        await self.plain.wait_ready(timeout=900)
        if "chat" in self.args.compare:
            self.baseline = Server({"VCHAT_BASELINE_BASE_URL": self.plain.url + "/v1",
                                    "VCHAT_BASELINE_MODEL": self.plain.served_name,
                                    "VCHAT_BASELINE_PASSWORD": TEST_PASSWORD,
                                    "VCHAT_BASELINE_IGNORE_EOS": "1",
                                    "CHAINLIT_AUTH_SECRET": secrets.token_urlsafe(32)},
                                   base_env=self.base_env, app="bench/baseline_app.py")
            await self.baseline.wait_http()

    def stop(self) -> None:
        for server in (self.baseline, self.plain, self.app):
            if server is not None:
                server.stop()

    async def api_run(self, side: str, seed: int, num_prompts: int, output_len: int) -> dict:
        """One run of vLLM's benchmark client against `side` ("app" or "vllm")."""
        from tools.vllm_server import bench_serve

        a = self.args
        url, name = ((self.app.url, self.profile.name) if side == "app"
                     else (self.plain.url, self.plain.served_name))
        argv = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                "--base-url", url, "--model", self.model, "--tokenizer", self.model,
                "--served-model-name", name, "--dataset-name", "random",
                "--random-input-len", str(a.input_len), "--random-output-len", str(output_len),
                "--num-prompts", str(num_prompts), "--max-concurrency", str(a.concurrency),
                "--ignore-eos", "--seed", str(seed), "--temperature", "0.8", "--top-p", "1.0",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
                "--disable-tqdm"]
        if side == "app":
            argv += ["--header", f"Authorization=Bearer {self.api_key}"]
        result = await bench_serve(argv)
        if result.get("failed") or result["completed"] != num_prompts:
            raise RuntimeError(f"{side}: {result.get('failed')} of {num_prompts} requests "
                               f"failed\n{result['log']}")
        return api_summary(result)

    async def chat_run(self, side: str, requests: list) -> dict:
        """One run of the chat workload through the app's or the baseline's chat path."""
        from bench import paths

        server = self.app if side == "app" else self.baseline
        result = await paths.run_app(server.url, self.profile.name, requests,
                                     self.args.concurrency)
        if result["completed"] != len(requests):
            raise RuntimeError(f"{side}: {result['completed']} of {len(requests)} turns done")
        return result


async def take_turns(pairs: int, run, sides: tuple[str, str]) -> list[dict]:
    """`pairs` neighbouring pairs, the order swapped every pair: run(side, i) each."""
    done = []
    for i in range(pairs):
        order = sides if i % 2 == 0 else sides[::-1]
        pair = {"order": list(order)}
        for side in order:
            await asyncio.sleep(SETTLE_S)
            pair[side] = await run(side, i)
            print(f"  pair {i + 1}/{pairs} {side}: {pair[side]['tok_s']} tok/s, TTFT p95 "
                  f"{pair[side]['ttft_ms']['p95']} ms", flush=True)
        done.append(pair)
    return done


def ratios(pairs: list[dict], ours: str, theirs: str) -> dict:
    tok = [round(p[ours]["tok_s"] / p[theirs]["tok_s"], 3) for p in pairs]
    ttft = [round(p[ours]["ttft_ms"]["p95"] / p[theirs]["ttft_ms"]["p95"], 3) for p in pairs]
    return {"tok_s_ratio": tok, "tok_s_ratio_median": round(statistics.median(tok), 3),
            "ttft_p95_ratio": ttft, "ttft_p95_ratio_median": round(statistics.median(ttft), 3),
            "pair_count": len(pairs)}


async def measure(args, sides: Sides) -> dict:
    from bench.workloads import chat

    out = {}
    if "api" in args.compare:
        for side in ("app", "vllm"):  # the CPU kernels set up each batch shape on first use
            print(f"api warm-up: {side}", flush=True)
            await sides.api_run(side, 10_000 + args.seed, args.concurrency, WARMUP_OUTPUT_LEN)
        print("api: the app's /v1/chat/completions vs vLLM's server", flush=True)
        pairs = await take_turns(args.pairs, lambda side, i: sides.api_run(
            side, args.seed + i, args.num_prompts, args.output_len), ("app", "vllm"))
        out["api"] = {"pairs": pairs, **ratios(pairs, "app", "vllm")}
    if "chat" in args.compare:
        for side in ("app", "baseline"):
            print(f"chat warm-up: {side}", flush=True)
            await sides.chat_run(side, chat(args.concurrency, WARMUP_OUTPUT_LEN, seed=99))
        print("chat: the app's chat path vs the usual Chainlit + vLLM app", flush=True)
        pairs = await take_turns(args.pairs, lambda side, i: sides.chat_run(
            side, chat(args.num_prompts, args.output_len, seed=1000 + args.seed + i)),
            ("app", "baseline"))
        out["chat"] = {"pairs": pairs, **ratios(pairs, "app", "baseline")}
    return out


def table(result: dict) -> str:
    rows = ["| comparison | pair | order | ours tok/s | theirs tok/s | tok/s ratio | "
            "ours TTFT p50 / p95 ms | theirs TTFT p50 / p95 ms |", "|" + " --- |" * 8]
    for what, theirs in (("api", "vllm"), ("chat", "baseline")):
        r = result.get(what)
        if not r:
            continue
        for i, p in enumerate(r["pairs"]):
            a, b = p["app"], p[theirs]
            rows.append(f"| {what} | {i + 1} | {' then '.join(p['order'])} | {a['tok_s']} | "
                        f"{b['tok_s']} | {r['tok_s_ratio'][i]} | {a['ttft_ms']['p50']:.0f} / "
                        f"{a['ttft_ms']['p95']:.0f} | {b['ttft_ms']['p50']:.0f} / "
                        f"{b['ttft_ms']['p95']:.0f} |")
        rows.append(f"| {what} | median of {r['pair_count']} | | | | {r['tok_s_ratio_median']} | "
                    f"TTFT p95 ratio {r['ttft_p95_ratio_median']} | |")
    return "\n".join(rows)


async def main(args) -> None:
    from bench.run import versions

    started = time.monotonic()
    sides = Sides(args)
    try:
        print(f"starting the app, vLLM's server and the baseline ({sides.model})", flush=True)
        await sides.start()
        runs = await measure(args, sides)
    finally:
        sides.stop()
    result = {
        "targets": TARGETS,
        "api_tok_s_ratio": runs.get("api", {}).get("tok_s_ratio_median"),
        "chat_tok_s_ratio": runs.get("chat", {}).get("tok_s_ratio_median"),
        "chat_ttft_p95_ratio": runs.get("chat", {}).get("ttft_p95_ratio_median"),
        "machine": {"arch": platform.machine(), "cores": os.cpu_count(),
                    "gpu": sides.machine.gpu, "python": platform.python_version(),
                    **versions()},
        "model": sides.model, "preset": args.preset, "profile": sides.profile.name,
        "engine_args": sides.setup.args, "engine_env": sides.setup.env,
        "vllm_server_command": sides.plain.command,
        "command": "python -m bench.serve_compare " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "name"},
        "duration_s": round(time.monotonic() - started, 1),
        **runs,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"serve-compare-{args.name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {path} ({result['duration_s']} s)")


if __name__ == "__main__":
    asyncio.run(main(parse_args(sys.argv[1:])))
