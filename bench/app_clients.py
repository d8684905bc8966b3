"""The app path's users in several client processes, as several browsers would be.

At 256 users one client process reads every stream's socket frames on one event loop
(python-socketio makes a task per frame); each frame is stamped when that loop gets to it,
so a client that falls behind adds its own wait to the app's first token and gaps.
`run_spread` splits the users over `processes` spawned processes: user i and request i go
to process i % processes. Each connects its clients, says so, and starts when every
process has (time.monotonic() is the machine's one clock, so the timings of all of them go
together); the wall time runs from the first start to the last end. Each process also
reports the CPU time its event loop's thread spent, the check that no client was the
limit (thread time: the bench's own process also holds an engine's threads).

    bench.paths.run_app(url, profile, requests, users, processes=4)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

from bench.metrics import RequestTiming, summarize
from bench.workloads import Request, arrive

READY_TIMEOUT_S = 300.0  # 256 logins and sockets on a busy server
RUN_TIMEOUT_S = 900.0


async def drive(url: str, profile: str, requests: list[Request], users: int, progress=None,
                started_by=None) -> tuple[list[RequestTiming], float, float, float]:
    """`users` socket sessions of `profile`, each taking the next request when its turn
    ends. `started_by()`, awaited once every session is open, holds the start. Returns the
    timings, the start, the end (time.monotonic()) and the CPU seconds this thread spent
    between."""
    from tools.chainlit_client import ChatClient

    queue = list(reversed(requests))
    timings: list[RequestTiming] = []
    clients = [ChatClient(url, profile) for _ in range(users)]
    await asyncio.gather(*[c.connect() for c in clients])
    output_len = requests[0].output_len
    await asyncio.gather(*[c.settings(max_tokens=output_len, show_stats=False)
                           for c in clients])
    if started_by is not None:
        await started_by()

    async def user(client: ChatClient):
        while queue:
            req = queue.pop()
            await arrive(req, started)
            start = len(client.events)
            t = RequestTiming(sent=time.monotonic())
            timings.append(t)
            await client.emit_message(req.prompt)
            end = await client.wait_for("task_end", since=start, timeout=600)
            for e in client.events[start:end]:
                if e.name in ("stream_start", "stream_token"):
                    t.chunks.append(e.at)
            reply = client.collect(start, end + 1).reply
            t.ok = reply is not None and "output_tokens" in reply.get("metadata", {})
            t.output_tokens = reply["metadata"].get("output_tokens", 0) if t.ok else 0
            if progress:
                progress.update(1)

    started, cpu = time.monotonic(), time.thread_time()
    await asyncio.gather(*[user(c) for c in clients])
    ended, cpu = time.monotonic(), time.thread_time() - cpu
    await asyncio.gather(*[c.close() for c in clients])
    return timings, started, ended, cpu


def _share(url: str, profile: str, requests: list[Request], users: int, conn, go) -> None:
    """One client process: its share of the users, started when `go` is set."""
    async def held():
        conn.send("ready")
        while not go.is_set():
            await asyncio.sleep(0.002)

    try:
        timings, started, ended, cpu = asyncio.run(
            drive(url, profile, requests, users, started_by=held))
        conn.send(([(t.sent, t.chunks, t.output_tokens, t.ok) for t in timings],
                   started, ended, cpu))
    except Exception as exc:  # told to the bench, which stops there
        conn.send(f"client process failed: {exc!r}")


async def run_spread(url: str, profile: str, requests: list[Request], users: int,
                     processes: int, progress=None) -> dict:
    """`users` sessions spread over `processes` client processes; the run's figures, with
    `client_cpu`: each process's loop thread's CPU seconds over the run's wall time."""
    context = multiprocessing.get_context("spawn")  # this process holds an engine
    go = context.Event()
    procs, conns = [], []
    for i in range(processes):
        mine, theirs = context.Pipe()
        share = requests[i::processes]
        proc = context.Process(target=_share, name=f"bench-clients-{i}", daemon=True,
                               args=(url, profile, share, len(range(users)[i::processes]),
                                     theirs, go))
        proc.start()
        procs.append(proc)
        conns.append(mine)
    try:
        for conn in conns:
            said = await _answer(conn, READY_TIMEOUT_S)
            if said != "ready":
                raise RuntimeError(said)
        go.set()
        results = []
        for conn in conns:
            said = await _answer(conn, RUN_TIMEOUT_S)
            if isinstance(said, str):
                raise RuntimeError(said)
            results.append(said)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    timings = [RequestTiming(sent, chunks, tokens, ok)
               for rows, *_ in results for sent, chunks, tokens, ok in rows]
    if progress:
        progress.update(len(timings))
    start, end = min(r[1] for r in results), max(r[2] for r in results)
    out = summarize(timings, end - start)
    out["client_cpu"] = [round(r[3] / (end - start), 3) for r in results]
    return out


async def _answer(conn, timeout: float):
    """The next thing a client process says, waited for without holding the event loop."""
    deadline = time.monotonic() + timeout
    while not conn.poll():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a client process said nothing in {timeout:.0f} s")
        await asyncio.sleep(0.01)
    return conn.recv()
