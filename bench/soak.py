"""Mixed traffic for a long while (issue 57: an hour on the GPU), sampled every minute: the
app as `make run` starts it, and at once

- chat users of both profiles: short and long prompts, Stop pressed now and then, a
  Regenerate, a new chat every few turns, a small document attached now and then;
- API users: streamed chat completions with a key, both models;
- guests joining through one invite link, one every `--guest-every-s`, each asking once.

Every `--sample-s`: each process's RSS (the launcher, its front ends, the engine core and
its workers), the GPU's memory in use, the event loops' lag (p95 of the window, from
/metrics), and the window's TTFT and gap p95 (turns that ended in it, measured by the
clients), turns, errors and 5xx answers. At the end, the traffic stopped: no turn left
running on any front end. Writes bench/results/NAME.json (with `targets`) and NAME.png.

    python -m bench.soak --minutes 60 --chat-users 48 --api-users 16 --name gpu-soak
    scripts/gpu_run.sh OUT soak --minutes 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.reliability import device, ready_fronts, save
from chat.turns import REGENERATE
from tools.chainlit_client import ROOT, ChatClient, Server

SHORT = "Say something kind about the sea in two sentences."
LONG = ("Here is a report to summarize. " + "The harbour kept its lights on through the "
        "storm, and the keepers wrote down each ship that passed. " * 60).strip()
FINE = ("Reading your message", "Task manually stopped.",  # notes that are not errors
        "no longer fits the model's context")


class Tally:
    """What the clients saw, stamped with when each turn ended."""

    def __init__(self):
        self.turns: list[tuple[float, float | None, list[float]]] = []  # (end, ttft, gaps)
        self.errors: list[tuple[float, str]] = []
        self.server_errors = 0  # the API's 5xx answers

    def turn(self, sent: float, tokens: list[float]) -> None:
        gaps = [b - a for a, b in zip(tokens, tokens[1:])]
        self.turns.append((time.monotonic(), tokens[0] - sent if tokens else None, gaps))

    def error(self, what: str) -> None:
        self.errors.append((time.monotonic(), what[:300]))


def tokens_of(client: ChatClient, start: int, end: int) -> list[float]:
    return [e.at for e in client.events[start:end] if e.name == "stream_token"]


async def chat_user(url: str, i: int, until: float, tally: Tally, max_tokens: int) -> None:
    rng = random.Random(i)
    c = ChatClient(url, "Throughput-first" if i % 2 else "Latency-first")
    await c.connect()
    await c.settings(max_tokens=max_tokens, show_stats=False)
    n = 0
    while time.monotonic() < until:
        n += 1
        try:
            files = []
            if n % 9 == 0:  # a small document, now and then
                answer = await c.attach(f"notes-{n}.txt", (SHORT + "\n").encode() * 20,
                                        "text/plain")
                files = [answer.json()["id"]] if answer.status_code == 200 else []
            start, sent = len(c.events), time.monotonic()
            await c.emit_message(LONG if n % 4 == 0 else SHORT, files)
            if n % 5 == 0:  # Stop, once it streams
                await c.wait_for_tokens(start, 3, timeout=300)
                await c.stop()
            end = await c.wait_for("task_end", since=start, timeout=600)
            reply = c.collect(start, end + 1)
            tally.turn(sent, tokens_of(c, start, end))
            if [x for x in reply.notes if not any(fine in x for fine in FINE)]:
                tally.error(f"chat: {reply.notes}")
            if n % 7 == 0 and reply.reply:  # Regenerate
                button = [a for a in c.actions(reply.reply["id"]) if a["name"] == REGENERATE]
                if button:
                    sent = time.monotonic()
                    start = await c.press(button[0])
                    end = await c.wait_for("task_end", since=start, timeout=600)
                    tally.turn(sent, tokens_of(c, start, end))
            if n % 10 == 0:
                await c.new_chat()
        except Exception as exc:  # counted, and the user goes on
            tally.error(f"chat user {i}: {exc!r}")
        await asyncio.sleep(rng.uniform(0.5, 3.0))
    await c.close()


async def api_user(url: str, key: str, i: int, until: float, tally: Tally,
                   max_tokens: int) -> None:
    rng = random.Random(1000 + i)
    model = "Throughput-first" if i % 2 else "Latency-first"
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 headers={"authorization": f"Bearer {key}"}) as http:
        n = 0
        while time.monotonic() < until:
            n += 1
            body = {"model": model, "stream": True, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": LONG if n % 3 == 0 else SHORT}]}
            sent, tokens = time.monotonic(), []
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                    if answer.status_code >= 500:
                        tally.server_errors += 1
                    if answer.status_code != 200:
                        tally.error(f"api {answer.status_code}: {(await answer.aread())[:200]}")
                    else:
                        async for line in answer.aiter_lines():
                            if line.startswith("data: {") and '"content":"' in line:
                                tokens.append(time.monotonic())
                        tally.turn(sent, tokens)
            except httpx.HTTPError as exc:
                tally.error(f"api user {i}: {exc!r}")
            await asyncio.sleep(rng.uniform(0.5, 3.0))


async def guests(url: str, token: str, until: float, every_s: float, tally: Tally) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                joined = await http.post(f"/invite/{token}", data={"name": f"Guest {n}"})
            if joined.status_code != 303:
                tally.error(f"guest join {joined.status_code}")
            else:
                g = ChatClient(url, "Latency-first")
                await g.connect_with(joined.cookies["access_token"])
                start, sent = len(g.events), time.monotonic()
                reply = await g.send("Hello, I just joined.")
                tally.turn(sent, tokens_of(g, start, len(g.events)))
                if not reply.shown:
                    tally.error(f"guest: {reply.notes}")
                await g.close()
        except Exception as exc:
            tally.error(f"guest {n}: {exc!r}")
        await asyncio.sleep(every_s)


def processes(launcher: int) -> dict[str, float]:
    """RSS (MB) of the launcher and each process under it, by a stable name."""
    out = {}
    root = psutil.Process(launcher)
    for p in [root, *root.children(recursive=True)]:
        try:
            name = "launcher" if p.pid == launcher else p.name()  # vLLM names its own
            out[f"{name}:{p.pid}"] = round(p.memory_info().rss / 2**20, 1)
        except psutil.Error:
            pass
    return out


def gpu_memory_mb() -> float | None:
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30).stdout
        return float(text.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def lag_buckets(metrics: str) -> dict[float, float]:
    """The event loops' lag histogram, every front end's buckets added: {le: count}."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "vchat_event_loop_lag_seconds_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


def p95(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return round(values[int(0.95 * (len(values) - 1))], 4) if values else None


def bucket_p95(now: dict, before: dict) -> float | None:
    counts = sorted((le, now[le] - before.get(le, 0.0)) for le in now)
    total = counts[-1][1] if counts else 0
    return next((le for le, n in counts if n >= 0.95 * total), None) if total else None


async def sample(server: Server, tally: Tally, since: float, lag_before: dict) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(server.url + "/metrics")).text
    lag = lag_buckets(metrics)
    window = [t for t in tally.turns if t[0] >= since]
    return {"t_s": None, "rss_mb": processes(server.proc.pid), "gpu_mb": gpu_memory_mb(),
            "turns": len(window), "ttft_p95_s": p95([t[1] for t in window]),
            "gap_p95_s": p95([g for t in window for g in t[2]]),
            "loop_lag_p95_s": bucket_p95(lag, lag_before),
            "errors": len([e for e in tally.errors if e[0] >= since]),
            "server_errors_so_far": tally.server_errors}, lag


async def left_running(server: Server, count: int) -> int:
    """Turns still counted on any front end, asked of each (new connections)."""
    seen = await ready_fronts(server.url, count, tries=50 * count)
    return sum((e.get("unfinished_requests") or 0) + (e.get("admitted") or 0)
               for h in seen.values() for e in h["engines"].values())


def store_command(server: Server, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "store", *args], env=server.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


def window(samples: list[dict], start_s: float, end_s: float, key: str) -> float | None:
    values = [s[key] for s in samples if start_s <= s["t_s"] <= end_s and s[key] is not None]
    return max(values) if values else None


def targets(result: dict) -> list[dict]:
    """The issue's, on a run of any length: its minutes 10 and 60 are 1/6 and the end of
    the run, minutes 5-15 are 1/12 to 1/4, the last 10 minutes the last sixth."""
    samples, run = result["samples"], result["minutes"] * 60
    early = next((s for s in samples if s["t_s"] >= run / 6), samples[0])
    last = samples[-1]
    growth = {name: round(last["rss_mb"][name] / mb - 1, 4)
              for name, mb in early["rss_mb"].items() if name in last["rss_mb"] and mb > 0}
    out = [{"target": "RSS growth of every process < 5% between minute 10 and 60 (scaled)",
            "value": max(growth.values(), default=None),
            "met": bool(growth) and max(growth.values()) < 0.05, "each": growth}]
    for key in ("ttft_p95_s", "gap_p95_s"):
        before = window(samples, run / 12, run / 4, key)
        after = window(samples, run * 5 / 6, run, key)
        ratio = round(after / before, 3) if before and after else None
        out.append({"target": f"{key} of the last 10 minutes within 1.2x of minutes 5-15 "
                    "(scaled)", "value": ratio, "met": ratio is not None and ratio <= 1.2})
    out.append({"target": "0 5xx", "value": result["server_errors"],
                "met": result["server_errors"] == 0})
    out.append({"target": "no error seen by a client", "value": len(result["errors"]),
                "met": not result["errors"]})
    out.append({"target": "0 turns left running", "value": result["turns_left_running"],
                "met": result["turns_left_running"] == 0})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name in samples[-1]["rss_mb"]:
        axes[0][0].plot(minutes, [s["rss_mb"].get(name) for s in samples], label=name)
    axes[0][0].set_title("RSS per process (MB)")
    axes[0][0].legend(fontsize=6)
    axes[0][1].plot(minutes, [s["gpu_mb"] for s in samples])
    axes[0][1].set_title("GPU memory used (MB)")
    for key in ("ttft_p95_s", "gap_p95_s"):
        axes[1][0].plot(minutes, [s[key] for s in samples], label=key)
    axes[1][0].set_title("client-side p95 per window (s)")
    axes[1][0].legend()
    axes[1][1].plot(minutes, [s["loop_lag_p95_s"] for s in samples])
    axes[1][1].set_title("event loops' lag p95 per window (s)")
    for ax in axes.flat:
        ax.set_xlabel("minutes")
    fig.suptitle(f"{result['device']}: {result['minutes']} min, {result['chat_users']} chat "
                 f"+ {result['api_users']} API users")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


async def main(args) -> dict:
    env = {"VCHAT_API_KEY": "soak-operator-key"}
    if args.front_ends:
        env["VCHAT_FRONT_ENDS"] = str(args.front_ends)
    server = Server(env)
    tally, samples = Tally(), []
    try:
        await server.wait_ready(timeout=900)
        count = ((await server.get("/ready")).get("front_end") or {}).get("count", 1)
        token = store_command(server, "invites", "add", "--uses", "10000", "--expires",
                              "12h").rsplit("/invite/", 1)[1]
        start = time.monotonic()
        until = start + args.minutes * 60
        users = [chat_user(server.url, i, until, tally, args.max_tokens)
                 for i in range(args.chat_users)]
        users += [api_user(server.url, env["VCHAT_API_KEY"], i, until, tally, args.max_tokens)
                  for i in range(args.api_users)]
        users.append(guests(server.url, token, until, args.guest_every_s, tally))
        traffic = asyncio.gather(*users)
        lag: dict = {}
        while time.monotonic() < until:
            since = time.monotonic()
            await asyncio.sleep(min(args.sample_s, max(0.0, until - since)))
            row, lag = await sample(server, tally, since, lag)
            row["t_s"] = round(time.monotonic() - start, 1)
            samples.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rss_mb"}), flush=True)
        await traffic
        await asyncio.sleep(5)
        left = await left_running(server, count)
    finally:
        server.stop()
    return {"device": device(), "minutes": args.minutes, "chat_users": args.chat_users,
            "api_users": args.api_users, "front_ends": count, "max_tokens": args.max_tokens,
            "turns": len(tally.turns), "server_errors": tally.server_errors,
            "errors": tally.errors[:20], "turns_left_running": left, "samples": samples}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--sample-s", type=float, default=60)
    p.add_argument("--chat-users", type=int, default=48)
    p.add_argument("--api-users", type=int, default=16)
    p.add_argument("--guest-every-s", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--front-ends", type=int, default=0, help="default: the app's own")
    p.add_argument("--name", default="soak-cpu")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    result = asyncio.run(main(args))
    result["targets"] = targets(result)
    plot(result, save(result, args.name).with_suffix(".png"))
