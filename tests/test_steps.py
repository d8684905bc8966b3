"""engine/steps.py's plan for each step of a shared engine, on its own (no engine): who
sits a step out, in what order the rest are taken, and how the pace is learnt from the
steps' durations. The engine applying it is tested in tests/test_shared_engine.py."""

from engine.steps import MIN_PIECE, SLOWEST_SHARE, ClassSteps, StepPlanner, long_piece

LF, TF = 0, 1
PACED = {LF: ClassSteps(max_num_batched_tokens=2048, step_ms=10)}


def running(lf: int, tf: int) -> list[tuple[str, int]]:
    return [(f"tf{i}", TF) for i in range(tf)] + [(f"lf{i}", LF) for i in range(lf)]


def test_alone_a_class_without_a_promise_gets_the_engines_own_steps():
    planner = StepPlanner(PACED)
    assert planner.plan(running(0, 5)) is None
    assert planner.plan([]) is None


def test_the_top_class_comes_first_and_sets_the_step_shape():
    plan = StepPlanner(PACED).plan(running(2, 3))
    assert sorted(plan.order, key=plan.order.get)[:2] == ["lf0", "lf1"]
    assert plan.max_num_batched_tokens == 2048 and not plan.skip
    # A higher class only waiting (its prompt not yet in) already shapes the step.
    plan = StepPlanner(PACED).plan(running(0, 3), waiting=[LF])
    assert plan.max_num_batched_tokens == 2048 and plan.lower_seats == 3


def test_slow_steps_shrink_the_lower_seats_and_they_take_turns():
    planner = StepPlanner(PACED)
    now, served = 0.0, {f"tf{i}": 0 for i in range(64)}
    for step in range(90):  # each step takes 5 ms + 0.1 ms per lower turn in it
        plan = planner.plan(running(4, 64))
        ids = [rid for rid in plan.order if rid not in plan.skip]
        planner.scheduled(ids, plan.order)
        for rid in ids:  # counted once settled
            served[rid] = served.get(rid, 0) + (step >= 60)
        now += 0.005 + 0.0001 * plan.lower_seats
        planner.output(now, plan)
    # 10 ms fits 50 lower turns: the learnt seats settle there.
    assert 45 <= plan.lower_seats <= 55 and len(plan.skip) == 64 - plan.lower_seats
    tf = [served[f"tf{i}"] for i in range(64)]
    assert max(tf) - min(tf) <= 2, "they take turns: none served much more than another"
    assert all(served[f"lf{i}"] == 30 for i in range(4)), "the top class is in every step"


def test_every_lower_turn_keeps_a_share_of_the_steps_however_slow():
    planner = StepPlanner(PACED)
    now = 0.0
    for _ in range(40):  # every step far over the pace
        plan = planner.plan(running(4, 64))
        planner.scheduled([r for r in plan.order if r not in plan.skip], plan.order)
        now += 0.1
        planner.output(now, plan)
    assert plan.lower_seats == 64 // SLOWEST_SHARE


def test_what_is_not_a_paced_decode_step_teaches_nothing():
    planner = StepPlanner(PACED)
    planner.output(1.0)
    planner.output(1.5, None)  # a step with a prompt in it: not a measure of the pace
    assert planner.seats is None
    plan = planner.plan(running(1, 8))
    planner.output(5.0, plan)  # after an idle spell: not a step's duration
    assert planner.seats is None
    planner.output(5.001, plan)  # quick, and nobody sat out: says nothing of more seats
    assert planner.seats is None
    planner.output(5.1, plan)  # 100 ms: too slow for 10 ms
    assert planner.seats is not None and planner.seats < 8


def test_without_a_pace_the_budget_alone_bounds_the_step_and_the_least_served_go_first():
    planner = StepPlanner({LF: ClassSteps(max_num_batched_tokens=6,
                                          long_prefill_token_threshold=4)})
    first = planner.plan(running(2, 8))
    assert first.lower_seats is None and len(first.skip) == 4  # what the budget leaves
    assert first.long_prefill_token_threshold == 4
    assert first.max_num_batched_tokens == 6  # two top turns + the one-in-8 share fit
    taken = [r for r in sorted(first.order, key=first.order.get)][:6]
    planner.scheduled(taken, first.order)
    second = planner.plan(running(2, 8))
    following = sorted(second.order, key=second.order.get)
    assert following[:2] == ["lf0", "lf1"]
    assert set(following[2:6]) == {f"tf{i}" for i in range(4, 8)}, "unserved ones first"
    # Many lower turns: the budget grows to hold the top class and one lower turn in 8.
    assert planner.plan(running(2, 64)).max_num_batched_tokens == 2 + 64 // SLOWEST_SHARE


def test_a_waiting_top_turn_finds_room_in_the_step_however_many_lower_turns_run():
    """vLLM takes the running turns first and admits a waiting one only with budget left:
    the lower turns let in leave the top class a prompt piece for each waiting turn (within
    its budget), never less than their own share. Without the room, 40 running
    Throughput-first turns filled every 24-token step and a Latency-first turn waited
    until they ended (tests/test_waiting_turns.py runs it on the real engine)."""
    planner = StepPlanner({LF: ClassSteps(max_num_batched_tokens=24,
                                          long_prefill_token_threshold=12)})
    for lf_running, lf_waiting in ((0, 1), (2, 1), (0, 10), (3, 0)):
        plan = planner.plan(running(lf_running, 40), waiting=[LF] * lf_waiting + [TF] * 5)
        let_in = 40 - len(plan.skip)
        room = plan.max_num_batched_tokens - let_in - lf_running  # after a token each
        assert room >= min(12 * lf_waiting, 24 - lf_running), (lf_running, lf_waiting, plan)
        assert let_in >= 40 // SLOWEST_SHARE, "the lower turns keep their share"
        assert plan.max_num_batched_tokens <= 24 + 40 // SLOWEST_SHARE
    # Paced, the learnt seats are capped the same way.
    paced = StepPlanner({LF: ClassSteps(max_num_batched_tokens=24,
                                        long_prefill_token_threshold=12, step_ms=50)})
    paced.seats = 30.0
    plan = paced.plan(running(0, 40), waiting=[LF])
    assert plan.lower_seats == 12 and plan.max_num_batched_tokens == 24


LONG = {LF: ClassSteps(max_num_batched_tokens=8192, long_piece=2048, long_context=65536)}


def test_a_long_prompt_is_read_in_pieces_that_shrink_as_its_context_grows():
    """Piece x context stays at 2048 x 65536 beyond 64K tokens of context (issue 53)."""
    assert long_piece(2048, 65536, [0]) == 2048
    assert long_piece(2048, 65536, [131072]) == 1024
    assert long_piece(2048, 65536, [250_000]) == 2048 * 65536 // 250_000 == 536
    # Two prompts read at once share one piece's cost.
    assert long_piece(2048, 65536, [250_000, 250_000]) == 268
    assert long_piece(2048, 65536, [10**9]) == MIN_PIECE, "it keeps being read"
    planner = StepPlanner(LONG)
    beside = planner.plan(running(3, 0), reading=[250_000])
    assert beside.long_prefill_token_threshold == beside.long_piece == 536


def test_a_prompt_read_alone_or_without_a_promise_keeps_the_engines_own_pieces():
    assert StepPlanner(LONG).plan(running(1, 0), reading=[250_000]).long_piece is None
    # Beside turns that decode, a new prompt's first piece is the whole piece.
    assert StepPlanner(LONG).plan(running(3, 0)).long_piece == 2048
    # The promise of the top class decides: Throughput-first alone has none here.
    assert StepPlanner(LONG).plan(running(0, 3), reading=[250_000]) is None
    # A class's own cut (long_prefill_token_threshold) stays where it is smaller.
    own = {LF: ClassSteps(long_prefill_token_threshold=256, long_piece=2048, long_context=65536)}
    assert StepPlanner(own).plan(running(3, 0), reading=[0]).long_prefill_token_threshold == 256
