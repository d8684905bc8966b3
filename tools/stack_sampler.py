"""Where a process's main thread spends its time, sampled from inside it (a diagnostic for
machines where no profiler can be installed, such as the H200 one).

A thread wakes every `every_s`, takes the main thread's stack and counts it; between
`start_s` and `stop_s` after the process started, and writes the counts as collapsed
stacks ("outer;inner;innermost count", the input of flame-graph tools) to `path` every
10 s and at the end. The sampler needs the GIL to look, so it sees the main thread where
it lets go of it (a blocking C call, or the interpreter's switch interval): a rough
picture of what holds the event loop, not a precise one.

Loaded into a server that cannot be changed, through `sitecustomize` (a folder first on
PYTHONPATH holding a sitecustomize.py that calls `from_env()`):
    STACK_SAMPLES=out.txt:150:230 (path:start_s:stop_s), only in processes whose
    command line contains STACK_SAMPLES_MATCH (default "app.py"), checked at start_s: while
    sitecustomize runs, `python -m chainlit run app.py` has no module name in sys.argv yet.
    Each such process writes `path.main.PID`, or `path.spawned.PID` where multiprocessing
    spawned it (vLLM's engine process, which is given the app's command line).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import threading
import time

TICK_S = 0.002
WRITE_EVERY_S = 10.0


def stack_of(frame) -> str:
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return ";".join(reversed(names))


class StackSampler:
    def __init__(self, path: str, start_s: float, stop_s: float, every_s: float = TICK_S,
                 match: str = "", named: bool = False):
        self.match, self.named = match, named  # named: the file's name gets role and pid
        self.path, self.start_s, self.stop_s, self.every_s = path, start_s, stop_s, every_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.main = threading.main_thread().ident
        self.began = time.monotonic()

    def start(self) -> None:
        threading.Thread(target=self._run, name="stack-sampler", daemon=True).start()

    def _run(self) -> None:
        time.sleep(max(0.0, self.start_s - (time.monotonic() - self.began)))
        if self.match not in " ".join(sys.argv):
            return
        if self.named:  # vLLM's engine process is spawned with the app's command line
            role = "spawned" if multiprocessing.parent_process() is not None else "main"
            self.path = f"{self.path}.{role}.{os.getpid()}"
        written = time.monotonic()
        while time.monotonic() - self.began < self.stop_s:
            frame = sys._current_frames().get(self.main)
            if frame is not None:
                self.counts[stack_of(frame)] += 1
            del frame
            time.sleep(self.every_s)
            if time.monotonic() - written > WRITE_EVERY_S:
                self.write()
                written = time.monotonic()
        self.write()

    def write(self) -> None:
        with open(self.path, "w") as out:
            for stack, n in self.counts.most_common():
                out.write(f"{stack} {n}\n")


def from_env() -> StackSampler | None:
    spec = os.environ.get("STACK_SAMPLES")
    if not spec:
        return None
    path, start_s, stop_s = spec.rsplit(":", 2)
    sampler = StackSampler(path, float(start_s), float(stop_s),
                           match=os.environ.get("STACK_SAMPLES_MATCH", "app.py"), named=True)
    sampler.start()
    return sampler
