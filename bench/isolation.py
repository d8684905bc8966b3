"""Other users' streams while one long prompt is read (issue 53), on the shared engine as
the app builds it (engine/pool.py, profiles.yaml's presets), straight on its vLLM client:
the engine's steps are what is measured, not the app's front end (bench/big_request.py
does the app). Each trial:

- `users` streams run the whole trial, each a loop of replies of `--reply` tokens to a
  prompt of its own (~100 tokens: none finds another's in the prefix cache);
- once each has made 3 tokens, the window opens: with `long`, a prompt of `--long-tokens`
  random tokens is sent (or two at once: `--two`), and the window lasts until its first
  token; without, it lasts `--quiet-s`;
- meanwhile a short probe (`--probe-tokens` of prompt, one token back) is sent every
  `--probe-every-s`, as a Latency-first user's new message: its time to first token;
- figures over the window: the streams' update gaps (p95, max, between two pieces of one
  reply), their tokens per second together, the probes' TTFT p95, the long prompt's TTFT.

Variants of the long-prompt pieces (engine/steps.py, point 4) run on one engine: each is
the promise of a priority class of its own (`PIECE/CONTEXT`, or `none`: the engine's own
steps, as shipped before issue 53), and a trial's streams and probes run in that class, the
long prompt below it (so the class's promise shapes its steps).

    .venv/bin/python -m bench.isolation --plan cpu --users 4 --long-tokens 1800 \
        --variants none 128/256 --chosen 128/256 --reply 64 --quiet-s 4 --probe-tokens 32 \
        --probe-every-s 1 --repeats 2 --out bench/results/isolation-cpu.json     (CPU scale)
    scripts/gpu_run.sh OUT isolation --plan sweep loads heavy two --users 64 \
        --variants none 2048/32768 2048/65536 2048/131072 --chosen 2048/65536   (on a GPU)
    .venv/bin/python -m bench.isolation --report RUN.json --out bench/results/gpu-isolation.json \
        --png bench/results/gpu-isolation.png        (the targets and the plot of a run)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import time
import uuid
from pathlib import Path

import numpy as np

from engine import Engines, load_config
from engine.llm import PresetEngine
from engine.steps import STEP_CLASSES_KEY

SHARED = "latency-first+throughput-first"
FIRST_CLASS = 10  # the variants' priorities: 10, 11, ... (the presets use 0 and 1)
LONG_PRIORITY = 50  # below every variant: no promise of its own


def variant_classes(variants: list[str]) -> dict:
    """Each `PIECE/CONTEXT` variant's promise, by its priority (`none`: no promise)."""
    classes = {}
    for i, name in enumerate(variants):
        if name != "none":
            piece, context = (int(x) for x in name.split("/"))
            classes[str(FIRST_CLASS + i)] = {"long_piece": piece, "long_context": context}
    return classes


def with_variants(variants: list[str], name: str, setup):
    """The shared engine as the app builds it, with the variants' classes added."""
    extra = dict(setup.args.get("additional_config") or {})
    extra[STEP_CLASSES_KEY] = {**extra.get(STEP_CLASSES_KEY, {}), **variant_classes(variants)}
    return PresetEngine(name, setup.with_args(additional_config=extra))


def random_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def generate(llm, ids: list[int], max_tokens: int, priority: int, times: list | None = None
                   ) -> float:
    """One request on vLLM's engine; `times` gets (time, tokens) of each piece. Returns the
    time of its first token."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7,
                            top_p=0.9, output_kind=RequestOutputKind.DELTA)
    first = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                  f"iso-{uuid.uuid4().hex}", priority=priority):
        now = time.monotonic()
        first = first or now
        if times is not None:
            times.append((now, len(out.outputs[0].token_ids)))
    return first


async def user_loop(llm, priority: int, reply: int, rng: random.Random, replies: list) -> None:
    while True:
        times: list = []
        replies.append(times)
        await generate(llm, random_ids(100, rng), reply, priority, times)


def window_figures(replies: list[list], start: float, end: float, users: int) -> dict:
    gaps, tokens = [], 0
    for times in replies:
        for (t0, _), (t1, n) in zip(times, times[1:]):
            if start <= t1 <= end:
                gaps.append(t1 - max(t0, start))
        tokens += sum(n for t, n in times if start <= t <= end)
    span = max(end - start, 1e-9)
    return {"gap_p95_ms": round(float(np.percentile(gaps, 95)) * 1000, 1) if gaps else None,
            "gap_max_ms": round(max(gaps) * 1000, 1) if gaps else None,
            "tok_s": round(tokens / span, 1), "per_user_tok_s": round(tokens / span / users, 1)
            if users else None}


async def trial(llm, args, *, variant: int, users: int, long: int, two: bool,
                rng: random.Random) -> dict:
    priority = FIRST_CLASS + variant
    replies: list = []
    loops = [asyncio.ensure_future(user_loop(llm, priority, args.reply, rng, replies))
             for _ in range(users)]
    probes: list[float] = []
    try:
        while users and (len(replies) < users
                         or min(sum(n for _, n in r) for r in replies[:users]) < 3):
            await asyncio.sleep(0.02)
        start = time.monotonic()
        longs = []
        if long:
            longs = [asyncio.ensure_future(generate(llm, random_ids(long, rng), 1, LONG_PRIORITY))
                     for _ in range(2 if two else 1)]
        deadline = start + args.quiet_s
        probing = []
        while users and ((longs and not all(t.done() for t in longs))
                         or (not longs and time.monotonic() < deadline)):
            sent = time.monotonic()
            probing.append(asyncio.ensure_future(
                generate(llm, random_ids(args.probe_tokens, rng), 1, priority)))
            probing[-1].sent = sent
            await asyncio.sleep(args.probe_every_s)
        firsts = [await t for t in longs]
        end = max(firsts) if firsts else time.monotonic()
        for task in probing:
            probes.append((await task) - task.sent)
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    figures = window_figures(replies, start, end, users)
    figures.update(users=users, long_tokens=long, two=two, window_s=round(end - start, 2),
                   long_ttft_s=[round(f - start, 2) for f in firsts],
                   probe_ttft_p95_ms=round(float(np.percentile(probes, 95)) * 1000, 1)
                   if probes else None, probes=len(probes))
    return figures


def trials_of(plan: str, args) -> list[tuple[int, int, bool, bool]]:
    """(variant, users, long?, two?) in order: each long trial beside its quiet twin."""
    chosen = args.variants.index(args.chosen) if args.chosen in args.variants else 0
    every = range(len(args.variants))
    return {
        "cpu": [(i, args.users, q, False) for i in every for q in (False, True)],
        "sweep": [(-1, 0, True, False)]
        + [(i, args.users, q, False) for i in every for q in (False, True)],
        "loads": [(chosen, u, q, False) for u in (16, 240, 64) for q in (False, True)],
        "two": [(chosen, args.users, True, True)],
    }[plan]


async def heavy_trial(pool: Engines, args, heavy: int, rng: random.Random) -> dict:
    """`args.chat_users` chat users on Latency-first, each its own account, replies of
    `args.reply` tokens one after another through the app's admission line (engine/
    admission.py: each account's fair share), and `heavy` requests of one account sent at
    once beside them (refused ones counted): the users' TTFT p95 and pieces a second over
    `args.heavy_s`."""
    from engine import ChatError

    profile = "Latency-first"
    ttfts, pieces, refused = [], [0], [0]

    async def turn(who: str, mine: bool) -> None:
        prompt = pool.raw_prompt(profile, random_ids(100, rng), args.reply)
        sent, first = time.monotonic(), None
        async for item in pool.stream(prompt, profile, who=who, ignore_eos=True):
            if isinstance(item, str):
                first = first or time.monotonic()
                if mine:
                    pieces[0] += 1
        if mine and first is not None:
            ttfts.append((sent, first - sent))

    async def user(i: int) -> None:
        while True:
            await turn(f"account:user{i}", True)

    async def burst() -> None:
        try:
            await turn("account:heavy", False)
        except ChatError:
            refused[0] += 1

    users = [asyncio.ensure_future(user(i)) for i in range(args.chat_users)]
    await asyncio.sleep(3)  # every user under way
    start, pieces[0] = time.monotonic(), 0
    bursts = [asyncio.ensure_future(burst()) for _ in range(heavy)]
    await asyncio.sleep(args.heavy_s)
    span = time.monotonic() - start
    for task in users + bursts:
        task.cancel()
    await asyncio.gather(*users, *bursts, return_exceptions=True)
    mine = [t for s, t in ttfts if s >= start]
    return {"heavy": heavy, "chat_users": args.chat_users, "turns": len(mine),
            "ttft_p95_ms": round(float(np.percentile(mine, 95)) * 1000, 1) if mine else None,
            "pieces_s": round(pieces[0] / span, 1), "heavy_refused": refused[0]}


async def main(args) -> dict:
    import torch

    config = load_config()
    pool = Engines(config, engine_class=functools.partial(with_variants, args.variants))
    await pool.start()
    llm = pool.engines[SHARED].llm
    engine = pool.engines[SHARED]
    rng = random.Random(args.seed)
    room = engine.kv_tokens - 240 * (100 + args.reply) - 4096
    long = min(args.long_tokens, engine.max_model_len - 16, room)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    result = {"device": device, "plans": args.plan, "users": args.users,
              "variants": args.variants, "chosen": args.chosen, "kv_tokens": engine.kv_tokens,
              "max_model_len": engine.max_model_len, "long_tokens": long, "reply": args.reply,
              "trials": [], "heavy": []}
    print(json.dumps({k: v for k, v in result.items() if k not in ("trials", "heavy")}),
          flush=True)
    await generate(llm, random_ids(args.probe_tokens, rng), 4, FIRST_CLASS)  # sampling kernels
    for repeat in range(args.repeats):
        for plan in args.plan:
            if plan == "heavy":
                for heavy in (0, args.heavy, 0, args.heavy):
                    figures = await heavy_trial(pool, args, heavy, rng)
                    result["heavy"].append(figures)
                    print(json.dumps(figures), flush=True)
                continue
            for variant, users, with_long, two in trials_of(plan, args):
                size = min(long, room // 2) if two else long
                figures = await trial(llm, args, variant=max(variant, 0), users=users,
                                      long=size if with_long else 0, two=two, rng=rng)
                figures.update(variant=args.variants[max(variant, 0)] if users else "alone",
                               plan=plan, repeat=repeat)
                result["trials"].append(figures)
                print(json.dumps(figures), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    pool.shutdown()
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", nargs="+", default=["cpu"],
                        choices=["cpu", "sweep", "loads", "two", "heavy"])
    parser.add_argument("--variants", nargs="+", default=["none", "2048/65536"])
    parser.add_argument("--chosen", default="2048/65536", help="the variant of loads and two")
    parser.add_argument("--chat-users", type=int, default=16)
    parser.add_argument("--heavy", type=int, default=300)
    parser.add_argument("--heavy-s", type=float, default=15.0)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=250_000)
    parser.add_argument("--reply", type=int, default=256)
    parser.add_argument("--quiet-s", type=float, default=6.0)
    parser.add_argument("--probe-tokens", type=int, default=500)
    parser.add_argument("--probe-every-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=53)
    parser.add_argument("--out")
    parser.add_argument("--report", metavar="RUN.json",
                        help="no run: write RUN.json's targets into --out and its plot to --png")
    parser.add_argument("--png")
    return parser.parse_args(argv)




def piece_at_end(variant: str, long_tokens: int) -> int:
    """A variant's piece at the end of the long prompt (`none`: the engine's 8,192)."""
    if variant in ("none", "alone"):
        return 8192
    piece, context = (int(x) for x in variant.split("/"))
    return max(64, min(piece, piece * context // max(long_tokens, context)))


def plot(result: dict, path: str, shipped: str) -> None:
    """Piece size (at the end of the long prompt) against the others' gap p95 and the long
    prompt's TTFT, one point a variant (medians of its trials), the shipped one marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for t in result["trials"]:
        if t["long_tokens"] and t["users"] and not t["two"]:
            rows.setdefault(t["variant"], []).append(t)
    names = sorted(rows, key=lambda v: piece_at_end(v, result["long_tokens"]))
    x = [piece_at_end(v, result["long_tokens"]) for v in names]
    gap = [float(np.median([t["gap_p95_ms"] for t in rows[v]])) for v in names]
    ttft = [float(np.median([t["long_ttft_s"][0] for t in rows[v]])) for v in names]
    fig, left = plt.subplots(figsize=(7, 4.2))
    left.plot(x, gap, "o-", color="tab:blue", label="others' update gap p95 (ms)")
    left.set_xscale("log", base=2)
    left.set_xlabel(f"prompt piece at {result['long_tokens']:,} tokens of context (tokens)")
    left.set_ylabel("gap p95 (ms)", color="tab:blue")
    right = left.twinx()
    right.plot(x, ttft, "s--", color="tab:red", label="long prompt's TTFT (s)")
    right.set_ylabel("long prompt's TTFT (s)", color="tab:red")
    for name, xi, gi in zip(names, x, gap):
        mark = " (shipped)" if result.get("device") != "CPU" else " (chosen)"
        left.annotate(name + (mark if name == shipped else ""), (xi, gi),
                      textcoords="offset points", xytext=(4, 6), fontsize=8,
                      fontweight="bold" if name == shipped else "normal")
    users = sorted({t["users"] for v in names for t in rows[v]})
    left.set_title(f"One long prompt beside {', '.join(map(str, users))} streaming users "
                   f"({result.get('device', 'GPU')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(result: dict) -> list[dict]:
    """Issue 53's targets from one run: each figure a median over the trials (pairs: a
    long trial and the quiet trial just before it, same variant and users)."""
    chosen, trials = result["chosen"], result["trials"]
    out = []

    def add(name, values, target, direction):
        values = [v for v in values if v is not None]
        if values:
            out.append({"name": name, "measured": round(float(np.median(values)), 3),
                        "target": target, "direction": direction, "n": len(values)})

    pairs = [(q, t) for q, t in zip(trials, trials[1:]) if t["long_tokens"] and not t["two"]
             and not q["long_tokens"] and q["users"] == t["users"] and q["variant"] == t["variant"]]
    for users in sorted({t["users"] for _, t in pairs}):
        mine = [(q, t) for q, t in pairs if t["users"] == users and t["variant"] == chosen]
        add(f"others' update gap p95 (ms), long prompt beside {users} streams",
            [t["gap_p95_ms"] for _, t in mine], 150, "<=")
        add(f"others' update gap max (ms), long prompt beside {users} streams",
            [t["gap_max_ms"] for _, t in mine], 500, "<=")
        add(f"new short turn's TTFT p95 (ms) meanwhile, {users} streams",
            [t["probe_ttft_p95_ms"] for _, t in mine], 300, "<=")
        add(f"others' tok/s with / without the long prompt, {users} streams",
            [t["tok_s"] / q["tok_s"] for q, t in mine if q["tok_s"]], 0.8, ">=")
    alone = [t["long_ttft_s"][0] for t in trials if t["variant"] == "alone"]
    if alone:
        beside = [t["long_ttft_s"][0] for _, t in pairs if t["variant"] == chosen]
        add("long prompt's TTFT beside streams / alone on an idle engine",
            [b / float(np.median(alone)) for b in beside], 1.3, "<=")
    two = [t for t in trials if t["two"]]
    if two:
        add("two long prompts at once: both answered (share of runs)",
            [float(len(t["long_ttft_s"]) == 2) for t in two], 1.0, ">=")
        add("two long prompts at once: others' update gap p95 (ms)",
            [t["gap_p95_ms"] for t in two], 150, "<=")
    heavy = result.get("heavy", [])
    hpairs = [(a, b) for a, b in zip(heavy, heavy[1:]) if not a["heavy"] and b["heavy"]]
    add("one account's 300 requests: chat users' TTFT p95 with / without",
        [b["ttft_p95_ms"] / a["ttft_p95_ms"] for a, b in hpairs
         if a["ttft_p95_ms"] and b["ttft_p95_ms"]], 2.0, "<=")
    add("one account's 300 requests: chat users' pieces/s with / without",
        [b["pieces_s"] / a["pieces_s"] for a, b in hpairs if a["pieces_s"]], 0.8, ">=")
    for t in out:
        t["met"] = t["measured"] <= t["target"] if t["direction"] == "<=" else \
            t["measured"] >= t["target"]
    return out


def report(args) -> None:
    run = json.loads(Path(args.report).read_text())
    run["targets"] = targets(run)
    for t in run["targets"]:
        print(f"{'met' if t['met'] else 'MISSED':6} {t['name']}: {t['measured']} "
              f"({t['direction']} {t['target']}, median of {t['n']})")
    if args.out:
        Path(args.out).write_text(json.dumps(run, indent=1))
    if args.png:
        plot(run, args.png, run["chosen"])


if __name__ == "__main__":
    arguments = parse()
    report(arguments) if arguments.report else asyncio.run(main(arguments))
