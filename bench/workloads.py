"""Seeded, reproducible benchmark workloads.

- chat: short prompts, every reply exactly `output_len` tokens (ignore_eos).
- mixed: the same chat turns, and every `long_every`-th request instead carries a long
  prompt (`long_words` words) sent after a seeded delay of 0.5-3 s, so long
  prefills arrive while the others decode: where the presets' token budgets differ.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

# Every request's sampling, the same on the engine and the app path (the app path runs on a
# profiles file whose profiles carry exactly this; bench/run.py). top_p stays 1.0: vLLM's CPU
# sampler sorts the whole vocabulary for top_p < 1, which alone costs ~30% of the tokens/s at
# 32 users here (BENCHMARKS.md), and the benchmark is about batching, not the sampler.
SAMPLING = {"temperature": 0.8, "top_p": 1.0}
SYSTEM_PROMPT = ""

TOPICS = ["the sea", "a lighthouse", "bread", "trains", "the moon", "gardening", "chess",
          "volcanoes", "owls", "the printing press", "rain", "bicycles", "glaciers", "tea"]
FILLER = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
          "omicron pi rho sigma tau upsilon phi chi psi omega").split()


@dataclass(frozen=True)
class Request:
    prompt: str
    output_len: int
    long: bool = False
    delay_s: float = 0.0  # wait this long after the run starts before sending


async def arrive(req: Request, run_started: float) -> None:
    """Hold a delayed request until its arrival time (counted from the run's start)."""
    wait = run_started + req.delay_s - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)


def chat(n: int, output_len: int = 64, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"Tell me something about {rng.choice(TOPICS)} ({i}).", output_len)
            for i in range(n)]


def mixed(n: int, output_len: int = 64, seed: int = 0, long_every: int = 4,
          long_words: tuple[int, int] = (1200, 1200)) -> list[Request]:
    """`long_words`: the long prompts' length in words, drawn from this range (a filler
    word is about 1.3 tokens with either tokenizer here)."""
    rng = random.Random(seed)
    out = []
    for i, req in enumerate(chat(n, output_len, seed)):
        if i % long_every == long_every - 1:
            count = rng.randint(*long_words)
            words = " ".join(rng.choice(FILLER) for _ in range(count))
            out.append(Request(f"Summarise this text: {words}", output_len, long=True,
                               delay_s=round(rng.uniform(0.5, 3.0), 2)))
        else:
            out.append(req)
    return out


WORKLOADS = {"chat": chat, "mixed": mixed}
