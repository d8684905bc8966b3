"""Progress while a long message is read (issue 53): before its first token the engine says
nothing, so the chat shows how far it has read by an estimate (chat/streaming.py's
`Reading`, engine/reading.py's rate), and Stop during that reading aborts the request in
vLLM. The real engine on the real model through the real server, Chainlit's socket.

One server for this module: a 4,096-token context, so that a message of ~2,100 tokens
takes seconds to read on a CPU (Latency-first reads 24 tokens a step there: 8-25 s on
this machine's 2 busy cores), and the note shown from an estimated second of reading
(VCHAT_READING_NOTE_S), not 2. On a GPU a message the profile takes (100,000 characters)
is read in about a second: too soon to stop it there, so those tests are for a CPU.
"""

import asyncio
import re
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chat.session import PROMPT_PIECE, Conversation
from chat.streaming import Reading
from chat.view import WITHDRAWN
from engine import Prompt, TurnStats
from engine.launch import has_cuda
from engine.reading import DEFAULT_TOKENS_PER_S, MEASURED_FROM_TOKENS, ReadingRate
from tools.chainlit_client import ChatClient, engine_of, serving

ON_CPU = pytest.mark.skipif(has_cuda(), reason="a GPU reads a message too fast to watch")
READING = re.compile(r"Reading your message \(([\d,]+) tokens\): "
                     r"(?:about (\d+)% \(estimated\)|taking longer than estimated)")


@pytest.fixture(scope="module")
async def server():
    async with serving({"VCHAT_MAX_MODEL_LEN": "4096", "VCHAT_READING_NOTE_S": "1"}) as srv:
        yield srv


async def client(server, **settings) -> ChatClient:
    c = ChatClient(server.url, "Latency-first")
    await c.connect()
    assert (await c.settings(**settings)).messages == []
    return c


def long_text(topic: str, lines: int = 75) -> str:
    """~28 tokens a line; each topic its own from the first line (no prefix cached)."""
    return "\n".join(f"Note {i} on the {topic}: entry {i * 37 % 1000} was checked at "
                     f"{i % 24:02d}:{i * 7 % 60:02d} and found in order." for i in range(lines))


def reading_notes(events) -> list[tuple[int, str, int, int | None]]:
    """(event index, message id, tokens, percent) of every reading note sent or updated
    (percent None: past the estimate)."""
    out = []
    for i, e in enumerate(events):
        if e.name in ("new_message", "update_message"):
            found = READING.search(e.data.get("output", ""))
            if found:
                out.append((i, e.data["id"], int(found[1].replace(",", "")),
                            int(found[2]) if found[2] else None))
    return out


def deleted(events, message_id: str) -> int | None:
    """The index of the event that removed message `message_id`, if one did."""
    return next((i for i, e in enumerate(events)
                 if e.name == "delete_message" and e.data.get("id") == message_id), None)


async def engine_now(server) -> tuple[dict, float]:
    """Latency-first's engine in /ready, and its KV cache in use (vLLM's own gauge)."""
    _, health = await server.ready_state()
    engine = engine_of(health, "latency-first")
    name = next(n for n, e in health["engines"].items() if e is engine)
    text = (await server.request("/metrics")).text
    usage = sum(s.value for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "vllm:kv_cache_usage_perc" and s.labels.get("preset") == name)
    return engine, usage


async def in_the_engine(server, idle_kv: float) -> bool:
    """The engine has the turn: vLLM counts its request, or holds more of its KV cache."""
    engine, kv = await engine_now(server)
    return engine["unfinished_requests"] >= 1 or kv > idle_kv


def read_already(c: ChatClient, start: int) -> bool:
    """The turn since event `start` is past its reading: its reply began, or it ended."""
    return any(e.name in ("stream_start", "task_end") for e in c.events[start:])


def stats(prompt_tokens: int, ttft_s: float | None, cached: int | None = None) -> TurnStats:
    return TurnStats("chat-1", "latency-first", prompt_tokens, 8, ttft_s, 5.0, "length",
                     cached_tokens=cached)


def test_the_reading_rate_is_the_recent_long_prompts_new_tokens_a_second():
    rate = ReadingRate()
    assert rate.seconds(2000) == 2000 / DEFAULT_TOKENS_PER_S[False]
    assert rate.seconds(2000, gpu=True) == 2000 / DEFAULT_TOKENS_PER_S[True]
    rate.add(stats(MEASURED_FROM_TOKENS - 1, 0.5))  # a short prompt: a step's fixed cost
    rate.add(stats(5000, None))  # stopped before its first token
    rate.add(stats(5000, 1.0, cached=4900))  # mostly cached: 100 tokens read
    assert rate.tokens_per_s is None
    rate.add(stats(5000, 10.0, cached=1000))  # 4,000 new tokens in 10 s
    assert rate.tokens_per_s == 400 and rate.seconds(2000) == 5.0
    rate.add(stats(3000, 3.0))  # 1,000 a second: the newest weighs 0.3
    assert rate.tokens_per_s == pytest.approx(580) and rate.turns == 2


def test_a_follow_up_is_read_from_where_it_parts_from_the_chats_last_prompt():
    conv = Conversation(profile=None, settings=None)  # what it counts needs neither

    def prompt(ids: list[int]) -> Prompt:
        return Prompt([], "", ids, 8, 8)

    first = list(range(10 * PROMPT_PIECE + 5))
    assert conv.new_tokens(prompt(first)) == len(first), "a new chat reads it all"
    longer = first + list(range(300))
    assert conv.new_tokens(prompt(longer)) == len(longer) - 10 * PROMPT_PIECE
    edited = longer[:3 * PROMPT_PIECE + 7] + [-1] + longer[3 * PROMPT_PIECE + 8:]
    assert conv.new_tokens(prompt(edited)) == len(edited) - 3 * PROMPT_PIECE
    assert conv.new_tokens(prompt(edited[:100])) == 100


async def test_reading_says_its_share_by_the_clock_then_no_figure_and_nothing_once_stopped():
    said: list[int | None] = []

    async def say(percent: int | None) -> None:
        said.append(percent)

    reading = Reading(say, seconds=0.1, every=0.02)
    reading.start()
    async with asyncio.timeout(10):
        while None not in said:
            await asyncio.sleep(0.01)
    await reading.stop()
    stopped = len(said)
    await asyncio.sleep(0.05)
    assert len(said) == stopped, "said after stop"
    shares = said[:said.index(None)]
    assert shares[0] == 0 and shares == sorted(shares) and shares[-1] <= 99, said
    assert set(said[len(shares):]) == {None}, "no share once past the estimate"
    await Reading(say, seconds=1.0).stop()  # never started: nothing to stop


@ON_CPU
async def test_a_long_message_shows_how_far_it_is_read_until_the_reply_begins(server):
    c = await client(server, max_tokens=8)
    reply = await c.send(long_text("lighthouse"))
    events = reply.events
    began = next(i for i, e in enumerate(events) if e.name == "stream_start")
    notes = reading_notes(events)
    assert notes, "no reading progress shown before the reply"
    assert all(i < began for i, *_ in notes), "progress said after the reply began"
    prompt_tokens = reply.reply["metadata"]["prompt_tokens"]
    assert prompt_tokens > 2000
    assert {tokens for *_, tokens, _ in notes} == {prompt_tokens}, "a new chat reads it all"
    percents = [p for *_, p in notes]
    assert percents[0] is not None, "the first says a share"
    shares = [p for p in percents if p is not None]
    assert percents[:len(shares)] == shares == sorted(shares) and shares[-1] <= 99, percents
    note_id = notes[0][1]
    assert {m for _, m, *_ in notes} == {note_id}, "one note, updated in place"
    gone = deleted(events, note_id)
    assert gone is not None and gone <= began, "the note stays once the reply streams"
    print(f"{prompt_tokens} tokens read in {events[began].at - events[notes[0][0]].at:.1f} s;"
          f" progress said: {percents}")

    # A follow-up reads only what the prefix cache lacks: the history is not read again
    # (whether that is still long enough to show depends on this machine's measured rate).
    nxt = await c.send("Which entry came last?")
    assert nxt.reply["metadata"]["prompt_tokens"] > prompt_tokens
    assert all(tokens < 300 for *_, tokens, _ in reading_notes(nxt.events))
    await c.close()


@ON_CPU
async def test_stop_while_a_long_message_is_read_aborts_it_in_the_engine(server):
    c = await client(server, max_tokens=8)
    idle, idle_kv = await engine_now(server)
    assert idle["unfinished_requests"] == 0
    # Stop while the engine reads: on a loaded machine the whole turn may end before this
    # test sees the engine take it, so a longer message is tried then, in a new chat (the
    # checks below need the withdrawn message to be the chat's only one).
    for attempt, lines in enumerate((75, 100, 125)):
        if attempt:
            await c.close()
            c = await client(server, max_tokens=8)
        start = len(c.events)
        await c.emit_message(long_text(f"harbour {attempt}", lines))
        await c.wait_for_note("Reading your message", since=start)
        deadline = time.monotonic() + 60
        while not await in_the_engine(server, idle_kv) and not read_already(c, start):
            assert time.monotonic() < deadline, "the engine never took the prompt in"
            await asyncio.sleep(0.05)
        if not read_already(c, start):
            break
        await c.wait_for("task_end", since=start, timeout=60)  # read too soon: again
    else:
        pytest.fail("every message was read before Stop could come: nothing was tested")
    await c.stop()
    end = await c.wait_for("task_end", since=start, timeout=60)
    events = c.events[start:end + 1]
    assert not [e for e in events if e.name in ("stream_start", "stream_token")], \
        "the reply began before Stop: the message was read too soon for this test"
    assert any(e.name == "new_message" and e.data["output"] == WITHDRAWN for e in events)
    notes = reading_notes(events)
    assert deleted(events, notes[0][1]) is not None, "the reading note stayed after Stop"
    # Aborted in vLLM as the turn ended: no request left.
    engine, _ = await engine_now(server)
    assert engine["unfinished_requests"] == 0 and engine["admitted"] == 0

    # The next message is answered at once, without the withdrawn one in its history; after
    # it the KV cache is as idle as before: the aborted prompt's blocks were freed. (vLLM's
    # gauge is the last step's: an abort alone runs no step that would update it.)
    nxt = await c.send("Hello?", timeout=60)
    assert nxt.reply is not None and nxt.reply["metadata"]["output_tokens"] >= 1
    assert nxt.reply["metadata"]["prompt_tokens"] < 100
    engine, kv = await engine_now(server)
    print(f"KV cache in use: {idle_kv:.4f} idle, {kv:.4f} after Stop and the next turn")
    assert engine["unfinished_requests"] == 0 and kv <= idle_kv
    await c.close()
