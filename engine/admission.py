"""Admission control in front of an engine: bounded lines, seats, fair shares, the KV cache.

Each preset has an `Admission`: at most `running` of its turns are inside the engine at once
(its seats), up to `queued` more wait and are told their place whenever it changes; beyond
that a turn is refused at once with a `Busy` saying so. A waiting turn that is cancelled
(Stop, a closed browser) leaves the line and the turns behind it move up.

Fair shares: every turn belongs to someone (`who`: an account, or a chat session
or the operator's API key where there is none), and the line is fair across them, FIFO
within one: a free seat goes to the waiting turn of whoever has the fewest turns inside
(ties: the one waiting longest), so one account's 300 requests do not keep anyone else
waiting behind them. Two caps, both off while an account is alone:
1. seats: while someone else has a turn inside or waiting, an account gets no new seat
   beyond `account_share` of them; seats it holds already are kept (nothing is preempted),
   and those it frees stay free for the others, so their next turns find a seat at once;
2. the line: while it is full, an account waiting with more than `account_queued_share` of
   it gives up its newest waiting turn to another's newcomer (refused with a `Busy` naming
   that account's own limit), and a newcomer of such an account is refused itself.
Places are places in that fair order, told again whenever they change: a newcomer with
fewer turns inside goes ahead of the turns it passes, and a turn that ends moves its
account's waiting turns up.

The presets that run on one engine share its `Line`, which counts the engine's KV cache:
each turn holds its worst case (prompt + max tokens, in whole cache blocks) from admission to
its end, and a turn is let in only when that fits, so vLLM never runs out of cache and never
preempts (recomputes) a running turn. Presets are served by priority (lower first, vLLM's
convention): a turn of a lower class waits while one of a higher class waits for cache, and
lower classes may not take the cache a higher one keeps (`keep_tokens`), so a
Latency-first turn finds room at once even when Throughput-first's turns fill the rest.
Seats are each preset's own (the engine runs the sum), so they are never taken from another.
Every decision is taken in the same synchronous step as the seat (no await in between).

With several front ends (launcher.py) each has its own `Admission`s with its part of each
preset's seats (engine/pool.py), and takes a seat another front end leaves free while none
of theirs waits for its own part (engine/seats.py: the seats and the KV cache every front
end's turns hold are counted together, the decision under one lock, so together they never
seat more than the preset's seats nor hold more than the cache). Shares and places are fair
within each front end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

from .errors import Busy
from .seats import POLL_S, SharedSeats


class _Waiter:
    def __init__(self, loop: asyncio.AbstractEventLoop, tokens: int, who: Hashable, seq: int):
        self.tokens, self.who, self.seq = tokens, who, seq  # seq: its arrival, for ties
        self.admitted = loop.create_future()  # a Busy when pushed out of a full line
        self.told: int | None = None  # the place it was last told (None: not listening)
        self.told_at = float("-inf")  # when (the loop's clock)
        self.moved = asyncio.Event()  # its place is no longer `told`


class Line:
    """One engine's KV cache (`kv_tokens`; None: not counted here, as for a remote server),
    shared by the presets' `Admission`s that run on it."""

    def __init__(self, kv_tokens: int | None = None, block_size: int = 1,
                 shared: SharedSeats | None = None):
        self.kv_tokens = kv_tokens
        self.block_size = max(1, block_size)
        self.classes: list[Admission] = []  # by priority, highest first
        self.shared = shared  # the other front ends' figures on this engine, if any
        self._poller: asyncio.Task | None = None

    @property
    def held(self) -> int:
        """Tokens the turns inside hold, every class's together (this front end's)."""
        return sum(g.held for g in self.classes)

    def held_everywhere(self) -> int:
        """And every other front end's on this engine."""
        return self.held + (self.shared.others_held() if self.shared else 0)

    def locked(self):
        """The other front ends' figures held still while a seat is decided and taken."""
        return self.shared.locked() if self.shared else contextlib.nullcontext()

    def watch(self) -> None:
        """While turns wait here, look now and then for seats another front end left free
        (its turns ending wake only its own waiters)."""
        if self.shared is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while any(g.waiting for g in self.classes):
            await asyncio.sleep(POLL_S)
            self.admit()

    def need(self, tokens: int) -> int:
        """A turn's worst case in the cache, in tokens of whole blocks (0 when not counted)."""
        if self.kv_tokens is None:
            return 0
        return -(-max(tokens, 1) // self.block_size) * self.block_size

    def join(self, gate: "Admission") -> None:
        self.classes.append(gate)
        self.classes.sort(key=lambda g: g.priority)

    def cap_for(self, gate: "Admission") -> int | None:
        """The most cache `gate`'s turns may hold with everyone else's: all of it, less what
        higher classes keep."""
        if self.kv_tokens is None:
            return None
        kept = sum(g.keep_tokens for g in self.classes if g.priority < gate.priority)
        return max(0, self.kv_tokens - kept)

    def fits(self, gate: "Admission", tokens: int) -> bool:
        cap = self.cap_for(gate)
        if cap is None:
            return True
        held = self.held_everywhere()
        return held == 0 or held + tokens <= cap  # a turn alone always goes in (vLLM checked
                                                  # that the context fits the cache at start)

    def admit(self) -> None:
        """Let in every waiter that now fits, highest class first, each class's in its fair
        order; a class whose next turn waits for cache holds back the classes below it (one
        whose next waits for its account's share does not). Then the waiters are told."""
        try:
            with self.locked():
                for gate in self.classes:
                    while gate._has_seat():
                        waiter = gate._next()
                        if waiter is None:
                            break
                        if not self.fits(gate, waiter.tokens):
                            return
                        gate._take(waiter)
                        waiter.admitted.set_result(None)
        finally:
            for gate in self.classes:
                gate._tell_moved()


class Admission:
    def __init__(self, running: int, queued: int, *, line: Line | None = None,
                 priority: int = 0, keep_tokens: int = 0, account_share: float = 1.0,
                 account_queued_share: float = 1.0, name: str = "", whole: int | None = None,
                 tell_every_s: float = 0.0):
        # `running`: this front end's own seats; `whole`: every front end's together, when
        # the line's engine is shared with others (`line.shared`), under the preset's `name`.
        self.running, self.queued = running, queued
        self.name, self.whole = name, whole or running
        # A waiting turn is told its place again at most this often (0: at every move): in
        # a line of hundreds each turn that ends moves all of them, and each telling is a
        # message to a browser.
        self.tell_every_s = tell_every_s
        self.priority, self.keep_tokens = priority, keep_tokens
        # The most seats, and places in a full line, one account keeps beside others'.
        self.account_seats = max(1, int(account_share * running))
        self.account_queued = max(1, int(account_queued_share * queued))
        self.line = line or Line()
        self.line.join(self)
        self.inside = 0
        self.held = 0  # the cache this class's turns inside hold
        self.waiting = 0
        self.refused_over_share = 0  # turns refused for their account's share of the line
        self._inside: collections.Counter = collections.Counter()  # by who; no zeros
        self._lines: dict[Hashable, collections.deque[_Waiter]] = {}  # by who; none empty
        self._arrivals = itertools.count()
        self._places: dict[_Waiter, int] | None = None  # the fair order, until it changes
        self._unsaid = False  # places may have changed since the waiters were last told

    def shares(self) -> dict:
        """How the seats and the line are shared now, in figures only (no one named)."""
        return {"accounts_admitted": len(self._inside), "accounts_queued": len(self._lines),
                "largest_admitted": max(self._inside.values(), default=0),
                "largest_queued": max(map(len, self._lines.values()), default=0),
                "account_seats": self.account_seats, "account_queued": self.account_queued,
                "refused_over_share": self.refused_over_share}

    @contextlib.asynccontextmanager
    async def slot(self, on_queued: Callable[[int], Awaitable[None]] | None = None,
                   tokens: int = 0, who: Hashable = None
                   ) -> AsyncIterator[Callable[[], None]]:
        """Hold a seat, and `tokens` of the cache (the turn's prompt + max tokens), for the
        body, as one of `who`'s turns; wait in line first if it is not next or either is
        taken. The body gets `leave()`, which gives both back before it ends: once the
        engine has finished the turn, while its last words still go to the user.

        `on_queued(place)` is awaited when the turn has to wait (place 1 = next in line)
        and again each time its place changes.
        """
        need = self.line.need(tokens)
        waiter = _Waiter(asyncio.get_running_loop(), need, who, next(self._arrivals))
        with self.line.locked():  # to ask whether it is next: one step, no await before it
            self._add(waiter)     # goes in
            taken = self._has_seat() and self._next() is waiter \
                and not self._held_back() and self.line.fits(self, need)
            if taken:
                self._take(waiter)
        if not taken:
            await self._wait(waiter, on_queued)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self._leave(who, need)

        try:
            yield leave
        finally:
            leave()

    def _has_seat(self) -> bool:
        """Whether a seat is free for this front end's next turn: one of its own, or one
        another front end leaves free while none of theirs waits for its own part; never
        beyond the preset's seats (every front end's turns inside together)."""
        shared = self.line.shared
        if shared is None:
            return self.inside < self.running
        others = shared.others(self.name)
        if self.inside + sum(o.inside for o in others) >= self.whole:
            return False
        return self.inside < self.running or not any(
            o.waiting and o.inside < self.running for o in others)

    def _publish(self) -> None:
        if self.line.shared is not None:
            self.line.shared.publish(self.name, self.inside, self.held, self.waiting)

    def _add(self, waiter: _Waiter) -> None:
        self._lines.setdefault(waiter.who, collections.deque()).append(waiter)
        self.waiting += 1
        self._publish()

    def _remove(self, waiter: _Waiter) -> None:
        line = self._lines[waiter.who]
        line.remove(waiter)
        if not line:
            del self._lines[waiter.who]
        self.waiting -= 1
        self._publish()
        self._moved()

    def _next(self) -> _Waiter | None:
        """The next in the fair order, if it may take a seat: None while that one's account
        holds its share of the seats beside someone else's turns."""
        best = min(self._lines.items(), default=None,
                   key=lambda item: (self._inside[item[0]], item[1][0].seq))
        if best is None:
            return None
        who, line = best
        if self._inside[who] >= self.account_seats and (
                any(w != who for w in self._inside) or len(self._lines) > 1):
            return None
        return line[0]

    def _held_back(self) -> bool:
        """A higher class's turn waits for cache (not for a seat of its own, nor for its
        account's share): this one may not go before it."""
        return any(g._has_seat() and g._next() is not None
                   for g in self.line.classes if g.priority < self.priority)

    def _take(self, waiter: _Waiter) -> None:
        self._remove(waiter)
        self.inside += 1
        self._inside[waiter.who] += 1
        self.held += waiter.tokens
        self._publish()

    def _leave(self, who: Hashable, need: int) -> None:
        self.inside -= 1
        self._inside[who] -= 1
        if not self._inside[who]:
            del self._inside[who]
        self.held -= need
        self._publish()
        self._moved()  # places follow the counts inside
        self.line.admit()

    def _place(self, waiter: _Waiter) -> int:
        """`waiter`'s place in the fair order (1: next): the order seats would go in if they
        freed one at a time and no one came or went."""
        if self._places is None:
            self._places = {}
            heap = [(self._inside[who], line[0].seq, who, 0) for who, line in self._lines.items()]
            heapq.heapify(heap)  # (seq is unique: `who` is never compared)
            while heap:
                count, _, who, i = heapq.heappop(heap)
                line = self._lines[who]
                self._places[line[i]] = len(self._places) + 1
                if i + 1 < len(line):
                    heapq.heappush(heap, (count + 1, line[i + 1].seq, who, i + 1))
        return self._places[waiter]

    async def _wait(self, waiter: _Waiter, on_queued) -> None:
        if self.waiting > self.queued:  # counting this one
            self._make_room(waiter)
        self.line.watch()
        self._moved()
        self._tell_moved()  # those it passed move back
        loop = asyncio.get_running_loop()
        try:
            while not waiter.admitted.done():
                place, due = self._place(waiter), None
                if on_queued is not None and place != waiter.told:
                    due = waiter.told_at + self.tell_every_s - loop.time()
                    if due <= 0:
                        waiter.told, waiter.told_at = place, loop.time()
                        await on_queued(place)
                        continue  # the place may have changed meanwhile
                waiter.moved.clear()
                moved = asyncio.ensure_future(waiter.moved.wait())
                try:  # (told too lately: its new place is said once `due` has passed)
                    await asyncio.wait({waiter.admitted, moved}, timeout=due,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
        except BaseException:
            admitted = waiter.admitted
            if not admitted.done():
                admitted.cancel()
                self._remove(waiter)
                self.line.admit()  # it may have held back others, or kept them to a share
            elif not admitted.cancelled() and admitted.exception() is None:
                self._leave(waiter.who, waiter.tokens)  # admitted as it was cancelled:
            raise                                       # the place goes on
        waiter.admitted.result()  # a Busy: pushed out of the line by another's turn

    def _make_room(self, waiter: _Waiter) -> None:
        """The line is full: `waiter` is refused, or pushes out the newest turn of the
        account waiting with the most beyond its share."""
        who, mine = waiter.who, len(self._lines[waiter.who])
        others = [w for w in self._lines if w != who]
        over = max(others, default=None, key=lambda w: (len(self._lines[w]),
                                                        self._lines[w][-1].seq))
        if self.queued and mine > self.account_queued and others:
            self._remove(waiter)
            self.refused_over_share += 1
            raise self._over_share(mine - 1)  # its others waiting
        if not self.queued or over is None or len(self._lines[over]) <= self.account_queued:
            self._remove(waiter)
            raise Busy(f"This chat is busy right now: {self.inside} replies are being "
                       f"written and {self.waiting} messages are waiting. Please try "
                       "again in a minute; your message was not sent.")
        pushed = self._lines[over][-1]
        self._remove(pushed)
        self.refused_over_share += 1
        pushed.admitted.set_exception(self._over_share(len(self._lines[over])))

    def _over_share(self, waiting: int) -> Busy:
        return Busy(f"Too many of your requests are waiting already: {waiting} for this "
                    f"model, and one account keeps at most {self.account_queued} places in its "
                    "full line while others wait too. This one was not sent; please send it "
                    "again once your earlier ones have been answered.")

    def _moved(self) -> None:
        self._places, self._unsaid = None, True

    def _tell_moved(self) -> None:
        """Wake the waiters whose place is not the one they were told."""
        if not self._unsaid:
            return
        self._unsaid = False
        for line in self._lines.values():
            for waiter in line:
                if waiter.told is not None and self._place(waiter) != waiter.told:
                    waiter.moved.set()
