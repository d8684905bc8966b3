"""A room's turns taking their places in the guests' limits (store/admission.py) at once:
`--guests` guests who joined from one address (as a conference room's network is) each ask
for a turn at the same moment, spread over `--processes` processes as over the app's front
ends, on one SQLite database. Prints the wall time of the whole burst and each process's
median and slowest wait: the time the last guest's message waits before its turn begins.

    python -m bench.holds --guests 1000 --processes 1 4 --name holds-cpu

Writes bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
import uuid

from bench.reliability import device, save
from store.admission import Admission, GuestLimits
from store.invites import Invites, Joiner
from store.schema import connect, database_url, migrate

# The shipped defaults' guest limits (engine/settings.py), the address's raised for a room.
LIMITS = GuestLimits(chats=5, turns_per_minute=10, address_turns_per_minute=4000,
                     address_tokens=20_000_000)
ADDRESS = "203.0.113.5"


async def join(folder: str, guests: int) -> list[str]:
    engine = connect(database_url(folder, env={}))
    try:
        await migrate(engine)
        invites = Invites(engine)
        _, token = await invites.add(guests, 3600)
        return [(await invites.redeem(token, f"Guest {i}", joiner=Joiner(
            ADDRESS, per_hour=guests + 1))).identifier for i in range(guests)]
    finally:
        await engine.dispose()


async def ask(folder: str, identifiers: list[str]) -> dict:
    engine = connect(database_url(folder, env={}))
    admission = Admission(engine, LIMITS)
    waits: list[float] = []

    async def one(identifier: str) -> None:
        start = time.monotonic()
        await admission.take(identifier, profile="Throughput-first", source="chat",
                             reserve=256, thread_id=str(uuid.uuid4()), starts_chat=True)
        waits.append(time.monotonic() - start)

    start = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in identifiers))
    finally:
        await engine.dispose()
    return {"wall_s": round(time.monotonic() - start, 3),
            "wait_p50_s": round(statistics.median(waits), 3), "wait_max_s": round(max(waits), 3)}


def process_main(folder: str, identifiers: list[str], go, answers) -> None:
    go.wait()
    answers.put(asyncio.run(ask(folder, identifiers)))


def burst(guests: int, processes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="vchat-holds-") as folder:
        identifiers = asyncio.run(join(folder, guests))
        context = multiprocessing.get_context("spawn")
        go, answers = context.Event(), context.Queue()
        procs = [context.Process(target=process_main, args=(
            folder, identifiers[p::processes], go, answers)) for p in range(processes)]
        for proc in procs:
            proc.start()
        time.sleep(3)  # every process up and waiting
        start = time.monotonic()
        go.set()
        each = [answers.get(timeout=600) for _ in procs]
        wall = time.monotonic() - start
        for proc in procs:
            proc.join(30)
    return {"guests": guests, "processes": processes, "wall_s": round(wall, 3),
            "wait_p50_s": round(statistics.median(e["wait_p50_s"] for e in each), 3),
            "wait_max_s": max(e["wait_max_s"] for e in each), "each": each}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guests", type=int, default=1000)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--name", default="holds-cpu")
    args = p.parse_args(argv)
    runs = []
    for processes in args.processes:
        run = burst(args.guests, processes)
        print(f"{args.guests} guests of one address, {processes} processes: all placed in "
              f"{run['wall_s']} s; wait p50 {run['wait_p50_s']} s, max {run['wait_max_s']} s")
        runs.append(run)
    result = {"device": device(), "runs": runs, "targets": []}
    save(result, args.name)
    return result


if __name__ == "__main__":
    main()
