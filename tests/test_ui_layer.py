"""The chat layer alone, on the labelled STAND-IN engine (engine/standin.py, no model): a
`chainlit run app.py` server whose engine emits tokens far faster than any CPU model, to
check what the UI layer does with a fast stream."""

import pytest

from engine.standin import WORDS
from tests.chainlit_client import ChatClient, Server

RATE = 2000  # tokens/s per stream: 2 tokens every 1 ms step


@pytest.fixture(scope="module")
async def server():
    srv = Server({"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": str(RATE),
                  "VCHAT_BENCH_IGNORE_EOS": "1"})
    try:
        await srv.wait_ready(timeout=120)
        yield srv
    finally:
        srv.stop()


async def test_the_stand_in_is_labelled_for_operators_and_users(server):
    _, health = await server.ready_state()
    assert health["engine"].startswith("stand-in")
    c = ChatClient(server.url, "Latency-first")
    await c.connect()
    notes = [e.data["output"] for e in c.events if e.name == "new_message"]
    assert any("stand-in engine, not a model" in n for n in notes)
    await c.close()


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
