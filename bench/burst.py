"""How long the app takes to start many turns at once: every session sends a message at the
same moment, and the time to each one's first streamed text is what the app's per-turn work
costs when nothing else waits (the STAND-IN engine, no model; its first token is immediate).

`chainlit run app.py` with the stand-in and the shipped profiles, all sessions' turns
running at once (bench/ui_ceiling.py's profiles); `--rounds` bursts of short replies, one
line per burst. Before chat/stalls.py, 256 sessions waited ~1.1 s here (BENCHMARKS.md).
With VCHAT_FRONT_ENDS=N set, also how many sessions each front end held (the turn log).

    .venv/bin/python -m bench.burst --sessions 256 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from tools import turn_log
from bench.cli import whole_number
from bench.metrics import spread
from bench.ui_ceiling import PROFILE, all_at_once
from service.loop import freeze_heap
from tools.chainlit_client import ChatClient, Server


async def bursts(sessions: int, rounds: int) -> list[dict]:
    server = Server({"VCHAT_ENGINE": "stand-in", "VCHAT_BENCH_IGNORE_EOS": "1",
                     "VCHAT_PROFILES": str(all_at_once(sessions))})
    try:
        await server.wait_ready(timeout=120)
        clients = [ChatClient(server.url, PROFILE) for _ in range(sessions)]
        await asyncio.gather(*[c.connect() for c in clients])
        await asyncio.gather(*[c.settings(max_tokens=4, show_stats=False) for c in clients])
        freeze_heap()  # this process's collections would delay the clients, not the app
        out = []
        for r in range(rounds):
            starts = [len(c.events) for c in clients]
            sent = time.monotonic()
            await asyncio.gather(*[c.emit_message(f"Hello, number {i} of burst {r}.")
                                   for i, c in enumerate(clients)])
            ends = await asyncio.gather(*[c.wait_for("task_end", since=s, timeout=120)
                                          for c, s in zip(clients, starts)])
            texts = [[e.at for e in c.events[s:end] if e.name in ("stream_start", "stream_token")]
                     for c, s, end in zip(clients, starts, ends)]
            out.append({
                "first_text_ms": spread([t[0] - sent for t in texts]),
                # From the reply's last text to the turn's end (the next message allowed): the
                # turn's closing work, the wait for its writes to the database among it.
                "closing_ms": spread([c.events[end].at - t[-1]
                                      for c, t, end in zip(clients, texts, ends)])})
            print(f"burst {r + 1}: first text after {out[-1]['first_text_ms']} ms, "
                  f"turn closed {out[-1]['closing_ms']} ms after the last text", flush=True)
        await asyncio.gather(*[c.close() for c in clients])
        # With several front ends (VCHAT_FRONT_ENDS): how the sessions were spread over them.
        fronts = turn_log.summary(turn_log.turns(server.log_path.read_text())).get("front_ends")
        if fronts:
            out[-1]["sessions_per_front_end"] = [f["turns"] // rounds
                                                 for f in fronts.values()]
            print(f"sessions per front end: {out[-1]['sessions_per_front_end']}", flush=True)
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=whole_number, default=256)
    parser.add_argument("--rounds", type=whole_number, default=4)
    args = parser.parse_args()
    runs = asyncio.run(bursts(args.sessions, args.rounds))
    print(json.dumps({"sessions": args.sessions, "bursts": runs, **{
        f"median_{key}_p50": statistics.median(r[key]["p50"] for r in runs)
        for key in ("first_text_ms", "closing_ms")}}))


if __name__ == "__main__":
    main()
