"""The chat layer alone, on the labelled STAND-IN engine (engine/standin.py, no model): a
`chainlit run app.py` server whose engine emits tokens far faster than any CPU model, to
check what the UI layer does with a fast stream."""

import asyncio
import re

import pytest
import yaml

from chat.view import STAND_IN
from engine.launch import has_cuda
from engine.standin import WORDS
from tools.chainlit_client import ROOT, ChatClient, engine_of, serving


@pytest.fixture
def server(fast_stand_in):
    return fast_stand_in


async def test_the_stand_in_is_labelled_for_operators_and_users(server):
    _, health = await server.ready_state()
    assert health["engine"].startswith("stand-in")
    # Users in the line above every page's chat (public/model-status.js), not in the chat:
    # a message at a chat's start lost what a user had begun typing (tests/e2e/test_demo.py).
    assert await server.get("/notice") == {"ready": True, "notice": STAND_IN}
    c = ChatClient(server.url, "Latency-first")
    await c.connect()
    assert [e for e in c.events if e.name == "new_message"
            and e.data.get("type") == "assistant_message"] == []
    await c.close()


async def test_once_started_the_server_keeps_its_event_loop_from_stalling(server):
    """app.py's settle_after_start (chat/stalls.py, service/loop.py): the device's streaming
    pace, Chainlit's blocking constructor pause skipped, the long-lived heap out of the
    collector's walks."""
    pattern = re.compile(r"streaming pace: (\d+) updates/s .* constructor pause skipped: "
                         r"(\w+); (\d+) long-lived objects .*; event loop: (.*)")
    for _ in range(100):  # it runs right after the engines are up
        if found := pattern.search(server.log_path.read_text(errors="replace")):
            break
        await asyncio.sleep(0.1)
    assert found, server.log()[-2000:]
    pace, skipped, frozen, event_loop = found.groups()
    assert int(pace) == (2000 if has_cuda() else 160)
    assert skipped == "True"
    assert int(frozen) > 10_000
    # asyncio's C tasks rather than nest_asyncio's Python ones (service/loop.py); the chat
    # above connected and streamed on it.
    assert event_loop == "asyncio, C tasks"


async def test_a_fast_stream_is_coalesced_into_few_events_and_loses_nothing(server):
    c = ChatClient(server.url, "Throughput-first")
    await c.connect()
    await c.settings(max_tokens=1000, show_stats=False)
    reply = await c.send("Go.")
    meta = reply.reply["metadata"]
    assert meta["output_tokens"] == 1000
    words = reply.shown.split()
    assert len(words) == 1000 and words[:3] == WORDS[:3], "every token reaches the browser"
    assert reply.reply["output"] == reply.shown, "the final message is the streamed text"
    # The engine produced 500 deltas (2 tokens per 1 ms step) in 0.5 s or more; at one
    # event per 40 ms the browser gets a dozen or so, never one per delta.
    events = len(reply.tokens)
    assert events < 500 / 10, f"{events} text events for 500 engine deltas"
    await c.close()


@pytest.fixture(scope="module")
async def small_queue_server(tmp_path_factory):
    """A slow stand-in (10 tokens/s per stream, as a CPU model at 32 users). Latency-first
    runs 12 turns at once (its CPU value, here on any device); at most 8 more may wait.
    Turns of 40 tokens last 4 s: far longer than 64 messages take to arrive."""
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    fast = raw["presets"]["latency-first"]
    fast["max_queued_turns"] = 8
    fast["vllm_gpu"]["max_num_seqs"] = fast["vllm_cpu"]["max_num_seqs"] = 12
    path = tmp_path_factory.mktemp("profiles") / "profiles.yaml"
    path.write_text(yaml.safe_dump(raw))
    # The CPU's streaming pace (160 updates/s in all) on any device.
    async with serving({"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": "10",
                        "VCHAT_BENCH_IGNORE_EOS": "1", "VCHAT_PROFILES": str(path),
                        "VCHAT_STREAM_EVENTS_PER_S": "160"}, timeout=120) as srv:
        yield srv


async def test_overload_beyond_the_queue_is_refused_at_once_and_nothing_hangs(
        small_queue_server):
    server = small_queue_server
    clients = [ChatClient(server.url, "Latency-first") for _ in range(64)]
    await asyncio.gather(*[c.connect() for c in clients])
    await asyncio.gather(*[c.settings(max_tokens=40, show_stats=False) for c in clients])
    outcomes = await asyncio.gather(*[c.send("Hello!", timeout=120) for c in clients])
    _, health = await server.ready_state()
    gate = engine_of(health, "latency-first")
    answered = [o for o in outcomes if o.reply is not None]
    busy = [o for o in outcomes if any("busy right now" in n for n in o.notes)]
    waited = [o for o in answered if any("in line" in n for n in o.notes)]
    # Every turn ended one way or the other, clearly; none hung (send() would time out).
    assert len(answered) + len(busy) == 64 and not (set(map(id, answered)) & set(map(id, busy)))
    assert all(o.reply["metadata"]["output_tokens"] == 40 for o in answered)
    line = gate["presets"]["latency-first"]  # its own line, on the engine it may share
    assert len(answered) == line["seats"] + line["max_queued"] == 12 + 8
    assert len(waited) == 8 and len(busy) == 44
    assert all(o.reply is None for o in busy), "a refused turn gets no reply"
    assert line["admitted"] == 0 and line["queued"] == 0 and gate["admitted"] == 0
    # Refused users can simply try again.
    retry = await clients[outcomes.index(busy[0])].send("Hello again!")
    assert retry.reply["metadata"]["output_tokens"] == 40
    await asyncio.gather(*[c.close() for c in clients])


async def test_updates_slow_down_only_when_many_replies_stream_at_once(small_queue_server):
    """chat/streaming.py's Pace: one reply alone gets each token as it comes; with 32 at
    once (throughput-first, 10 tokens/s each) the app sends every 0.2 s, two tokens an
    update, which halves the socket events without holding any text back for long."""
    server = small_queue_server
    clients = [ChatClient(server.url, "Throughput-first") for _ in range(32)]
    await asyncio.gather(*[c.connect() for c in clients])
    await asyncio.gather(*[c.settings(max_tokens=40, show_stats=False) for c in clients])
    alone = await clients[0].send("Hello!")
    assert len(alone.tokens) >= 36, f"{len(alone.tokens)} updates for 40 tokens alone"
    together = await asyncio.gather(*[c.send("Hello!", timeout=120) for c in clients])
    for reply in together:
        assert reply.reply["metadata"]["output_tokens"] == 40
        assert len(reply.shown.split()) == 40, "every token reaches the browser"
        assert len(reply.tokens) <= 26, f"{len(reply.tokens)} updates for 40 tokens"
        gaps = [b.at - a.at for a, b in zip(reply.events, reply.events[1:])
                if b.name == "stream_token"]
        assert max(gaps) < 0.6, "no text is held back much longer than the interval"
    again = await clients[0].send("Hello!")
    assert len(again.tokens) >= 36, "finished replies no longer count as streaming"
    await asyncio.gather(*[c.close() for c in clients])
