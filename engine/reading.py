"""How fast an engine reads prompts (its prefill), for the chat's progress while a long
message is read. vLLM says nothing of a request between taking it and its first token, so
that progress is an estimate: the prompt's new tokens (those not in the prefix cache) at
the rate this engine read its recent long prompts, or a default before it read any.

    rate = ReadingRate()
    rate.add(stats)                        # each turn's TurnStats, as the engine ends it
    rate.seconds(40_000, gpu=True)         # about how long 40,000 new tokens take

The rate is tokens read per second of time to first token: that time also holds the
request's way into the engine and its wait there behind other turns, as the user's wait
does. One rate for every length is a simplification: attention makes a step slower the
more context it holds, so a prompt much longer than those measured takes longer than
estimated (the chat says "about" and "estimated", and once the estimated time has run out,
that it takes longer).
"""

from __future__ import annotations

from .stats import TurnStats

# Before an engine has read any long prompt; low rather than high, as a progress that
# runs ahead of the engine would stand at its end for long. Without a GPU (SmolLM2-135M,
# Latency-first's 24-token steps on 2 busy cores): 233 tokens/s (tests/test_reading.py).
# With one (Qwen3-4B on an H200): tens of thousands a second for prompts of a few thousand
# tokens, but 7,000 for a 252k-token one (BENCHMARKS.md, "The engine's part"), and the long
# ones are those shown.
DEFAULT_TOKENS_PER_S = {False: 200.0, True: 7000.0}  # by "has a GPU"
# A turn that read fewer new tokens says more about a step's fixed cost than about reading.
MEASURED_FROM_TOKENS = 256
# The newest turn's share of the rate (an exponentially weighted mean): a few turns move it.
NEWEST_WEIGHT = 0.3


class ReadingRate:
    """An engine's reading rate, from its recent turns."""

    def __init__(self):
        self.tokens_per_s: float | None = None  # None before any long prompt was read
        self.turns = 0  # turns measured

    def add(self, stats: TurnStats) -> None:
        """A turn's figures: counted when it read enough new tokens and got a token."""
        read = stats.prompt_tokens - (stats.cached_tokens or 0)
        if stats.ttft_s is None or stats.ttft_s <= 0 or read < MEASURED_FROM_TOKENS:
            return
        rate = read / stats.ttft_s
        self.turns += 1
        self.tokens_per_s = rate if self.tokens_per_s is None else \
            (1 - NEWEST_WEIGHT) * self.tokens_per_s + NEWEST_WEIGHT * rate

    def seconds(self, tokens: int, gpu: bool = False) -> float:
        """About how long reading `tokens` new tokens takes."""
        return tokens / (self.tokens_per_s or DEFAULT_TOKENS_PER_S[gpu])
