"""The app layer's own ceiling, measured with the STAND-IN engine (no model).

`chainlit run app.py` with `VCHAT_ENGINE=stand-in` answers every turn with filler tokens
(1,000 tokens/s per stream by default, one token per delta: 64,000 tokens/s asked for
with 64 sessions), so what limits the tokens/s that reach the headless
clients is the chat layer itself (Chainlit, Socket.IO, our streaming) on this machine's
cores, which the clients share. Run once with coalescing on (the product default) and once
with it off (one event per engine delta) to show what it buys.

    .venv/bin/python -m bench.ui_ceiling --sessions 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from bench import paths
from bench.cli import whole_number
from bench.workloads import chat
from tools.chainlit_client import ROOT, Server

PROFILE = "Throughput-first"  # the profile whose limits allow the longest replies
PRESET = "throughput-first"


def all_at_once(sessions: int) -> Path:
    """The shipped profiles, with the stand-in's preset running `sessions` turns at once on
    any device (the CPU preset's 128 would queue the rest, and refuse some)."""
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    preset = raw["presets"][PRESET]
    for device in ("vllm", "vllm_cpu", "vllm_gpu"):
        if "max_num_seqs" in (preset.get(device) or {}):
            preset[device]["max_num_seqs"] = max(sessions, preset[device]["max_num_seqs"])
    out = Path(tempfile.mkdtemp()) / "profiles.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


async def ceiling(sessions: int = 64, tokens: int = 1000, rate: float = 1000.0,
                  interval_ms: int | None = None) -> dict:
    """One turn of `tokens` tokens per session, all sessions at once, stand-in at `rate`
    tokens/s per stream. `interval_ms`: the app's coalescing interval (None: its default)."""
    env = {"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": str(rate),
           "VCHAT_BENCH_IGNORE_EOS": "1", "VCHAT_PROFILES": str(all_at_once(sessions))}
    if interval_ms is not None:
        env["VCHAT_STREAM_INTERVAL_MS"] = str(interval_ms)
    server = Server(env)
    try:
        health = await server.wait_ready(timeout=120)
        assert health["engine"].startswith("stand-in"), health
        await paths.run_app(server.url, PROFILE, chat(8, 16, seed=1), 8)  # warm-up
        server_proc = psutil.Process(server.proc.pid)
        server_cpu, own_cpu = sum(server_proc.cpu_times()[:2]), time.process_time()
        result = await paths.run_app(server.url, PROFILE, chat(sessions, tokens, seed=2),
                                     sessions)
        wall = result["wall_s"]
        result.update({
            "engine": health["engine"], "sessions": sessions,
            "stand_in_tok_s_per_stream": rate,
            "coalescing_interval_ms": interval_ms,
            "events_per_s": round(result["chunks"] / wall, 1),
            "tokens_per_event": round(result["output_tokens"] / max(result["chunks"], 1), 1),
            "server_cpu_share": round((sum(server_proc.cpu_times()[:2]) - server_cpu) / wall, 2),
            "clients_cpu_share": round((time.process_time() - own_cpu) / wall, 2),
        })
        return result
    finally:
        server.stop()


KEEP = ("engine", "sessions", "stand_in_tok_s_per_stream", "coalescing_interval_ms", "requests",
        "completed", "output_tokens", "wall_s", "tok_s", "events_per_s", "tokens_per_event",
        "ttft_ms", "itl_ms", "server_cpu_share", "clients_cpu_share")


async def ceiling_runs(sessions: int = 64, tokens: int = 1000, rate: float = 1000.0,
                       uncoalesced: bool = True) -> dict:
    """The product default (coalesced) and, for comparison, one event per engine delta."""
    runs = {"coalesced": await ceiling(sessions, tokens, rate)}
    if uncoalesced:
        runs["one_event_per_delta"] = await ceiling(sessions, tokens, rate, interval_ms=0)
    return {name: {k: r[k] for k in KEEP} for name, r in runs.items()}


async def main(args) -> None:
    runs = await ceiling_runs(args.sessions, args.tokens, args.rate, not args.skip_uncoalesced)
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=whole_number, default=64)
    parser.add_argument("--tokens", type=whole_number, default=1000, help="tokens per reply")
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="stand-in tokens/s per stream, one token per delta (the demand)")
    parser.add_argument("--skip-uncoalesced", action="store_true")
    asyncio.run(main(parser.parse_args()))
