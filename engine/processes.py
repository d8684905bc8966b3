"""The processes an engine's core runs, ended with it.

vLLM's core starts processes of its own (on CPU the model runs in a worker process; several
GPUs, one worker each). When the core dies (killed, out of memory), each of its workers
sees its parent gone and exits by itself, seconds later (3 s on an idle 2-core machine, 6 s
beside 3 busy processes); one that does not (a full test run once found one still running
after its engine had started again; a stopped one never would) keeps its model weights and
KV cache in memory while the engine is started again, which then may not fit. So each
core's processes are noted once it runs (`CoreProcesses`), and before its engine starts
again, those still running are asked to end (SIGTERM: a worker's own clean exit) and, past
`END_GRACE_S`, killed.

Each is a psutil.Process, which tells a process from a later one given the same pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import psutil

log = logging.getLogger(__name__)

END_GRACE_S = 10.0  # a worker asked to end that still runs then is killed
POLL_S = 0.1


class CoreProcesses:
    """The processes of the cores `pids` (and theirs), as they are now."""

    def __init__(self, pids: Iterable[int]):
        self.processes: list[psutil.Process] = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                core = psutil.Process(pid)
                self.processes += [core, *core.children(recursive=True)]

    @classmethod
    def of_manager(cls, manager) -> CoreProcesses:
        """Those of vLLM's engine manager (its `processes`; none where it runs none here)."""
        return cls(proc.pid for proc in getattr(manager, "processes", ()) or ()
                   if proc.pid is not None)

    def running(self) -> list[psutil.Process]:
        """Those still running (a zombie has ended: only its parent's wait is left)."""
        alive = []
        for proc in self.processes:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        return alive

    def end(self) -> list[psutil.Process]:
        """Ask those still running to end; returns them."""
        left = self.running()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
                proc.resume()  # a stopped process takes its SIGTERM only once resumed
        if left:
            log.warning("Processes of a dead engine still running, asked to end: %s",
                        ", ".join(f"{p.pid}" for p in left))
        return left

    def kill(self, grace_s: float) -> None:
        for proc in self.running():
            log.error("Process %d of a dead engine did not end in %.0f s: killed", proc.pid,
                      grace_s)
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def ended(self, grace_s: float = END_GRACE_S) -> None:
        """Until every one has ended: asked, then killed past `grace_s` (blocking)."""
        deadline = time.monotonic() + grace_s
        if self.end():
            while self.running() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            self.kill(grace_s)

    async def ended_async(self, grace_s: float = END_GRACE_S) -> None:
        """`ended`, in a worker thread: the event loop serves on meanwhile."""
        await asyncio.to_thread(self.ended, grace_s)
