"""OpenAI's Responses API on a real `chainlit run app.py` with the embedded model (issue 54's
stretch): the same turn as the chat completion it amounts to, its stream's events, function
tools and a tool round, stored responses (fetched, continued, cancelled, deleted) kept to
their owner, and bad input refused in words. vLLM's own Responses tests run in `make
conformance` and a few in tests/test_api_conformance.py.

    .venv/bin/python -m pytest tests/test_api_responses.py
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from store.responses import StoredResponses
from store.schema import connect, migrate
from tests.conftest import API_KEY as KEY
from tests.test_accounts import add_user, store_command
from tests.test_app import idle, settled
from tools.polling import until

MODEL = "Latency-first"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


@pytest.fixture
def server(api_app):
    return api_app


async def call(server, method: str, path: str, body: dict | None = None, key: str = KEY
               ) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.request(method, server.url + path, json=body,
                                    headers={"Authorization": f"Bearer {key}"})


async def respond(server, body: dict, key: str = KEY) -> dict:
    answer = await call(server, "POST", "/v1/responses", {"model": MODEL, **body}, key)
    assert answer.status_code == 200, answer.text
    return answer.json()


def text_of(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message"
                   for p in item["content"])


async def events_of(server, body: dict) -> list[dict]:
    events = []
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", server.url + "/v1/responses",
                                 json={"model": MODEL, "stream": True, **body},
                                 headers={"Authorization": f"Bearer {KEY}"}) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    return events


async def test_a_response_is_the_chat_completions_turn_in_responses_shapes(server):
    """Instructions, a conversation of input items and max_output_tokens make the prompt
    the chat completion makes of the same messages: the same tokens, the same greedy
    reply; a reply cut by max_output_tokens is "incomplete"."""
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": "Hello Ada."},
                    {"role": "user", "content": [{"type": "input_text",
                                                  "text": "What is my name?"}]}]
    response = await respond(server, {
        "instructions": "Answer in one short sentence.", "input": conversation,
        "max_output_tokens": 12, "temperature": 0})
    chat = (await call(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 12, "temperature": 0, "messages": [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Hello Ada."},
            {"role": "user", "content": "What is my name?"}]})).json()
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert text_of(response) == chat["choices"][0]["message"]["content"]
    message = response["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert response["instructions"] == "Answer in one short sentence."
    assert response["max_output_tokens"] == 12
    finish = chat["choices"][0]["finish_reason"]
    assert response["status"] == ("incomplete" if finish == "length" else "completed")
    long = await respond(server, {"input": "Tell me a long story about a lighthouse.",
                                  "max_output_tokens": 5, "ignore_eos": True})
    assert long["status"] == "incomplete"
    assert long["incomplete_details"] == {"reason": "max_output_tokens"}
    assert long["usage"]["output_tokens"] == 5


async def test_the_stream_says_each_step_and_its_text_is_the_whole_responses(server):
    events = await events_of(server, {
        "input": "Count from one to five.", "max_output_tokens": 16,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["item_id"] == events[2]["item"]["id"] for e in deltas)
    assert all(len(lp["top_logprobs"]) <= 2 and lp["logprob"] <= 0
               for e in deltas for lp in e["logprobs"])
    assert any(lp["top_logprobs"] for e in deltas for lp in e["logprobs"])
    completed = events[-1]["response"]
    assert "".join(e["delta"] for e in deltas) == text_of(completed) == events[-4]["text"]
    assert completed["usage"]["output_tokens"] == 16 or completed["status"] == "completed"


async def test_a_named_function_is_called_and_its_result_answered(server):
    """tool_choice naming a function: a function_call item with JSON arguments (streamed:
    its item and arguments' events, no text); the call and its output sent back as input
    items are answered in text."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    response = await respond(server, {"input": [question], "tools": [WEATHER],
                                      "tool_choice": {"type": "function", "name": "get_weather"},
                                      "max_output_tokens": 60, "temperature": 0})
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert "city" in json.loads(calls[0]["arguments"])
    assert calls[0]["call_id"] and calls[0]["id"].startswith("fc_")
    follow = await respond(server, {"input": [
        question, calls[0], {"type": "function_call_output", "call_id": calls[0]["call_id"],
                             "output": "Sunny, 21 degrees."}],
        "tools": [WEATHER], "max_output_tokens": 40, "temperature": 0})
    assert follow["status"] in ("completed", "incomplete") and text_of(follow)
    events = await events_of(server, {
        "input": [question], "tools": [WEATHER], "max_output_tokens": 60, "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"}})
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds
    added = next(e for e in events if e["type"] == "response.output_item.added")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    streamed = "".join(e["delta"] for e in events
                       if e["type"] == "response.function_call_arguments.delta")
    assert streamed == done["arguments"] == calls[0]["arguments"]
    assert events[-1]["response"]["output"][0]["arguments"] == streamed


async def test_a_namespaces_function_is_called_by_its_two_names(server):
    """A namespace of functions (as vLLM's): the model sees NAMESPACE__NAME, the call's item
    says the namespace and the name apart, and sent back it is read as the same call."""
    tools = [{"type": "namespace", "name": "weather_tools", "description": "Weather.",
              "tools": [{k: v for k, v in WEATHER.items() if k != "strict"}]}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    response = await respond(server, {"input": [question], "tools": tools,
                                      "tool_choice": "required", "max_output_tokens": 80,
                                      "temperature": 0})
    [item] = [i for i in response["output"] if i["type"] == "function_call"]
    assert (item["namespace"], item["name"]) == ("weather_tools", "get_weather")
    follow = await respond(server, {"input": [
        question, item, {"type": "function_call_output", "call_id": item["call_id"],
                         "output": "Sunny."}], "tools": tools, "max_output_tokens": 8})
    flat = {**item, "name": "weather_tools__get_weather"}
    flat.pop("namespace")
    same = await respond(server, {"input": [
        question, flat, {"type": "function_call_output", "call_id": item["call_id"],
                         "output": "Sunny."}], "tools": tools, "max_output_tokens": 8})
    assert follow["usage"]["input_tokens"] == same["usage"]["input_tokens"]


PAIRS = {"response.completed": "response.created",
         "response.output_item.done": "response.output_item.added",
         "response.content_part.done": "response.content_part.added",
         "response.output_text.done": "response.output_text.delta",
         "response.function_call_arguments.done": "response.function_call_arguments.delta"}


def nested(events: list[dict]) -> bool:
    """Every "done" event closes the last one opened of its kind (its "added" or its first
    delta), and nothing is left open: the order Responses clients rely on."""
    opened = []
    for kind in (e["type"] for e in events):
        if kind in ("response.created",) or kind.endswith("added") or (
                kind.endswith("delta") and (not opened or opened[-1] != kind)):
            opened.append(kind)
        elif kind in PAIRS:
            if not opened or opened.pop() != PAIRS[kind]:
                return False
    return not opened


@pytest.mark.parametrize("extra", [
    {}, {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
    {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 3},
    {"tools": [WEATHER], "tool_choice": "auto"}], ids=["text", "named", "cut", "auto"])
async def test_every_stream_opens_and_closes_its_parts_in_order(server, extra):
    """Text, a named call, a required call cut short before any (an empty message: no
    text part, no text done without a delta), the model's own choice."""
    events = await events_of(server, {"input": "What is the weather in Paris?",
                                      "max_output_tokens": 40, "temperature": 0, **extra})
    assert nested(events), [e["type"] for e in events]
    assert events[-1]["response"]["output"]


async def test_a_stored_response_is_fetched_continued_and_deleted_by_its_owner_only(server):
    """store (the default) keeps a response in the database: GET gives it back,
    previous_response_id continues its conversation (the follow-up's prompt is the whole
    conversation's, token for token), DELETE forgets it; store=false keeps nothing. Another
    account's key finds none of them, and cannot continue, cancel or delete them."""
    first = await respond(server, {"instructions": "Be brief.", "input": "My name is Ada.",
                                   "max_output_tokens": 8, "temperature": 0})
    got = await call(server, "GET", f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    follow = await respond(server, {"input": "What is my name?", "max_output_tokens": 8,
                                    "previous_response_id": first["id"], "temperature": 0})
    whole = await respond(server, {"input": [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "What is my name?"}],
        "max_output_tokens": 8, "temperature": 0, "store": False})
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert text_of(follow) == text_of(whole)
    assert follow["previous_response_id"] == first["id"]
    unkept = await call(server, "GET", f"/v1/responses/{whole['id']}")
    assert unkept.status_code == 404 and "not found" in unkept.json()["error"]["message"]

    add_user(server, "responses-other", "another password 123")
    other = store_command(server, "keys", "add", "responses-other").strip().splitlines()[-1]
    for method, path, body in (
            ("GET", f"/v1/responses/{first['id']}", None),
            ("DELETE", f"/v1/responses/{first['id']}", None),
            ("POST", f"/v1/responses/{first['id']}/cancel", None),
            ("POST", "/v1/responses", {"model": MODEL, "input": "And mine?",
                                       "previous_response_id": first["id"]})):
        refused = await call(server, method, path, body, key=other)
        assert refused.status_code == 404, (method, path, refused.text)
    assert (await call(server, "GET", f"/v1/responses/{first['id']}")).status_code == 200
    mine = await respond(server, {"input": "Hi", "max_output_tokens": 2}, key=other)
    assert (await call(server, "GET", f"/v1/responses/{mine['id']}")).status_code == 404
    assert (await call(server, "GET", f"/v1/responses/{mine['id']}", key=other)
            ).status_code == 200

    gone = await call(server, "DELETE", f"/v1/responses/{first['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert (await call(server, "GET", f"/v1/responses/{first['id']}")).status_code == 404
    again = await call(server, "POST", "/v1/responses", {
        "model": MODEL, "input": "Hi", "previous_response_id": first["id"]})
    assert again.status_code == 404


async def test_a_background_response_runs_on_and_a_cancelled_one_stops(server):
    """background: answered "queued", then completed where GET finds it; a cancelled one
    stays cancelled and its engine request ends (no turn left running); an ended one
    cannot be cancelled."""
    queued = await respond(server, {"input": "Say hi.", "background": True,
                                    "max_output_tokens": 8})
    assert queued["status"] == "queued" and queued["output"] == []

    async def status(response_id: str) -> str:
        return (await call(server, "GET", f"/v1/responses/{response_id}")).json()["status"]

    await until(lambda: status(queued["id"]), lambda s: s == "incomplete" or
                s == "completed", timeout=120)
    ended = await call(server, "POST", f"/v1/responses/{queued['id']}/cancel")
    assert ended.status_code == 400 and "Cannot cancel" in ended.json()["error"]["message"]

    long = await respond(server, {"input": "Write a long story.", "background": True,
                                  "max_output_tokens": 1000, "ignore_eos": True})
    await asyncio.sleep(1)
    cancelled = await call(server, "POST", f"/v1/responses/{long['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    health = await settled(server, timeout=60)
    assert idle(health), health
    assert await status(long["id"]) == "cancelled"


@pytest.mark.parametrize("body, words", [
    ({"input": "Hi", "prompt": {"id": "p1"}}, "'prompt' is not supported"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "this model reads text"),
    ({"input": "Hi", "background": True, "store": False}, "background can only be used"),
    ({"input": "Hi", "previous_response_id": "resp_nothing"}, "not found"),
    ({"input": []}, "'input' must be text or a non-empty list"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "is not taken here"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "'text.format' must be"),
    ({"input": "Hi", "include": ["everything"]}, "'include' must be"),
    ({"input": "Hi", "metadata": {"k": 5}}, "'metadata' must be"),
    ({"input": "Hi", "max_output_tokens": 10 ** 9}, "max_tokens"),
])
async def test_bad_input_is_refused_in_words(server, body, words):
    answer = await call(server, "POST", "/v1/responses", {"model": MODEL, **body})
    assert answer.status_code in (400, 404), answer.text
    assert words in answer.json()["error"]["message"]


async def test_an_owner_keeps_at_most_its_limit_of_responses_stored_at_once(tmp_path):
    """24 responses stored at the same moment against a limit of 5: exactly the 5 newest
    kept (the limit taken in one transaction under the owner's lock); another owner's
    untouched. PostgreSQL: tests/test_postgres.py."""
    engine = connect(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")
    try:
        await migrate(engine)
        await race_for_the_limit(StoredResponses(engine, keep=5))
    finally:
        await engine.dispose()


async def race_for_the_limit(stored: StoredResponses) -> None:
    """24 at once against keep=5, then against a limit on their size: one too large for it
    alone is not kept, and a large one pushes out as many of the oldest as it takes."""
    await stored.put("other", {"id": "resp_other", "status": "completed"}, [])
    bodies = [{"id": f"resp_{n:02d}", "status": "completed"} for n in range(24)]
    await asyncio.gather(*(stored.put("owner", b, [{"role": "user", "content": str(n)}])
                           for n, b in enumerate(bodies)))
    kept = [b["id"] for b in bodies if await stored.get(b["id"], "owner") is not None]
    assert len(kept) == 5
    assert await stored.get("resp_other", "other") is not None
    assert await stored.get("resp_other", "owner") is None
    stored.max_chars = 10_000
    await stored.put("owner", {"id": "resp_huge", "status": "completed"},
                     [{"role": "user", "content": "x" * 20_000}])
    assert await stored.get("resp_huge", "owner") is None
    await stored.put("owner", {"id": "resp_big", "status": "completed"},
                     [{"role": "user", "content": "x" * 9_800}])
    assert await stored.get("resp_big", "owner") is not None
    left = [b["id"] for b in bodies if await stored.get(b["id"], "owner") is not None]
    assert len(left) < len(kept) and left == kept[len(kept) - len(left):]
