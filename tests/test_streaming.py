"""Coalescing streamed text (chat/streaming.py): nothing lost, order kept, rate bounded."""

import asyncio
import time

from chat.streaming import Coalescer, Pace


class Sink:
    def __init__(self):
        self.sent: list[tuple[float, str]] = []

    async def send(self, text: str) -> None:
        await asyncio.sleep(0)  # a real send yields to the loop
        self.sent.append((time.monotonic(), text))

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.sent)


async def test_fast_pieces_are_joined_and_nothing_is_lost():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.05)
    pieces = [f"t{i} " for i in range(300)]
    for p in pieces:
        await out.add(p)
        await asyncio.sleep(0.001)  # ~1,000 pieces/s: far faster than the interval
    await out.close()
    assert sink.text == "".join(pieces)
    # About one send per 50 ms over ~0.3-0.6 s, not one per piece.
    assert len(sink.sent) < 40, len(sink.sent)
    assert sink.sent[0][1] == "t0 ", "the first piece goes out at once"


async def test_slow_pieces_go_out_one_by_one_without_waiting():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.02)
    for p in ["a", "b", "c"]:
        await out.add(p)
        assert sink.text.endswith(p), "a piece after a quiet spell is sent immediately"
        await asyncio.sleep(0.05)
    await out.close()
    assert [t for _, t in sink.sent] == ["a", "b", "c"]


async def test_a_held_piece_is_sent_by_the_timer_when_nothing_follows():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.05)
    await out.add("first")
    await out.add("second")  # inside the interval: held
    assert sink.text == "first"
    await asyncio.sleep(0.2)  # no more pieces, no close(): the timer sends it
    assert sink.text == "firstsecond"
    await out.close()
    assert len(sink.sent) == 2


async def test_discard_drops_what_was_not_shown():
    sink = Sink()
    out = Coalescer(sink.send, interval=0.05)
    await out.add("shown")
    await out.add(" never shown")
    out.discard()
    await asyncio.sleep(0.1)
    assert sink.text == "shown"


def test_the_pace_slows_only_when_many_replies_stream_at_once():
    pace = Pace(fastest=0.04, slowest=0.2, events_per_s=160)
    intervals = {}
    for streams in (0, 1, 6, 16, 32, 64):
        pace.streams = streams
        intervals[streams] = pace.interval
    assert intervals == {0: 0.04, 1: 0.04, 6: 0.04, 16: 0.1, 32: 0.2, 64: 0.2}
    assert Pace(fastest=0, slowest=0).interval == 0, "0 turns coalescing off"


async def test_a_reply_counts_on_the_pace_from_its_first_piece_until_it_ends():
    pace, sink = Pace(), Sink()
    a, b, c = (Coalescer(sink.send, pace=pace) for _ in range(3))
    assert pace.streams == 0, "a reply still waiting for its first token does not count"
    for out in (a, b, c):
        await out.add("x")
    assert pace.streams == 3
    await a.close()
    b.discard()
    b.discard()
    assert pace.streams == 1
    await c.close()
    assert pace.streams == 0


async def test_with_many_streams_a_slow_stream_sends_two_pieces_an_update():
    pace = Pace(fastest=0.01, slowest=0.2, events_per_s=100)
    pace.streams = 20  # others streaming: up to 0.2 s, here twice the 20 ms gap
    sink = Sink()
    out = Coalescer(sink.send, pace=pace)
    pieces = [f"t{i} " for i in range(30)]
    for p in pieces:  # a piece every 20 ms: each would go out alone at 0.01 s
        await out.add(p)
        await asyncio.sleep(0.02)
    await out.close()
    assert sink.text == "".join(pieces)
    assert 12 <= len(sink.sent) <= 19, [t for _, t in sink.sent]
    assert max(b - a for (a, _), (b, _) in zip(sink.sent, sink.sent[1:])) < 0.1


async def test_with_many_streams_a_fast_stream_keeps_the_short_interval():
    pace = Pace(fastest=0.04, slowest=0.2)
    pace.streams = 64  # the longest interval allowed: 0.2 s
    sink = Sink()
    out = Coalescer(sink.send, pace=pace)
    started = time.monotonic()
    while time.monotonic() - started < 0.4:  # ~1,000 pieces/s
        await out.add("x")
        await asyncio.sleep(0.001)
    await out.close()
    # One update per ~40 ms (about 10), not per 200 ms (about 2): the pieces are small and
    # many, so holding them longer would only make the text jump.
    assert len(sink.sent) >= 7, len(sink.sent)


async def test_feed_pulls_a_joining_source_once_per_update_and_loses_nothing():
    # The stand-in, like vLLM, joins the tokens it made while nobody pulled.
    from engine import Prompt
    from engine.launch import EngineSetup
    from engine.standin import StandInEngine

    engine = StandInEngine("p", EngineSetup({"model": "unused"}), tokens_per_s=1000)
    prompt = Prompt((), "", list(range(4)), 400, 400, 0)
    pace = Pace(fastest=0.04, slowest=0.2)
    pace.streams = 64  # many replies at once: the longest interval, 0.2 s
    sink, pulls = Sink(), 0
    out = Coalescer(sink.send, pace=pace)
    async for item in engine.stream(prompt):
        if isinstance(item, str):
            pulls += 1
            await out.feed(item)
    await out.close()
    words = sink.text.split()
    assert len(words) == 400 and words[:3] == ["stand-in", "text", "for"]
    # 400 tokens at 1,000/s take ~0.4 s: a handful of updates (the interval grows from
    # 0.04 s to the pace's 0.2 s as the gap between pulls does), each one pull, where `add`
    # would have pulled 400 times.
    assert pulls == len(sink.sent) <= 10, (pulls, len(sink.sent))
