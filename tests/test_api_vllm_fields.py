"""Chat completions answered as `vllm serve` answers them (issue 54), on a real `chainlit run
app.py` with the embedded model: stream_options' rules and continuous usage, the last
streamed chunk carrying the last text with its finish reason, vLLM's own keys in a whole
reply, a conversation of system messages only, every bad logit_bias key named, and vLLM's
own fields (token ids, allowed tokens, structured outputs, prompt logprobs, the template's
options, echo, min_tokens, logprob_token_ids).

    .venv/bin/python -m pytest -q tests/test_api_vllm_fields.py
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from api.choices import Choices
from engine.decoding import Piece
from tests.conftest import API_KEY as KEY

MODEL = "Throughput-first"


@pytest.fixture
def server(api_app):
    return api_app


def api(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def post(server, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(server.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"})


def test_the_last_piece_and_its_finish_make_one_chunk():
    choices = Choices(1)
    first = choices.take(Piece(0, "Hello"))
    assert choices.deltas(first, False) == [({"delta": {"content": "Hello"}, "logprobs": None},
                                             None)]
    last = choices.take(Piece(0, " world", None, "length", (1, 2)))
    assert choices.deltas(last, False) == [
        ({"delta": {"content": " world"}, "logprobs": None}, "length")]
    assert choices.tokens == [3]  # a piece without its ids counts one token
    empty = Choices(1)
    assert empty.deltas(empty.take(Piece(0, "", None, "stop")), False) == [
        ({"delta": {}}, "stop")]


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": None},
                                     {"continuous_usage_stats": True}])
async def test_stream_options_without_a_stream_are_refused(server, options):
    with pytest.raises(openai.BadRequestError) as refused:
        await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=3, stream=False,
            stream_options=options)
    assert "'stream_options'" in refused.value.body["message"]


async def test_continuous_usage_puts_the_usage_so_far_in_every_chunk(server):
    stream = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Count from one to twenty."), max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [chunk async for chunk in stream]
    last = 0
    for chunk in chunks:
        usage = chunk.usage
        assert usage is not None and usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert last == 0 or usage.completion_tokens > last or (
            not chunk.choices and usage.completion_tokens == last)
        last = usage.completion_tokens
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].choices == []
    assert last == chunks[-1].usage.completion_tokens == 8


async def test_continuous_usage_needs_include_usage(server):
    stream = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Hi"), max_tokens=4, temperature=0, stream=True,
        stream_options={"continuous_usage_stats": True})
    assert all([chunk.usage is None async for chunk in stream])


async def test_the_last_chunk_carries_the_last_text_with_its_finish(server):
    stream = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Tell me a long story about a cat."), max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == "length"
    assert finished[0].choices[0].delta.content  # not an empty delta of its own
    assert chunks.index(finished[0]) == len(chunks) - 2  # then the usage chunk
    assert chunks[-1].usage.completion_tokens == 6


async def test_a_whole_reply_has_vllms_own_keys(server):
    reply = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 3})
    body = reply.json()
    assert reply.status_code == 200, body
    assert "prompt_logprobs" in body and body["prompt_logprobs"] is None
    assert "prompt_token_ids" in body and body["prompt_token_ids"] is None


async def test_system_messages_alone_are_answered(server):
    reply = await api(server).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Say hello to the user."}],
        max_tokens=5, temperature=0)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 5
    # and streamed
    stream = await api(server).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Say hello."}], max_tokens=3,
        temperature=0, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text


async def test_every_bad_logit_bias_key_is_named(server):
    with pytest.raises(openai.BadRequestError) as refused:
        await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=3,
            logit_bias={"bad1": 50.0, "bad2": 20.0, "7": 1.0})
    message = refused.value.body["message"]
    assert "bad1" in message and "bad2" in message and "logit_bias" in message
    with pytest.raises(openai.BadRequestError) as refused:
        await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=3, logit_bias={"1": "not_a_number"})
    assert "logit_bias" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:  # outside the vocabulary
        await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=3, logit_bias={"99999999": 1.0})
    assert "99999999" in refused.value.body["message"]
    assert "logit_bias" in json.dumps(refused.value.body)


# -- vLLM's own token fields ----------------------------------------------------------------

async def test_return_token_ids_gives_the_prompts_and_each_replys_ids(server):
    body = {"model": MODEL, "messages": ask("Name three colours."), "max_tokens": 6,
            "temperature": 0, "return_token_ids": True}
    whole = (await post(server, body)).json()
    prompt, ids = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert len(prompt) == whole["usage"]["prompt_tokens"] and all(
        isinstance(i, int) for i in prompt)
    assert len(ids) == whole["usage"]["completion_tokens"] == 6
    stream = await api(server).chat.completions.create(
        **{k: v for k, v in body.items() if k != "return_token_ids"}, stream=True,
        extra_body={"return_token_ids": True})
    chunks = [chunk.model_dump() async for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == prompt
    assert [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]] == ids


async def test_streamed_token_ids_keep_a_characters_first_bytes(server):
    """A token that is only part of a character (an emoji's first bytes) makes no text
    and no chunk of its own; its id was lost from the stream. It comes with the next."""
    talk = [{"role": "system", "content": "You like to use emojis in your responses."},
            {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    body = {"model": MODEL, "messages": talk, "max_tokens": 30, "temperature": 0}
    whole = (await post(server, {**body, "return_token_ids": True})).json()["choices"][0]
    stream = await api(server).chat.completions.create(
        **body, stream=True, extra_body={"return_token_ids": True})
    chunks = [c.model_dump() async for c in stream]
    ids = [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]]
    assert ids == whole["token_ids"]
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:])
    assert text == whole["message"]["content"]
    assert any(ord(ch) > 0xFFFF for ch in text), "the reply has no emoji to split"


async def test_return_tokens_as_token_ids_names_each_token_by_its_id(server):
    reply = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Hi"), max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                    "return_token_ids": True})
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{i}" for i in
                                         reply.model_dump()["choices"][0]["token_ids"]]
    assert all(alt.token.startswith("token_id:") for t in content for alt in t.top_logprobs)


async def test_allowed_token_ids_hold_the_reply_to_them(server):
    first = (await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 1,
                                 "temperature": 0, "return_token_ids": True})).json()
    allowed = [first["choices"][0]["token_ids"][0] + 1]
    reply = (await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4,
                                 "temperature": 0, "return_token_ids": True,
                                 "allowed_token_ids": allowed})).json()
    assert reply["choices"][0]["token_ids"] == allowed * 4
    for bad in ([99999999], [], ["7"]):
        refused = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2,
                                      "allowed_token_ids": bad})
        assert refused.status_code == 400 and "allowed_token_ids" in refused.text or \
            "99999999" in refused.text


async def test_structured_outputs_hold_the_reply_to_a_choice_or_a_regex(server):
    colours = ["red", "green", "blue"]
    reply = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Your favourite colour?"), max_tokens=10, temperature=0.7,
        extra_body={"structured_outputs": {"choice": colours}})
    assert reply.choices[0].message.content in colours
    reply = await api(server).chat.completions.create(
        model=MODEL, messages=ask("A number?"), max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(reply.choices[0].message.content) == 3
    assert reply.choices[0].message.content.isdigit()
    for bad in ({"choice": ["a"], "regex": "x"}, {"nonsense": 1},
                {"json": {"type": "nonsense"}}):
        with pytest.raises(openai.BadRequestError):
            await api(server).chat.completions.create(
                model=MODEL, messages=ask("Hi"), max_tokens=3,
                extra_body={"structured_outputs": bad})
    with pytest.raises(openai.BadRequestError) as refused:
        await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=3,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a"}})
    assert "cannot be combined" in refused.value.body["message"]


async def test_prompt_logprobs_come_with_a_whole_reply(server):
    reply = (await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2,
                                 "prompt_logprobs": 1, "return_token_ids": True})).json()
    places, ids = reply["prompt_logprobs"], reply["prompt_token_ids"]
    assert len(places) == len(ids) == reply["usage"]["prompt_tokens"] and places[0] is None
    for place, token in zip(places[1:], ids[1:]):
        assert str(token) in place and all(
            {"logprob", "rank", "decoded_token"} <= set(p) for p in place.values())
    streamed = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2,
                                   "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text
    too_many = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2,
                                   "prompt_logprobs": 21})
    assert too_many.status_code == 400 and "prompt_logprobs" in too_many.text


async def test_the_chat_templates_options_shape_the_prompt(server):
    talk = [{"role": "user", "content": "Count to ten."},
            {"role": "assistant", "content": "One, two, three,"}]

    async def prompt_of(**options) -> list[int]:
        reply = await post(server, {"model": MODEL, "messages": talk, "max_tokens": 3,
                                    "temperature": 0, "return_token_ids": True, **options})
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_token_ids"]

    continued = await prompt_of(add_generation_prompt=False, continue_final_message=True)
    closed = await prompt_of(add_generation_prompt=False)
    # the assistant's message left open: no end of turn after it
    assert closed[:len(continued)] == continued and len(closed) > len(continued)
    plain = (await post(server, {"model": MODEL, "messages": talk[:1], "max_tokens": 2,
                                 "return_token_ids": True})).json()["prompt_token_ids"]
    kwargs = (await post(server, {"model": MODEL, "messages": talk[:1], "max_tokens": 2,
                                  "return_token_ids": True, "chat_template_kwargs": {
                                      "enable_thinking": False}})).json()
    assert kwargs["prompt_token_ids"][:len(plain) - 1] == plain[:-1]
    for bad in ({"add_generation_prompt": True, "continue_final_message": True},
                {"chat_template_kwargs": {"tools": []}},
                {"chat_template_kwargs": {"x": "<|im_end|>"}}):
        refused = await post(server, {"model": MODEL, "messages": talk[:1], "max_tokens": 2,
                                      **bad})
        assert refused.status_code == 400, (bad, refused.text)


async def test_echo_puts_the_continued_message_before_the_reply(server):
    """vLLM's `echo`: the last message's text before the reply where the reply continues
    its role (an assistant's message continued), nothing where a new turn starts."""
    said = "A common saying: an apple a day keeps"
    talk = [{"role": "user", "content": "Tell me a common saying."},
            {"role": "assistant", "content": said}]
    body = {"model": MODEL, "messages": talk, "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = (await post(server, body)).json()["choices"][0]["message"]["content"]
    echoed = (await post(server, {**body, "echo": True})).json()
    assert echoed["choices"][0]["message"]["content"] == said + plain
    streamed = await api(server).chat.completions.create(
        **{k: v for k, v in body.items() if k in ("model", "messages", "max_tokens",
                                                  "temperature")}, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True})
    text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
    assert text == said + plain
    # A new turn: nothing put before its reply (greedy, so the reply alone is known: a
    # sampled one may itself begin with the user's "Hi", as "Hi there!" did in a CI run).
    hi = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 3, "temperature": 0}
    alone = (await post(server, hi)).json()["choices"][0]["message"]["content"]
    new_turn = (await post(server, {**hi, "echo": True})).json()
    assert new_turn["choices"][0]["message"]["content"] == alone


async def test_min_tokens_hold_off_the_end(server):
    """vLLM's `min_tokens`: no end of turn before them (here the end is made the likeliest
    token, and the reply still runs to its length)."""
    async with httpx.AsyncClient(timeout=60) as client:  # the model's end of turn
        end = (await client.post(server.url + "/tokenize", json={
            "model": MODEL, "prompt": "<|im_end|>"},
            headers={"Authorization": f"Bearer {KEY}"})).json()["tokens"]
    assert len(end) == 1
    ended = (await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 8,
                                 "temperature": 0, "logit_bias": {str(end[0]): 100}})).json()
    assert ended["usage"]["completion_tokens"] <= 1
    assert ended["choices"][0]["finish_reason"] == "stop"
    held = (await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 8,
                                "temperature": 0, "logit_bias": {str(end[0]): 100},
                                "min_tokens": 5})).json()
    assert held["usage"]["completion_tokens"] >= 5
    refused = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2,
                                  "min_tokens": 3})
    assert refused.status_code == 400 and "'min_tokens'" in refused.text


async def test_logprob_token_ids_report_the_named_tokens(server):
    """vLLM's `logprob_token_ids`: each place's alternatives are the named tokens and the
    sampled one, in place of the likeliest; streamed too."""
    for named, top in (([5000], 5), ([100, 1000, 5000], 3)):
        reply = await api(server).chat.completions.create(
            model=MODEL, messages=ask("Hello"), max_tokens=1, temperature=0, logprobs=True,
            top_logprobs=top, extra_body={"logprob_token_ids": named,
                                          "allowed_token_ids": [42],
                                          "return_tokens_as_token_ids": True})
        place = reply.choices[0].logprobs.content[0]
        assert place.token == "token_id:42"
        assert {t.token for t in place.top_logprobs} == {f"token_id:{i}" for i in named + [42]}
        assert all(-9999 <= t.logprob <= 0 for t in place.top_logprobs)
    stream = await api(server).chat.completions.create(
        model=MODEL, messages=ask("Hello"), max_tokens=1, temperature=0, logprobs=True,
        stream=True, extra_body={"logprob_token_ids": [5000], "allowed_token_ids": [42],
                                 "return_tokens_as_token_ids": True})
    seen = {t.token async for c in stream if c.choices and c.choices[0].logprobs
            for place in c.choices[0].logprobs.content for t in place.top_logprobs}
    assert seen == {"token_id:42", "token_id:5000"}
    refused = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 1,
                                  "logprob_token_ids": [5]})
    assert refused.status_code == 400 and "'logprobs'" in refused.text


async def test_a_number_out_of_bounds_names_the_broken_check(server):
    """vLLM's clients match pydantic's words for the check a number failed."""
    for seed, check in ((-1, "greater_than_equal"), (2**63, "less_than_equal")):
        refused = await post(server, {"model": MODEL, "messages": ask("Hi"), "max_tokens": 1,
                                      "seed": seed})
        assert refused.status_code == 400 and check in refused.text


def test_the_models_own_sampling_defaults_fill_what_a_request_leaves_out():
    """As `vllm serve` applies the model's generation config: a field left out or null takes
    the model's default; one given stays; a default outside the profile's bounds is left
    out (the request is not refused for what it did not send)."""
    from api.requests import with_model_defaults
    from engine import load_config

    profile = load_config().profile(MODEL)
    qwen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 100}
    body = {"model": MODEL, "temperature": 0.2, "top_p": None}
    assert with_model_defaults(body, qwen, profile) == {
        "model": MODEL, "temperature": 0.2, "top_p": 0.8, "top_k": 20}
    assert with_model_defaults(body, {}, profile) == body
    assert with_model_defaults({}, {"temperature": 9.0, "min_p": 0.1}, profile) == \
        {"min_p": 0.1}


async def test_sampling_left_out_is_the_models_default_not_the_profiles(server):
    """The embedded model names no sampling defaults, so a request without temperature and
    top_p samples at 1.0 and 1.0 (as `vllm serve`), not the profile's 0.7 and 0.9: with
    one seed, the draws match the reply asked at 1.0 and differ from the profile's."""
    async def reply(**sampling) -> str:
        out = await api(server).chat.completions.create(
            model=MODEL, messages=ask("Tell me about the sea."), max_tokens=48, seed=11,
            extra_body={"ignore_eos": True}, **sampling)
        return out.choices[0].message.content

    left_out = await reply()
    assert left_out == await reply(temperature=1.0, top_p=1.0)
    assert left_out != await reply(temperature=0.7, top_p=0.9)


async def test_a_reply_without_max_tokens_may_run_to_the_contexts_end(server):
    """`vllm serve` gives a reply that names no max_tokens the rest of the context; so does
    the app, up to the profile's limit (Throughput-first: 4,096, over this 2,048 context).
    The prompt keeps no reply room of its own: one of about 1,900 tokens is taken whole
    (with the profile's 1,024-token default it was refused)."""
    async with httpx.AsyncClient(timeout=120) as client:
        sized = (await client.post(server.url + "/tokenize", json={
            "model": MODEL, "prompt": " harbour" * 100},
            headers={"Authorization": f"Bearer {KEY}"})).json()
    context, each = sized["max_model_len"], sized["count"] / 100
    out = await api(server).chat.completions.create(
        model=MODEL, messages=ask(" harbour" * int(1900 / each)),
        extra_body={"ignore_eos": True})
    assert 1800 < out.usage.prompt_tokens < context - 20
    assert out.usage.prompt_tokens + out.usage.completion_tokens == context
    assert out.choices[0].finish_reason == "length"
