"""An engine's seats shared by the front ends that run on its core (launcher.py).

Each front end has lines of its own (engine/admission.py) and a part of each preset's seats
(the seats over the front ends, at least 1). Split alone, the parts left seats idle
whenever the kernel handed one front end more users than another: 1,000 guests over 4
front ends came to 230 on one and 270 on another, and the second's last turns ran while the
first's seats stood empty (H100, 2026-12-07: 0.63x the engine path at the same seats).
So the parts are only what each front end is sure of: a front end also takes a seat another
leaves free, while no other front end's turn waits for its own part; as those turns end,
the seats go back to whoever waits for its part. All of them together never seat more than
the preset's seats, and never hold more of the KV cache than it has.

The figures live in a small file in the launcher's private folder, mapped into each front
end's memory: per front end and preset, its turns inside, the cache they hold and its
turns waiting. Each front end writes only its own; a decision to seat a turn reads the
others' and writes its own under one lock on that file (fcntl.flock), so two front ends
cannot both take the last seat. A front end that starts (or starts again after dying)
zeroes its own figures first.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("inside", "held", "waiting")
POLL_S = 0.02  # how often a front end with turns waiting looks for seats others left free


@dataclass(frozen=True)
class Figures:
    inside: int
    held: int
    waiting: int


class SharedSeats:
    """One engine's figures in `folder`, as front end `index` of `count` sees them, for the
    presets named (the same list, in the same order, in every front end)."""

    def __init__(self, folder: str | Path, engine: str, index: int, count: int,
                 presets: list[str]):
        if not 0 <= index < count:
            raise ValueError(f"front end {index} of {count}")
        self.index, self.count = index, count
        self.presets = {name: i for i, name in enumerate(presets)}
        size = count * len(presets) * len(FIELDS) * 8
        path = Path(folder) / f"seats-{engine.replace('/', '_')}"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._depth = 0
        with self.locked():
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            self._cells = memoryview(self._map).cast("q")
            for preset in presets:
                self.publish(preset, 0, 0, 0)

    def _at(self, index: int, preset: str) -> int:
        return (index * len(self.presets) + self.presets[preset]) * len(FIELDS)

    @contextlib.contextmanager
    def locked(self):
        """Every front end's figures held still: a decision read and written within it is
        the only one at that moment. Re-entered freely within one process."""
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def publish(self, preset: str, inside: int, held: int, waiting: int) -> None:
        """This front end's own figures for `preset`."""
        at = self._at(self.index, preset)
        self._cells[at], self._cells[at + 1], self._cells[at + 2] = inside, held, waiting

    def others(self, preset: str) -> list[Figures]:
        """The other front ends' figures for `preset`."""
        return [Figures(*self._cells[self._at(i, preset):self._at(i, preset) + len(FIELDS)])
                for i in range(self.count) if i != self.index]

    def others_held(self) -> int:
        """The KV cache the other front ends' turns hold, every preset's together."""
        return sum(f.held for preset in self.presets for f in self.others(preset))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._cells.release()
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
