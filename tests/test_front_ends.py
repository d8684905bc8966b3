"""The app as several front-end processes sharing one engine core (issue 31,
launcher.py): `python -m launcher` with VCHAT_FRONT_ENDS=2, the real
engine, Chainlit's socket protocol, as users and a hostile user meet it. The launcher is
started as an operator would; the kernel spreads the connections over the front ends."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools import turn_log
from chat.turns import REGENERATE
from chat.view import CUT_OFF
from engine.launch import has_cuda
from launcher import RESTART_WINDOW_S, RESTARTS
from tests.test_accounts import add_user
from tools.chainlit_client import ROOT, ChatClient, Server, engine_of, serving
from tools.polling import until

COUNT = 2


async def answers(server: Server, tries: int = 200) -> dict[int, dict]:
    """/ready as each front end answers it, by index (new connections until all have)."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        async with httpx.AsyncClient() as http:  # a new connection each: any front end
            health = (await http.get(server.url + "/ready", timeout=30)).json()
        seen[health["front_end"]["index"]] = health
        if len(seen) == COUNT:
            return seen
    raise AssertionError(f"only front ends {sorted(seen)} answered in {tries} tries")


@pytest.fixture(scope="module")
async def server():
    # /ready is 200 once every front end's engine has attached, not the first one's alone.
    async with serving({"VCHAT_FRONT_ENDS": str(COUNT)}) as srv:
        add_user(srv, "mallory", "mallory's own password")
        yield srv


async def test_each_front_end_answers_and_attaches_to_the_one_shared_engine(server):
    seen = await answers(server)
    pids = {h["front_end"]["pid"] for h in seen.values()}
    assert len(pids) == COUNT and server.proc.pid not in pids
    for health in seen.values():
        assert health["front_end"]["count"] == COUNT
        assert health["front_ends"] == {str(i): "ok" for i in range(COUNT)}
        # Both presets on the one engine, attached in each front end.
        assert engine_of(health, "latency-first") is engine_of(health, "throughput-first")
        assert engine_of(health, "latency-first")["healthy"] is True
    # One engine core for all of them: the launcher's child, not each front end's.
    launcher = psutil.Process(server.proc.pid)
    cores = [p for p in launcher.children(recursive=True) if "EngineCore" in " ".join(
        p.cmdline()) or "EngineCore" in p.name()]
    assert cores and all(p.ppid() == server.proc.pid for p in cores), [p.name() for p in cores]
    for pid in pids:
        assert not [p for p in psutil.Process(pid).children(recursive=True)
                    if "EngineCore" in p.name()]


async def test_users_of_both_profiles_on_both_front_ends_and_regenerate_from_any(server):
    """Users of both profiles at once, their sockets on both front ends; each presses
    Regenerate, whose HTTP call may reach the other front end: it is forwarded to the one
    holding the chat, and the new reply streams as with one process."""
    clients, owners, forwarded = [], set(), 0
    while len(clients) < 32 and (len(owners) < COUNT or not forwarded or len(clients) < 8):
        batch = [ChatClient(server.url, "Throughput-first" if i % 2 else "Latency-first")
                 for i in range(len(clients), len(clients) + 4)]
        await asyncio.gather(*[c.connect() for c in batch])
        await asyncio.gather(*[c.settings(max_tokens=12, temperature=0) for c in batch])
        replies = await asyncio.gather(*[c.send(f"Count to {i + 3}.")
                                         for i, c in enumerate(batch)])
        for c, reply in zip(batch, replies):
            assert reply.shown and reply.notes == [], reply.notes
            button = [a for a in c.actions(reply.reply["id"]) if a["name"] == REGENERATE]
            start = await c.press(button[0])
            end = await c.wait_for("task_end", since=start)
            again = c.collect(start, end + 1)
            assert again.shown and again.notes == [], again.notes
            owners.add(c.pressed.headers["x-vchat-front-end"])
            forwarded += "x-vchat-forwarded-by" in c.pressed.headers
        clients += batch
    assert owners == {str(i) for i in range(COUNT)}, owners
    assert forwarded, "no press reached a front end other than its chat's"
    # Every chat kept both replies: the regenerated one is the chat's last.
    for c in clients:
        async with c.api() as http:
            listed = (await http.post("/project/threads", json={
                "pagination": {"first": 50}, "filter": {}})).json()["data"]
        assert listed, "the chat was stored"
    await asyncio.gather(*[c.close() for c in clients])
    for health in (await answers(server)).values():
        assert engine_of(health, "throughput-first")["unfinished_requests"] == 0
    # Each turn's log line says which front end ran it (tools/turn_log.py reads them).
    fronts = {r.get("front_end") for r in turn_log.turns(server.log_path.read_text())}
    assert fronts == set(range(COUNT)), fronts


async def test_new_connections_are_spread_over_every_front_end(server):
    """The shipped spread (VCHAT_CONNECTION_SPREAD=hash): a listening socket per front end
    with SO_REUSEPORT, the kernel choosing by each connection's addresses. With one shared
    socket a loaded machine once handed 12 connections in a row to one front end."""
    seen = collections.Counter()
    for _ in range(64):
        async with httpx.AsyncClient() as http:  # a new connection (a new source port) each
            health = (await http.get(server.url + "/ready", timeout=30)).json()
        seen[health["front_end"]["index"]] += 1
    # Even by hash: each of 2 front ends gets 32 +- 4 of 64; fewer than 12 is 1 in 10^5.
    assert all(seen[i] >= 12 for i in range(COUNT)), seen


async def test_metrics_from_any_front_end_hold_every_front_ends_series(server):
    """/metrics answered by either front end: every front end's series, each labelled with
    its own, so a scraper sees the whole app whichever one it reaches; the turns counted
    are the turns run (the test above ran at least 16, two for each of its 8+ chats)."""
    for _ in range(6):
        async with httpx.AsyncClient() as http:  # a new connection each: either front end
            text = (await http.get(server.url + "/metrics", timeout=30)).text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        fronts = {s.labels.get("front_end") for s in samples}
        assert fronts == {str(i) for i in range(COUNT)}, fronts
        turns = [s for s in samples if s.name == "vchat_turns_finished_total"]
        assert {s.labels["front_end"] for s in turns} == fronts
        assert sum(s.value for s in turns) >= 16
    # A forged peer header is no key to anything: the answer is still the whole app's.
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.url + "/metrics", headers={"x-vchat-peer": "x"})).text
    assert {s.labels.get("front_end") for f in text_string_to_metric_families(text)
            for s in f.samples} == {str(i) for i in range(COUNT)}


async def test_stop_ends_a_reply_in_whichever_front_end_holds_it(server):
    c = ChatClient(server.url, "Latency-first")
    await c.connect()
    await c.settings(max_tokens=1024, temperature=1.5)
    start = len(c.events)
    await c.emit_message("Write a very long story about a lighthouse keeper.")
    await c.wait_for_tokens(start, 3)
    await c.stop()
    end = await c.wait_for("task_end", since=start, timeout=10)
    stopped = c.collect(start, end + 1)
    assert stopped.reply["metadata"]["stopped"] is True
    await c.close()


async def test_the_engines_seats_are_split_so_those_beyond_them_are_told_their_place(server):
    """Each front end has lines of its own: a preset's seats are split among them, so that
    together they seat no more turns than the engine runs at once; the rest wait in the
    app's line, told their place. (With every front end holding all the seats, the engine's
    own line took them, and those users saw nothing while they waited: issue 59's room.)"""
    from engine import load_config
    from engine.launch import seats

    config = load_config(env=dict(server.env))
    engine_seats = seats(config, config.presets["latency-first"], gpu=False)
    for health in (await answers(server)).values():  # every front end's figures together
        engine = engine_of(health, "latency-first")
        assert engine["front_ends_counted"] == COUNT
        assert engine["presets"]["latency-first"]["seats"] == COUNT * (engine_seats // COUNT)
    users = engine_seats + 4
    clients = [ChatClient(server.url, "Latency-first") for _ in range(users)]
    await asyncio.gather(*[c.connect() for c in clients])
    await asyncio.gather(*[c.settings(max_tokens=48) for c in clients])
    starts = [len(c.events) for c in clients]
    replies = await asyncio.gather(*[c.send(f"Tell me a story about the number {i}.")
                                     for i, c in enumerate(clients)])
    told = [any(e.name == "new_message" and str(e.data.get("output", "")).startswith(
        "Many people are chatting right now") for e in c.events[start:])
        for c, start in zip(clients, starts)]
    assert all(r.shown for r in replies)  # every one answered in the end
    # However the kernel spread them, at least those beyond the engine's seats were told.
    assert sum(told) >= users - engine_seats, (sum(told), users, engine_seats)
    await asyncio.gather(*[c.close() for c in clients])


def test_ready_adds_up_every_front_ends_engine_figures():
    """/ready's engine figures are the app's: each front end's lines hold its own turns and
    its part of the seats, and vLLM sends each step's statistics to one front end only, so
    the one answering adds its peers' in (peak_running: the highest); an answer it cannot
    read adds nothing."""
    import json as json_
    from api.ops import _fold, _parsed

    def engine(admitted, seats, preempted, peak):
        return {"admitted": admitted, "queued": 1, "max_admitted": seats, "max_queued": 8,
                "kv_held": 100, "steps": 10, "preempted": preempted, "peak_running": peak,
                "unfinished_requests": admitted, "healthy": True,
                "presets": {"throughput-first": {"admitted": admitted, "queued": 1,
                                                 "seats": seats, "max_queued": 8,
                                                 "kv_held": 100, "priority": 1}}}

    health = {"engines": {"shared": engine(3, 64, 0, 40)}}
    peer = (200, json_.dumps({"engines": {"shared": engine(5, 64, 2, 70)}}))
    _fold(health, _parsed(peer))
    for bad in (None, (503, "not json"), (200, "[]"), (200, '{"engines": 7}')):
        _fold(health, _parsed(bad))
    shared = health["engines"]["shared"]
    assert (shared["admitted"], shared["max_admitted"], shared["preempted"], shared["steps"],
            shared["peak_running"], shared["front_ends_counted"]) == (8, 128, 2, 20, 70, 2)
    line = shared["presets"]["throughput-first"]
    assert (line["seats"], line["admitted"], line["queued"], line["priority"]) == (128, 8, 2, 1)


async def test_another_account_cannot_reach_a_chat_through_any_front_end(server):
    """A hostile user with an ordinary account presses a button of another account's chat,
    from connections that reach either front end, with and without a forged peer header:
    refused each time, as by one process (403), never run and never 421."""
    victim = ChatClient(server.url, "Latency-first")
    await victim.connect()
    await victim.settings(max_tokens=8, temperature=0)
    reply = await victim.send("Hello.")
    button = [a for a in victim.actions(reply.reply["id"]) if a["name"] == REGENERATE][0]
    mallory = ChatClient(server.url, "Latency-first", user="mallory",
                         password="mallory's own password")
    before = len(victim.events)
    seen: dict[str | None, int] = {}  # who forwarded the press (None: none) -> forged ones
    token = await mallory.login()
    for i in range(60):  # until presses reached both front ends, forged ones among them
        forged = i % 2 == 1
        async with httpx.AsyncClient(base_url=server.url, cookies={"access_token": token},
                                     timeout=60) as http:  # a new connection each time
            r = await http.post("/project/action",
                                headers={"x-vchat-peer": "guessed"} if forged else {},
                                json={"sessionId": victim.session_id, "action": button})
        assert r.status_code == 403, (r.status_code, r.text)
        by = r.headers.get("x-vchat-forwarded-by")
        seen[by] = seen.get(by, 0) + forged
        if i >= 11 and len(seen) > 1 and all(seen.values()):
            break
    assert None in seen and len(seen) > 1 and all(seen.values()), seen
    # A settings change is answered (its own task_start and task_end) after anything a
    # press could have started in the victim's session.
    await victim.settings(max_tokens=8)
    assert [e.name for e in victim.events[before:]
            if e.name in ("task_start", "stream_start")] == ["task_start"]
    await victim.close()


def test_a_port_already_taken_is_one_line_not_a_trace(server):
    """Also by another launcher, whose SO_REUSEPORT sockets would otherwise join these on
    the port and take half of its connections."""
    taken = subprocess.run(
        [sys.executable, "-m", "launcher", "--front-ends", "2", "--port",
         str(server.port)], env={**os.environ, "VCHAT_ENGINE": "stand-in"}, cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    assert taken.returncode == 1 and "Traceback" not in taken.stdout + taken.stderr
    assert f"Cannot listen on 127.0.0.1:{server.port}: Address already in use" in taken.stderr


async def test_one_shared_socket_is_the_other_spread():
    """VCHAT_CONNECTION_SPREAD=first-free: one listening socket for all, whichever front end
    accepts first (the stand-in engine: this is about the sockets)."""
    env = {"VCHAT_FRONT_ENDS": str(COUNT), "VCHAT_CONNECTION_SPREAD": "first-free",
           "VCHAT_ENGINE": "stand-in"}
    async with serving(env) as srv:
        assert set(await answers(srv)) == set(range(COUNT))
        c = ChatClient(srv.url, "Latency-first")
        await c.connect()
        assert (await c.send("Hello.")).shown
        await c.close()
    assert "connections spread: first-free" in srv.log_path.read_text()


def connections_of(pid: int, port: int) -> int:
    """How many TCP connections to `port` the process `pid` holds open."""
    return len([c for c in psutil.Process(pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port])


async def test_a_front_end_killed_mid_reply_is_started_again_alone(server):
    """A front end killed outright (a crash) while both stream replies: the launcher starts
    it again alone, attached to the running core; the other's replies go on streaming; the
    killed one's users reconnect (as their pages do), find their chats with the cut-off
    reply said, and chat on; the core aborted the requests the dead one left running."""
    await until(lambda: server.log_path.read_text(errors="replace"),
                lambda log: "a spare front end is ready" in log, timeout=120)
    fronts = await answers(server)
    pids = {i: h["front_end"]["pid"] for i, h in fronts.items()}
    before = {i: connections_of(pid, server.port) for i, pid in pids.items()}
    clients: list[ChatClient] = []
    while any(connections_of(pid, server.port) <= before[i] for i, pid in pids.items()):
        assert len(clients) < 40, "the kernel gave every connection to one front end"
        c = ChatClient(server.url, "Throughput-first" if len(clients) % 2 else "Latency-first")
        await c.connect()
        await c.settings(max_tokens=1024, temperature=1.5)
        clients.append(c)
    starts = [len(c.events) for c in clients]
    for c in clients:
        await c.emit_message("Write a very long story about a lighthouse keeper.")
    for c, start in zip(clients, starts):
        await c.wait_for_tokens(start, 3)
    os.kill(pids[1], signal.SIGKILL)
    killed, killed_at = time.monotonic(), len(server.log_path.read_text(errors="replace"))
    cut = await until(lambda: [c for c in clients if not c.sio.connected],
                      lambda cut: len(cut) >= 1, timeout=30)
    kept = [c for c in clients if c not in cut]
    assert kept, "every socket was on the killed front end"
    marks = {id(c): len(c.events) for c in kept}

    def streamed() -> list[int]:  # tokens since the kill, or (a reply ended) plenty
        return [len([e for e in c.events[marks[id(c)]:] if e.name == "stream_token"])
                + 100 * any(e.name == "task_end" for e in c.events[marks[id(c)]:])
                for c in kept]

    assert min(await until(streamed, lambda n: min(n) >= 5, timeout=60)) >= 5
    for c, start in zip(clients, starts):  # the other's replies: stopped, not broken
        if c in kept:
            await c.stop()
            end = await c.wait_for("task_end", since=start, timeout=30)
            reply = c.collect(start, end + 1)
            assert reply.shown and reply.notes in ([], ["Task manually stopped."]), reply.notes

    async def fronts_now() -> dict:
        with contextlib.suppress(AssertionError, httpx.HTTPError):
            return await answers(server, tries=20)
        return {}

    # The killed one answers again: a new process in its place, the core the same.
    back = await until(fronts_now, lambda seen: seen and seen[1]["front_end"]["pid"] != pids[1]
                       and all(h["front_ends"] == {"0": "ok", "1": "ok"} for h in seen.values()),
                       timeout=120)
    assert back[1]["front_end"]["pid"] != pids[1], back
    print(f"front end killed -> serving again: {time.monotonic() - killed:.1f} s (at most)")
    assert back[0]["front_end"]["pid"] == pids[0]
    assert all(h["front_ends"] == {"0": "ok", "1": "ok"} for h in back.values()), back
    log = server.log_path.read_text(errors="replace")[killed_at:]
    assert "front end front-end-1 (status -9) stopped: started again alone" in log
    left = [int(n) for n in re.findall(r"left running, aborted: (\d+)", log)]
    assert left and left[0] >= 1, log[-3000:]  # (a cut reply may also have ended by itself)
    for c in cut:  # its users come back: the chat with its cut-off reply said, then on
        start = len(c.events)
        await c.reconnect()
        assert await c.wait_for_note("went away", since=start) == CUT_OFF
        again = await c.send("Just say hi.")
        assert again.shown and again.notes == [], again.notes
    await asyncio.gather(*[c.close() for c in clients])
    for health in (await answers(server)).values():  # no turn left counted anywhere
        assert engine_of(health, "throughput-first")["unfinished_requests"] == 0


async def test_an_engine_core_killed_mid_reply_is_started_again_in_place(server):
    """The engine core killed outright while users of both front ends stream replies: the
    front ends stay up (/health answers throughout), /ready says "restarting" with the time
    it expects, the turns in flight end with a message saying so, the launcher starts the
    core again at the same addresses, and each user's next message, on the same page and
    socket, is answered."""
    fronts = await answers(server)
    pids = {i: h["front_end"]["pid"] for i, h in fronts.items()}
    clients = [ChatClient(server.url, "Throughput-first" if i % 2 else "Latency-first")
               for i in range(4)]
    await asyncio.gather(*[c.connect() for c in clients])
    await asyncio.gather(*[c.settings(max_tokens=1024, temperature=1.5) for c in clients])
    starts = [len(c.events) for c in clients]
    for c in clients:
        await c.emit_message("Write a very long story about a lighthouse keeper.")
    for c, start in zip(clients, starts):
        await c.wait_for_tokens(start, 3)
    core = next(p for p in psutil.Process(server.proc.pid).children()
                if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()))
    # On CPU the model runs in a worker process of the core's. One that would not end with
    # its core (stopped here) is ended by the launcher before the core starts again.
    workers = [p for p in core.children(recursive=True) if p.name() == "VLLM::Worker"]
    assert has_cuda() or workers
    for p in workers[:1]:
        p.suspend()
    killed = time.monotonic()
    core.kill()
    health, said = [], []

    async def watch() -> None:  # /health and /ready through the restart, from any front end
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                health.append((await http.get(server.url + "/health")).status_code)
                ready = (await http.get(server.url + "/ready")).json()
                said.append(ready["status"])
                if ready["status"] == "restarting":
                    shared = engine_of(ready, "latency-first")
                    assert shared["restarting"] and shared["back_in_s"] is not None, ready
                await asyncio.sleep(0.5)

    watching = asyncio.ensure_future(watch())
    try:
        for c, start in zip(clients, starts):  # each reply in flight ends, said why
            end = await c.wait_for("task_end", since=start, timeout=60)
            cut = c.collect(start, end + 1)
            assert any("stopped unexpectedly" in n for n in cut.notes), cut.notes
        back = await until(lambda: answers(server), lambda seen: all(
            h["status"] == "ok" and h["front_ends"] == {"0": "ok", "1": "ok"}
            for h in seen.values()), timeout=300)
    finally:
        watching.cancel()
    assert {i: h["front_end"]["pid"] for i, h in back.items()} == pids  # the same processes
    left = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"left over from the dead core: {left}"
    assert health and set(health) == {200}, collections.Counter(health)
    assert "restarting" in said, collections.Counter(said)
    await asyncio.gather(*[c.settings(max_tokens=16) for c in clients])
    again = [len(c.events) for c in clients]
    for c in clients:
        await c.emit_message("Just say hi.")
    for c, start in zip(clients, again):
        await c.wait_for_tokens(start, 1)
    print(f"core killed -> a first token for every user again: "
          f"{time.monotonic() - killed:.1f} s")
    for c, start in zip(clients, again):
        end = await c.wait_for("task_end", since=start)
        reply = c.collect(start, end + 1)
        assert reply.shown and reply.notes == [], reply.notes
    log = server.log_path.read_text(errors="replace")
    assert re.search(r"its core is back in [\d.]+ s", log)
    assert "starting it again in place" in log
    for c in clients:  # each chat: both messages, the cut-off reply's and the new one's
        async with c.api() as http:
            listed = (await http.post("/project/threads", json={
                "pagination": {"first": 50}, "filter": {}})).json()["data"]
        assert listed
    await asyncio.gather(*[c.close() for c in clients])


def front_end_pids(launcher: int, port: int) -> list[int]:
    """The launcher's children that serve on `port` (its front ends; not the core, its
    workers or the spare, which gets its socket only when it takes a place)."""
    pids = []
    for child in psutil.Process(launcher).children():
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in child.net_connections(kind="tcp")):
                pids.append(child.pid)
    return pids


async def test_a_front_end_that_keeps_dying_ends_them_all_for_the_supervisor(server):
    """Last in the module: a front end killed again and again (a crash its restart does not
    mend) is started again RESTARTS times within RESTART_WINDOW_S (the restarts above
    count), then the launcher ends every front end and the core with status 1."""
    family = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
    for _ in range(RESTARTS + 1):
        pids = await until(lambda: [] if server.proc.poll() is not None
                           else front_end_pids(server.proc.pid, server.port),
                           lambda pids: len(pids) == COUNT or server.proc.poll() is not None,
                           timeout=60)
        if server.proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.kill(max(pids), signal.SIGKILL)
        await asyncio.sleep(1)
    assert server.proc.wait(timeout=90) == 1
    left = await until(lambda: alive(family), lambda left: not left)
    assert left == [], [" ".join(p.cmdline()) for p in left]
    assert f"restarts within {RESTART_WINDOW_S} s: ending every front end" in \
        server.log_path.read_text(errors="replace")


def alive(pids: list[int]) -> list[psutil.Process]:
    """Those of `pids` still running (not gone, not a zombie)."""
    running = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running
