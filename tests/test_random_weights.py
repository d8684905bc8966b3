"""A model with random weights (`load_format: dummy`, as the dummy Qwen3-4B runs on a GPU
without its download) is announced: every user is told replies are random text, and
/ready says so. Here the embedded model's shapes with random weights, one preset."""

import yaml

from chat.view import RANDOM_WEIGHTS
from tools.chainlit_client import ROOT, ChatClient, Server


async def test_random_weights_are_announced_to_users_and_operators(tmp_path):
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    raw["vllm"]["load_format"] = "dummy"
    raw["profiles"] = [p for p in raw["profiles"] if p["preset"] == "latency-first"]
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump(raw))
    server = Server({"VCHAT_PROFILES": str(profiles)})
    try:
        health = await server.wait_ready()
        assert health["status"] == "ok" and health["random_weights"] is True
        # Every page says so above its chat (a message in it lost what users typed).
        assert await server.get("/notice") == {"ready": True, "notice": RANDOM_WEIGHTS}
        assert "random weights" in RANDOM_WEIGHTS and "random text" in RANDOM_WEIGHTS
        client = ChatClient(server.url, "Latency-first")
        await client.connect()
        await client.settings(max_tokens=8)
        reply = await client.send("Hello?", timeout=120)
        assert reply.reply["metadata"]["output_tokens"] > 0  # the engine still answers
        await client.close()
    finally:
        server.stop()
