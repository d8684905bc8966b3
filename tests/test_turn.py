"""service/turn.py: one turn for the chat and the API alike, on the pool with the labelled
STAND-IN engine (no model: the turn's course is what is tested; the real engine's turns
run through it in test_app.py and test_openai_api.py). Each way a turn ends is counted
once, under its outcome, and the stream hands over text only, the stats kept aside
(issue 28: the chat and the API each mapped outcomes and split the stream themselves)."""

import asyncio
import functools

import pytest
from prometheus_client import CollectorRegistry

from engine import Busy, ChatError, Engines, Message
from engine.standin import StandInEngine
from service.turn import Stopped, Turn, outcome_of
from service.turn_metrics import TurnMetrics
from tests.test_metrics import samples

PROFILE = "Latency-first"


@pytest.fixture(scope="module")
async def pool(config):
    engines = Engines(config, engine_class=functools.partial(StandInEngine, tokens_per_s=500))
    await engines.start()
    yield engines
    engines.shutdown()


class Counted(TurnMetrics):
    """The app's turn metrics in a registry of their own, read back by outcome."""

    def __init__(self):
        self.registry = CollectorRegistry()
        super().__init__(self.registry, log_text=True)  # the record keeps what was said

    def __call__(self, outcome: str) -> float:
        labels = (("profile", PROFILE),) + ((("reason", "turn"),) if outcome == "refused" else ())
        return samples(self.registry).get((f"vchat_turns_{outcome}_total", labels), 0.0)


@pytest.fixture
def metrics() -> Counted:
    return Counted()


def new_turn(pool, metrics, text="Hello") -> Turn:
    return Turn(pool, metrics, PROFILE, user="ann", message=text)


async def test_a_finished_turn_streams_text_only_and_keeps_the_stats(pool, metrics):
    turn = new_turn(pool, metrics)
    prompt = turn.fit([], Message("user", "Hello"), system_prompt="", max_tokens=8)
    pieces = [p async for p in turn.stream(prompt, temperature=0.7)]
    assert pieces and all(isinstance(p, str) for p in pieces)
    assert turn.stats.output_tokens == 8 and turn.stats.preset == "latency-first"
    turn.reply = "".join(pieces)
    assert turn.end() == "finished" and turn.end(RuntimeError()) == "finished", "once"
    assert metrics("finished") == 1 and metrics("failed") == 0
    assert turn.record.reply == turn.reply and turn.record.output_tokens == 8


@pytest.mark.parametrize("ended, outcome", [
    (asyncio.CancelledError(), "stopped"), (Stopped(), "stopped"),
    (Busy("full"), "refused"), (ChatError("too long"), "refused"),
    (RuntimeError("a bug"), "failed")])
async def test_every_other_end_is_counted_once_under_its_outcome(pool, metrics, ended,
                                                                  outcome):
    assert outcome_of(ended) == outcome
    turn = new_turn(pool, metrics)
    assert turn.end(ended) == outcome
    turn.end()
    assert metrics(outcome) == 1 and metrics("finished") == 0
    running = samples(metrics.registry)[("vchat_turns_running", (("profile", PROFILE),))]
    assert running == 0


async def test_leaving_a_stream_early_ends_the_turn_on_the_engine(pool, metrics):
    turn = new_turn(pool, metrics)
    prompt = turn.fit([], Message("user", "Tell me more"), system_prompt="", max_tokens=400)
    stream = turn.stream(prompt, temperature=0.7)
    assert await anext(stream)
    await stream.aclose()
    assert turn.stats is None and turn.end(asyncio.CancelledError()) == "stopped"
    engine = pool.for_profile(PROFILE)
    assert engine.num_unfinished_requests() == 0
    assert pool.admission["latency-first"].inside == 0, "its seat is free again"


class Written:
    """Stands in for store/usage.py's Usage (tested on both databases in test_limits.py and
    test_trials.py): the rows a turn hands it, kept in a list."""

    def __init__(self):
        self.rows = []

    def record(self, spent, hold=None):
        self.rows.append(spent)

    def release(self, hold):
        self.rows.append(None)


async def test_a_stopped_reply_costs_at_most_its_room(pool, metrics):
    """A stopped reply is counted from its text; text re-counted can come out longer than
    the tokens that wrote it (a CI run counted 418 for a 400-token room): never more."""
    usage = Written()
    turn = Turn(pool, metrics, PROFILE, user="ann", message="Hi", usage=usage, source="chat")
    prompt = turn.fit([], Message("user", "Hi"), system_prompt="", max_tokens=5)
    turn.reply = "many words " * 40
    assert pool.count_tokens(PROFILE, turn.reply) > 5
    assert turn.end(asyncio.CancelledError()) == "stopped"
    assert usage.rows[0].reply_tokens == prompt.max_tokens == 5 and usage.rows[0].stopped


def test_a_ruled_out_tokens_log_probability_is_sent_as_vllm_sends_it():
    """A structured output gives ruled-out tokens -inf, which JSON cannot hold (vLLM's own
    test_structured_outputs_choice_chat_logprobs got a 500 from the app): -9999.0."""
    import json
    from types import SimpleNamespace

    from engine.decoding import LOWEST_LOGPROB, token_logprob

    inf = float("-inf")
    place = {7: SimpleNamespace(logprob=inf, rank=1, decoded_token="a"),
             9: SimpleNamespace(logprob=inf, rank=2, decoded_token="b")}
    token = token_logprob(7, place, top=2)
    assert token.logprob == LOWEST_LOGPROB == -9999.0
    assert [lp for _, lp in token.top] == [LOWEST_LOGPROB] * 2
    json.dumps({"logprob": token.logprob, "top": token.top}, allow_nan=False)
