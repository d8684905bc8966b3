"""Crashes under load (issue 57): the app as `make run` starts it (the launcher, its front
ends sharing one engine core), `--users` chats streaming replies at once, then

1. one front end killed with SIGKILL: the other front ends' streams go on to their end (a
   stream lost: one that ended with a note or never ended); the killed one is started again
   alone (seconds until it answers /ready again); its users reconnect, as their pages do,
   and each finds its chat with the cut-off reply said and is answered again;
2. the engine core killed with SIGKILL: /health asked every half second throughout (any
   answer but 200 counted); each reply in flight ends saying so; each user sends again until
   answered (the first token of each, in seconds after the kill); every chat still holds
   its messages.

    python -m bench.reliability --users 256 --name gpu-reliability   # (GPU: dummy Qwen3-4B)
    scripts/gpu_run.sh OUT reliability --users 256

Writes bench/results/NAME.json with a `targets` list (the issue's, on the H100 or H200).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import psutil

from chat.view import CUT_OFF, queued_notice
from tools.chainlit_client import ChatClient, Server

RESULTS = Path(__file__).resolve().parent / "results"
WAITING = queued_notice(1).split(":")[0]  # "Many people are chatting right now"
DIED = "stopped unexpectedly"  # the note of a reply its engine's death cut off (engine/llm.py)


async def ready_fronts(url: str, count: int, tries: int = 100) -> dict[int, dict]:
    """/ready as each front end answers it, by index (new connections until all have)."""
    seen: dict[int, dict] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(tries):
            try:
                health = (await http.get(url + "/ready",
                                         headers={"connection": "close"})).json()
            except (httpx.HTTPError, ValueError):
                continue
            seen[(health.get("front_end") or {}).get("index", 0)] = health  # (one: none)
            if len(seen) == count:
                break
    return seen


def problems(reply) -> list[str]:
    """A reply's notes but the one saying it waits in line (many users at once: expected)."""
    return [n for n in reply.notes if n and not n.startswith(WAITING)]


async def stream_all(clients: list[ChatClient], text: str) -> list[int]:
    """Every client sends `text`; returns once each reply has streamed a few tokens: the
    index of each one's first event of this turn."""
    starts = [len(c.events) for c in clients]
    await asyncio.gather(*[c.emit_message(text) for c in clients])
    await asyncio.gather(*[c.wait_for_tokens(s, 3, timeout=300) for c, s in zip(clients, starts)])
    return starts


async def ended(client: ChatClient, start: int, timeout: float):
    """The turn from event `start`: its Reply once ended, or None if it did not end."""
    try:
        end = await client.wait_for("task_end", since=start, timeout=timeout)
    except (AssertionError, TimeoutError, asyncio.TimeoutError):
        return None
    return client.collect(start, end + 1)


async def runs_stored(server: Server, count: int, since: float, timeout: float = 120
                      ) -> float | None:
    """Seconds from `since` (time.monotonic()) until `count` turns begun since then are
    stored (Chainlit writes a message's "on_message" run when its handling begins), read
    from the app's SQLite file; None if not within `timeout`."""
    after = (datetime.now(timezone.utc) - timedelta(seconds=time.monotonic() - since + 1)
             ).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    path = Path(server.env.get("VCHAT_DATA_DIR", "")) / "chat.db"
    if server.env.get("DATABASE_URL") or not path.exists():
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            (running,) = db.execute(
                "SELECT COUNT(*) FROM steps WHERE type = 'run' AND name = 'on_message' "
                'AND "createdAt" > ?', (after,)).fetchone()
        if running >= count:
            return round(time.monotonic() - since, 2)
        await asyncio.sleep(0.1)
    return None


async def spare_ready(server: Server, timeout: float = 300) -> bool:
    """Whether the launcher's spare front end has its imports done (it says so in its log),
    waiting up to `timeout`: a crash within a minute of the start is not what is measured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "a spare front end is ready" in server.log_path.read_text(errors="replace"):
            return True
        await asyncio.sleep(1)
    return False


async def kill_a_front_end(server: Server, clients: list[ChatClient], count: int) -> dict:
    spare = await spare_ready(server)
    fronts = await ready_fronts(server.url, count)
    victim = max(fronts)
    pid = fronts[victim]["front_end"]["pid"]
    sent = time.monotonic()
    starts = await stream_all(clients, "Write a very long story about a lighthouse keeper.")
    # A process killed loses the writes it had not made yet: the kill waits until every
    # turn's begun run is stored (how long that took under this load is a figure of its own).
    stored_s = await runs_stored(server, len(clients), sent)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    done_before = {i for i, (c, s) in enumerate(zip(clients, starts))
                   if any(e.name == "task_end" for e in c.events[s:])}
    await asyncio.sleep(2)  # the killed one's sockets close at once
    cut = [i for i, c in enumerate(clients) if not c.sio.connected]
    kept = [i for i in range(len(clients)) if i not in cut]
    back_in_s = None

    async def watch_back() -> None:
        nonlocal back_in_s
        while back_in_s is None:
            seen = await ready_fronts(server.url, count, tries=20)
            again = seen.get(victim)
            if again and again["front_end"]["pid"] != pid and again["status"] == "ok":
                back_in_s = round(time.monotonic() - killed, 2)
            await asyncio.sleep(0.25)

    watching = asyncio.ensure_future(watch_back())
    replies = await asyncio.gather(*[ended(clients[i], starts[i], 600) for i in kept])
    lost = [i for i, r in zip(kept, replies) if r is None or not r.shown or problems(r)]
    await asyncio.wait_for(watching, 120)

    async def resume(i: int) -> bool:
        c = clients[i]
        start = len(c.events)
        await c.reconnect()
        if i in done_before:  # its reply ended before the kill: nothing was cut
            again = await c.send("Just say hi.", timeout=300)
            return bool(again.shown) and not problems(again)
        try:
            note = await c.wait_for_note("went away", since=start, timeout=120)
        except TimeoutError:  # what the page got instead, to tell a new chat from a late note
            raise AssertionError(f"no cut-off note; events: "
                                 f"{[e.name for e in c.events[start:]][:10]}") from None
        again = await c.send("Just say hi.", timeout=300)
        return note == CUT_OFF and bool(again.shown) and not problems(again)

    resumed = await asyncio.gather(*[resume(i) for i in cut], return_exceptions=True)
    log = server.log_path.read_text(errors="replace")
    return {"front_ends": count, "spare_ready": spare, "killed_index": victim,
            "users_on_it": len(cut), "replies_ended_before_the_kill": len(done_before & set(cut)),
            "turns_stored_s": stored_s,
            "lost_notes": [replies[kept.index(i)].notes if replies[kept.index(i)] else None
                           for i in lost][:3],
            "users_on_the_others": len(kept), "streams_lost_on_the_others": len(lost),
            "serving_again_s": back_in_s,
            "chats_resumed": sum(r is True for r in resumed),
            "resume_failures": [repr(r)[:300] for r in resumed if r is not True][:5],
            "chats_taken_over_in_log": log.count("taken over by this process"),
            "database_waits_in_log": log.count("the database is away"),
            "database_failures_in_log": log.count("database statement failed")}


async def kill_the_core(server: Server, clients: list[ChatClient]) -> dict:
    core = next(p for p in psutil.Process(server.proc.pid).children()
                if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()))
    starts = await stream_all(clients, "Write a very long story about a lighthouse keeper.")
    killed = time.monotonic()
    core.kill()
    health: list[int] = []

    async def watch_health() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                try:
                    health.append((await http.get(server.url + "/health")).status_code)
                except httpx.HTTPError:
                    health.append(0)
                await asyncio.sleep(0.5)

    watching = asyncio.ensure_future(watch_health())
    cut = await asyncio.gather(*[ended(c, s, 120) for c, s in zip(clients, starts)])
    said = sum(1 for r in cut if r is not None and any(DIED in n for n in r.notes))

    async def until_answered(c: ChatClient) -> float | None:
        while time.monotonic() - killed < 600:
            start = len(c.events)
            await c.emit_message("Just say hi.")
            reply = await ended(c, start, 300)
            tokens = [e.at for e in c.events[start:] if e.name == "stream_token"]
            if reply is not None and reply.shown and not reply.notes and tokens:
                return round(tokens[0] - killed, 2)
            await asyncio.sleep(2)
        return None

    firsts = await asyncio.gather(*[until_answered(c) for c in clients])
    watching.cancel()
    answered = [f for f in firsts if f is not None]

    async def intact(c: ChatClient) -> bool:
        async with c.api() as http:
            threads = (await http.post("/project/threads", json={
                "pagination": {"first": 5}, "filter": {}})).json()["data"]
        return bool(threads)

    kept = await asyncio.gather(*[intact(c) for c in clients[:32]])
    return {"health_checks": len(health), "health_not_200": sum(s != 200 for s in health),
            "replies_cut_said": said, "users": len(clients),
            "first_token_after_kill_s": {
                "first": min(answered, default=None),
                "p50": round(statistics.median(answered), 2) if answered else None,
                "max": max(answered, default=None)},
            "users_answered_again": len(answered),
            "chats_checked_intact": sum(kept), "chats_checked": len(kept)}


def device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"CPU only, {os.cpu_count()} cores"


def targets(result: dict) -> list[dict]:
    fe, core = result["front_end_kill"], result["core_kill"]
    first = core["first_token_after_kill_s"]["max"]
    return [
        {"target": "one front end killed: 0 streams lost on the other front ends",
         "value": fe["streams_lost_on_the_others"],
         "met": fe["streams_lost_on_the_others"] == 0},
        {"target": "the killed front end serving again within 15 s",
         "value": fe["serving_again_s"],
         "met": fe["serving_again_s"] is not None and fe["serving_again_s"] <= 15},
        {"target": "each of its users' chats resumed", "value":
         f'{fe["chats_resumed"]} of {fe["users_on_it"]}',
         "met": fe["chats_resumed"] == fe["users_on_it"]},
        {"target": "core killed: /health answered throughout",
         "value": f'{core["health_not_200"]} of {core["health_checks"]} not 200',
         "met": core["health_not_200"] == 0},
        {"target": "core killed: a new message's first token within 90 s (every user)",
         "value": first, "met": first is not None and first <= 90
         and core["users_answered_again"] == core["users"]},
        {"target": "core killed: every chat intact",
         "value": f'{core["chats_checked_intact"]} of {core["chats_checked"]} checked',
         "met": core["chats_checked_intact"] == core["chats_checked"]},
    ]


async def main(args) -> dict:
    env = {"VCHAT_FRONT_ENDS": str(args.front_ends)} if args.front_ends else {}
    server = Server(env)
    try:
        started = time.monotonic()
        await server.wait_ready(timeout=900)
        start_s = time.monotonic() - started
        count = (await server.get("/ready"))["front_end"]["count"]
        clients = [ChatClient(server.url, "Throughput-first" if i % 2 else "Latency-first")
                   for i in range(args.users)]
        await asyncio.gather(*[c.connect() for c in clients])
        await asyncio.gather(*[c.settings(max_tokens=args.output_len) for c in clients])
        result = {"device": device(), "users": args.users, "output_len": args.output_len,
                  "app_start_s": round(start_s, 1)}
        result["front_end_kill"] = await kill_a_front_end(server, clients, count)
        print(json.dumps(result["front_end_kill"]), flush=True)
        result["core_kill"] = await kill_the_core(server, clients)
        print(json.dumps(result["core_kill"]), flush=True)
        await asyncio.gather(*[c.close() for c in clients], return_exceptions=True)
        log = server.log_path.read_text(errors="replace")
        result["launcher_log"] = [line for line in log.splitlines()
                                  if "front_ends:" in line or "rejoined" in line][-12:]
    finally:
        server.stop()
    result["targets"] = targets(result)
    return result


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=256)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--front-ends", type=int, default=0, help="default: the app's own")
    p.add_argument("--name", default="reliability-cpu")
    return p.parse_args(argv)


def save(result: dict, name: str) -> Path:
    """`result` in bench/results/NAME.json, its targets printed, met or not."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for t in result["targets"]:
        print(f'{"met " if t["met"] else "MISSED"} {t["target"]}: {t["value"]}')
    return path


if __name__ == "__main__":
    args = parse()
    print(save(asyncio.run(main(args)), args.name))
