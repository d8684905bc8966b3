"""Other users' streams, and /health, while the OpenAI API takes the largest request it
accepts (issue 26: 40 MB of history stalled every chat for 10.6-13.9 s, 10 MB for 2.2-2.7 s).

Chat users stream long replies over the socket the whole run; /health is asked every 50 ms.
Each round sends three requests, one after the other, each measured over the window from
its sending to its answer (at least `--window-s`):
- small: one short message;
- large: the largest body the API accepts (full-size messages of the profile's
  `message_chars`, the body just under VCHAT_API_MAX_BODY_MB), ending in that message; its
  oldest turns cannot fit the context and are left out (`--messages N`: instead, at most N
  messages in all, short ones such as "hello number 00042" in whole turns, a user's and an
  assistant's, then the last question; 10,000 is the most a request may hold: issue 52);
- tail: only the turns the large one kept, so the model gets a prompt as long from a
  smaller body (checked by its prompt tokens): large against tail is the app's work on the
  rest of the body, tail against small the model's on the longer prompt.
Each request's messages start with a tag of its own (digits: as many tokens each time), so
that none finds another's prompt in the engine's prefix cache (`--cached` leaves them
alike: the app's part alone). max_tokens 1. Per window: the streams' update gaps (p95,
max) and /health's answer times; with the server started here, the CPU seconds its front
end (the app's process) and its engine's processes spent while the request was taken.
Targets: update gap p95 <= 200 ms and /health within 200 ms while the large one is taken.

    .venv/bin/python -m bench.big_request --users 8 --rounds 5
    .venv/bin/python -m bench.big_request --users 4 --rounds 5 --messages 10000
    .venv/bin/python -m bench.big_request --url http://127.0.0.1:8000 --api-key KEY
                                          (a server already running, its admin `tester`)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np
import psutil

from bench.cli import report, whole_number
from tools.chainlit_client import ChatClient, Server

PROFILE = "Latency-first"
KEY = "bench-big-request-key"
PROBE_S = 0.05
LAST = {"role": "user", "content": "And the last question?"}
KINDS = ("small", "tail", "large")
# POST a file's JSON; print the status, then the answer (the standard library: quick to start).
POSTER = """
import sys, urllib.error, urllib.request
url, key, path = sys.argv[1:]
request = urllib.request.Request(url, data=open(path, "rb").read(), method="POST", headers={
    "Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=900) as answer:
        print(answer.status); print(answer.read().decode())
except urllib.error.HTTPError as refused:
    print(refused.code); print(refused.read().decode())
"""


def body_of(turns: list[list[dict]], tag: str = "") -> bytes:
    """The request: `turns`, then LAST; `tag` starts every message, so that no request
    finds another's prompt in the engine's prefix cache."""
    return json.dumps({"model": PROFILE, "max_tokens": 1, "messages": [
        {**m, "content": tag + m["content"]} for turn in turns for m in turn] + [LAST]}).encode()


def full_turns(body_mb: float, message_chars: int) -> list[list[dict]]:
    """As many full-size turns as fill the body limit (with a tag on each message)."""
    turn = [{"role": "user", "content": ("lorem ipsum " * message_chars)[:message_chars - 20]},
            {"role": "assistant", "content": "noted " * 100}]
    return [turn] * ((int(body_mb * 1e6) - 2000) // (len(json.dumps(turn)) + 40))


def short_turns(messages: int) -> list[list[dict]]:
    """Short messages in whole turns of a user's and an assistant's, each as many tokens
    long: with the last question, at most `messages` in all."""
    return [[{"role": "user", "content": f"hello number {2 * i:05d}"},
             {"role": "assistant", "content": f"hello number {2 * i + 1:05d}"}]
            for i in range((messages - 1) // 2)]


def fresh_tag() -> str:
    return f"[{secrets.randbelow(10 ** 8):08d}] "  # as many tokens each time


def cached_tag() -> str:
    return "[00000000] "


def p(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


class Cpu:
    """CPU seconds spent so far by a server's front end (its processes but the engine's)
    and by its engine (vLLM's processes, named VLLM::...)."""

    def __init__(self, pid: int | None):
        self.root = psutil.Process(pid) if pid else None

    def now(self) -> dict[str, float]:
        if self.root is None:
            return {}
        spent = {"frontend_cpu_s": 0.0, "engine_cpu_s": 0.0}
        for proc in [self.root] + self.root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                kind = "engine_cpu_s" if proc.name().startswith("VLLM") else "frontend_cpu_s"
                spent[kind] += times.user + times.system
        return spent

    @staticmethod
    def since(before: dict, after: dict) -> dict[str, float]:
        return {k: round(after[k] - before[k], 2) for k in after}


class Load:
    """Users streaming without pause, and the /health prober, recording as they go."""

    def __init__(self, url: str, users: int):
        self.url = url
        self.clients = [ChatClient(url, PROFILE) for _ in range(users)]
        self.probes: list[tuple[float, float]] = []  # (sent, seconds to answer)
        self.running = True

    async def start(self) -> list[asyncio.Task]:
        await asyncio.gather(*[c.connect() for c in self.clients])
        await asyncio.gather(*[c.settings(max_tokens=1000, show_stats=False)
                               for c in self.clients])
        return [asyncio.create_task(self._chat(c)) for c in self.clients] + \
            [asyncio.create_task(self._probe())]

    async def _chat(self, client: ChatClient) -> None:
        while self.running:
            await client.send("Write a long story about a lighthouse keeper.", timeout=600)

    async def _probe(self) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            while self.running:
                sent = time.monotonic()
                await http.get(self.url + "/health")
                self.probes.append((sent, time.monotonic() - sent))
                await asyncio.sleep(max(0.0, PROBE_S - (time.monotonic() - sent)))

    def window(self, start: float, end: float) -> dict:
        gaps = []
        for c in self.clients:
            times = [e.at for e in c.events if e.name in ("stream_start", "stream_token")]
            # Every gap that overlaps the window (a stall longer than it counts whole), not
            # the pause between two turns of one user.
            gaps += [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end and
                     not (a < start and b > end and b - a > 30)]
        health = [d for sent, d in self.probes if start <= sent <= end]
        return {"gap_p95_ms": p(gaps, 95), "gap_max_ms": p(gaps, 100), "gaps": len(gaps),
                "health_p95_ms": p(health, 95), "health_max_ms": p(health, 100)}


class Requests:
    """Requests sent from another process (POSTER): sending megabytes from this one would
    delay the events its socket clients record, and be counted as the app's."""

    def __init__(self, url: str, key: str, folder: str):
        self.url, self.key, self.folder = url, key, folder
        self._files = 0

    async def post(self, body: bytes) -> tuple[int, dict, float]:
        self._files += 1
        path = f"{self.folder}/body-{self._files}.json"
        with open(path, "wb") as out:
            out.write(body)
        sent = time.monotonic()
        poster = await asyncio.create_subprocess_exec(
            sys.executable, "-c", POSTER, self.url + "/v1/chat/completions", self.key, path,
            stdout=asyncio.subprocess.PIPE)
        answer, _ = await poster.communicate()
        status, _, text = answer.decode().partition("\n")
        with contextlib.suppress(ValueError):
            return int(status), json.loads(text), sent
        return int(status or 0), {}, sent

    async def prompt_tokens(self, body: bytes) -> int:
        status, answer, _ = await self.post(body)
        if status != 200:
            raise RuntimeError(f"the API answered {status}: {answer}")
        return answer["usage"]["prompt_tokens"]


def bodies(turns: list[list[dict]], kept: int, tag) -> dict[str, bytes]:
    """small, tail and large, each tagged afresh: the tail holds the `kept` newest turns."""
    return {"small": body_of([], tag()), "tail": body_of(turns[len(turns) - kept:] if kept
                                                         else [], tag()),
            "large": body_of(turns, tag())}


async def kept_turns(requests: Requests, turns: list[list[dict]], tag) -> int:
    """How many turns the large request's prompt keeps (from the prompt tokens of no turn,
    one turn and all of them)."""
    none, one, large = [await requests.prompt_tokens(body_of(turns[:n], tag()))
                        for n in (0, 1, len(turns))]
    return (large - none) // max(1, one - none)


async def measure(url: str, key: str, users: int, rounds: int, turns: list[list[dict]],
                  window_s: float, warmup_s: float, tag, cpu: Cpu) -> tuple[dict, list[dict]]:
    load = Load(url, users)
    tasks = await load.start()
    out = []
    try:
        await asyncio.sleep(warmup_s)
        with tempfile.TemporaryDirectory(prefix="big-request-") as folder:
            requests = Requests(url, key, folder)
            kept = await kept_turns(requests, turns, tag)
            for n in range(rounds):
                taken, sent_bodies = {}, bodies(turns, kept, tag)
                for kind in KINDS:
                    before = cpu.now()
                    status, answer, sent = await requests.post(sent_bodies[kind])
                    took, spent = time.monotonic() - sent, Cpu.since(before, cpu.now())
                    window = max(window_s, took)
                    await asyncio.sleep(max(0.0, window - took) + 1.0)  # its last gaps
                    taken[kind] = {"request_s": round(took, 3), "status": status,
                                   "prompt_tokens": answer.get("usage", {}).get(
                                       "prompt_tokens"), **spent,
                                   **load.window(sent, sent + window)}
                out.append(taken)
                print(f"round {n + 1}: " + "; ".join(
                    f"{k} {v['status']} in {v['request_s']:.2f} s ({v['prompt_tokens']} prompt "
                    f"tokens, CPU s front end {v.get('frontend_cpu_s')} engine "
                    f"{v.get('engine_cpu_s')}): gap p95 {v['gap_p95_ms']} max "
                    f"{v['gap_max_ms']} ms, /health p95 {v['health_p95_ms']} max "
                    f"{v['health_max_ms']} ms" for k, v in taken.items()), flush=True)
    finally:
        load.running = False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.gather(*[c.close() for c in load.clients])
    return {"kept_turns": kept, **{k: len(b) for k, b in sent_bodies.items()}}, out


def summary(rounds: list[dict]) -> dict:
    def median(kind: str, key: str):
        values = [r[kind][key] for r in rounds if r[kind].get(key) is not None]
        return statistics.median(values) if values else None

    def ratio(a: str, b: str):
        values = [r[a]["gap_p95_ms"] / r[b]["gap_p95_ms"] for r in rounds
                  if r[a]["gap_p95_ms"] and r[b]["gap_p95_ms"]]
        return round(statistics.median(values), 3) if values else None

    return {"median_gap_p95_ratio_large_to_tail": ratio("large", "tail"),
            "median_gap_p95_ratio_large_to_small": ratio("large", "small"),
            **{f"median_{kind}_{key}": median(kind, key) for kind in KINDS
               for key in ("request_s", "frontend_cpu_s", "engine_cpu_s", "gap_p95_ms",
                           "gap_max_ms", "health_p95_ms", "health_max_ms")}}


async def run(args) -> dict:
    server = None
    url, key = args.url, args.api_key
    if url is None:
        server = Server({"VCHAT_API_KEY": KEY, "VCHAT_BENCH_IGNORE_EOS": "1"})
        url, key = server.url, KEY
    try:
        if server is not None:
            await server.wait_ready(timeout=900)
        turns = short_turns(args.messages) if args.messages else \
            full_turns(args.body_mb, args.message_chars)
        print(f"the large request: {len(body_of(turns, cached_tag())) / 1e6:.2f} MB in "
              f"{len(turns)} turns ({sum(map(len, turns)) + 1} messages), {args.users} users "
              "streaming", flush=True)
        sizes, rounds = await measure(url, key, args.users, args.rounds, turns, args.window_s,
                                      args.warmup_s, cached_tag if args.cached else fresh_tag,
                                      Cpu(server.proc.pid if server else None))
        return {"users": args.users, "body_bytes": sizes, "window_s": args.window_s,
                "cached": args.cached, "messages": args.messages,
                "rounds": rounds, **summary(rounds)}
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=whole_number, default=8)
    parser.add_argument("--rounds", type=whole_number, default=5)
    parser.add_argument("--body-mb", type=float, default=3.99,
                        help="the large request's size (the shipped limit: 4 MB)")
    parser.add_argument("--message-chars", type=whole_number, default=100_000)
    parser.add_argument("--messages", type=whole_number,
                        help="the large request: this many short messages instead (at most "
                        "10,000: the API's MAX_MESSAGES)")
    parser.add_argument("--window-s", type=float, default=2.0,
                        help="each window at least, from its request's sending")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--cached", action="store_true",
                        help="the same tag on every request: the engine finds the prompt cached")
    parser.add_argument("--url", help="a server already running (default: start one)")
    parser.add_argument("--api-key", default=KEY)
    parser.add_argument("--out", help="also write the result (JSON) here")
    args = parser.parse_args()
    report(asyncio.run(run(args)), args.out)


if __name__ == "__main__":
    main()
