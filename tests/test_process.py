"""The app as a process: `chainlit run app.py` starts, serves users who arrive during
start-up, and stops without leaving engine processes behind.

Regression: under `chainlit run` vLLM's spawned engine processes re-imported Chainlit's
CLI as their main module and died ("WorkerProc failed to start"); see engine/llm.py.
"""

import asyncio
import signal
import time

import psutil

from tests.chainlit_client import ChatClient, Server


async def test_start_serve_during_startup_and_clean_shutdown():
    server = Server()
    try:
        await server.wait_http()
        status, health = await server.ready_state()
        assert status == 503 and health["status"] == "starting"

        # A user who arrives now sees that the model is starting, and is answered later.
        early = ChatClient(server.url, "Latency-first")
        await early.connect()
        assert (await early.settings(max_tokens=16)).messages == []
        reply = await early.send("Hello, are you there?", timeout=400)
        notes = [e.data["output"] for e in early.events if e.name == "new_message"]
        assert any("still starting" in n for n in notes)
        assert reply.tokens and reply.reply["metadata"]["output_tokens"] > 0
        status, health = await server.ready_state()
        assert status == 200 and health["status"] == "ok"
        await early.close()

        family = psutil.Process(server.proc.pid).children(recursive=True)
        assert len([p for p in family if "VLLM" in " ".join(p.cmdline()) or
                    "EngineCore" in p.name()]) >= 2, "one engine per preset"
    finally:
        code = server.stop(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family) and (
            time.monotonic() < deadline):
        await asyncio.sleep(0.5)
    left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes left behind: {left}"
    assert code is not None
