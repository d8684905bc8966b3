"""The history policy, the chat formatting behind it and a session's settings, on the
embedded model's real tokenizer (and Qwen's, for the target model's template)."""

import copy
import math
import random
import re

import pytest
from transformers import AutoTokenizer

from chat.session import Conversation
from engine import ChatError, ChatFormatter, Message, load_config
from engine.history import fit_history
from engine.model import resolve_model
from tools import tiny_qwen3

SYSTEM = "You are helpful."


@pytest.fixture(scope="module")
def fmt():
    """The configured model's chat format (the embedded model's unless VCHAT_MODEL says)."""
    return ChatFormatter(AutoTokenizer.from_pretrained(resolve_model(load_config().model)))


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
    with pytest.raises(ChatError, match="at most 1,800 tokens per prompt"):
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
    assert conv.sampling() == {"temperature": 0.2}
    assert (conv.settings.max_tokens, conv.settings.system_prompt) == (64, "Be terse.")
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
    conv.record(Message("user", "hi"), "Hel")
    assert conv.history() == [Message("user", "hi"), Message("assistant", "Hel")]
    # The same message objects each turn: they carry their token ids from turn to turn.
    assert all(a is b for a, b in zip(conv.history(), conv.history()))


def test_the_user_is_told_once_about_dropped_turns_and_shortened_replies(conv, fmt):
    history = turns(10)
    for _ in range(2):
        prompt = fit_history(fmt, history, Message("user", "next"), system_prompt=SYSTEM,
                             max_model_len=700, max_tokens=5000)
        assert prompt.dropped_turns and prompt.reply_shortened
        told = conv.notices(prompt)
        if _ == 0:
            assert len(told) == 2 and "left out" in told[0] and "cut short" in told[1]
            assert f"room for {prompt.max_tokens:,} tokens" in told[1] and "5,000" in told[1]
        else:
            assert told == []


# -- the context rule for the reply ----------------------------------------------------


def test_max_tokens_beyond_the_context_lowers_the_reply_not_the_prompt_budget(fmt):
    """Regression: the prompt budget was max_model_len - max_tokens, negative when a
    profile allowed more reply tokens than the context holds (every message refused)."""
    prompt = fit_history(fmt, turns(2), Message("user", "next"), system_prompt=SYSTEM,
                         max_model_len=2048, max_tokens=4096)
    assert prompt.dropped_turns == 0 and prompt.reply_shortened
    assert prompt.prompt_tokens + prompt.max_tokens == 2048
    assert prompt.asked_max_tokens == 4096
    # A long history keeps at most half the context, so the reply always has room.
    long = fit_history(fmt, turns(40), Message("user", "next"), system_prompt=SYSTEM,
                       max_model_len=2048, max_tokens=4096)
    assert long.dropped_turns > 0 and long.prompt_tokens <= 1024
    assert long.max_tokens == 2048 - long.prompt_tokens >= 1024


def test_max_tokens_within_half_the_context_is_kept_whole(fmt):
    prompt = fit_history(fmt, turns(40), Message("user", "next"), system_prompt=SYSTEM,
                         max_model_len=2048, max_tokens=1000)
    assert prompt.max_tokens == 1000 and not prompt.reply_shortened
    assert prompt.prompt_tokens <= 2048 - 1000


# -- chat formatting: the cheap path gives exactly the full render's tokens -------------


def reference_ids(tokenizer, messages, system_prompt):
    """The whole-render path (the formatting before issue 13), as the reference: render
    the conversation with placeholders, encode the template's text with special tokens
    and each message's text without."""
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": m.role, "content": m.content} for m in messages]
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": f"@@MSG{i}@@"} for i, m in enumerate(msgs)], tokenize=False,
        add_generation_prompt=True)
    ids = []
    for piece in re.split(r"(@@MSG\d+@@)", rendered):
        match = re.fullmatch(r"@@MSG(\d+)@@", piece)
        text, special = (msgs[int(match.group(1))]["content"], False) if match else (piece, True)
        if text:
            ids += tokenizer(text, add_special_tokens=False,
                             split_special_tokens=not special)["input_ids"]
    return ids


def random_conversation(rng, n_turns):
    words = ["hello", "world", "<|im_end|>", "{{ x }}", "🙂", "\n", "  ", "tea", "<|im_start|>"]
    out = []
    for i in range(n_turns):
        out += [Message("user", " ".join(rng.choices(words, k=rng.randint(1, 12)))),
                Message("assistant", " ".join(rng.choices(words, k=rng.randint(0, 12))))]
    return out + [Message("user", f"last {rng.random()}")]


@pytest.fixture(scope="module")
def qwen_fmt():
    return ChatFormatter(tiny_qwen3.tokenizer())


@pytest.mark.parametrize("which", ["embedded", "qwen"])
def test_prompts_from_learnt_template_pieces_equal_a_full_render(fmt, qwen_fmt, which):
    formatter = fmt if which == "embedded" else qwen_fmt
    assert formatter.glue is not None, "the cheap path is in use for this template"
    rng = random.Random(7)
    for n in (0, 1, 2, 5, 30):
        for system in ("", SYSTEM):
            messages = random_conversation(rng, n)
            assert formatter.prompt_ids(messages, system) == reference_ids(
                formatter.tokenizer, messages, system), (n, system)


def test_a_template_that_looks_beyond_neighbouring_roles_is_rendered_each_time(fmt):
    tokenizer = copy.deepcopy(fmt.tokenizer)
    tokenizer.chat_template = (  # numbers the messages: no piece depends on roles alone
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}")
    numbered = ChatFormatter(tokenizer)
    assert numbered.glue is None
    messages = random_conversation(random.Random(3), 6)
    assert numbered.prompt_ids(messages, SYSTEM) == reference_ids(tokenizer, messages, SYSTEM)


def test_each_message_is_encoded_once(fmt, monkeypatch):
    """Fitting a turn encodes only what is new: the last reply and the new message."""
    encoded = []
    real = fmt._encode
    monkeypatch.setattr(fmt, "_encode", lambda text, special: (
        encoded.append(text) if not special else None, real(text, special))[1])
    history, system, first = turns(30), "A system prompt of this test's own.", Message(
        "user", "first")
    fit_history(fmt, history, first, system_prompt=system, max_model_len=8192, max_tokens=256)
    assert len(encoded) == 61 + 1  # every message, and the system prompt
    encoded.clear()
    history += [first, Message("assistant", "a reply")]  # as the session records the turn
    fit_history(fmt, history, Message("user", "second"), system_prompt=system,
                max_model_len=8192, max_tokens=256)
    assert sorted(encoded) == ["a reply", "second"]


def test_a_history_far_over_the_context_encodes_only_the_turns_that_could_fit(fmt, monkeypatch):
    """Regression (issue 26): an API request's 40 MB history was encoded whole on the event
    loop, stalling every user's stream for seconds. Turns older than the first one that
    cannot fit are never encoded, and the result is the same as fitting them all."""
    encoded = []
    real = fmt._encode
    monkeypatch.setattr(fmt, "_encode", lambda text, special: (
        encoded.append(text) if not special else None, real(text, special))[1])
    history = [Message(role, f"{role} message {n}: " + "words " * 50)
               for n in range(2000) for role in ("user", "assistant")]
    prompt = fit_history(fmt, history, Message("user", "the new one"), system_prompt="",
                         max_model_len=2048, max_tokens=256)
    kept = len(prompt.messages) - 1
    assert prompt.dropped_turns == 2000 - kept // 2 and prompt.prompt_tokens <= 2048 - 256
    # The kept turns, and a few more whose text fits but not with the template's pieces
    # between messages (the walk counts text only, so it never drops a turn that fits).
    assert len(encoded) <= 2 * kept < 100, len(encoded)
    newest = history[-kept:] + [Message("user", "the new one")]
    assert prompt.token_ids == fmt.assemble(newest)[0]


class CountingTokenizer:
    """A test double around the real tokenizer: it answers as the tokenizer does, and
    counts the texts encoded and the messages the chat template rendered."""

    def __init__(self, tokenizer):
        self._tokenizer, self.encoded, self.rendered = tokenizer, 0, 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text, **kwargs):
        self.encoded += 1
        return self._tokenizer(text, **kwargs)

    def apply_chat_template(self, conversation, **kwargs):
        self.rendered += len(conversation)
        return self._tokenizer.apply_chat_template(conversation, **kwargs)


def counting_formatter(fmt) -> tuple[ChatFormatter, CountingTokenizer]:
    """A formatter on the real tokenizer, counted from after its set-up."""
    counting = CountingTokenizer(fmt.tokenizer)
    formatter = ChatFormatter(counting)
    counting.encoded = counting.rendered = 0
    return formatter, counting


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Looks a word up.",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string"}}}}}]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["learnt pieces", "rendered, with tools"])
def test_10000_short_messages_cost_what_the_context_keeps(fmt, tools):
    """Issue 52: the most messages an API request may hold (10,000), each short. Only the
    newest, as far as the context could keep them, are encoded and rendered (not all
    10,000), and the prompt is the one the kept turns alone give."""
    formatter, counting = counting_formatter(fmt)
    history = [Message(role, f"hello number {n}") for n in range(4999)
               for role in ("user", "assistant")]
    new = Message("user", "And the last question?")
    prompt = fit_history(formatter, history, new, system_prompt=SYSTEM, max_model_len=2048,
                         max_tokens=256, tools=tools)
    kept = len(prompt.messages)  # the new message with them
    assert prompt.dropped_turns > 4500 and prompt.prompt_tokens <= 2048 - 256
    assert prompt.messages == history[-(kept - 1):] + [new]
    # Each kept message, and about as many older whose text fits but not with the
    # template's pieces between messages (the walk back counts text only).
    assert counting.encoded <= 3 * kept < 1000, counting.encoded
    assert counting.rendered <= 4 * kept, counting.rendered  # rendered twice at most
    alone = fit_history(fmt, history[-(kept - 1):], new, system_prompt=SYSTEM,
                        max_model_len=2048, max_tokens=256, tools=tools)
    assert alone.dropped_turns == 0 and alone.token_ids == prompt.token_ids


def test_a_turn_of_thousands_of_messages_is_encoded_only_as_far_as_it_could_fit(fmt):
    """Regression (issue 52): a turn is a user's message and all that follows it up to the
    next, so an API request may send one question, then 9,998 assistant messages. That
    turn cannot fit, and it was encoded whole to learn so: 9,999 texts, a cost set by what
    was sent. Now the walk back stops at the first message that cannot fit."""
    formatter, counting = counting_formatter(fmt)
    history = [Message("user", "A question.")] + [
        Message("assistant", f"hello number {n}") for n in range(9998)]
    new = Message("user", "And the last question?")
    prompt = fit_history(formatter, history, new, system_prompt=SYSTEM, max_model_len=2048,
                         max_tokens=256)
    assert prompt.messages == [new] and prompt.dropped_turns == 1
    assert counting.encoded < 1000, counting.encoded
