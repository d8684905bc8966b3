"""How long the app takes to start many turns at once: every session sends a message at the
same moment, and the time to each one's first streamed text is what the app's per-turn work
costs when nothing else waits (the STAND-IN engine, no model; its first token is immediate).

`chainlit run app.py` with the stand-in and the shipped profiles, all sessions' turns
running at once (bench/ui_ceiling.py's profiles); `--rounds` bursts of short replies, one
line per burst. Before chat/stalls.py, 256 sessions waited ~1.1 s here (BENCHMARKS.md).

    .venv/bin/python -m bench.burst --sessions 256 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.cli import whole_number
from bench.ui_ceiling import PROFILE, all_at_once
from chat.stalls import freeze_heap
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
            await asyncio.gather(*[c.wait_for("task_end", since=s, timeout=120)
                                   for c, s in zip(clients, starts)])
            first = sorted(
                next(e.at for e in c.events[s:] if e.name in ("stream_start", "stream_token"))
                - sent for c, s in zip(clients, starts))
            out.append({"first_text_ms": {
                "min": round(first[0] * 1000), "p50": round(statistics.median(first) * 1000),
                "max": round(first[-1] * 1000)}})
            print(f"burst {r + 1}: first text after {out[-1]['first_text_ms']} ms", flush=True)
        await asyncio.gather(*[c.close() for c in clients])
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=whole_number, default=256)
    parser.add_argument("--rounds", type=whole_number, default=4)
    args = parser.parse_args()
    runs = asyncio.run(bursts(args.sessions, args.rounds))
    p50s = [r["first_text_ms"]["p50"] for r in runs]
    print(json.dumps({"sessions": args.sessions, "bursts": runs,
                      "median_p50_ms": statistics.median(p50s)}))


if __name__ == "__main__":
    main()
