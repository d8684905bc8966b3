"""Seats and KV cache shared by the front ends on one engine's core (engine/seats.py): each
takes the seats another leaves free, gives them back when that one's turns wait, and all of
them together never seat more than the preset's seats, also when they race for the last."""

import asyncio
import multiprocessing
import random

from engine.admission import Admission, Line
from engine.seats import POLL_S, SharedSeats
from tests.test_admission import Turn, settle

PRESET = "throughput-first"


def front_end(folder, index: int, count: int, whole: int, kv_tokens: int | None = None,
              queued: int = 1000) -> Admission:
    """Front end `index`'s line for PRESET, its part of `whole` seats, as engine/pool.py
    makes it."""
    shared = SharedSeats(folder, "shared", index, count, [PRESET])
    return Admission(max(1, whole // count), queued, name=PRESET, whole=whole,
                     line=Line(kv_tokens, 1, shared))


def inside_everywhere(gates: list[Admission]) -> int:
    return sum(g.inside for g in gates)


async def polled():
    await asyncio.sleep(POLL_S * 4)
    await settle()


async def test_a_front_end_takes_the_seats_another_leaves_free_and_gives_them_back(tmp_path):
    a, b = front_end(tmp_path, 0, 2, whole=8), front_end(tmp_path, 1, 2, whole=8)
    mine = [Turn(a) for _ in range(9)]
    await settle()
    # B has no turns: A seats 8, not only its part of 4; the 9th waits, told its place.
    assert sum(t.inside.is_set() for t in mine) == 8 and mine[8].places == [1]
    theirs = [Turn(b) for _ in range(3)]
    await polled()
    assert not any(t.inside.is_set() for t in theirs), "never beyond the 8 seats"
    # As A's turns end, the seats go to B's waiting turns (B is under its part), not to
    # A's own 9th, until B holds what it asks for.
    for n in range(3):
        mine[n].done.set()
        await polled()
        assert sum(t.inside.is_set() for t in theirs) == n + 1
        assert not mine[8].inside.is_set()
        assert inside_everywhere([a, b]) == 8
    mine[3].done.set()
    await polled()
    assert mine[8].inside.is_set(), "B waits no more: A takes the free seat again"
    for t in mine + theirs:
        t.done.set()
    await asyncio.gather(*[t.task for t in mine + theirs])
    assert inside_everywhere([a, b]) == 0 and a.waiting == b.waiting == 0


async def test_each_keeps_its_part_while_both_have_turns_waiting(tmp_path):
    a, b = front_end(tmp_path, 0, 2, whole=6), front_end(tmp_path, 1, 2, whole=6)
    mine = [Turn(a) for _ in range(20)]
    await settle()
    theirs = [Turn(b) for _ in range(20)]
    await polled()
    seen = [(a.inside, b.inside)]  # A came first and took all 6
    for _ in range(5):  # two turns end at a time, A's first; the freed seats go to B
        for t in [t for t in mine + theirs if t.inside.is_set() and not t.done.is_set()][:2]:
            t.done.set()
        await polled()
        seen.append((a.inside, b.inside))
    assert seen[:3] == [(6, 0), (4, 2), (3, 3)] and set(seen[3:]) == {(3, 3)}
    for t in mine + theirs:
        t.done.set()
    await asyncio.gather(*[t.task for t in mine + theirs])


async def test_the_kv_cache_is_counted_over_every_front_end(tmp_path):
    a = front_end(tmp_path, 0, 2, whole=8, kv_tokens=100)
    b = front_end(tmp_path, 1, 2, whole=8, kv_tokens=100)
    held, entered = asyncio.Event(), asyncio.Event()
    done = asyncio.Event()

    async def turn(gate, tokens, inside):
        async with gate.slot(tokens=tokens):
            inside.set()
            await done.wait()

    first = asyncio.ensure_future(turn(a, 60, held))
    await settle()
    second = asyncio.ensure_future(turn(b, 50, entered))
    await polled()
    assert held.is_set() and not entered.is_set(), "60 + 50 do not fit 100 tokens"
    assert b.line.held_everywhere() == 60
    done.set()
    await first
    await polled()
    assert entered.is_set()
    await second


def test_a_front_end_started_again_starts_from_nothing(tmp_path):
    mine = SharedSeats(tmp_path, "shared", 0, 2, [PRESET])
    dead = SharedSeats(tmp_path, "shared", 1, 2, [PRESET])
    dead.publish(PRESET, 5, 500, 7)
    assert [(f.inside, f.held, f.waiting) for f in mine.others(PRESET)] == [(5, 500, 7)]
    dead.close()
    again = SharedSeats(tmp_path, "shared", 1, 2, [PRESET])  # its turns died with it
    assert [(f.inside, f.held, f.waiting) for f in mine.others(PRESET)] == [(0, 0, 0)]
    mine.close()
    again.close()


def racing_front_end(folder, index: int, count: int, whole: int, turns: int, start, conn):
    """One process: `turns` turns at once, each checking every front end's seats together
    right after it got one (under the lock, as a decision is taken)."""
    async def main():
        gate = front_end(folder, index, count, whole)
        shared = gate.line.shared
        peak, rng = 0, random.Random(index)

        async def turn():
            nonlocal peak
            async with gate.slot():
                with shared.locked():
                    peak = max(peak, gate.inside + sum(f.inside for f in shared.others(PRESET)))
                await asyncio.sleep(rng.uniform(0, 0.01))

        while not start.is_set():
            await asyncio.sleep(0.001)
        await asyncio.gather(*[turn() for _ in range(turns)])
        return peak, gate.inside, gate.waiting

    conn.send(asyncio.run(main()))


def test_front_ends_racing_for_seats_never_seat_more_than_there_are(tmp_path):
    """4 processes x 150 turns at the same moment against 10 seats (a part of 2 each)."""
    context = multiprocessing.get_context("spawn")
    start, count, whole = context.Event(), 4, 10
    pipes = [context.Pipe() for _ in range(count)]
    procs = [context.Process(target=racing_front_end, args=(
        str(tmp_path), i, count, whole, 150, start, theirs)) for i, (_, theirs) in enumerate(pipes)]
    for proc in procs:
        proc.start()
    start.set()
    answers = [mine.recv() for mine, _ in pipes]
    for proc in procs:
        proc.join(30)
    peaks = [peak for peak, _, _ in answers]
    assert max(peaks) <= whole, f"seated {max(peaks)} of {whole} at once"
    assert max(peaks) == whole, "the seats were all used"
    assert all(inside == waiting == 0 for _, inside, waiting in answers)
