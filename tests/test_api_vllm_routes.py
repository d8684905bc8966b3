"""Issue 54: what `vllm serve` accepts, a real `chainlit run app.py` accepts and answers as
vLLM does (vLLM 0.32's own OpenAI-server tests failed on these): tools whose parameters use
`$defs`, a held tool call cut short, /v1/completions' `logprobs: 0`, lists of prompts, `echo`
(with `logprobs` too) and vLLM's own fields, the batched chat, /invocations, /tokenize and
/detokenize, long stop strings.

    .venv/bin/python -m pytest tests/test_api_vllm_routes.py
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import API_KEY as KEY

MODEL = "Latency-first"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"},
                       "options": {"$ref": "#/$defs/WeatherOptions"}},
        "required": ["city", "options"],
        "$defs": {"WeatherOptions": {
            "type": "object", "properties": {"unit": {"type": "string",
                                                      "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"]}}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture
def server(api_app):
    return api_app


async def post(server, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.post(server.url + path, json=body,
                                 headers={"Authorization": f"Bearer {KEY}"})


async def ok(server, path: str, body: dict) -> dict:
    response = await post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_required_tool_calls_keep_the_parameters_defs(server):
    """The schema for "required" lost each tool's `$defs`: 400 "Pointer '/$defs/
    WeatherOptions' does not exist"."""
    reply = await ok(server, "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER],
        "tool_choice": "required", "max_tokens": 200, "temperature": 0})
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments["options"]["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_held_tool_call_cut_short_is_no_call(server, choice):
    """A named tool's reply cut off by max_completion_tokens came back as a call whose
    arguments were '{'; vLLM answers finish "length", no tool calls, empty content."""
    reply = await ok(server, "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": choice,
        "max_completion_tokens": 1, "temperature": 0})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"].get("tool_calls")
    assert not choice["message"]["content"]


async def test_completion_logprobs_0_give_the_sampled_tokens_logprob(server):
    """`logprobs: 0` gave empty alternatives; vLLM gives the sampled token's alone."""
    reply = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, "logprobs": 0})
    logprobs = reply["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4
    assert logprobs["top_logprobs"] == [{token: logprob} for token, logprob in
                                        zip(logprobs["tokens"], logprobs["token_logprobs"])]
    two = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, "logprobs": 2})
    for token, top in zip(two["choices"][0]["logprobs"]["tokens"],
                          two["choices"][0]["logprobs"]["top_logprobs"]):
        assert next(iter(top)) == token and 1 <= len(top) <= 3


async def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(server):
    """A list of prompts was refused; vLLM answers each, choice i for prompt i."""
    prompts = ["One, two, three,", "Monday, Tuesday,"]
    singles = [await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0}) for p in prompts]
    both = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0})
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["text"] for c in both["choices"]] == \
        [s["choices"][0]["text"] for s in singles]
    assert both["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert both["usage"]["completion_tokens"] == 8
    tokens = (await ok(server, "/tokenize", {"model": MODEL, "prompt": prompts[0]}))["tokens"]
    ids = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": [tokens, tokens], "max_tokens": 4, "temperature": 0})
    assert [c["text"] for c in ids["choices"]] == [singles[0]["choices"][0]["text"]] * 2


async def test_echo_puts_the_prompt_before_the_completion(server):
    """`echo` was refused; vLLM echoes the prompt before the reply, streamed too."""
    prompt = "One, two, three,"
    plain = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    echoed = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True})
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", server.url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "echo": True, "stream": True},
                headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            events = [json.loads(line[6:]) async for line in response.aiter_lines()
                      if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["choices"][0]["text"]


async def test_the_batched_chat_answers_each_conversation(server):
    """/v1/chat/completions/batch was missing: vLLM 0.32's batched chat."""
    reply = await ok(server, "/v1/chat/completions/batch", {
        "model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [
            [{"role": "user", "content": "Reply with exactly the word: alpha"}],
            [{"role": "user", "content": "Reply with exactly the word: beta"}]]})
    assert reply["object"] == "chat.completion"
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["message"]["content"] for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] <= 16
    refused = await post(server, "/v1/chat/completions/batch", {
        "model": MODEL, "stream": True, "messages": [ASK_WEATHER]})
    assert refused.status_code == 400 and "stream" in refused.json()["error"]["message"]


async def test_invocations_routes_by_the_bodys_shape(server):
    """/invocations was missing: vLLM routes it to chat completions or completions."""
    chat = await ok(server, "/invocations", {
        "model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4})
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    text = await ok(server, "/invocations", {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert text["object"] == "text_completion" and text["choices"][0]["text"]
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await client.post(server.url + "/invocations", json={
            "model": MODEL, "prompt": "Hi"})).status_code == 401


async def test_tokenize_and_detokenize_as_vllm(server):
    tokenized = await ok(server, "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                               "return_token_strs": True})
    assert set(tokenized) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert (await ok(server, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]})
            ) == {"prompt": "Hello world"}
    chat = await ok(server, "/tokenize", {"messages": ASK_WEATHER})  # model left out
    assert chat["count"] > tokenized["count"] and chat["token_strs"] is None


async def test_long_stop_strings_are_taken(server):
    """Stop strings over 200 characters were refused; `vllm serve` has no such limit."""
    reply = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 4,
        "stop": ["x" * 1000, "y" * 300, "z", "w", "v", "u"]})
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


async def test_echo_with_logprobs_puts_the_prompts_tokens_first(server):
    """`echo` with `logprobs` was a 400; vLLM puts the prompt's tokens first in the
    log probabilities, the first without one (nothing comes before it)."""
    prompt = "One, two, three,"
    ids = (await ok(server, "/tokenize", {"model": MODEL, "prompt": prompt}))["tokens"]
    for top in (0, 1):
        reply = await ok(server, "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": top, "return_token_ids": True})
        choice = reply["choices"][0]
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(logprobs["tokens"]) == len(ids) + 3 == len(logprobs["text_offset"])
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for token, logprob, alternatives in zip(logprobs["tokens"][1:],
                                                logprobs["token_logprobs"][1:],
                                                logprobs["top_logprobs"][1:]):
            assert logprob <= 0 and max(top, 1) <= len(alternatives) <= top + 1
            assert next(iter(alternatives)) == token
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3
    streamed = await post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1,
        "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.text


async def test_completions_take_vllms_own_fields(server):
    """return_token_ids, prompt_logprobs, min_tokens, allowed_token_ids and
    logprob_token_ids were refused on /v1/completions; vLLM takes them there too."""
    prompt = "The capital of France is"
    ids = (await ok(server, "/tokenize", {"model": MODEL, "prompt": prompt}))["tokens"]
    reply = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True, "prompt_logprobs": 1})
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 4
    assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None
    plain = await ok(server, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                 "max_tokens": 4})
    assert plain["choices"][0]["token_ids"] is None
    assert plain["choices"][0]["prompt_logprobs"] is None
    # min_tokens: an end of text is not sampled before them (EOS banned)
    eos = (await ok(server, "/tokenize", {"model": MODEL, "prompt": "<|im_end|>"}))["tokens"]
    ended = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "logit_bias": {str(eos[0]): 100}})
    assert ended["choices"][0]["finish_reason"] == "stop"
    held = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "min_tokens": 6,
        "temperature": 0, "logit_bias": {str(eos[0]): 100}, "return_token_ids": True})
    assert len(held["choices"][0]["token_ids"]) == 6
    assert held["choices"][0]["finish_reason"] == "length"
    # logprob_token_ids: the named tokens' log probabilities and the sampled one's
    named = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
        "logprob_token_ids": [100, 1000], "allowed_token_ids": [42],
        "return_tokens_as_token_ids": True})
    top = named["choices"][0]["logprobs"]["top_logprobs"][0]
    assert set(top) == {"token_id:42", "token_id:100", "token_id:1000"}
    refused = await post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "min_tokens": 3})
    assert refused.status_code == 400 and "'min_tokens'" in refused.text


async def test_truncate_prompt_tokens_keeps_one_end_of_the_prompt(server):
    """vLLM's truncate_prompt_tokens was refused: the last k tokens are kept (or the
    first k with truncation_side "right"); -1 keeps as many as the context leaves."""
    ids = list(range(100, 108))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:]), (None, ids[-4:])):
        reply = await ok(server, "/v1/completions", {
            "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side})
        assert reply["choices"][0]["prompt_token_ids"] == kept
    whole = await ok(server, "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1, "return_token_ids": True,
        "truncate_prompt_tokens": -1})
    assert whole["choices"][0]["prompt_token_ids"] == ids
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": "4"},
                {"truncate_prompt_tokens": 4, "truncation_side": "middle"}):
        refused = await post(server, "/v1/completions", {
            "model": MODEL, "prompt": ids, "max_tokens": 1, **bad})
        assert refused.status_code == 400 and "trunca" in refused.text


async def test_a_missing_prompt_is_refused_in_vllms_words(server):
    """No prompt (and vLLM's empty prompt_embeds, its "none") is a 400 that says so in the
    words vLLM's server uses, not a refusal of prompt_embeds."""
    for body in ({"prompt": None, "prompt_embeds": []}, {}, {"prompt": ""}):
        response = await post(server, "/v1/completions", {"model": MODEL, "max_tokens": 5,
                                                          **body})
        assert response.status_code == 400
        assert "Either prompt or prompt_embeds must be provided and non-empty" in \
            response.json()["error"]["message"]
    response = await post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                      "prompt_embeds": "AAAA"})
    assert response.status_code == 400 and "'prompt_embeds'" in response.json()["error"]["message"]
