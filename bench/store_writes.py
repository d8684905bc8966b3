"""What the stored chat costs a burst of turns: N turns at once, each writing what
Chainlit writes for a turn (the user's message, the `on_message` run step, the reply when
it starts streaming; after a second of streaming, the finished reply and the run step),
through chat/data_layer.py into a new SQLite database (or DATABASE_URL's).

    .venv/bin/python -m bench.store_writes --turns 256

Prints the wall time and, per turn, how long its first writes and its last writes took to
land (the app's turn waits for neither; its save check waits for the last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid

from chainlit.context import init_http_context
from chainlit.user import User

from bench.metrics import spread
from chat.clock import CLOCK
from chat.data_layer import ChatDataLayer
from store.schema import database_url, migrate

STREAMING_S = 1.0


def step(thread_id: str, name: str, kind: str, output: str, streaming: bool = False) -> dict:
    return {"id": str(uuid.uuid4()), "threadId": thread_id, "name": name, "type": kind,
            "output": output, "streaming": streaming, "createdAt": CLOCK.utc_now(),
            "start": CLOCK.utc_now(), "metadata": {}, "tags": None, "isError": False}


async def burst(turns: int) -> dict:
    init_http_context()
    store = ChatDataLayer(database_url(tempfile.mkdtemp(prefix="vchat-bench-")))
    await migrate(store.engine)
    user = await store.create_user(User(identifier="bench"))

    async def turn() -> tuple[float, float]:
        thread_id = str(uuid.uuid4())
        await store.update_thread(thread_id, user_id=user.id, name="A chat")
        asked = step(thread_id, "User", "user_message", "A question of some words. " * 8)
        run = step(thread_id, "on_message", "run", "")
        reply = step(thread_id, "Assistant", "assistant_message", "", streaming=True)
        started = time.monotonic()
        await asyncio.gather(store.create_step(asked), store.create_step(run))
        await store.create_step(reply)
        first = time.monotonic() - started
        await asyncio.sleep(STREAMING_S)
        reply.update(output="word " * 256, streaming=False)
        run["end"] = CLOCK.utc_now()
        ended = time.monotonic()
        await asyncio.gather(store.update_step(reply), store.update_step(run))
        return first, time.monotonic() - ended

    started = time.monotonic()
    timings = await asyncio.gather(*[turn() for _ in range(turns)])
    wall = time.monotonic() - started
    await store.engine.dispose()

    return {"turns": turns, "wall_s": round(wall, 2),
            "writes_s": round(wall - STREAMING_S, 2),  # the wall less the streaming pause
            "first_writes_ms": spread([t[0] for t in timings]),
            "last_writes_ms": spread([t[1] for t in timings])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(burst(args.turns))))


if __name__ == "__main__":
    main()
