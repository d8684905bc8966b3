"""The two measured paths: straight into engine/ (no UI), and through the running app over
Chainlit's socket protocol with headless clients, exactly as browsers would.
"""

from __future__ import annotations

import asyncio
import functools
import time

from bench.metrics import RequestTiming, decode_by_wave, summarize
from bench.workloads import SAMPLING, SYSTEM_PROMPT, Request, arrive
from engine import Message, Prompt, TurnStats
from engine.history import fit_history
from engine.llm import PresetEngine


def one_message(engine: PresetEngine, text: str, max_tokens: int,
                system_prompt: str = SYSTEM_PROMPT) -> Prompt:
    """A new conversation's first prompt, fitted to `engine` as the app fits every turn."""
    return fit_history(engine.formatter, [], Message("user", text), system_prompt=system_prompt,
                       max_model_len=engine.max_model_len, max_tokens=max_tokens)


def engine_view(engine: PresetEngine) -> dict:
    """The scheduler's own view over the last run: requests per step and KV cache use."""
    samples = list(engine.step_stats.samples)
    if not samples:
        return {}
    running = [s.running for s in samples]
    return {"steps": engine.step_stats.steps, "running_mean": round(sum(running) / len(running), 2),
            "running_max": max(running), "waiting_max": max(s.waiting for s in samples),
            "kv_cache_usage_max": round(max(s.kv_cache_usage for s in samples), 4)}


async def drive_engine(engine: PresetEngine, requests: list[Request], concurrency: int,
                       progress=None, from_arrival: bool = False, sampling: dict | None = None
                       ) -> tuple[list[RequestTiming], float]:
    """`concurrency` users at once, each taking the next request when its turn ends.
    Returns the per-request timings and the wall time. `from_arrival`: each request's
    times count from its arrival (the run's start plus its delay), its wait for one of the
    `concurrency` seats included, as a user who asked then would count them; otherwise from
    when it was sent. `sampling`: the requests' (default: the benches' SAMPLING)."""
    sampling = SAMPLING if sampling is None else sampling
    queue = list(reversed(requests))
    timings: list[RequestTiming] = []
    # Every run starts as new conversations would: prompts an earlier run sent (a repeat, or
    # the baseline's share of the batched run's requests) would otherwise skip their prefill.
    await engine.llm.reset_prefix_cache()

    async def user():
        while queue:
            req = queue.pop()
            await arrive(req, started)
            t = RequestTiming(sent=started + req.delay_s if from_arrival else time.monotonic())
            timings.append(t)
            async for item in engine.stream(one_message(engine, req.prompt, req.output_len),
                                            ignore_eos=True, **sampling):
                if isinstance(item, TurnStats):
                    t.output_tokens = item.output_tokens
                else:
                    t.chunks.append(time.monotonic())
            if progress:
                progress.update(1)

    started = time.monotonic()
    await asyncio.gather(*[user() for _ in range(concurrency)])
    return timings, time.monotonic() - started


async def drive_raw(engine: PresetEngine, requests: list[Request], concurrency: int,
                    progress=None) -> tuple[list[RequestTiming], float]:
    """As drive_engine, but straight into the engine's vLLM AsyncLLM: the same prompts
    (token ids, fitted beforehand) and sampling, without engine/'s stream around it. The
    anchor that engine/'s own cost is measured against."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm
    prompts = {id(r): one_message(engine, r.prompt, r.output_len) for r in requests}
    queue = list(reversed(requests))
    timings: list[RequestTiming] = []
    await llm.reset_prefix_cache()

    async def user(n: int):
        while queue:
            req = queue.pop()
            prompt = prompts[id(req)]
            await arrive(req, started)
            params = SamplingParams(max_tokens=prompt.max_tokens, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA, **SAMPLING)
            t = RequestTiming(sent=time.monotonic())
            timings.append(t)
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt.token_ids),
                                          params, f"raw-{n}-{len(timings)}-{time.time_ns()}"):
                completion = out.outputs[0]
                t.output_tokens += len(completion.token_ids)
                if completion.text:
                    t.chunks.append(time.monotonic())
            if progress:
                progress.update(1)

    started = time.monotonic()
    await asyncio.gather(*[user(i) for i in range(concurrency)])
    return timings, time.monotonic() - started


async def run_raw(engine: PresetEngine, requests: list[Request], concurrency: int,
                  progress=None) -> dict:
    """One run on the raw vLLM path (see drive_raw)."""
    return await _measured(drive_raw, engine, requests, concurrency, progress)


async def run_engine(engine: PresetEngine, requests: list[Request], concurrency: int,
                     progress=None, from_arrival: bool = False, waves: int = 0,
                     sampling: dict | None = None) -> dict:
    """One run on the engine path: its metrics and the scheduler's view of it; `waves`:
    also the streams' decode speed for every that many turns (bench/metrics.py)."""
    drive = functools.partial(drive_engine, from_arrival=from_arrival, sampling=sampling)
    return await _measured(drive, engine, requests, concurrency, progress, waves)


async def _measured(drive, engine: PresetEngine, requests: list[Request], concurrency: int,
                    progress, waves: int = 0) -> dict:
    engine.step_stats.reset()
    timings, wall_s = await drive(engine, requests, concurrency, progress)
    result = summarize(timings, wall_s)
    if waves:
        result["decode_tok_s_by_wave"] = decode_by_wave(timings, waves)
    result["engine"] = engine_view(engine)
    return result


async def run_app(url: str, profile: str, requests: list[Request], concurrency: int,
                  progress=None, processes: int = 1) -> dict:
    """The same, through the app: one socket session per user, the users in `processes`
    client processes (bench/app_clients.py). `client_cpu`: the share of the run's wall
    time that each client process's event loop spent on a CPU (near 1: that client was
    the limit)."""
    from bench.app_clients import drive, run_spread

    processes = min(processes, concurrency)  # a client process holds at least one user
    if processes > 1:
        return await run_spread(url, profile, requests, concurrency, processes, progress)
    timings, started, ended, cpu = await drive(url, profile, requests, concurrency, progress)
    out = summarize(timings, ended - started)
    out["client_cpu"] = [round(cpu / (ended - started), 3)]
    return out
