"""The admission queue in front of an engine (engine/admission.py), on its own."""

import asyncio

import pytest

from engine import ChatError
from engine.admission import Admission, Line


class Turn:
    """One turn holding a place until `done` is set; records the places it was told."""

    def __init__(self, gate: Admission):
        self.places: list[int] = []
        self.inside = asyncio.Event()
        self.done = asyncio.Event()
        self.task = asyncio.ensure_future(self.run(gate))

    async def told(self, place: int) -> None:
        self.places.append(place)

    async def run(self, gate: Admission):
        async with gate.slot(self.told):
            self.inside.set()
            await self.done.wait()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_full_engine_queues_in_order_tells_places_and_refuses_beyond_the_bound():
    gate = Admission(running=2, queued=2)
    turns = [Turn(gate) for _ in range(4)]
    await settle()
    assert [t.inside.is_set() for t in turns] == [True, True, False, False]
    assert turns[2].places == [1] and turns[3].places == [2]
    with pytest.raises(ChatError, match="2 replies are being written and 2 messages"):
        async with gate.slot():
            pass
    turns[0].done.set()
    await settle()
    assert turns[2].inside.is_set() and not turns[3].inside.is_set()
    assert turns[3].places == [2, 1], "told when it moved up"
    for t in turns:
        t.done.set()
    await asyncio.gather(*[t.task for t in turns])
    assert gate.inside == 0 and gate.waiting == 0


async def test_a_withdrawn_turn_leaves_the_queue_and_no_place_is_lost():
    gate = Admission(running=1, queued=3)
    first, second, third = Turn(gate), Turn(gate), Turn(gate)
    await settle()
    second.task.cancel()  # Stop (or a closed browser) while waiting
    await settle()
    assert gate.waiting == 1 and third.places == [2, 1]
    first.done.set()
    await settle()
    assert third.inside.is_set()
    third.done.set()
    await asyncio.gather(first.task, third.task)
    assert gate.inside == 0 and gate.waiting == 0


async def test_cancelled_just_as_admitted_passes_the_place_on():
    gate = Admission(running=1, queued=2)
    first, second, third = Turn(gate), Turn(gate), Turn(gate)
    await settle()
    first.done.set()
    await asyncio.sleep(0)  # `second` is admitted but has not run yet ...
    second.task.cancel()    # ... and is cancelled right then
    await settle()
    assert third.inside.is_set(), "the place went on to the next in line"
    third.done.set()
    await asyncio.gather(first.task, third.task)
    assert gate.inside == 0 and gate.waiting == 0


class SizedTurn(Turn):
    """A turn that holds `tokens` of the engine's KV cache."""

    def __init__(self, gate: Admission, tokens: int):
        self.tokens = tokens
        super().__init__(gate)

    async def run(self, gate: Admission):
        async with gate.slot(self.told, tokens=self.tokens):
            self.inside.set()
            await self.done.wait()


async def test_turns_wait_while_their_worst_case_does_not_fit_the_cache():
    line = Line(kv_tokens=1000, block_size=16)
    gate = Admission(running=8, queued=8, line=line)
    big = SizedTurn(gate, 600)       # 38 blocks: 608 tokens
    small = SizedTurn(gate, 300)     # 304: 912 in all, fits
    late = SizedTurn(gate, 200)      # 208 more would be 1,120: waits, though seats are free
    await settle()
    assert [t.inside.is_set() for t in (big, small, late)] == [True, True, False]
    assert late.places == [1] and line.held == 912
    big.done.set()
    await settle()
    assert late.inside.is_set() and line.held == 512
    small.done.set(), late.done.set()
    await asyncio.gather(big.task, small.task, late.task)
    assert line.held == 0 and gate.inside == 0


async def test_a_turn_alone_goes_in_even_if_larger_than_its_share():
    line = Line(kv_tokens=1000)
    Admission(running=4, queued=4, line=line, priority=0, keep_tokens=800)
    low = Admission(running=4, queued=4, line=line, priority=1)
    whole = SizedTurn(low, 900)  # more than the 200 low may hold beside others: alone, it runs
    await settle()
    assert whole.inside.is_set()
    whole.done.set()
    await whole.task


async def test_higher_priority_keeps_its_room_and_goes_first_when_cache_frees():
    line = Line(kv_tokens=1000)
    high = Admission(running=2, queued=4, line=line, priority=0, keep_tokens=400)
    low = Admission(running=8, queued=8, line=line, priority=1)
    lows = [SizedTurn(low, 250) for _ in range(4)]
    await settle()
    # low may hold 1000 - 400: two of its turns run, two wait although low has seats.
    assert [t.inside.is_set() for t in lows] == [True, True, False, False]
    first = SizedTurn(high, 300)  # the kept room: in at once, beside low's 500
    await settle()
    assert first.inside.is_set() and line.held == 800
    second = SizedTurn(high, 300)  # 1,100 would not fit: waits for cache ...
    await settle()
    assert not second.inside.is_set()
    lows[0].done.set()  # 250 freed: low's next in line must not take it before `second`
    await settle()
    assert second.inside.is_set() and not lows[2].inside.is_set()
    assert high.inside == 2 and low.inside == 1
    for t in [*lows, first, second]:
        t.done.set()
    await asyncio.gather(*[t.task for t in [*lows, first, second]])
    assert line.held == 0 and low.waiting == high.waiting == 0


async def test_seats_are_each_class_own():
    line = Line(kv_tokens=None)  # not counted (remote): only seats
    high = Admission(running=1, queued=2, line=line, priority=0)
    low = Admission(running=1, queued=2, line=line, priority=1)
    a, b = SizedTurn(high, 10), SizedTurn(high, 10)
    c = SizedTurn(low, 10)  # high waits for a seat of its own, not for cache: low goes in
    await settle()
    assert a.inside.is_set() and not b.inside.is_set() and c.inside.is_set()
    for t in (a, b, c):
        t.done.set()
    await asyncio.gather(a.task, b.task, c.task)
