"""Both profiles at once through the app, as deployed (issue 27): `chainlit run app.py` with
the shipped profiles.yaml and sampling, headless socket clients, and the engine layout under
test (`--engines`: shared, per-preset, or auto as shipped).

On one server, in this order:
  first burst   right after /ready, 16 Latency-first + 16 Throughput-first sessions ask
                one 256-token reply each; then the same burst warmed (TTFT p95 ratio)
  light         pairs: 16 + 16 sessions at once against 32 Throughput-first sessions alone
                (per-stream tok/s; target: every stream >= 0.85x the alone figure)
  long prompts  pairs: 16 Latency-first users streaming while 4-8k-token prompts arrive,
                one every --long-every-s, against the same users alone (update gap p95)
  saturated     pairs: --load Throughput-first sessions streaming 2,048-token replies,
                plus 16 + 16 probe sessions, against Throughput-first alone at --load + 16
                sessions (total tok/s from vLLM's counters; preemptions)
Replies run to their max tokens (VCHAT_BENCH_IGNORE_EOS). Per stream: TTFT (send to first
token), tok/s (tokens over first to last token), update gaps (between streamed events).

    VCHAT_MODEL=qwen3-4b-dummy python -m bench.profiles --engines shared --out r.json
    scripts/gpu_run.sh OUT profiles [ARGS...]     through the device tool
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import time

import httpx
import numpy as np

from bench.cli import whole_number
from tools.chainlit_client import ChatClient, Server

LF, TF = "Latency-first", "Throughput-first"
ASK = "Write a long story about a lighthouse keeper."
WORDS = "the keeper walked up the stairs and looked out over the grey sea".split()
# The app as shipped: the test suite's small engine settings unset.
SHIPPED = {"VCHAT_ENFORCE_EAGER": "", "VCHAT_MAX_MODEL_LEN": "", "VCHAT_KV_CACHE_GIB": "",
           "VCHAT_BENCH_IGNORE_EOS": "1"}


def pct(values, q):
    return round(float(np.percentile(values, q)), 4) if values else None


def stream_figures(client: ChatClient, start: int, sent: float) -> dict | None:
    """One reply's TTFT, tok/s and update gaps, from the events after index `start`."""
    times = [e.at for e in client.events[start:] if e.name in ("stream_start", "stream_token")]
    reply = client.collect(start, len(client.events)).reply
    tokens = ((reply or {}).get("metadata") or {}).get("output_tokens")
    if len(times) < 2 or not tokens:
        return None
    return {"ttft_s": times[0] - sent, "tok_s": tokens / max(times[-1] - times[0], 1e-6),
            "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": tokens}


async def ask(client: ChatClient, text: str = ASK) -> dict | None:
    start, sent = len(client.events), time.monotonic()
    await client.send(text, timeout=900)
    return stream_figures(client, start, sent)


def summary(rows: list[dict | None]) -> dict:
    rows = [r for r in rows if r]
    gaps = [g for r in rows for g in r["gaps"]]
    return {"streams": len(rows),
            "tok_s_median": pct([r["tok_s"] for r in rows], 50),
            "tok_s_min": pct([r["tok_s"] for r in rows], 0),
            "ttft_p50_s": pct([r["ttft_s"] for r in rows], 50),
            "ttft_p95_s": pct([r["ttft_s"] for r in rows], 95),
            "gap_p95_s": pct(gaps, 95), "gap_max_s": pct(gaps, 100)}


async def sessions(url: str, profile: str, n: int, max_tokens: int) -> list[ChatClient]:
    clients = [ChatClient(url, profile) for _ in range(n)]
    for i in range(0, n, 32):  # logins hash a password each: a few at a time
        await asyncio.gather(*[c.connect() for c in clients[i:i + 32]])
    await asyncio.gather(*[c.settings(max_tokens=max_tokens, show_stats=True)
                           for c in clients])
    return clients


async def burst(lf: list[ChatClient], tf: list[ChatClient]) -> dict:
    done = await asyncio.gather(*[ask(c) for c in lf + tf])
    return {LF: summary(done[:len(lf)]), TF: summary(done[len(lf):])}


async def counters(url: str) -> dict[str, float]:
    """vLLM's generated tokens and preemptions so far, all engines together (/metrics)."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url + "/metrics")).text
    out = {"tokens": 0.0, "preempted": 0.0}
    for line in text.splitlines():
        for key, name in (("tokens", "vllm:generation_tokens_total"),
                          ("preempted", "vllm:num_preemptions_total")):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


class Loop:
    """Sessions asking one reply after another until stopped."""

    def __init__(self, clients: list[ChatClient]):
        self.clients, self.running = clients, True
        self.tasks = [asyncio.create_task(self._run(c)) for c in clients]

    async def _run(self, client):
        while self.running:
            with contextlib.suppress(Exception):
                await client.send(ASK, timeout=900)

    async def stop(self):
        self.running = False
        for c in self.clients:
            with contextlib.suppress(Exception):
                await c.stop()
        await asyncio.wait(self.tasks, timeout=60)
        for t in self.tasks:
            t.cancel()


def long_prompt(rng: random.Random, tokens: int) -> str:
    return f"[{rng.random():.8f}] Summarise this: " + " ".join(
        rng.choice(WORDS) for _ in range(tokens))  # ~1 token a word


async def long_prompts(senders: list[ChatClient], every_s: float, until: asyncio.Event,
                       rng: random.Random) -> int:
    """A 4-8k-token prompt every `every_s` from the next free sender, until `until`."""
    sent, busy = 0, set()

    async def one(client):
        try:
            await client.send(long_prompt(rng, rng.randint(4000, 8000)), timeout=900)
        finally:
            busy.discard(client)

    tasks = []
    while not until.is_set():
        free = [c for c in senders if c not in busy]
        if free:
            busy.add(free[0])
            tasks.append(asyncio.create_task(one(free[0])))
            sent += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(until.wait(), every_s)
    await asyncio.gather(*tasks, return_exceptions=True)
    return sent


def ratio(a, b):
    return round(a / b, 3) if a and b else None


async def run(args) -> dict:
    rng = random.Random(7)
    server = Server({**SHIPPED, "VCHAT_ENGINES": args.engines})
    out: dict = {"engines": args.engines, "pairs": args.pairs}
    try:
        await server.wait_http(timeout=600)
        lf = await sessions(server.url, LF, 16, 256)
        tf = await sessions(server.url, TF, 32, 256)
        started = time.monotonic()
        out["health_at_ready"] = await server.wait_ready(timeout=1200)
        out["ready_after_s"] = round(time.monotonic() - started, 1)
        first = await burst(lf, tf[:16])
        warm = await burst(lf, tf[:16])
        ttft = lambda b: max(b[LF]["ttft_p95_s"] or 0, b[TF]["ttft_p95_s"] or 0)  # noqa: E731
        out["first_burst"] = {"first": first, "warmed": warm,
                              "ttft_p95_ratio": ratio(ttft(first), ttft(warm))}
        print("first burst", json.dumps(out["first_burst"]), flush=True)

        out["light"] = []
        for n in range(args.pairs):
            both = await burst(lf, tf[:16])
            alone = (await burst([], tf))[TF]
            worst = min(both[LF]["tok_s_median"], both[TF]["tok_s_median"])
            out["light"].append({"both": both, "alone_32": alone,
                                 "ratio": ratio(worst, alone["tok_s_median"])})
            print(f"light {n + 1}", json.dumps(out["light"][-1]), flush=True)

        await asyncio.gather(*[c.settings(max_tokens=512) for c in lf])
        senders = await sessions(server.url, TF, 8, 16)
        out["long_prompts"] = []
        for n in range(args.pairs):
            until = asyncio.Event()
            sending = asyncio.create_task(long_prompts(senders, args.long_every_s, until, rng))
            with_long = summary(await asyncio.gather(*[ask(c) for c in lf]))
            until.set()
            sent = await sending
            alone = summary(await asyncio.gather(*[ask(c) for c in lf]))
            out["long_prompts"].append({"with_long": with_long, "alone": alone,
                                        "long_prompts_sent": sent})
            print(f"long prompts {n + 1}", json.dumps(out["long_prompts"][-1]), flush=True)
        await asyncio.gather(*[c.settings(max_tokens=256) for c in lf])

        load = await sessions(server.url, TF, args.load, 2048)
        out["saturated"] = []
        for n in range(args.pairs):
            loop = Loop(load)
            await asyncio.sleep(args.ramp_s)
            before, t0 = await counters(server.url), time.monotonic()
            probes = await burst(lf, tf[:16])
            after, t1 = await counters(server.url), time.monotonic()
            await loop.stop()
            loop = Loop(load + tf[:16])  # Throughput-first alone, as many sessions
            await asyncio.sleep(args.ramp_s)
            b2, t2 = await counters(server.url), time.monotonic()
            await asyncio.sleep(t1 - t0)
            a2, t3 = await counters(server.url), time.monotonic()
            await loop.stop()
            total = (after["tokens"] - before["tokens"]) / (t1 - t0)
            alone = (a2["tokens"] - b2["tokens"]) / (t3 - t2)
            out["saturated"].append({
                "probes": probes, "total_tok_s": round(total), "alone_total_tok_s": round(alone),
                "total_ratio": ratio(total, alone),
                "preempted": after["preempted"] - before["preempted"],
                "preempted_alone": a2["preempted"] - b2["preempted"]})
            print(f"saturated {n + 1}", json.dumps(out["saturated"][-1]), flush=True)
        out["targets"] = targets(out)
        out["health_at_end"] = await server.get("/health")
        return out
    finally:
        server.stop()
        if args.log:
            with open(args.log, "w") as log:
                log.write(server.log_path.read_text(errors="replace")[-200_000:])


def med(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def targets(out: dict) -> list[dict]:
    """Issue 27's targets against the medians of this run's pairs."""
    sat = out.get("saturated", [])
    probe = [s["probes"][LF] for s in sat]
    return [
        {"name": "light: worst profile's per-stream tok/s / one engine's at 32 streams",
         "measured": med([p["ratio"] for p in out["light"]]), "target": 0.85,
         "direction": "min"},
        {"name": "saturated: Latency-first TTFT p95 (s)",
         "measured": med([p["ttft_p95_s"] for p in probe]), "target": 0.3, "direction": "max"},
        {"name": "saturated: Latency-first update gap p95 (s)",
         "measured": med([p["gap_p95_s"] for p in probe]), "target": 0.1, "direction": "max"},
        {"name": "saturated: Latency-first tok/s per stream (median)",
         "measured": med([p["tok_s_median"] for p in probe]), "target": 100,
         "direction": "min"},
        {"name": "saturated: total tok/s / Throughput-first alone",
         "measured": med([s["total_ratio"] for s in sat]), "target": 0.8, "direction": "min"},
        {"name": "saturated: preemptions", "measured": sum(s["preempted"] for s in sat),
         "target": 0, "direction": "max"},
        {"name": "long prompts: Latency-first update gap p95 (s)",
         "measured": med([p["with_long"]["gap_p95_s"] for p in out["long_prompts"]]),
         "target": 0.1, "direction": "max"},
        {"name": "first burst after /ready: TTFT p95 / a warmed burst's",
         "measured": out["first_burst"]["ttft_p95_ratio"], "target": 2.0, "direction": "max"},
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", choices=["auto", "shared", "per-preset"], default="auto")
    p.add_argument("--pairs", type=whole_number, default=2)
    p.add_argument("--load", type=whole_number, default=240,
                   help="saturated: Throughput-first sessions streaming 2,048-token replies")
    p.add_argument("--ramp-s", type=float, default=15.0)
    p.add_argument("--long-every-s", type=float, default=0.5)
    p.add_argument("--out", help="write the result (JSON) here")
    p.add_argument("--log", help="copy the server's log here")
    args = p.parse_args()
    if args.out and not re.fullmatch(r"[\w./-]+\.json", args.out):
        p.error("--out must be a .json path")
    result = asyncio.run(run(args))
    for t in result["targets"]:
        print(f"{t['name']}: {t['measured']} ({t['direction']} {t['target']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
