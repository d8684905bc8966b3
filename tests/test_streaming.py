"""Coalescing streamed text (chat/streaming.py): nothing lost, order kept, rate bounded."""

import asyncio
import time

from chat.streaming import Coalescer


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
