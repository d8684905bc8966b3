"""The admission queue in front of an engine (engine/admission.py), on its own."""

import asyncio

import pytest

from engine import ChatError
from engine.admission import Admission


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
