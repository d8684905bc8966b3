"""Engine lifecycles (engine/pool.py, engine/llm.py): a start or restart under way when the
app stops leaves no engine behind. The dead-engine restart itself is tested on the real
server in test_app.py."""

import asyncio
import functools
import os
import time

import psutil
import pytest

from engine import Engines
from engine.launch import Machine, engine_setup
from engine.llm import PresetEngine
from engine.model import resolve_model
from engine.pool import RESTART_BACKOFF_S
from engine.standin import StandInEngine


async def test_shutdown_during_a_restart_leaves_no_engine_running(config):
    """Regression: restart tasks were fire-and-forget; shutdown did not cancel them, so a
    restart could put a live engine back after the app stopped. With the labelled
    STAND-IN engine (no model), whose start is quick."""
    engines = Engines(config, engine_class=functools.partial(StandInEngine, tokens_per_s=100))
    await engines.start()
    (name,) = engines.engines  # one engine for both presets
    engines.engines[name].shutdown()  # the engine dies
    deadline = time.monotonic() + 10
    while name not in engines.restarting:
        assert time.monotonic() < deadline, "the watchdog never noticed"
        await asyncio.sleep(0.05)
    restart = engines._restarting[name]  # the restart under way, in its back-off
    engines.shutdown()
    await asyncio.wait([restart], timeout=RESTART_BACKOFF_S[0] + 30)
    assert restart.cancelled(), "the restart went on after shutdown"
    assert engines.engines == {} and engines.restarting == set()
    assert engines.state == "stopped"


async def test_health_while_another_engine_joins_reads_those_there_when_asked(config):
    """Regression (seen in CI, the deployment test): /ready's health check awaits each
    engine's check while remote presets' engines join the pool, and the iteration over
    the pool broke ("dictionary changed size during iteration", a trace for /ready).
    With the labelled STAND-IN engine (no model)."""
    engines = Engines(config, engine_class=functools.partial(StandInEngine, tokens_per_s=100))
    await engines.start()
    try:
        (name,) = engines.engines
        engine = engines.engines[name]
        checked = engine.check_health

        async def joined_meanwhile():
            engines.engines["another"] = engine  # as a remote preset's engine joins
            return await checked()

        engine.check_health = joined_meanwhile
        health = await engines.health()
        assert list(health["engines"]) == [name]
    finally:
        engines.engines.pop("another", None)
        engines.shutdown()


def engine_cores() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)
            if p.name() == "VLLM::EngineCore"}


async def test_a_start_cancelled_midway_leaves_no_engine_process(config):
    """vLLM builds an engine in a worker thread, which a cancelled start() cannot stop: the
    build must shut its engine down itself once it finishes."""
    setup = engine_setup(config, config.presets["latency-first"],
                         await asyncio.to_thread(resolve_model, config.model), Machine.here())
    engine = PresetEngine("cancelled", setup.with_args(kv_cache_memory_bytes=256 << 20,
                                                       max_num_seqs=4))
    before = engine_cores()
    task = asyncio.create_task(engine.start())
    deadline = time.monotonic() + 120
    while not engine_cores() - before:  # the build is under way
        assert time.monotonic() < deadline and not task.done(), "no engine process started"
        await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 180
    while engine_cores() - before:
        assert time.monotonic() < deadline, "the cancelled start left its engine running"
        await asyncio.sleep(0.5)
    assert not engine.running
