"""service/shutdown.py: the drain's own logic (pure asyncio). The real server's graceful stop
is tested in tests/test_process.py."""

import asyncio

from service.shutdown import Shutdown


async def test_drain_waits_for_turns_that_finish_in_time_and_cuts_the_rest():
    shutdown = Shutdown(grace_s=0.3)
    ended = []

    async def turn(name: str, takes: float):
        with shutdown.turn():
            try:
                await asyncio.sleep(takes)
                ended.append((name, "finished"))
            except asyncio.CancelledError:
                ended.append((name, "cut"))
                raise

    tasks = [asyncio.create_task(turn("short", 0.05)), asyncio.create_task(turn("long", 30))]
    await asyncio.sleep(0)
    assert shutdown.turns == 2 and not shutdown.closing
    started = asyncio.get_running_loop().time()
    assert await shutdown.drain() == (1, 1)
    took = asyncio.get_running_loop().time() - started
    assert shutdown.closing and shutdown.turns == 0
    assert sorted(ended) == [("long", "cut"), ("short", "finished")]
    assert 0.25 < took < 5, "the long turn gets the grace period, then no more"
    assert tasks[1].cancelled()


async def test_drain_with_nothing_in_flight_returns_at_once():
    shutdown = Shutdown(grace_s=30)
    assert await asyncio.wait_for(shutdown.drain(), 1) == (0, 0)
    assert shutdown.closing


async def test_a_turn_that_fails_still_leaves_the_count():
    shutdown = Shutdown(grace_s=1)

    async def failing():
        with shutdown.turn():
            raise ValueError("boom")

    task = asyncio.create_task(failing())
    await asyncio.wait([task])
    assert shutdown.turns == 0 and isinstance(task.exception(), ValueError)


async def test_work_a_turn_left_to_finish_later_is_waited_for_but_not_counted_as_a_turn():
    shutdown = Shutdown(grace_s=5)
    saved = []

    async def save():
        await asyncio.sleep(0.1)
        saved.append("the turn's writes")

    shutdown.finish_later(save())
    assert shutdown.turns == 0, "not a turn in flight (readiness counts turns)"
    assert await shutdown.drain() == (1, 0)
    assert saved == ["the turn's writes"]
