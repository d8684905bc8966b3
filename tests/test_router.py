"""The model tier behind vLLM Router (deploy/model-router.sh, the shipped script and its
flags): an app replica whose presets run on two `vllm serve` processes (the CPU build, the
embedded model) through the router, which hashes each chat's session key. As
tests/test_deploy.py does for HAProxy (deploy/haproxy-models.cfg, the plain alternative):
each server records the requests it gets (tools/header_log.py), which shows where each
chat's turns went.

    .venv/bin/python -m pytest -q tests/test_router.py
"""

import os

import httpx
import pytest

from tests.test_accounts import add_user
from tests.test_deploy import chats_kept_on_one_server, client, killed_mid_reply_then_moved
from tools.deployment import Deployment, haproxy_binary

pytestmark = pytest.mark.skipif(
    haproxy_binary() is None and not os.environ.get("VCHAT_REQUIRE_PROXY"),
    reason="needs Debian's haproxy (the app's proxy in front of the replica)")


@pytest.fixture(scope="module")
async def site(tmp_path_factory):
    async with Deployment(tmp_path_factory.mktemp("router"), "", replicas=1,
                          model_router="vllm-router") as deployment:
        add_user(deployment.replicas[0], "alice", "alice's password")
        add_user(deployment.replicas[0], "dave", "dave's password")
        yield deployment


async def test_the_router_answers_for_its_servers(site):
    async with httpx.AsyncClient() as http:
        ready = await http.get(site.models_url + "/readiness", timeout=10)
        models = await http.get(site.models_url + "/v1/models", timeout=10)
    assert ready.status_code == 200, ready.text
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smol"


async def test_each_chat_stays_on_one_server_whose_cache_holds_its_history(site):
    await chats_kept_on_one_server(site, lambda n: client(site, 0))


async def test_a_server_killed_mid_reply_moves_its_chats_to_the_other(site):
    await killed_mid_reply_then_moved(site, client(site, 0, user="dave",
                                                   profile="Throughput-first"))
