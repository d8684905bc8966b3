"""The history policy and a session's settings, on the embedded model's real tokenizer."""

import math

import pytest
from transformers import AutoTokenizer

from chat.session import Conversation
from engine import ChatFormatter, Message, MessageTooLong, load_config
from engine.history import fit_history
from engine.model import prepare_embedded

SYSTEM = "You are helpful."


@pytest.fixture(scope="module")
def fmt():
    return ChatFormatter(AutoTokenizer.from_pretrained(str(prepare_embedded())))


def turns(n, words=50):
    out = []
    for i in range(n):
        out += [Message("user", f"question {i} " + "word " * words),
                Message("assistant", f"answer {i} " + "word " * words)]
    return out


def test_everything_is_kept_when_it_fits(fmt):
    history = turns(3)
    fitted = fit_history(fmt, history, Message("user", "next"), system_prompt=SYSTEM,
                         max_model_len=2048, max_tokens=256)
    assert fitted.dropped_turns == 0 and fitted.messages == history + [Message("user", "next")]
    assert fitted.prompt_tokens == fmt.count(fitted.messages, SYSTEM)


def test_oldest_whole_turns_are_dropped_and_the_newest_kept(fmt):
    history = turns(10)
    budget_len, max_tokens = 700, 100
    fitted = fit_history(fmt, history, Message("user", "next"), system_prompt=SYSTEM,
                         max_model_len=budget_len, max_tokens=max_tokens)
    kept = fitted.messages[:-1]
    assert fitted.dropped_turns > 0 and kept == history[2 * fitted.dropped_turns:]
    assert kept[0].role == "user", "turns are dropped whole"
    assert fitted.prompt_tokens <= budget_len - max_tokens
    # Fewest drops: keeping one more turn would not fit.
    one_more = history[2 * (fitted.dropped_turns - 1):] + [Message("user", "next")]
    assert fmt.count(one_more, SYSTEM) > budget_len - max_tokens


def test_a_message_that_cannot_fit_alone_is_refused_with_the_limit(fmt):
    with pytest.raises(MessageTooLong, match="at most 1,800 tokens per prompt"):
        fit_history(fmt, turns(2), Message("user", "word " * 3000), system_prompt=SYSTEM,
                    max_model_len=2048, max_tokens=248)


def test_a_long_message_may_push_out_all_history(fmt):
    new = Message("user", "word " * 600)
    fitted = fit_history(fmt, turns(3), new, system_prompt=SYSTEM, max_model_len=800,
                         max_tokens=100)
    assert fitted.messages == [new] and fitted.dropped_turns == 3


@pytest.fixture()
def conv():
    return Conversation.start(load_config().profile("Latency-first"))


def test_settings_within_limits_are_applied(conv):
    assert conv.update_settings({"temperature": 0.2, "max_tokens": 64.0,
                                 "system_prompt": "Be terse.", "show_stats": False}) == []
    assert conv.sampling() == {"temperature": 0.2, "max_tokens": 64,
                               "system_prompt": "Be terse."}
    assert conv.settings.show_stats is False


@pytest.mark.parametrize("values", [
    {"temperature": -0.1}, {"temperature": 99}, {"temperature": math.nan},
    {"temperature": "hot"}, {"max_tokens": 0}, {"max_tokens": 10**6}, {"max_tokens": 3.5},
    {"max_tokens": True}, {"system_prompt": "x" * 5000}, {"system_prompt": 42},
])
def test_invalid_settings_are_refused_and_the_old_value_kept(conv, values):
    before = conv.settings
    problems = conv.update_settings(values)
    assert len(problems) == 1 and "kept" in problems[0]
    assert conv.settings == before


def test_history_records_stopped_replies_as_shown(conv):
    conv.record("hi", "Hel", stopped=True)
    assert conv.history() == [Message("user", "hi"), Message("assistant", "Hel")]
    assert conv.turns[0].stopped
