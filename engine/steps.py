"""What goes into each step of an engine that several presets share (`engines: shared`).

In one vLLM engine every running request advances one token per step, so a step's duration
is everyone's time between tokens: with hundreds of Throughput-first decodes in it, a step
is long (reading their KV cache dominates) and Latency-first streams move at that pace
(BENCHMARKS.md, "Both profiles at once"). vLLM's priority policy orders admission and preemption, not what shares a step. So
while a higher class's turns run (or wait), each step follows that class's promise:

1. Its step shape: at most its `max_num_batched_tokens` tokens and its
   `long_prefill_token_threshold` per prompt piece (the engine itself is built with the
   largest shape among its presets, which the lower classes use when they run alone).
2. Its pace (`step_ms`): the lower classes' running turns join a step only as far as the
   step stays within it. How many join is adjusted from the measured duration of the
   steps that only decode; the ones that sit a step out are those served longest ago, so
   they take turns, and each gets at least one step in `SLOWEST_SHARE`.
3. Its turns come first in the step's order, and the lower classes' turns let in leave
   room for its waiting turns' first prompt pieces, so a token budget never runs out
   before them (vLLM admits a waiting turn only with budget left after the running ones).
4. Its long-prompt pieces (`long_piece` tokens up to `long_context` tokens of context): a
   prompt piece reads the whole context before it, so its cost grows with how far the
   prompt has got (an 8,192-token piece at 250K tokens of context took 1.7-1.9 s on an
   H100, every other stream waiting as long). While some turn decodes beside
   prompts still being read, each step's piece is cut so that piece x context, summed over
   those prompts, stays at `long_piece x long_context`: pieces of `long_piece` tokens at
   first, smaller in proportion beyond `long_context` (never below `MIN_PIECE`). vLLM's
   own `long_prefill_token_threshold` is one size for every context: small enough for the
   end of a long prompt, it slows the start of every prompt. Alone (nobody decoding) a
   prompt is read in the engine's own pieces.

This module is the policy alone (no vLLM); engine/scheduler.py applies it inside vLLM's
scheduler, in the engine's own process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

STEP_CLASSES_KEY = "vchat_step_classes"  # in vLLM's additional_config: {priority: promise}
SLOWEST_SHARE = 8  # a lower class's running turn gets at least one step in this many
# Between two outputs longer than this, the engine idled: not a step's duration.
IDLE_S = 1.0
SMOOTHING = 0.3  # weight of the newest step's estimate of the seats that fit the pace
# One step's estimate moves at most this far from the seats it ran with (a pause of the
# engine's process, say, is not the GPU's pace).
MOST_CHANGE = 2.0
MIN_PIECE = 64  # a long prompt's piece never shrinks below this: it keeps being read


@dataclass(frozen=True)
class ClassSteps:
    """A class's promise for the steps taken while its turns run (None: no bound)."""

    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    step_ms: float | None = None
    long_piece: int | None = None  # with long_context: a long prompt's pieces (point 4)
    long_context: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Plan:
    """One step's arrangement: who sits it out, the order the rest are taken in, and the
    step shape to apply (None: the engine's own)."""

    skip: frozenset[str] = frozenset()
    order: Mapping[str, int] = field(default_factory=dict)
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    lower_seats: int | None = None  # lower classes' turns let in (when paced)
    step_ms: float | None = None  # the pace it keeps (when paced)
    long_piece: int | None = None  # the piece of each prompt being read (when cut to it)


def long_piece(piece: int, context: int, reading: Sequence[int]) -> int:
    """The piece each prompt being read gets, where `reading` holds how many of each one's
    tokens are in already: together they read about what one `piece` reads at `context`."""
    load = sum(max(done, context) for done in reading)
    return max(MIN_PIECE, min(piece, piece * context // max(load, 1)))


class StepPlanner:
    """Decides each step's plan from the running requests' classes, and learns from the
    measured step durations how many lower-class turns fit the top class's pace."""

    def __init__(self, classes: Mapping[int, ClassSteps]):
        self.classes = dict(classes)
        self.served: dict[str, int] = {}  # request id -> the step it was last scheduled in
        self.step = 0
        self.seats: float | None = None  # the lower classes' seats per step, as learnt
        self._place: dict[str, int] = {}  # lower turns' places in the last step's order
        self._last_output: float | None = None

    def plan(self, running: Sequence[tuple[str, int]], waiting: Iterable[int] = (),
             reading: Sequence[int] = ()) -> Plan | None:
        """`running`: (request id, priority) in the engine's order; `waiting`: priorities
        of the requests not yet running; `reading`: of the running requests whose prompt is
        not all in, how many of its tokens are. None when the step needs no arranging."""
        self.step += 1
        waiting = list(waiting)
        classes = [p for _, p in running] + waiting
        if not classes:
            return None
        top = min(classes)
        promise = self.classes.get(top)
        if promise is None:
            return None
        own = [rid for rid, p in running if p == top]
        # Longest unserved first; among those served at the same step, in the last
        # step's order: the ones left out go round to the front, as in a ring.
        lower = sorted((rid for rid, p in running if p != top),
                       key=lambda rid: (self.served.get(rid, -1), self._place.get(rid, -1)))
        self._place = {rid: i for i, rid in enumerate(lower)}
        seats = len(lower)
        floor = math.ceil(len(lower) / SLOWEST_SHARE)
        paced = bool(lower) and promise.step_ms is not None
        if paced and self.seats is not None:
            seats = max(floor, min(len(lower), round(self.seats)))
        order = {rid: i for i, rid in enumerate(own + lower)}
        budget = promise.max_num_batched_tokens
        if budget is not None:
            # The class's room: a token for each of its running turns and, within the
            # budget, a prompt piece for each of its waiting ones. vLLM takes the running
            # turns first and admits a waiting one only with budget left over, so the lower
            # turns let in (at least their share) must leave the room free.
            piece = promise.long_prefill_token_threshold or 1
            room = len(own) + min(waiting.count(top) * piece, max(0, budget - len(own)))
            seats = max(floor, min(seats, budget - room))
            budget = max(budget, room + seats)
        threshold, piece = promise.long_prefill_token_threshold, None
        if promise.long_piece and promise.long_context and len(running) > len(reading):
            # Someone decodes: prompts are read in pieces, a new one's first at most
            # `long_piece` (vLLM cuts running and waiting prompts alike).
            piece = long_piece(promise.long_piece, promise.long_context, reading) \
                if reading else promise.long_piece
            threshold = min(threshold or piece, piece)
        return Plan(frozenset(lower[seats:]), order, budget, threshold,
                    seats if paced else None, promise.step_ms if paced else None, piece)

    def scheduled(self, request_ids: Iterable[str], running: Iterable[str]) -> None:
        """Record who got tokens this step; forget requests no longer running."""
        alive = set(running)
        self.served = {rid: s for rid, s in self.served.items() if rid in alive}
        for rid in request_ids:
            self.served[rid] = self.step

    def output(self, now: float, paced: Plan | None = None) -> None:
        """A step's output arrived at `now`. For a `paced` step that only decoded, its
        duration (since the previous output: the engine runs its steps back to back) says
        how many lower seats would have kept its `step_ms`, in proportion; the seats move a
        part of the way there. A quick step that left nobody out says nothing of how many
        more would fit."""
        last, self._last_output = self._last_output, now
        if paced is None or paced.step_ms is None or last is None or now - last > IDLE_S:
            return
        took, pace = max(now - last, 1e-6), paced.step_ms / 1000
        if not paced.skip and took <= pace:
            return
        change = min(MOST_CHANGE, max(1 / MOST_CHANGE, pace / took))
        estimate = max(1.0, paced.lower_seats * change)
        self.seats = estimate if self.seats is None else \
            (1 - SMOOTHING) * self.seats + SMOOTHING * estimate
