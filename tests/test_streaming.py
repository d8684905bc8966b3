"""Coalescing streamed text (chat/streaming.py): nothing lost, order kept, rate bounded."""

import asyncio
import time

from chat.streaming import Coalescer, Pace
from tools.sockets import socket_server


class Sink:
    def __init__(self):
        self.sent: list[tuple[float, str]] = []

    async def send(self, text: str) -> None:
        await asyncio.sleep(0)  # a real send yields to the loop
        self.sent.append((time.monotonic(), text))

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.sent)


async def test_a_piece_after_a_quiet_spell_goes_out_at_once():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.02)
    for p in ["a", "b", "c"]:
        await out.feed(p)
        assert sink.text.endswith(p), "a piece after a quiet spell is sent before feed returns"
        await asyncio.sleep(0.05)
    await out.close()
    assert [t for _, t in sink.sent] == ["a", "b", "c"]


async def test_a_piece_within_the_interval_waits_for_it():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.05)
    await out.feed("first")
    await out.feed(" second")  # inside the interval: feed sleeps until it is over
    assert [t for _, t in sink.sent] == ["first", " second"]
    assert sink.sent[1][0] - sink.sent[0][0] >= 0.05 - 0.001  # never early (clock rounding)


async def test_a_stopped_reply_sends_nothing_more():
    # The user presses Stop while a piece waits for its turn: the turn's task is cancelled
    # in feed's sleep, and discard drops the piece.
    sink = Sink()
    out = Coalescer(sink.send, interval=0.05)
    await out.feed("shown")
    waiting = asyncio.create_task(out.feed(" never shown"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    out.discard()
    await out.close()
    assert sink.text == "shown"


def test_the_pace_slows_only_when_many_replies_stream_at_once():
    pace = Pace(fastest=0.04, slowest=0.2, events_per_s=160)
    intervals = {}
    for streams in (0, 1, 6, 16, 32, 64):
        pace.by_rank[0] = streams
        intervals[streams] = pace.interval()
    assert intervals == {0: 0.04, 1: 0.04, 6: 0.04, 16: 0.1, 32: 0.2, 64: 0.2}
    off = Pace(fastest=0, slowest=0)
    off.by_rank.update({0: 3, 1: 5})
    assert off.interval(0) == off.interval(1) == 0, "0 turns coalescing off"
    # With a GPU the app's core is its own: many more updates before replies slow down.
    gpu = Pace.starting_at(0.04, Pace.events_for(gpu=True))
    gpu.by_rank[0] = 64
    assert gpu.interval() == 0.04
    gpu.by_rank[0] = 256
    assert 0.04 < gpu.interval() < 0.2


def test_a_higher_class_keeps_its_pace_and_the_lower_ones_share_what_is_left():
    """Latency-first's 16 replies beside Throughput-first's 256 on a GPU (2,000 updates a
    second in all): one interval for everyone would be 0.136 s; Latency-first keeps 0.04 s
    (400 updates a second) and Throughput-first's 256 share the other 1,600 (0.16 s)."""
    pace = Pace.starting_at(0.04, 2000)
    pace.by_rank.update({0: 16, 1: 256})
    assert pace.interval(0) == 0.04
    assert pace.interval(1) == 0.16
    assert pace.streams == 272
    # A class alone, or the top class with many replies, as before.
    pace.by_rank[0] = 0
    assert pace.interval(1) == 0.128
    pace.by_rank.update({0: 500, 1: 10})
    assert pace.interval(0) == 0.2 and pace.interval(1) == 0.2, "never slower than slowest"


async def test_a_reply_counts_on_the_pace_from_its_first_piece_until_it_ends():
    pace, sink = Pace(), Sink()
    a, b, c = (Coalescer(sink.send, pace=pace, rank=rank) for rank in (0, 1, 1))
    assert pace.streams == 0, "a reply still waiting for its first token does not count"
    for out in (a, b, c):
        await out.feed("x")
    assert pace.streams == 3 and pace.by_rank == {0: 1, 1: 2}
    await a.close()
    b.discard()
    b.discard()
    assert pace.streams == 1
    await c.close()
    assert pace.streams == 0


async def test_feed_pulls_a_joining_source_once_per_update_and_loses_nothing(config):
    # The stand-in, like vLLM, joins the tokens it made while nobody pulled.
    from engine import Prompt
    from engine.launch import EngineSetup
    from engine.model import resolve_model
    from engine.standin import StandInEngine

    model = await asyncio.to_thread(resolve_model, config.model)
    engine = StandInEngine("p", EngineSetup({"model": model}), tokens_per_s=1000)
    await engine.start()  # its tokenizer: a stand-in serves only once started, like vLLM
    prompt = Prompt((), "", list(range(4)), 400, 400, 0)
    pace = Pace(fastest=0.04, slowest=0.2)
    pace.by_rank[0] = 64  # many replies at once: the longest interval, 0.2 s
    sink, pulls = Sink(), 0
    out = Coalescer(sink.send, pace=pace)
    async for item in engine.stream(prompt, temperature=0.7, top_p=1.0):
        if isinstance(item, str):
            pulls += 1
            await out.feed(item)
    await out.close()
    engine.shutdown()
    words = sink.text.split()
    assert len(words) == 400 and words[:3] == ["stand-in", "text", "for"]
    # 400 tokens at 1,000/s take ~0.4 s: a few updates 0.2 s apart, each one pull, where
    # pulling each token as it comes would have pulled 400 times.
    assert pulls == len(sink.sent) <= 5, (pulls, len(sink.sent))


async def test_an_event_for_one_browser_goes_out_without_waiting_for_the_event_loop():
    """python-socketio's emit makes a task per recipient and waits for it, so every event
    of Chainlit's (each for one socket) cost its sender two turns of the event loop, and a
    turn's way to its first token has several: on a busy loop each turn is milliseconds
    (BENCHMARKS.md, "2026-12-03: what holds Latency-first's first token", item 7).
    Installed, the event is on the socket's queue when emit returns, and nothing else ran
    meanwhile; events for a room still go out."""
    from chat import emits

    for in_line in (False, True):
        sio, sid, eio_socket = await socket_server(in_line)
        assert emits.installed(sio) is in_line
        ran = []
        asyncio.get_running_loop().call_soon(ran.append, "the loop's next turn")
        await sio.emit("stream_token", {"id": "m1", "token": "Hel"}, to=sid)
        assert bool(ran) is not in_line, "the usual emit lets the loop run first"
        assert eio_socket.queue.get_nowait().data == \
            '2["stream_token",{"id":"m1","token":"Hel"}]'
    await sio.enter_room(sid, "everyone")
    await sio.emit("note", ("two", "args"), room="everyone")
    assert eio_socket.queue.get_nowait().data == '2["note","two","args"]'


async def test_an_event_for_a_socket_that_closed_is_dropped_and_the_sender_goes_on():
    sio, sid, eio_socket = await socket_server(in_line=True)
    eio_socket.closed = True
    await sio.emit("stream_token", {"id": "m1", "token": "lost"}, to=sid)  # no exception
    assert eio_socket.queue.empty()
    await sio.emit("stream_token", {"id": "m1", "token": "x"}, to="no-such-sid")
