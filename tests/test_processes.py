"""A dead engine's processes are ended before it starts again (engine/processes.py). The
engines' own cases, a worker left stopped when its core is killed, are in test_app.py (one
front end) and test_front_ends.py (the launcher's cores)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import psutil

from engine.processes import CoreProcesses
from tools.polling import until

# A "core" that starts a "worker" of its own, as vLLM's CPU core does; the worker's extra
# line may make it ignore SIGTERM (one that would not end when asked).
CORE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(600)
"""
WORKER = "import signal, time\n{}\ntime.sleep(600)"
IGNORES_TERM = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"


def core_with_worker(worker_line: str = "") -> tuple[subprocess.Popen, psutil.Process]:
    core = subprocess.Popen([sys.executable, "-c", CORE, WORKER.format(worker_line)])
    parent = psutil.Process(core.pid)
    deadline = time.monotonic() + 30
    while not parent.children():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    return core, parent.children()[0]


def gone(proc: psutil.Process) -> bool:
    return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE


def test_a_dead_cores_worker_that_ends_when_asked_is_asked():
    core, worker = core_with_worker()
    noted = CoreProcesses([core.pid])
    assert {p.pid for p in noted.processes} == {core.pid, worker.pid}
    core.kill()
    core.wait()
    assert noted.running() == [worker]  # the dead core is not counted; its worker is
    noted.ended(grace_s=60)
    assert gone(worker)
    assert noted.running() == []


async def test_one_that_ignores_it_or_is_stopped_is_killed_past_the_grace():
    cores = [core_with_worker(IGNORES_TERM), core_with_worker()]
    cores[1][1].suspend()  # a stopped one takes no signal but SIGKILL until resumed
    noted = [CoreProcesses([core.pid]) for core, _ in cores]
    for core, _ in cores:
        core.kill()
        core.wait()
    await asyncio.gather(*[n.ended_async(grace_s=1.0) for n in noted])
    left = await until(lambda: [w for _, w in cores if not gone(w)], lambda left: left == [],
                       timeout=10)
    assert left == []
