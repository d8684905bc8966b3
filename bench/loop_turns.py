"""What a message's way to its turn costs on a busy event loop: its login check and its
socket events, each done the ways the app has done them, in neighbouring rounds.

Every chat session shares one event loop; under a saturated H200 it also runs ~270
streams' updates (~2,000 a second, near a full core: BENCHMARKS.md, run I). A coroutine
that awaits something which yields to the loop waits behind everything ready; one that
hands work to another thread waits for the GIL as well. The ways:

- the login check (store/sessions.py `is_live`) on SQLite: through aiosqlite (the app
  before issue 27's 2026-12-04 change: connection, cursor, execute, close, each an awaited
  call into its thread); through a thread of our own per query; in line on the loop's
  thread (store/schema.py `Reader`, shipped);
- one Socket.IO event to one browser (Chainlit sends several before a turn's first token):
  python-socketio's emit (a task per recipient, awaited), or chat/emits.py's in line.

The load is a stand-in, not the app: `--streams` tasks that each spend `--work-us` of CPU
per update and send one every `--interval-s` (the defaults: 270 streams at the GPU's pace,
0.135 s, ~0.8 of a core). Run:
    .venv/bin/python -m bench.loop_turns --rounds 5 --out bench/results/loop-turns-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.sockets import socket_server


class TurnCounter:
    """Counts the event loop's turns: a callback that schedules itself again each turn."""

    def __init__(self):
        self.turns = 0
        self._running = False

    def start(self) -> None:
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False

    def _tick(self) -> None:
        if self._running:
            self.turns += 1
            asyncio.get_running_loop().call_soon(self._tick)


async def stream(stop: asyncio.Event, work_s: float, interval_s: float, offset_s: float):
    """One stand-in stream: `work_s` of CPU every `interval_s`."""
    await asyncio.sleep(offset_s)
    while not stop.is_set():
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(interval_s)


async def timed(step, counter: TurnCounter, repeats: int) -> dict:
    """`step()` awaited `repeats` times: its median time and loop turns."""
    times, turns = [], []
    for _ in range(repeats):
        before, started = counter.turns, time.perf_counter()
        await step()
        times.append(time.perf_counter() - started)
        turns.append(counter.turns - before)
    return {"ms_p50": statistics.median(times) * 1000, "turns_p50": statistics.median(turns)}


class ThreadReads:
    """A thread per query on SQLite's reading connections (this change's first form)."""

    def __init__(self, url):
        from sqlalchemy import create_engine, event

        from store.schema import _sqlite_reader_settings
        self.sync_engine = create_engine(f"sqlite:///{url.database}", pool_size=2,
                                         max_overflow=0)
        event.listen(self.sync_engine, "connect", _sqlite_reader_settings)
        self.threads = ThreadPoolExecutor(2)

    async def rows(self, statement, params=None) -> list:
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, self._rows, statement, params or {})

    def _rows(self, statement, params) -> list:
        with self.sync_engine.connect() as conn:
            return conn.execute(statement, params).all()

    async def dispose(self) -> None:
        self.threads.shutdown()
        self.sync_engine.dispose()


async def login_checks(folder: Path):
    """The ways of checking a login session, on one SQLite database with a live one."""
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import create_async_engine

    from store.accounts import Accounts
    from chat.data_layer import ChatDataLayer
    from store.schema import Reader, _sqlite_reader_settings, migrate
    from store.sessions import LoginSessions

    layer = ChatDataLayer(f"sqlite+aiosqlite:///{folder / 'chat.db'}")
    await migrate(layer.engine)
    await Accounts(layer.engine).add("alice", "correct horse battery")
    session = await LoginSessions(layer.engine, layer.reader).open("alice", 3600)
    aiosqlite = create_async_engine(layer.engine.url, pool_size=2, max_overflow=0)
    event.listen(aiosqlite.sync_engine, "connect", _sqlite_reader_settings)
    threads = ThreadReads(layer.engine.url)
    ways = {"aiosqlite": LoginSessions(layer.engine, Reader(aiosqlite, own=False)),
            "a thread per query": LoginSessions(layer.engine, threads),
            "in line": LoginSessions(layer.engine, layer.reader)}

    async def close():
        await aiosqlite.dispose()
        await threads.dispose()
        await layer.close()
    return {name: (lambda s=s: s.is_live(session, "alice")) for name, s in ways.items()}, close


async def socket_emits():
    """The two ways of sending an event to one socket (no transport: sent = queued)."""
    ways = {}
    for name, in_line in (("socketio's emit", False), ("in line", True)):
        sio, sid, eio_socket = await socket_server(in_line)

        async def send(sio=sio, sid=sid, eio_socket=eio_socket):
            await sio.emit("stream_token", {"id": "m1", "token": "Hel"}, to=sid)
            eio_socket.queue.get_nowait()
        ways[name] = send
    return ways


async def measure(args) -> dict:
    result = {"streams": args.streams, "work_us": args.work_us, "interval_s": args.interval_s,
              "rounds": args.rounds, "repeats": args.repeats, "steps": {}}
    with tempfile.TemporaryDirectory() as folder:
        checks, close = await login_checks(Path(folder))  # set up before the loop is busy
        steps = {"login check": checks, "one socket event": await socket_emits()}
        for ways in steps.values():
            for way in ways.values():  # warm: connections open, code loaded
                await way()
        counter, stop = TurnCounter(), asyncio.Event()
        streams = [asyncio.create_task(stream(stop, args.work_us / 1e6, args.interval_s,
                                              args.interval_s * i / args.streams))
                   for i in range(args.streams)]
        await asyncio.sleep(args.interval_s * 2)  # every stream under way
        counter.start()
        try:
            for step, ways in steps.items():
                rounds = []
                for n in range(args.rounds):  # each round in the other order
                    order = list(ways.items())[::1 if n % 2 == 0 else -1]
                    rounds.append({name: await timed(way, counter, args.repeats)
                                   for name, way in order})
                first = next(iter(ways))
                result["steps"][step] = {"rounds": rounds, "ways": {name: {
                    "ms_p50": statistics.median(r[name]["ms_p50"] for r in rounds),
                    "turns_p50": statistics.median(r[name]["turns_p50"] for r in rounds),
                    "time_ratio_to_first": statistics.median(
                        r[name]["ms_p50"] / r[first]["ms_p50"] for r in rounds)}
                    for name in ways}}
        finally:
            stop.set()
            counter.stop()
            await asyncio.gather(*streams)
            await close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=270, help="stand-in streams on the loop")
    p.add_argument("--work-us", type=float, default=400.0, help="CPU per update")
    p.add_argument("--interval-s", type=float, default=0.135, help="between updates")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=21, help="awaits per way in a round")
    p.add_argument("--out", help="write the result (JSON) here")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    for step, figures in result["steps"].items():
        print(f"{step} (medians of {args.rounds} rounds; time / the first way's, per round):")
        for name, way in figures["ways"].items():
            print(f"  {name}: {way['ms_p50']:.2f} ms, {way['turns_p50']:g} loop turns, "
                  f"{way['time_ratio_to_first']:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
