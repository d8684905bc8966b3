"""A room of people joining one demo through one invite link (issue 59): the app as
`make run` starts it (the launcher, its front ends), an invite link made as an operator
makes it (`python -m store invites add`), then `--guests` people:

1. join: each opens the link and sends a name (POST /invite/TOKEN: the guest row and its
   login), arriving evenly over `--join-over-s`; then opens the chat's socket with the
   login it got. Each join's and connect's time, and any refusal;
2. once all are in, every guest sends one message at the same moment, asking for
   `--output-len` tokens (VCHAT_BENCH_IGNORE_EOS: replies run to it), in the chat profile
   `--profile`: each reply's time to first token, whether it came whole, and whether the
   guest was told its place in line while waiting; the engines' preemptions (/ready).

The guests are spread over `--processes` client processes (as many browsers are), which
start each step together. On a CPU the stand-in engine (`--stand-in`) stands for the model:
the join path and the app's line are measured, not a model. With `--engine-baseline`
the same load then runs on the engine path (bench/paths.py), for app/engine tok/s and the
TTFT p50 ratio (the app's figures are saved first, should the engine path not finish);
`--engine-seats N` holds it to N turns at once (the app's Throughput-first seats, for a
like-for-like figure; by default vLLM's own line holds the rest). `--cpu-offload-gib`
runs both with that KV offloading (profiles.yaml's memory.cpu_offload_gib).

    python -m bench.room --guests 1000 --join-over-s 30 --engine-baseline --name gpu-room
                                                             (GPU: dummy Qwen3-4B)
    scripts/gpu_run.sh OUT room --front-ends 4 --cpu-offload-gib 0     (on the GPU machine)
    python -m bench.room --guests 200 --stand-in --name room-cpu            (CPU, a proxy)
    python -m bench.room --engine-only --engine-seats 256 --engine-repeats 3 --name NAME
                             (the engine path alone: the guests' sampling beside top_p 1)

Writes bench/results/NAME.json with a `targets` list.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

import httpx

from bench.app_clients import _answer
from bench.returning import profiles_with
from bench import replicas
from bench.reliability import WAITING, device, save
from tools.chainlit_client import ROOT, ChatClient, Server

READY_TIMEOUT_S, RUN_TIMEOUT_S = 600.0, 900.0


def percentile(values: list[float], q: float) -> float | None:
    return replicas.percentile(values, q) if values else None


async def join_and_connect(url: str, token: str, name: str, at: float) -> dict:
    """One guest: waits until `at`, joins, connects. Its figures and its client."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        joined = await http.post(f"/invite/{token}", data={"name": name})
    join_s = time.monotonic() - start
    out = {"join_s": join_s, "status": joined.status_code, "client": None}
    cookie = joined.cookies.get("access_token")
    if joined.status_code != 303 or not cookie:
        out["refused"] = joined.text[-300:]
        return out
    client = ChatClient(url, "")
    start = time.monotonic()
    try:
        await client.connect_with(cookie)
    except Exception as exc:  # said in the figures
        out["connect_error"] = repr(exc)[:200]
        return out
    out["connect_s"] = time.monotonic() - start
    out["client"] = client
    return out


async def ask(client: ChatClient, text: str, output_len: int) -> dict:
    start_event = len(client.events)
    sent = time.monotonic()
    try:
        reply = await client.send(text, timeout=RUN_TIMEOUT_S)
    except Exception as exc:
        return {"ok": False, "error": repr(exc)[:200]}
    tokens = [e for e in client.events[start_event:] if e.name == "stream_token"]
    notes = [n for n in reply.notes if not n.startswith(WAITING)]
    meta = (reply.reply or {}).get("metadata") or {}
    return {"ok": bool(reply.shown) and not notes and meta.get("output_tokens") == output_len,
            "ttft_s": tokens[0].at - sent if tokens else None, "end_s": time.monotonic() - sent,
            # The place-in-line note is a message of its own, removed once the reply starts.
            "waited": any(e.name == "new_message" and isinstance(e.data, dict)
                          and str(e.data.get("output", "")).startswith(WAITING)
                          for e in client.events[start_event:]),
            "output_tokens": meta.get("output_tokens"), "notes": notes[:2],
            "sent": sent, "ended": time.monotonic()}


async def guests(url: str, token: str, names: list[str], offsets: list[float], profile: str,
                 output_len: int, conn, go_join, go_ask) -> None:
    """One client process's guests: join when told, then ask when told."""
    conn.send("ready")
    while not go_join.is_set():
        await asyncio.sleep(0.002)
    base = time.monotonic()
    joined = await asyncio.gather(*[join_and_connect(url, token, n, base + o)
                                    for n, o in zip(names, offsets)])
    clients = [j.pop("client") for j in joined]
    live = [c for c in clients if c is not None]
    await asyncio.gather(*[c.settings(max_tokens=output_len, show_stats=False) for c in live])
    conn.send(("joined", joined))
    while not go_ask.is_set():
        await asyncio.sleep(0.002)
    asked = await asyncio.gather(*[ask(c, f"Hello from seat {i}, please tell me a story.",
                                       output_len) for i, c in enumerate(live)])
    await asyncio.gather(*[c.close() for c in live], return_exceptions=True)
    conn.send(("asked", asked))


def process_main(*args) -> None:
    conn = args[6]
    try:
        asyncio.run(guests(*args))
    except Exception as exc:
        conn.send(("failed", repr(exc)))


async def answer(conn, timeout: float):
    said = await _answer(conn, timeout)
    if isinstance(said, tuple) and said[0] == "failed":
        raise RuntimeError(f"a client process failed: {said[1]}")
    return said


def make_invite(server: Server, uses: int, profile: str | None) -> str:
    extra = ["--profile", profile] if profile else []
    done = subprocess.run([sys.executable, "-m", "store", "invites", "add", "--uses", str(uses),
                           "--expires", "2h", *extra], env=dict(server.env), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1].rsplit("/invite/", 1)[1]


async def main(args) -> dict:
    env = {"VCHAT_BENCH_IGNORE_EOS": "1", "VCHAT_GUEST_JOINS_PER_ADDRESS": str(args.guests + 10),
           "VCHAT_GUEST_ADDRESS_TURNS_PER_MINUTE": str(args.guests * 2)}
    if args.front_ends:
        env["VCHAT_FRONT_ENDS"] = str(args.front_ends)
    if args.stand_in:
        env.update(VCHAT_ENGINE="stand-in", VCHAT_STANDIN_TOKENS_PER_S=str(args.stand_in_tps))
    if args.cpu_offload_gib is not None:  # the app and the engine path alike
        os.environ["VCHAT_PROFILES"] = env["VCHAT_PROFILES"] = str(
            profiles_with(args.cpu_offload_gib, None))
    if args.engine_only:  # the engine path's runs alone (its samplings side by side)
        return {"device": device(), "guests": args.guests, "output_len": args.output_len,
                "engine_path": await engine_path(args), "targets": []}
    server = Server(env)
    context = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        await server.wait_ready(timeout=900)
        ready = await server.get("/ready")
        token = make_invite(server, args.guests, args.profile)
        go_join, go_ask = context.Event(), context.Event()
        spacing = args.join_over_s / max(1, args.guests)
        for p in range(args.processes):
            mine, theirs = context.Pipe()
            seats = range(args.guests)[p::args.processes]
            proc = context.Process(target=process_main, daemon=True, args=(
                server.url, token, [f"Guest {i}" for i in seats], [i * spacing for i in seats],
                args.profile, args.output_len, theirs, go_join, go_ask))
            proc.start()
            procs.append(proc)
            conns.append(mine)
        for conn in conns:
            assert await answer(conn, READY_TIMEOUT_S) == "ready"
        start = time.monotonic()
        go_join.set()
        joins = [j for conn in conns for j in (await answer(conn, READY_TIMEOUT_S))[1]]
        joined_s = time.monotonic() - start
        before = await counted(server)
        go_ask.set()
        asks = [a for conn in conns for a in (await answer(conn, RUN_TIMEOUT_S))[1]]
        result = figures(args, joins, asks, joined_s)
        after = await counted(server)
        steps = after["steps"] - before["steps"]
        result.update(device=device(), front_ends=(ready.get("front_end") or {}).get("count"),
                      engine="stand-in" if args.stand_in else "vllm", seats=seats_of(ready),
                      preemptions=after["preempted"] - before["preempted"], steps=steps,
                      # Below the seats: seats stood empty (the engine path's running_mean
                      # is the like figure); steps slower at as many: the engine's pace.
                      tokens_per_step=round(args.output_len * result["complete"] / steps, 1)
                      if steps else None)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.stop()
    result["cpu_offload_gib"] = args.cpu_offload_gib
    result["targets"] = targets(result)
    if args.engine_baseline and not args.stand_in:
        save(result, args.name)  # the app's figures kept, should the engine path not finish
        result["engine_path"] = await engine_path(args)
        result.update(ratios(result))
        result["targets"] = targets(result)
    return result


async def engine_path(args) -> dict:
    """The same load straight on the shared engine (bench/paths.py's engine path: no app,
    no line of the app's own; vLLM queues beyond its seats), after the app has stopped.

    Like for like, its requests sample as the guests' turns do (the invite's profile's
    temperature and top_p: top-p costs the engine each step) and go in their preset's class
    (the shared engine's priority). `--engine-repeats` runs it that many times, each beside
    a run with the benches' own sampling (top_p 1, as the figures before 2026-12-07 were
    taken), in turn: the median is the figure."""
    from bench.paths import run_engine
    from bench.workloads import SAMPLING, chat
    from engine import Engines, load_config

    config = load_config()
    pool = Engines(config)
    theirs, priority = guests_sampling(config, args.profile), guests_class(pool, args.profile)
    seats = args.engine_seats or args.guests
    await pool.start()
    runs: dict[str, list[dict]] = {"guests": [], "benches": []}
    try:
        (engine,) = pool.engines.values()
        for _ in range(max(1, args.engine_repeats)):
            for name, sampling in (("guests", theirs), ("benches", SAMPLING)):
                # Every guest asks at once: held to fewer seats, a turn's TTFT counts its wait
                # for one, as the app's guests' do.
                runs[name].append(await run_engine(
                    engine, chat(args.guests, args.output_len), seats, from_arrival=True,
                    waves=seats, sampling={**sampling, **priority}))
    finally:
        pool.shutdown()

    def median_of(name: str) -> dict:
        # tok_s: the runs' median; the rest from the middle run (of two, the faster).
        out = sorted(runs[name], key=lambda r: r["tok_s"])[len(runs[name]) // 2]
        # decode_tok_s_by_wave: the engine's pace wave by wave, beside the app's (the turn
        # log's tokens_per_s for every as many turns: tools/turn_log.py --each).
        return {"tok_s": statistics.median(r["tok_s"] for r in runs[name]),
                "ttft_p50_s": out["ttft_ms"]["p50"] / 1000,
                "completed": out["completed"], "at_once": seats,
                "decode_tok_s_by_wave": out["decode_tok_s_by_wave"],
                "runs_tok_s": [r["tok_s"] for r in runs[name]], "engine": out.get("engine")}

    # Each pair's two runs were neighbours: their ratio is what top-p costs the engine.
    pairs = [round(g["tok_s"] / b["tok_s"], 3) for g, b in zip(runs["guests"], runs["benches"])]
    return {**median_of("guests"), "sampling": theirs, **priority,
            "with_benches_sampling": {**median_of("benches"), "sampling": SAMPLING},
            "guests_over_benches_tok_s": {"pairs": pairs, "median": statistics.median(pairs)}}


def guests_sampling(config, profile: str) -> dict:
    """How the guests' turns sample: their profile's temperature and top_p (a guest's
    settings start at them; the room's guests change only max_tokens)."""
    sampling = config.profile_or_default(profile).sampling
    return {"temperature": sampling.temperature, "top_p": sampling.top_p}


def guests_class(pool, profile: str) -> dict:
    """The class the guests' turns go to the shared engine in: the app's own (Engines.
    priority, their preset's; the planned scheduler keeps a step budget for the first
    class's turns: sent in class 0, the engine path's turns were taken for Latency-first's;
    on 2 CPU cores it then ran 13.6 turns at once where the app ran 62)."""
    return {"priority": pool.priority(pool.config.profile_or_default(profile).name)}


def ratios(r: dict) -> dict:
    engine = r["engine_path"]
    return {"app_over_engine_tok_s": round(r["tokens_per_s"] / engine["tok_s"], 3)
            if r["tokens_per_s"] and engine["tok_s"] else None,
            "ttft_p50_over_engine": round(r["ttft_p50_s"] / engine["ttft_p50_s"], 3)
            if r["ttft_p50_s"] and engine["ttft_p50_s"] else None}


def seats_of(ready: dict) -> int:
    """The seats of the line the guests' turns go to (Throughput-first's preset), every
    front end's together as /ready says them: beyond them a guest waits, and should be
    told its place."""
    return sum(preset.get("seats") or 0 for engine in (ready.get("engines") or {}).values()
               for name, preset in (engine.get("presets") or {}).items()
               if name == "throughput-first")


async def counted(server: Server) -> dict[str, int]:
    """vLLM's preemptions and steps so far (/ready: every front end's together; each step's
    figures go to one front end)."""
    engines = (await server.get("/ready")).get("engines") or {}
    return {key: sum(e.get(key) or 0 for e in engines.values())
            for key in ("preempted", "steps")}


def figures(args, joins: list[dict], asks: list[dict], joined_s: float) -> dict:
    join_s = [j["join_s"] for j in joins if j["status"] == 303]
    connect_s = [j["connect_s"] for j in joins if "connect_s" in j]
    ttft = [a["ttft_s"] for a in asks if a.get("ttft_s") is not None]
    complete = [a for a in asks if a.get("ok")]
    tokens = sum(a.get("output_tokens") or 0 for a in complete)
    span = (max(a["ended"] for a in complete) - min(a["sent"] for a in complete)) \
        if complete else 0.0
    return {
        "guests": args.guests, "join_over_s": args.join_over_s, "output_len": args.output_len,
        "profile": args.profile, "processes": args.processes,
        "joined": len(join_s), "refused": [j.get("refused", "")[:120] for j in joins
                                           if j["status"] != 303][:5],
        "join_p50_s": statistics.median(join_s) if join_s else None,
        "join_p95_s": percentile(join_s, 0.95), "all_joined_s": round(joined_s, 2),
        "connected": len(connect_s), "connect_p95_s": percentile(connect_s, 0.95),
        "connect_errors": [j["connect_error"] for j in joins if "connect_error" in j][:5],
        "asked": len(asks), "complete": len(complete),
        "incomplete": [a.get("notes") or a.get("error") for a in asks if not a.get("ok")][:5],
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": percentile(ttft, 0.95),
        "last_reply_s": max((a["end_s"] for a in complete), default=None),
        "told_their_place": sum(a.get("waited", False) for a in asks),
        "tokens_per_s": round(tokens / span, 1) if span else None}


def targets(r: dict) -> list[dict]:
    return [
        {"target": f"{r['guests']} guests join within 60 s", "value": r["all_joined_s"],
         "met": r["joined"] == r["guests"] and r["all_joined_s"] <= 60},
        {"target": "join p95 <= 1 s", "value": r["join_p95_s"],
         "met": r["join_p95_s"] is not None and r["join_p95_s"] <= 1.0},
        {"target": "none refused in error", "value": len(r["refused"]) + len(r["connect_errors"]),
         "met": not r["refused"] and not r["connect_errors"]},
        {"target": "every reply complete", "value": f"{r['complete']}/{r['guests']}",
         "met": r["complete"] == r["guests"]},
        {"target": "0 preemptions", "value": r["preemptions"], "met": r["preemptions"] == 0},
        {"target": f"those beyond the {r['seats']} seats told their place",
         "value": r["told_their_place"],
         "met": r["told_their_place"] >= r["guests"] - r["seats"]},
        *([{"target": "app/engine tok/s >= 0.9", "value": r["app_over_engine_tok_s"],
            "met": (r["app_over_engine_tok_s"] or 0) >= 0.9},
           {"target": "TTFT p50 <= 2x the engine path's", "value": r["ttft_p50_over_engine"],
            "met": (r["ttft_p50_over_engine"] or 99) <= 2.0}] if "engine_path" in r else [])]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guests", type=int, default=1000)
    p.add_argument("--join-over-s", type=float, default=30.0)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--profile", default="Throughput-first",
                   help="the invite's profile (empty: any; the guests' default)")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--front-ends", type=int, default=0, help="default: the app's own")
    p.add_argument("--stand-in", action="store_true", help="the stand-in engine (CPU)")
    p.add_argument("--stand-in-tps", type=float, default=200.0)
    p.add_argument("--engine-baseline", action="store_true",
                   help="then the same load on the engine path (not with --stand-in)")
    p.add_argument("--engine-seats", type=int, default=0,
                   help="the engine path's turns at once (default: all: vLLM's own line "
                        "holds the rest; the app's Throughput-first seats for a like-for-like "
                        "figure)")
    p.add_argument("--engine-repeats", type=int, default=1,
                   help="engine path runs with the guests' sampling, each beside one with the "
                        "benches' (top_p 1); the median is the figure")
    p.add_argument("--engine-only", action="store_true",
                   help="only the engine path's runs (with --engine-repeats: the guests' "
                        "sampling beside the benches', pair by pair), no app")
    p.add_argument("--cpu-offload-gib", default=None,
                   help="profiles.yaml's memory.cpu_offload_gib for this run (GiB or auto; "
                        "default: the file's)")
    p.add_argument("--name", default="room-cpu")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    print(save(asyncio.run(main(args)), args.name))
