"""Two app replicas against one, behind the shipped proxy (deploy/haproxy-app.cfg), on one
machine: turns per second and time to first text for `--users` chat sessions sending turn
after turn through the proxy for `--seconds`.

One deployment (tools/deployment.py): PostgreSQL, one `vllm serve` (the embedded model)
behind the model tier's proxy, two app replicas, and two app proxies: one in front of both
replicas, one in front of the first only. Runs alternate between the two proxies in
`--pairs` neighbouring pairs (which goes first alternates too), each with new sessions.
Everything shares this machine's cores, the model server most of all: on 2 CPU cores the
figure is what the proxy and a second app process cost, not what a second machine adds.

    .venv/bin/python -m bench.replicas --users 32 --seconds 60 --pairs 3 \
        --out bench/results/replicas-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.cli import whole_number
from tools.chainlit_client import ChatClient
from tools.deployment import Deployment
from tools.postgres import Postgres

TEXT_EVENTS = ("stream_start", "stream_token")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def user_turns(c: ChatClient, n: int, until: float) -> list[tuple[float, float]]:
    """One session's turns, one after the other, until `until`: (first text after,
    turn's end) in seconds from each message, for turns that streamed text."""
    done, turn = [], 0
    while time.monotonic() < until:
        start = len(c.events)
        sent = time.monotonic()
        await c.emit_message(f"Hello, I am user {n}. This is my message number {turn}.")
        end = await c.wait_for("task_end", since=start, timeout=300)
        texts = [e.at for e in c.events[start:end] if e.name in TEXT_EVENTS]
        if texts:
            done.append((texts[0] - sent, c.events[end].at - sent))
        turn += 1
    return done


async def load(url: str, users: int, seconds: float) -> dict:
    clients = [ChatClient(url, "Latency-first") for _ in range(users)]
    await asyncio.gather(*(c.connect() for c in clients))
    started = time.monotonic()
    turns = await asyncio.gather(*(user_turns(c, n, started + seconds)
                                   for n, c in enumerate(clients)))
    elapsed = time.monotonic() - started
    await asyncio.gather(*(c.close() for c in clients))
    ttft = [t[0] for per_user in turns for t in per_user]
    return {"turns": len(ttft), "seconds": round(elapsed, 1),
            "turns_per_s": round(len(ttft) / elapsed, 2),
            "ttft_p50_s": round(statistics.median(ttft), 3),
            "ttft_p95_s": round(percentile(ttft, 0.95), 3)}


async def measure(users: int, seconds: float, pairs: int) -> dict:
    with Postgres() as pg, tempfile.TemporaryDirectory(prefix="vchat-replicas-") as folder:
        async with Deployment(Path(folder), pg.new_database(), replicas=2,
                              model_servers=1) as site:
            _, one = await site.add_proxy([0])
            urls = {"1 replica": one, "2 replicas": site.url}
            runs = []
            for pair in range(pairs):
                order = list(urls) if pair % 2 == 0 else list(urls)[::-1]
                for name in order:
                    result = {"pair": pair + 1, "replicas": name, **await load(
                        urls[name], users, seconds)}
                    runs.append(result)
                    print(json.dumps(result), flush=True)
    ratios = {}
    for key in ("turns_per_s", "ttft_p95_s"):
        pair_ratios = [
            next(r[key] for r in runs if r["pair"] == p and r["replicas"] == "2 replicas")
            / next(r[key] for r in runs if r["pair"] == p and r["replicas"] == "1 replica")
            for p in range(1, pairs + 1)]
        ratios[key] = {"per_pair": [round(r, 3) for r in pair_ratios],
                       "median": round(statistics.median(pair_ratios), 3)}
    return {"users": users, "seconds": seconds, "pairs": pairs, "runs": runs,
            "two_over_one": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=whole_number, default=32)
    parser.add_argument("--seconds", type=whole_number, default=60)
    parser.add_argument("--pairs", type=whole_number, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = asyncio.run(measure(args.users, args.seconds, args.pairs))
    print(json.dumps(out["two_over_one"]))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
