"""Both profiles at once through the app, as deployed (issue 27): `chainlit run app.py` with
the shipped profiles.yaml and sampling, headless socket clients, and the engine layout under
test (`--engines`: shared, per-preset, or auto as shipped).

On one server, in this order (N: --sessions, 16; replies of --reply tokens, 256):
  first burst   right after /ready, N Latency-first + N Throughput-first sessions ask one
                reply each; then the same burst warmed (TTFT p95 ratio)
  one user      one Latency-first session alone, three replies (tok/s)
  light         pairs: N + N sessions at once against 2N Throughput-first sessions alone
                (per-stream tok/s; target: every stream >= 0.85x the alone figure)
  long prompts  pairs: N Latency-first users streaming --lf-reply tokens while prompts of
                --long-tokens arrive, one every --long-every-s, each in a new chat, against
                the same users alone (update gap p95)
  saturated     --load Throughput-first sessions stream --load-reply-token replies all
                along, each in a new chat, their starts spread over --load-stagger-s;
                pairs: N Throughput-first probes alone (Throughput-first alone at
                --load + N sessions) against N + N probes (total tok/s from vLLM's counters
                over each burst; preemptions over the phase; where a first token's time
                went: the app's and this client's event-loop lag, Latency-first's TTFT
                inside the app)
Each phase starts with every engine's seats empty (/ready). Replies run to their max
tokens (VCHAT_BENCH_IGNORE_EOS). Per stream: TTFT (send to first token), tok/s (tokens over
first to last token), update gaps (between streamed events). Pairs alternate their order.

    VCHAT_MODEL=qwen3-4b-dummy python -m bench.profiles --engines shared --out r.json
    scripts/gpu_run.sh DIR profiles-start shared per-preset -- --pairs 3   (the H200)
    python -m bench.profiles --cpu-scale --engines shared --out r.json      (2 CPU cores)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import sys
import time

import httpx
import yaml

from bench.cli import whole_number
from bench.run import versions
from bench.profile_figures import (LF, TF, bucket_quantile, pct, ratio, stream_figures,
                                   summary, targets)
from service.loop import LoopLag
from tools.chainlit_client import ROOT, ChatClient, Server

ASK = "Write a long story about a lighthouse keeper."
WORDS = "the keeper walked up the stairs and looked out over the grey sea".split()
# The app as shipped: the test suite's small engine settings unset.
SHIPPED = {"VCHAT_ENFORCE_EAGER": "", "VCHAT_MAX_MODEL_LEN": "", "VCHAT_KV_CACHE_GIB": "",
           "VCHAT_BENCH_IGNORE_EOS": "1"}
# The same phases at a size 2 CPU cores and the embedded model get through in minutes.
CPU_SCALE = {"sessions": 3, "reply": 24, "lf_reply": 48, "load": 12, "load_reply": 160,
             "long_tokens": [600, 1200], "long_every_s": 3.0, "ramp_s": 20.0,
             "load_stagger_s": 20.0}


# Candidates other than the shipped file, for side-by-side runs (--variant).
VARIANTS = {
    "priority-only": "the first shared engine (priority and admission by the KV cache, no "
                     "planned steps: no step_ms; on a GPU one step budget of 8,192 tokens)",
}


def variant_profiles(name: str) -> str:
    """The shipped profiles.yaml turned into the candidate `name`; its path."""
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    if name == "priority-only":
        for preset in raw["presets"].values():
            preset.pop("step_ms", None)
            if "max_num_batched_tokens" in preset.get("vllm_gpu", {}):
                preset["vllm_gpu"].update(max_num_batched_tokens=8192,
                                          long_prefill_token_threshold=0)
    path = ROOT / ".cache" / f"profiles-{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return str(path)


async def ask(client: ChatClient, text: str = ASK) -> dict | None:
    start, sent = len(client.events), time.monotonic()
    await client.send(text, timeout=900)
    return stream_figures(client, start, sent)


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


LAG = "vchat_event_loop_lag_seconds"
ENGINE_TTFT = "vchat_time_to_first_token_seconds"
APP_TTFT = "vchat_app_time_to_first_token_seconds"
GC = "vchat_gc_pause_seconds"
LEGS = "vchat_first_token_legs_seconds"
BUCKET = re.compile(r'^(\w+)_bucket\{(.*)\} (\S+)$')
SUM_COUNT = re.compile(r'^(\w+)_(sum|count)\{(.*)\} (\S+)$')


def labels_of(text: str) -> dict[str, str]:
    """A series' labels, from the text between its braces."""
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def add_leg(legs: dict, line: str) -> None:
    """One line of the LEGS histogram, Latency-first's, into `legs`."""
    if total := SUM_COUNT.match(line):
        name, kind, labels, value = total.groups()
    elif bucket := BUCKET.match(line):
        (name, labels, value), kind = bucket.groups(), "buckets"
    else:
        return
    labels = labels_of(labels)
    if name != LEGS or labels.get("profile") != LF:
        return
    leg = legs.setdefault(labels["leg"], {"sum": 0.0, "count": 0.0, "buckets": {}})
    if kind == "buckets":
        leg["buckets"][float(labels["le"])] = float(value)
    else:
        leg[kind] = float(value)


async def counters(url: str) -> dict:
    """vLLM's generated tokens and preemptions so far, all engines together; the app
    process's CPU seconds (its own, not the engine's processes); the app's event-loop lag,
    its full garbage collections' pauses and Latency-first's TTFT histograms, the engine's
    and the app's (cumulative by `le`), and the engine's by leg (LEGS: {leg: {"sum",
    "count", "buckets"}}); the time all collections stopped the app; from /metrics."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url + "/metrics")).text
    out: dict = {"tokens": 0.0, "preempted": 0.0, "gc_s": 0.0, "cpu_s": 0.0, LAG: {},
                 ENGINE_TTFT: {}, APP_TTFT: {}, GC: {}, LEGS: {}}
    for line in text.splitlines():
        for key, name in (("tokens", "vllm:generation_tokens_total"),
                          ("preempted", "vllm:num_preemptions_total"),
                          ("gc_s", GC + "_sum"), ("cpu_s", "process_cpu_seconds_total")):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
        if line.startswith(LEGS):
            add_leg(out[LEGS], line)
            continue
        bucket = BUCKET.match(line)
        if bucket and bucket[1] in (LAG, ENGINE_TTFT, APP_TTFT, GC):
            labels = labels_of(bucket[2])
            if bucket[1] == LAG or labels.get("profile") == LF or \
                    labels.get("generation") == "2":
                out[bucket[1]][float(labels["le"])] = float(bucket[3])
    return out


def legs_between(before: dict, after: dict) -> dict:
    """Latency-first's first-token legs over the turns that finished between two scrapes:
    each leg's mean (exact) and p95 (its bucket's upper bound), seconds."""
    out = {}
    for leg, now in after.items():
        then = before.get(leg, {"sum": 0.0, "count": 0.0, "buckets": {}})
        count = now["count"] - then["count"]
        if count > 0:
            out[leg] = {"mean_s": round((now["sum"] - then["sum"]) / count, 4),
                        "p95_s": bucket_quantile(then["buckets"], now["buckets"])}
    return out


async def measured(url: str, work) -> tuple[object, float, dict]:
    """`work`'s result, the engines' generated tokens a second while it ran, and where its
    time went in the app: how late the app's event loop ran what was due (p95), how late
    this client's did (the figures are taken here: a late client shows as a late token),
    the app's longest stall (its bucket's bound: a collection, a blocking call),
    and Latency-first's TTFT inside the app, from the engine's call to its first token and
    from the message's arrival to its first token sent (p95s; turns that finished
    meanwhile) and the engine's part by leg (to the engine's process, queued, prefill, back
    through this process's output path), how busy the app's process was (its CPU seconds a
    second: 1.0 is a core, and its event loop has one), and how long garbage collections
    stopped the app (in all; the longest full one). Quantiles of histograms: their
    buckets' upper bounds."""
    client_lag: list[float] = []
    watch = LoopLag(client_lag.append, every_s=0.05)
    watch.start()
    before, t0 = await counters(url), time.monotonic()
    try:
        result = await work
    finally:
        watch.stop()
    after, t1 = await counters(url), time.monotonic()
    app = {"app_loop_lag_p95_s": bucket_quantile(before[LAG], after[LAG]),
           "app_loop_lag_max_s": bucket_quantile(before[LAG], after[LAG], 1.0),
           "client_loop_lag_p95_s": pct(client_lag, 95),
           "client_loop_lag_max_s": pct(client_lag, 100),
           "lf_engine_ttft_p95_s": bucket_quantile(before[ENGINE_TTFT], after[ENGINE_TTFT]),
           "lf_app_ttft_p95_s": bucket_quantile(before[APP_TTFT], after[APP_TTFT]),
           "lf_engine_ttft_legs": legs_between(before[LEGS], after[LEGS]),
           "app_cpu_share": round((after["cpu_s"] - before["cpu_s"]) / (t1 - t0), 3),
           "app_gc_paused_s": round(after["gc_s"] - before["gc_s"], 3),
           "app_full_gc_max_s": bucket_quantile(before[GC], after[GC], 1.0)}
    return result, (after["tokens"] - before["tokens"]) / (t1 - t0), app


async def settled(server: Server, timeout: float = 300) -> None:
    """Wait until no turn holds a seat or waits for one (the last phase's are over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = (await server.get("/ready")).get("engines", {})
        if all(not e.get("admitted") and not e.get("queued") for e in engines.values()):
            return
        await asyncio.sleep(1)
    raise TimeoutError("the engines' seats did not empty between phases")


class Loop:
    """Sessions asking one reply after another until stopped, each in a new chat (a
    history of 2k-token replies would grow every prompt, and every turn's hold on the KV
    cache, until few fit); a user who is refused (the line is full) tries again after a
    second, as a person would, rather than at once."""

    def __init__(self, clients: list[ChatClient], stagger_s: float = 0.0):
        self.clients, self.running = clients, True
        self.refused = 0
        self.tasks = [asyncio.create_task(self._run(c, i * stagger_s / len(clients)))
                      for i, c in enumerate(clients)]

    async def _run(self, client, start_after_s: float):
        await asyncio.sleep(start_after_s)  # spread: turns then end at different times too
        first = True
        while self.running:
            try:
                if not first:
                    await client.new_chat()
                first = False
                reply = await client.send(ASK, timeout=900)
            except Exception:
                reply = None
            if reply is None or not reply.tokens:
                self.refused += 1
                await asyncio.sleep(1.0)

    async def stop(self):
        self.running = False
        for c in self.clients:
            with contextlib.suppress(Exception):
                await c.stop()
        await asyncio.wait(self.tasks, timeout=120)
        for t in self.tasks:
            t.cancel()


def long_prompt(rng: random.Random, tokens: int) -> str:
    return f"[{rng.random():.8f}] Summarise this: " + " ".join(
        rng.choice(WORDS) for _ in range(tokens))  # ~1 token a word


async def long_prompts(url: str, args, until: asyncio.Event, rng: random.Random) -> int:
    """A long prompt every `long_every_s`, each from a Throughput-first session of its own
    (a new chat: its history does not grow from one to the next), until `until`."""
    sent, tasks = 0, []

    async def one():
        client = ChatClient(url, TF)
        try:
            await client.connect()
            await client.settings(max_tokens=16)
            await client.send(long_prompt(rng, rng.randint(*args.long_tokens)), timeout=900)
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    while not until.is_set():
        tasks.append(asyncio.create_task(one()))
        sent += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(until.wait(), args.long_every_s)
    await asyncio.gather(*tasks, return_exceptions=True)
    return sent


async def first_burst(out: dict, lf, tf) -> None:
    first = await burst(lf, tf)
    warm = await burst(lf, tf)
    ttft = lambda b: max(b[LF]["ttft_p95_s"] or 0, b[TF]["ttft_p95_s"] or 0)  # noqa: E731
    out["first_burst"] = {"first": first, "warmed": warm,
                          "ttft_p95_ratio": ratio(ttft(first), ttft(warm))}
    print("first burst", json.dumps(out["first_burst"]), flush=True)


async def one_user(out: dict, lf) -> None:
    """One Latency-first user alone, three replies one after another (the app's pace for a
    single stream)."""
    out["one_user"] = [await ask(lf[0]) for _ in range(3)]
    for row in out["one_user"]:
        if row:
            row.pop("gaps")
    print("one user", json.dumps(out["one_user"]), flush=True)


async def seats_now(server: Server) -> dict:
    """Each preset's turns inside, waiting, and cache held (/ready)."""
    engines = (await server.get("/ready")).get("engines", {})
    return {p: {k: v[k] for k in ("admitted", "queued", "kv_held")}
            for e in engines.values() for p, v in (e.get("presets") or {}).items()}


async def light(out: dict, args, lf, tf) -> None:
    out["light"] = []
    for n in range(args.pairs):
        runs = {}
        for which in (("both", "alone") if n % 2 == 0 else ("alone", "both")):
            runs[which] = await burst(lf, tf[:len(lf)]) if which == "both" \
                else (await burst([], tf))[TF]
        both, alone = runs["both"], runs["alone"]
        worst = min(both[LF]["tok_s_median"], both[TF]["tok_s_median"])
        out["light"].append({"both": both, f"alone_{len(tf)}": alone,
                             "ratio": ratio(worst, alone["tok_s_median"])})
        print(f"light {n + 1}", json.dumps(out["light"][-1]), flush=True)


async def long_phase(out: dict, args, server: Server, lf, rng) -> None:
    await asyncio.gather(*[c.settings(max_tokens=args.lf_reply) for c in lf])
    out["long_prompts"] = []
    for n in range(args.pairs):
        runs = {}
        for which in (("with_long", "alone") if n % 2 == 0 else ("alone", "with_long")):
            await settled(server)
            if which == "alone":
                runs[which] = summary(await asyncio.gather(*[ask(c) for c in lf]))
                continue
            until = asyncio.Event()
            sending = asyncio.create_task(long_prompts(server.url, args, until, rng))
            await asyncio.sleep(min(1.0, args.long_every_s))  # the first prompt is in
            runs[which] = summary(await asyncio.gather(*[ask(c) for c in lf]))
            until.set()
            runs["long_prompts_sent"] = await sending
        out["long_prompts"].append(runs)
        print(f"long prompts {n + 1}", json.dumps(runs), flush=True)
    await asyncio.gather(*[c.settings(max_tokens=args.reply) for c in lf])


async def ramped(server: Server, load: int, ramp_s: float) -> None:
    """Wait until the load holds its seats (all of them, or what the line lets in)."""
    deadline = time.monotonic() + ramp_s
    while time.monotonic() < deadline:
        engines = (await server.get("/ready")).get("engines", {})
        if sum(e.get("admitted") or 0 for e in engines.values()) >= load:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(2)  # the last ones past their prompts


async def saturated(out: dict, args, server: Server, lf, tf) -> None:
    await settled(server)
    load = await sessions(server.url, TF, args.load, args.load_reply)
    start = await counters(server.url)
    loop = Loop(load, args.load_stagger_s)
    try:
        await ramped(server, args.load, args.load_stagger_s + args.ramp_s)
        out["saturated"] = []
        for n in range(args.pairs):
            runs = {"seats_before": await seats_now(server)}
            for which in (("both", "alone") if n % 2 == 0 else ("alone", "both")):
                probes, total, app = await measured(server.url, burst(lf if which == "both"
                                                                      else [], tf))
                runs[which] = {"probes": probes, "total_tok_s": round(total), **app}
            runs["total_ratio"] = ratio(runs["both"]["total_tok_s"],
                                        runs["alone"]["total_tok_s"])
            out["saturated"].append(runs)
            print(f"saturated {n + 1}", json.dumps(runs), flush=True)
    finally:
        await loop.stop()
    end = await counters(server.url)
    out["saturated_preempted"] = end["preempted"] - start["preempted"]
    out["saturated_gc"] = {"paused_s": round(end["gc_s"] - start["gc_s"], 3),
                           "full_max_s": bucket_quantile(start[GC], end[GC], 1.0)}
    out["saturated_load"] = {"sessions": args.load, "reply_tokens": args.load_reply,
                             "turns_refused_or_failed": loop.refused}


async def run(args) -> dict:
    rng = random.Random(7)
    env = {**SHIPPED, "VCHAT_ENGINES": args.engines}
    if args.variant:
        env["VCHAT_PROFILES"] = variant_profiles(args.variant)
    server = Server(env)
    label = args.label or "-".join(filter(None, (args.engines, args.variant)))
    out: dict = {"engines": args.engines, "variant": args.variant, "label": label,
                 "pairs": args.pairs,
                 "args": {k: v for k, v in vars(args).items() if k not in ("out", "log")}}
    try:
        await server.wait_http(timeout=600)
        lf = await sessions(server.url, LF, args.sessions, args.reply)
        tf = await sessions(server.url, TF, 2 * args.sessions, args.reply)
        started = time.monotonic()
        out["health_at_ready"] = await server.wait_ready(timeout=1200)
        out["ready_after_s"] = round(time.monotonic() - started, 1)
        if "first" in args.phases:
            await first_burst(out, lf, tf[:args.sessions])
        if "one" in args.phases:
            await one_user(out, lf)
        if "light" in args.phases:
            await light(out, args, lf, tf)
        if "long" in args.phases:
            await long_phase(out, args, server, lf, rng)
        if "saturated" in args.phases:
            await saturated(out, args, server, lf, tf[:args.sessions])
        out["targets"] = targets(out)
        out["health_at_end"] = await server.get("/ready")
    finally:
        server.stop()
        if args.log:
            with open(args.log, "w") as log:
                log.write(server.log_path.read_text(errors="replace")[-200_000:])
    # Once the server is gone (torch in this process only now, no GPU context beside it).
    out["machine"] = {"arch": platform.machine(), "cores": os.cpu_count(), **versions()}
    out["command"] = "python -m bench.profiles " + " ".join(sys.argv[1:])
    return out


PHASES = ("first", "one", "light", "long", "saturated")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", choices=["auto", "shared", "per-preset"], default="auto")
    p.add_argument("--pairs", type=whole_number, default=3)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--sessions", type=whole_number, default=16,
                   help="sessions of each profile in the bursts and probes")
    p.add_argument("--reply", type=whole_number, default=256, help="their reply tokens")
    p.add_argument("--lf-reply", type=whole_number, default=512,
                   help="long prompts: the Latency-first users' reply tokens")
    p.add_argument("--long-tokens", type=whole_number, nargs=2, default=[4000, 8000],
                   metavar=("LEAST", "MOST"), help="long prompts: their length in tokens")
    p.add_argument("--long-every-s", type=float, default=0.5)
    p.add_argument("--load", type=whole_number, default=240,
                   help="saturated: Throughput-first sessions streaming all along")
    p.add_argument("--load-reply", type=whole_number, default=2048,
                   help="saturated: the load's reply tokens")
    p.add_argument("--load-stagger-s", type=float, default=40.0,
                   help="saturated: the load's first turns start spread over this long "
                        "(about a reply's time: turns that start together end together, "
                        "and the total's windows would fall on different parts of a wave)")
    p.add_argument("--ramp-s", type=float, default=30.0,
                   help="saturated: the longest wait, after the stagger, for the load to "
                        "take its seats")
    p.add_argument("--cpu-scale", action="store_true",
                   help=f"sizes for 2 CPU cores and the embedded model: {CPU_SCALE}")
    p.add_argument("--variant", choices=sorted(VARIANTS),
                   help="a candidate instead of the shipped profiles.yaml: " + "; ".join(
                       f"{k}: {v}" for k, v in VARIANTS.items()))
    p.add_argument("--label", help="the run's name in the plot (default: engines-variant)")
    p.add_argument("--out", help="write the result (JSON) here")
    p.add_argument("--log", help="copy the server's log here")
    args = p.parse_args(argv)
    if args.out and not re.fullmatch(r"[\w./-]+\.json", args.out):
        p.error("--out must be a .json path")
    if args.cpu_scale:
        for key, value in CPU_SCALE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.long_tokens[0] > args.long_tokens[1]:
        p.error("--long-tokens: the least must not be above the most")
    return args


def main() -> None:
    args = parse_args()
    result = asyncio.run(run(args))
    for t in result["targets"]:
        print(f"{t['name']}: {t['measured']} ({t['direction']} {t['target']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
