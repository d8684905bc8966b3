"""Reproduce: the app refuses socket connections after roughly 80-100 sessions.

Starts `chainlit run app.py` (test settings), then connects N headless sessions at once,
closes them, and repeats. Seen on 2026-11-30 (Python 3.11.7, chainlit 2.12.0): rounds of 32
pass twice, then connects time out ("One or more namespaces failed to connect") and the
server log shows `RecursionError: maximum recursion depth exceeded while decoding a JSON
object` in engineio's packet decoding at a shallow stack. Same with
UVICORN_WS_PROTOCOL=wsproto and with UVICORN_WS_PER_MESSAGE_DEFLATE=false. Cause not found
yet (tracked in the reliability issue).

    .venv/bin/python -m bench.many_sessions --sessions 32 --rounds 4
"""

import argparse
import asyncio
import time

from tests.chainlit_client import ChatClient, Server


async def main(args) -> None:
    server = Server()
    try:
        await server.wait_ready()
        for round_ in range(1, args.rounds + 1):
            clients = [ChatClient(server.url, "Latency-first") for _ in range(args.sessions)]
            started = time.monotonic()
            results = await asyncio.gather(*[c.connect() for c in clients],
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, Exception)]
            print(f"round {round_}: {args.sessions} sessions, {len(failed)} failed to connect "
                  f"({time.monotonic() - started:.1f} s)", flush=True)
            for c in clients:
                if c.sio.connected:
                    await c.close()
    finally:
        server.stop()
        log = server.log_path.read_text(errors="replace")
        print(f"server log {server.log_path}: {log.count('RecursionError')} RecursionError lines")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
