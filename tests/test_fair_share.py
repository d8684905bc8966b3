"""Heavy callers get a fair share (issue 53), through a real server on the real CPU engine:
one account's burst of API requests (3x the seats) fills the seats and the line; another
account's request then takes the next free seat instead of being refused as busy, the
burst's newest waiting request is refused naming its own account's limit, and /ready and
/metrics show the accounts' figures, no account named. Before, the second account was
told "busy" at once, and had the line had room, it would have waited for the whole
backlog to drain."""

from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest
import yaml

from tests.test_accounts import add_user, store_command
from tools.chainlit_client import ROOT, engine_of, serving

PRESET, PROFILE = "latency-first", "Latency-first"
SEATS, LINE = 4, 8
HEAVY, LIGHT = "fair-heavy-caller", "fair-light-caller"


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    """Latency-first alone, with 4 seats and a line of 8 on any device; replies run to
    max_tokens (the benchmark switch), so a heavy turn lasts while the test looks."""
    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    body = raw["presets"][PRESET]
    body["vllm_cpu"]["max_num_seqs"] = body["vllm_gpu"]["max_num_seqs"] = SEATS
    raw["presets"] = {PRESET: {**body, "memory_share": 1.0, "max_queued_turns": LINE}}
    raw["profiles"] = [p for p in raw["profiles"] if p["preset"] == PRESET]
    path = tmp_path_factory.mktemp("profiles") / "profiles.yaml"
    path.write_text(yaml.safe_dump(raw))
    async with serving({"VCHAT_PROFILES": str(path), "VCHAT_BENCH_IGNORE_EOS": "1"}) as srv:
        yield srv


def client_of(server, name: str) -> openai.AsyncOpenAI:
    add_user(server, name, f"a password for {name}")
    key = store_command(server, "keys", "add", name).strip().splitlines()[-1]
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                              timeout=300)


async def line_of(server) -> dict:
    _, health = await server.ready_state()
    return engine_of(health, PRESET)["presets"][PRESET]


async def until(server, check, timeout: float = 120.0) -> dict:
    """/ready's figures for the preset once `check(figures)` holds (polled, to a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        figures = await line_of(server)
        if check(figures):
            return figures
        assert time.monotonic() < deadline, figures
        await asyncio.sleep(0.05)


async def metrics(server) -> str:
    return (await server.request("/metrics")).text


def sample(text: str, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    assert found, f"no {name}{{{wanted}}} in /metrics"
    return float(found.group(1))


async def test_another_accounts_turn_goes_ahead_of_one_accounts_burst(server):
    heavy, light = client_of(server, HEAVY), client_of(server, LIGHT)
    refused: list[str] = []
    streams: list = []

    async def first_piece(client, max_tokens: int) -> float | None:
        """When its first piece came (the server answers once it has one), or None when
        refused; the rest of the reply is left to read (`streams`)."""
        try:
            stream = await client.chat.completions.create(
                model=PROFILE, messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=max_tokens, stream=True)
        except openai.RateLimitError as exc:
            refused.append(exc.body["message"])
            return None
        streams.append(stream)
        return time.monotonic()

    burst = [asyncio.ensure_future(first_piece(heavy, 96)) for _ in range(3 * SEATS)]
    try:
        # 1. Alone, the burst takes every seat and the whole line; none is refused.
        figures = await until(server, lambda f: f["admitted"] == SEATS and f["queued"] == LINE)
        assert (figures["accounts_admitted"], figures["largest_admitted"]) == (1, SEATS)
        assert (figures["accounts_queued"], figures["largest_queued"]) == (1, LINE)
        assert (figures["account_seats"], figures["account_queued"]) == (SEATS // 2, LINE // 4)
        shown = await metrics(server)
        assert sample(shown, "vchat_admission_largest_account_turns", preset=PRESET,
                      state="queued") == LINE
        assert sample(shown, "vchat_admission_accounts", preset=PRESET, state="admitted") == 1
        assert not refused
        # 2. Another account's request: not refused as busy, it pushes the burst's newest
        # out of the full line and takes the next free seat, ahead of the burst's backlog.
        first = await first_piece(light, 8)
        assert first is not None, refused
        assert len(refused) == 1 and "Too many of your requests are waiting" in refused[0]
        assert (await line_of(server))["refused_over_share"] == 1
        heavy_firsts = [f for f in await asyncio.gather(*burst) if f is not None]
        assert len(heavy_firsts) == 3 * SEATS - 1
        later = [f for f in heavy_firsts if f > first]
        assert len(later) >= LINE // 2, \
            f"the burst's backlog went first: {len(later)} of its turns began after the other's"
    finally:
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
        for stream in streams:  # the replies are left part way: their seats are freed
            await stream.close()
        await heavy.close()
        await light.close()
    figures = await until(server, lambda f: f["admitted"] == f["queued"] == 0)
    assert figures["accounts_admitted"] == figures["accounts_queued"] == 0
    shown = await metrics(server)
    assert sample(shown, "vchat_admission_account_refused_total", preset=PRESET) == 1
    assert sample(shown, "vchat_admission_accounts", preset=PRESET, state="queued") == 0
    assert HEAVY not in shown and LIGHT not in shown, "no account is named in /metrics"
