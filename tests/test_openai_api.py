"""The OpenAI-compatible API (api/openai.py) of a real `chainlit run app.py`, driven by the
`openai` package: keys, models, completions whole and streamed, the profile's limits, a
client that leaves mid-reply, and requests batched with a chat user's turn."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from api.openai import refusal
from engine import Busy, ChatError, Unavailable
from tests.test_accounts import store_command
from tests.conftest import API_KEY as OPERATOR_KEY
from tools.chainlit_client import TEST_USER, ChatClient, engine_of

FULL = {"ignore_eos": True}  # vLLM's field: the reply runs to max_tokens, its length known


@pytest.fixture
def server(api_app):
    """The session's app with the operator's key (conftest), shared with the other API
    tests and the chat's."""
    return api_app


def api(server, key: str = OPERATOR_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def test_every_request_needs_a_key_and_each_profile_is_a_model(server):
    for key in ("wrong-key", "vck-00000000-not-a-real-one"):
        with pytest.raises(openai.AuthenticationError):
            await api(server, key).models.list()
    models = await api(server).models.list()
    assert [m.id for m in models.data] == ["Latency-first", "Throughput-first"]
    assert OPERATOR_KEY not in server.log()


async def test_a_whole_completion_with_usage(server):
    reply = await api(server).chat.completions.create(
        model="Latency-first", messages=ask("Name a colour."), max_tokens=8, extra_body=FULL)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 5
    assert reply.model == "Latency-first"


async def test_a_streamed_completion_arrives_in_pieces_with_usage_at_the_end(server):
    stream = await api(server).chat.completions.create(
        model="Throughput-first", max_tokens=24, stream=True, extra_body=FULL,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "My name is Ann."},
                  {"role": "assistant", "content": "Hello Ann."},
                  {"role": "user", "content": [{"type": "text", "text": "Who am I?"}]}])
    chunks = [chunk async for chunk in stream]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and
              c.choices[0].delta.content]
    assert len(pieces) > 3, "streamed in several pieces"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    alone = await api(server).chat.completions.create(
        model="Throughput-first", max_tokens=1,
        messages=[{"role": "system", "content": "You are terse."}, *ask("Who am I?")])
    assert usage.prompt_tokens >= alone.usage.prompt_tokens + 8, "the earlier turn was sent"


async def test_an_account_key_acts_as_its_account_until_revoked(server):
    made = store_command(server, "keys", "add", TEST_USER, "--label", "tests")
    key = made.strip().splitlines()[-1]
    key_id = made.split()[2]
    reply = await api(server, key).chat.completions.create(
        model="Latency-first", messages=ask("Hello from a script."), max_tokens=4,
        extra_body=FULL)
    assert reply.usage.completion_tokens == 4
    assert f'"user": "{TEST_USER}"' in server.log() or f"user={TEST_USER}" in server.log()
    assert key not in server.log() and "Hello from a script" not in server.log()
    store_command(server, "keys", "revoke", key_id)
    with pytest.raises(openai.AuthenticationError):
        await api(server, key).models.list()


async def test_requests_beyond_the_profiles_limits_are_refused_naming_them(server):
    client = api(server)
    with pytest.raises(openai.BadRequestError, match="max_tokens.*from 1 to 1024"):
        await client.chat.completions.create(model="Latency-first", messages=ask("Hi"),
                                             max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="characters long"):
        await client.chat.completions.create(model="Latency-first",
                                             messages=ask("a" * 100_001), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="last message must be the user's"):
        await client.chat.completions.create(
            model="Latency-first", max_tokens=4,
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "?"}])
    with pytest.raises(openai.NotFoundError, match="Unknown model 'gpt-4'"):
        await client.chat.completions.create(model="gpt-4", messages=ask("Hi"))


async def test_10000_short_messages_are_answered_from_the_newest_turns_that_fit(server):
    """Issue 52: the most messages a request may hold (10,000), each short, a system prompt
    first. Answered, from the system prompt and the newest turns that fit the context:
    what the oldest message says changes nothing in the prompt."""
    def messages(oldest: str) -> list[dict]:
        turns = [{"role": role, "content": f"hello number {n}"}
                 for n in range(4999) for role in ("user", "assistant")]
        return [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": oldest}, *turns[1:], *ask("And the last one?")]

    answers = []
    for oldest in ("hello number 0", "Remember the word zanzibar. " * 200):
        sent = messages(oldest)
        assert len(sent) == 10_000
        answers.append(await api(server).chat.completions.create(
            model="Throughput-first", messages=sent, max_tokens=4, extra_body=FULL))
    for reply in answers:
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
        assert 1000 < reply.usage.prompt_tokens <= 2048 - 4  # the context: 2,048 here
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_engine_refusals_map_to_http_statuses():
    assert refusal(Busy("full")).status == 429
    assert refusal(Unavailable("restarting")).status == 503
    assert refusal(ChatError("too long for the context")).status == 400


async def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    before = (await server.request("/metrics")).text
    stream = await api(server).chat.completions.create(
        model="Latency-first", messages=ask("Tell me a long story."), max_tokens=1000,
        stream=True, extra_body=FULL)
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    await stream.close()
    deadline = time.monotonic() + 20
    while True:  # the engine's request is gone well before its 1,000 tokens
        engines = (await server.ready_state())[1]["engines"]
        if engine_of({"engines": engines}, "latency-first")["unfinished_requests"] == 0:
            break
        assert time.monotonic() < deadline, engines
        await asyncio.sleep(0.2)
    assert stopped((await server.request("/metrics")).text) == stopped(before) + 1


def stopped(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('vchat_turns_stopped_total{profile="Latency-first"}'):
            return float(line.split()[-1])
    return 0.0


async def test_api_requests_batch_with_a_chat_users_turn(server):
    """Scripts and browser users share the engine: the five turns of 48 tokens run in the
    same steps (one after another they would take at least 5 x 48). The chat user's reply
    is greedy, to a prompt the embedded model answers at length: it runs to its 48."""
    async def steps() -> int:
        engines = (await server.ready_state())[1]["engines"]
        return engine_of({"engines": engines}, "latency-first")["steps"]

    user = ChatClient(server.url, "Latency-first")
    await user.connect()
    assert (await user.settings(max_tokens=48, temperature=0)).messages == []
    calls = [api(server).chat.completions.create(model="Latency-first", max_tokens=48,
                                                 messages=ask(f"Question {n}."), extra_body=FULL)
             for n in range(4)]
    before = await steps()
    replies = await asyncio.gather(
        user.send("Tell me a very long story about a lighthouse."), *calls)
    taken = await steps() - before
    await user.close()
    assert replies[0].reply["metadata"]["output_tokens"] == 48
    assert all(r.usage.completion_tokens == 48 for r in replies[1:])
    assert taken < 2 * 48, f"{taken} steps for five turns of 48 tokens"
