"""Requests straight on an engine's vLLM client (no app), for the tests and benchmarks that
load an engine beside the turn they watch."""

from __future__ import annotations

import uuid

from vllm import SamplingParams, TokensPrompt
from vllm.sampling_params import RequestOutputKind


async def generate(llm, prompt, max_tokens: int, priority: int, counts: dict, key) -> None:
    """One request of `max_tokens` (end of text ignored) on vLLM's engine client `llm`,
    counting its tokens into counts[key] as they come."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7,
                            top_p=0.9, output_kind=RequestOutputKind.DELTA)
    counts[key] = 0
    async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt.token_ids), params,
                                  f"wait-{uuid.uuid4().hex}", priority=priority):
        counts[key] += len(out.outputs[0].token_ids)
