"""The chat path of two or more app builds side by side on one machine, in neighbouring
runs: each variant is its own `chainlit run app.py` server (its own engine, an equal share
of the memory), started one after another, then every round sends the same burst of chat
turns to each variant in turn. Ratios against the first variant are per round (neighbouring
runs), their median the figure. For changes that the bench's app/engine ratio cannot show
apart from run-to-run drift of the machine (issue 31: the event loop, its tasks, the
websocket protocol).

A variant is NAME, or NAME:VAR=VALUE,VAR=VALUE (its environment), or NAME@DIR (the app
from another checkout, run from DIR: the code before a change).

    python -m bench.loop_ab --variants before@/tmp/base after after-wsproto:UVICORN_WS_PROTOCOL=wsproto \\
        --users 256 --rounds 3 --out OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from bench.cli import whole_number
from bench.paths import run_app
from bench.run import ENV_AT_START, single_preset_profiles
from bench.workloads import chat
from engine import load_config
from engine.launch import Machine
from tools.chainlit_client import ROOT, Server

PRESET = "throughput-first"


def variant(text: str) -> dict:
    name, _, where = text.partition("@")
    name, _, env = name.partition(":")
    pairs = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return {"name": name, "env": pairs, "dir": where or None}


def start(v: dict, profiles: Path) -> Server:
    env = {"VCHAT_PROFILES": str(profiles), "VCHAT_BENCH_IGNORE_EOS": "1",
           "VCHAT_MAX_MODEL_LEN": "-1" if Machine.here().gpu else "2048", **v["env"]}
    base = dict(ENV_AT_START)
    if v["dir"]:  # the other checkout's modules first
        base["PYTHONPATH"] = os.pathsep.join(
            [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and
             Path(p).resolve() != ROOT] + [v["dir"]])
    return Server(env, base_env=base, root=Path(v["dir"]) if v["dir"] else ROOT)


async def main(args) -> dict:
    config = load_config()
    variants = [variant(t) for t in args.variants]
    profile = next(p.name for p in config.profiles if p.preset == PRESET)
    share = round(0.9 / len(variants), 3)
    profiles = single_preset_profiles(Path(config.source), PRESET, share, args.users)
    servers = {}
    try:
        for v in variants:  # one at a time: vLLM counts the memory others hold at its start
            servers[v["name"]] = start(v, profiles)
            await servers[v["name"]].wait_ready(timeout=600)
        requests = chat(args.users, args.output_len)
        for url in (s.url for s in servers.values()):  # warm-up, not counted
            await run_app(url, profile, requests[:8], 8)
        rounds = []
        for r in range(args.rounds):
            row = {}
            for v in variants:
                m = await run_app(servers[v["name"]].url, profile, requests, args.users)
                row[v["name"]] = {"tok_s": m["tok_s"], "ttft_p50_ms": m["ttft_ms"]["p50"],
                                  "ttft_p95_ms": m["ttft_ms"]["p95"], "wall_s": m["wall_s"],
                                  "completed": m["completed"]}
                print(f"round {r} {v['name']}: {row[v['name']]}", flush=True)
            rounds.append(row)
        first = variants[0]["name"]
        ratios = {v["name"]: {
            "tok_s_over_first": statistics.median(
                row[v["name"]]["tok_s"] / row[first]["tok_s"] for row in rounds),
            "ttft_p50_over_first": statistics.median(
                row[v["name"]]["ttft_p50_ms"] / row[first]["ttft_p50_ms"] for row in rounds),
            "pairs": len(rounds)} for v in variants[1:]}
        logs = {name: s.log_path.read_text(errors="replace") for name, s in servers.items()}
        loops = {name: next((line.split("event loop: ")[1] for line in log.splitlines()
                             if "event loop: " in line), "Chainlit's (nest_asyncio)")
                 for name, log in logs.items()}
        return {"variants": variants, "users": args.users, "output_len": args.output_len,
                "rounds": rounds, "ratios": ratios, "event_loops": loops,
                "machine": "gpu" if Machine.here().gpu else "cpu",
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--users", type=whole_number, default=256)
    parser.add_argument("--output-len", type=whole_number, default=256)
    parser.add_argument("--rounds", type=whole_number, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result["ratios"], indent=1), result["event_loops"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
