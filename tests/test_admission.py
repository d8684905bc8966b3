"""The admission queue in front of an engine (engine/admission.py), on its own."""

import asyncio

import pytest

from engine import Busy, ChatError, ConfigError
from engine.admission import Admission, Line
from engine.config import load_config
from tools.chainlit_client import ROOT


class Turn:
    """One turn of `who`'s holding a place until `done` is set; records the places it was
    told, and a Busy that refused it (else it raises)."""

    def __init__(self, gate: Admission, who=None):
        self.who = who
        self.places: list[int] = []
        self.inside = asyncio.Event()
        self.done = asyncio.Event()
        self.refused: Busy | None = None
        self.task = asyncio.ensure_future(self.run(gate))

    async def told(self, place: int) -> None:
        self.places.append(place)

    async def run(self, gate: Admission):
        try:
            async with gate.slot(self.told, who=self.who):
                self.inside.set()
                await self.done.wait()
        except Busy as exc:
            self.refused = exc


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


async def test_a_turn_that_leaves_early_gives_its_seat_and_cache_back_once():
    """The engine finished the turn while its caller still sends its last words (paced:
    chat/streaming.py): the seat and its cache go to the next turn then, and leaving the
    body afterwards gives back nothing more."""
    gate = Admission(running=1, queued=2, line=Line(kv_tokens=100))
    order = []

    async def first():
        async with gate.slot(tokens=80) as leave:
            order.append("first in")
            leave()
            leave()  # twice: still one seat given back
            await asyncio.sleep(0.05)  # its last words going out
            order.append("first out")

    async def second():
        await asyncio.sleep(0)
        async with gate.slot(tokens=80):
            order.append("second in")
            assert gate.inside == 1 and gate.held == 80

    await asyncio.gather(first(), second())
    assert order == ["first in", "second in", "first out"]
    assert gate.inside == 0 and gate.waiting == 0 and gate.held == 0


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


class SizedTurn(Turn):
    """A turn that holds `tokens` of the engine's KV cache."""

    def __init__(self, gate: Admission, tokens: int, who=None):
        self.tokens = tokens
        super().__init__(gate, who)

    async def run(self, gate: Admission):
        async with gate.slot(self.told, tokens=self.tokens, who=self.who):
            self.inside.set()
            await self.done.wait()


async def test_turns_wait_while_their_worst_case_does_not_fit_the_cache():
    line = Line(kv_tokens=1000, block_size=16)
    gate = Admission(running=8, queued=8, line=line)
    big = SizedTurn(gate, 600)       # 38 blocks: 608 tokens
    small = SizedTurn(gate, 300)     # 304: 912 in all, fits
    late = SizedTurn(gate, 200)      # 208 more would be 1,120: waits, though seats are free
    await settle()
    assert [t.inside.is_set() for t in (big, small, late)] == [True, True, False]
    assert late.places == [1] and line.held == 912
    big.done.set()
    await settle()
    assert late.inside.is_set() and line.held == 512
    small.done.set(), late.done.set()
    await asyncio.gather(big.task, small.task, late.task)
    assert line.held == 0 and gate.inside == 0


async def test_a_turn_alone_goes_in_even_if_larger_than_its_share():
    line = Line(kv_tokens=1000)
    Admission(running=4, queued=4, line=line, priority=0, keep_tokens=800)
    low = Admission(running=4, queued=4, line=line, priority=1)
    whole = SizedTurn(low, 900)  # more than the 200 low may hold beside others: alone, it runs
    await settle()
    assert whole.inside.is_set()
    whole.done.set()
    await whole.task


async def test_higher_priority_keeps_its_room_and_goes_first_when_cache_frees():
    line = Line(kv_tokens=1000)
    high = Admission(running=2, queued=4, line=line, priority=0, keep_tokens=400)
    low = Admission(running=8, queued=8, line=line, priority=1)
    lows = [SizedTurn(low, 250) for _ in range(4)]
    await settle()
    # low may hold 1000 - 400: two of its turns run, two wait although low has seats.
    assert [t.inside.is_set() for t in lows] == [True, True, False, False]
    first = SizedTurn(high, 300)  # the kept room: in at once, beside low's 500
    await settle()
    assert first.inside.is_set() and line.held == 800
    second = SizedTurn(high, 300)  # 1,100 would not fit: waits for cache ...
    await settle()
    assert not second.inside.is_set()
    lows[0].done.set()  # 250 freed: low's next in line must not take it before `second`
    await settle()
    assert second.inside.is_set() and not lows[2].inside.is_set()
    assert high.inside == 2 and low.inside == 1
    for t in [*lows, first, second]:
        t.done.set()
    await asyncio.gather(*[t.task for t in [*lows, first, second]])
    assert line.held == 0 and low.waiting == high.waiting == 0


async def test_seats_are_each_class_own():
    line = Line(kv_tokens=None)  # not counted (remote): only seats
    high = Admission(running=1, queued=2, line=line, priority=0)
    low = Admission(running=1, queued=2, line=line, priority=1)
    a, b = SizedTurn(high, 10), SizedTurn(high, 10)
    c = SizedTurn(low, 10)  # high waits for a seat of its own, not for cache: low goes in
    await settle()
    assert a.inside.is_set() and not b.inside.is_set() and c.inside.is_set()
    for t in (a, b, c):
        t.done.set()
    await asyncio.gather(a.task, b.task, c.task)


# Fair shares across accounts (issue 53).


async def finish(turns):
    for t in turns:
        t.done.set()
    await asyncio.gather(*[t.task for t in turns])


def inside(turns) -> list[bool]:
    return [t.inside.is_set() for t in turns]


async def test_one_accounts_burst_does_not_keep_anothers_turn_behind_its_backlog():
    """300 requests of one account at once beside one of another's: the other's turn takes
    the next free seat, and the burst's excess is refused, naming its own limit."""
    gate = Admission(running=4, queued=16, account_share=0.5, account_queued_share=0.25)
    heavy = [Turn(gate, "heavy") for _ in range(300)]
    await settle()
    # Alone it uses every seat and the whole line; the rest is busy as before.
    assert sum(inside(heavy)) == 4 and gate.waiting == 16
    assert sum(t.refused is not None for t in heavy) == 280
    assert "busy right now" in str(heavy[-1].refused)
    assert [t.places for t in heavy[4:20]] == [[i] for i in range(1, 17)]
    light = Turn(gate, "light")  # the line is full: it pushes out heavy's newest waiting turn
    await settle()
    assert light.places == [1] and gate.waiting == 16
    assert "Too many of your requests are waiting already: 15" in str(heavy[19].refused)
    assert heavy[4].places == [1, 2] and heavy[18].places == [15, 16], "moved back, told"
    assert gate.refused_over_share == 1
    heavy[0].done.set()
    await settle()
    assert light.inside.is_set() and not any(inside(heavy[4:]))
    # Heavy holds 3 of 4 seats beside light's turn, more than its share (2): the next seat
    # it frees stays free for others, whose turn then starts at once.
    heavy[1].done.set()
    await settle()
    assert gate.inside == 3 and not any(inside(heavy[4:]))
    other = Turn(gate, "other")
    await settle()
    assert other.inside.is_set() and other.places == []
    assert gate.shares() == {"accounts_admitted": 3, "accounts_queued": 1,
                             "largest_admitted": 2, "largest_queued": 15, "account_seats": 2,
                             "account_queued": 4, "refused_over_share": 1}
    # Once the others are done heavy is alone again: every seat is its own.
    await finish([light, other])
    await settle()
    assert gate.inside == 4 and sum(inside(heavy)) == 6
    await finish(heavy)
    assert gate.inside == gate.waiting == 0 and gate.shares()["accounts_admitted"] == 0


async def test_in_a_full_line_an_account_over_its_share_is_refused_and_others_are_not():
    gate = Admission(running=1, queued=8, account_queued_share=0.25)  # 2 places each
    holder = Turn(gate, "holder")
    heavy = [Turn(gate, "heavy") for _ in range(6)]
    light = [Turn(gate, "light") for _ in range(2)]
    await settle()
    assert gate.waiting == 8 and all(t.refused is None for t in heavy + light)
    late = Turn(gate, "heavy")  # over its share of a full line: refused itself
    await settle()
    assert "Too many of your requests are waiting already: 6" in str(late.refused)
    third = Turn(gate, "third")  # pushes out heavy's newest
    more = Turn(gate, "light")   # light holds its share (2): nobody over it to push out,
    await settle()               # and it is over itself
    assert third.refused is None and heavy[-1].refused is not None
    assert "Too many of your requests" in str(more.refused)
    fourth = Turn(gate, "fourth")  # heavy's 5 are still over 2: one more goes
    await settle()
    assert fourth.refused is None and heavy[-2].refused is not None
    assert gate.refused_over_share == 4 and gate.waiting == 8
    await finish([holder, *heavy, *light, third, fourth])
    assert gate.inside == gate.waiting == 0


async def test_places_told_are_the_order_seats_go_in():
    """Round robin across accounts by turns inside, first come first served within one;
    a newcomer that goes ahead moves the others back, and they are told."""
    gate = Admission(running=7, queued=16)
    xs = [Turn(gate, "x") for _ in range(6)]  # x holds 6 seats and waits for none
    held = Turn(gate, "h")
    h = [Turn(gate, "h") for _ in range(3)]
    await settle()
    a1 = Turn(gate, "a")
    await settle()
    b1 = Turn(gate, "b")
    await settle()
    a2 = Turn(gate, "a")
    await settle()
    order = [a1, b1, h[0], a2, h[1], h[2]]  # h has a turn inside: a and b go first
    assert [t.places[-1] for t in order] == [1, 2, 3, 4, 5, 6]
    assert h[0].places == [1, 2, 3] and a1.places == [1] and a2.places == [4]
    entered = []
    for x in xs[:3]:  # seats freed by x's turns: the one told place 1 goes in each time
        first = next(t for t in order if t not in entered and t.places[-1] == 1)
        x.done.set()
        await settle()
        assert first.inside.is_set()
        entered.append(first)
        waiting = [t for t in order if t not in entered]
        assert [t.places[-1] for t in waiting] == list(range(1, len(waiting) + 1))
        assert not any(t.inside.is_set() for t in waiting)
    assert entered == [a1, b1, h[0]]
    held.done.set()  # h's turn ends: h has as many inside as a now, and waited longer
    await settle()
    assert h[1].inside.is_set() and not a2.inside.is_set()
    assert a2.places[-1] == 1 and h[2].places[-1] == 2
    await finish([*xs, held, *order])
    assert gate.inside == gate.waiting == 0


async def test_a_place_is_told_again_at_most_every_tell_every_s():
    """In a long line every turn that ends moves everyone behind it: each is told its new
    place at most every `tell_every_s`, the latest one once that has passed."""
    gate = Admission(running=1, queued=8, tell_every_s=0.3)
    turns = [Turn(gate) for _ in range(5)]
    await settle()
    last = turns[4]
    assert last.places == [4]
    for t in turns[:2]:  # two end at once: the last moves from 4 to 3, then to 2
        t.done.set()
        await settle()
    assert turns[2].inside.is_set() and last.places == [4], "not told again so soon"
    await asyncio.sleep(0.4)
    assert last.places == [4, 2], "told its place once the time had passed, the latest"
    await finish(turns)
    assert gate.inside == gate.waiting == 0


async def test_a_waiting_turn_withdrawn_keeps_counts_shares_and_places_right():
    gate = Admission(running=2, queued=16, account_share=0.5)
    busy = [Turn(gate, "heavy"), Turn(gate, "heavy")]
    heavy = [Turn(gate, "heavy") for _ in range(5)]
    light = Turn(gate, "light")
    await settle()
    assert light.places == [1] and [t.places[-1] for t in heavy] == [2, 3, 4, 5, 6]
    light.task.cancel()  # Stop while waiting
    heavy[1].task.cancel()
    await settle()
    assert gate.waiting == 4 and gate.shares()["accounts_queued"] == 1
    assert [t.places[-1] for t in (heavy[0], heavy[2], heavy[3], heavy[4])] == [1, 2, 3, 4]
    busy[0].done.set()  # heavy is alone again: its share does not hold it back
    await settle()
    assert heavy[0].inside.is_set() and gate.inside == 2
    await finish([*busy, heavy[0], heavy[2], heavy[3], heavy[4]])
    assert gate.inside == gate.waiting == 0 and gate.held == 0
    assert gate.shares()["accounts_admitted"] == gate.shares()["largest_queued"] == 0


async def test_a_pushed_out_turn_cancelled_too_leaves_nothing_behind():
    gate = Admission(running=1, queued=2, account_queued_share=0.5)
    holder = Turn(gate, "h")
    mine = [Turn(gate, "h"), Turn(gate, "h")]
    await settle()
    other = Turn(gate, "o")
    mine[1].task.cancel()  # cancelled in the same step as it is pushed out
    await settle()
    assert mine[1].task.cancelled() and gate.waiting == 2
    await finish([holder, mine[0], other])
    assert gate.inside == gate.waiting == 0


async def test_the_fair_order_keeps_the_caches_rules():
    """The next turn in the fair order that does not fit the cache waits and holds back
    the turns behind it (its class's and lower classes'), as in first-come order; a class
    whose next turn waits for its account's share holds back no one."""
    line = Line(kv_tokens=1000)
    high = Admission(running=4, queued=8, line=line, priority=0, account_share=0.25)
    low = Admission(running=4, queued=8, line=line, priority=1)
    a = [SizedTurn(high, 300, "a") for _ in range(2)]  # a alone: both seats its own
    await settle()
    big = SizedTurn(high, 500, "b")     # b has none inside: next, but 1,100 does not fit
    small = SizedTurn(high, 100, "a")   # a is over its share beside b's turn
    lows = SizedTurn(low, 100, "c")     # held back by b's turn waiting for cache
    await settle()
    assert inside([*a, big, small, lows]) == [True, True, False, False, False]
    a[0].done.set()
    await settle()
    # a holds 1 (its share) beside b's: small waits for its share, not for cache, and
    # holds back no one: low's turn fits and goes in.
    assert big.inside.is_set() and lows.inside.is_set() and not small.inside.is_set()
    assert line.held == 300 + 500 + 100
    await finish([*a, big, small, lows])
    assert line.held == 0


def test_the_shares_are_preset_options_checked_at_load(tmp_path):
    config = load_config()
    assert {(p.account_share, p.account_queued_share) for p in config.presets.values()} \
        == {(0.5, 0.25)}
    text = (ROOT / "profiles.yaml").read_text().replace(
        "    priority: 1\n", "    priority: 1\n    account_share: 1.0\n"
        "    account_queued_share: 0.1\n", 1)
    (tmp_path / "p.yaml").write_text(text)
    preset = load_config(tmp_path / "p.yaml").presets["throughput-first"]
    assert (preset.account_share, preset.account_queued_share) == (1.0, 0.1)
    (tmp_path / "bad.yaml").write_text(text.replace("account_share: 1.0", "account_share: 0"))
    with pytest.raises(ConfigError, match=r"presets\.throughput-first\.account_share: "
                       "must be > 0 and <= 1"):
        load_config(tmp_path / "bad.yaml")
