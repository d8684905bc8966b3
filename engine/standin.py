"""A STAND-IN ENGINE for measuring the app layer alone. It runs no model.

It answers every turn with filler words at a set speed per stream, one token per delta
like an engine step (above 1,000 tokens/s per stream, several tokens per 1 ms step), so the
UI layer can be driven at any token rate, far beyond what a CPU model produces. It keeps the real
chat formatting and history fitting (the model's tokenizer), so the app works unchanged.

Only for benchmarks: the app uses it when `VCHAT_ENGINE=stand-in`, and says so to every
user and in /ready. Selected in bench/ui_ceiling.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from .base import Engine
from .chat_format import ChatFormatter
from .decoding import Decoding, Piece
from .errors import ChatError
from .history import Prompt, check_fits
from .launch import EngineSetup
from .stats import TurnStats

WORDS = ("stand-in text for measuring the chat layer only no model wrote this "
         "reply").split()
DEFAULT_MAX_MODEL_LEN = 8192


class StandInEngine(Engine):
    """An engine (base.py) with no model behind it."""

    label = "stand-in engine (no model)"

    def __init__(self, preset: str, setup: EngineSetup, tokens_per_s: float = 1000.0):
        super().__init__(preset)
        self.setup = setup
        self.step_s = max(1.0 / tokens_per_s, 0.001)
        self.tokens_per_step = max(1, round(tokens_per_s * self.step_s))
        self._unfinished = 0

    async def start(self) -> None:
        from transformers import AutoTokenizer

        started = time.monotonic()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained,
                                            self.setup.args["model"])
        self._formatter = ChatFormatter(tokenizer)
        wanted = self.setup.args.get("max_model_len") or -1
        self.max_model_len = wanted if wanted > 0 else DEFAULT_MAX_MODEL_LEN
        self.started_in_s = time.monotonic() - started

    def shutdown(self) -> None:
        self._formatter = None

    @property
    def max_num_seqs(self) -> int:
        return self.setup.args.get("max_num_seqs", 256)

    @property
    def running(self) -> bool:
        return self._formatter is not None

    async def check_health(self) -> bool:
        return self.running

    def num_unfinished_requests(self) -> int:
        return self._unfinished

    async def stream(self, prompt: Prompt, *, temperature: float, top_p: float,
                     ignore_eos: bool = False, seed: int | None = None, priority: int = 0,
                     preset: str | None = None, session: str | None = None,
                     decoding: Decoding | None = None,
                     on_finished: Callable[[], None] | None = None
                     ) -> AsyncIterator[str | Piece | TurnStats]:
        """`prompt.max_tokens` filler tokens, `tokens_per_step` of them every `step_s` by the
        clock: like vLLM, a reader who pulls late gets every token made meanwhile at once
        (the engine never waits for its readers), and `on_finished()` is called with the
        last ones. It writes filler only: a turn asking for more of the decoding (stop
        strings, JSON, log probabilities...) is refused."""
        if not self.running:
            raise self.not_running()
        if decoding is not None and replace(decoding, token_ids=False) != Decoding():
            raise ChatError("The stand-in engine (benchmarks) writes filler text only; it "
                            "cannot honour stop, penalties, JSON, tools, n or logprobs.")
        check_fits(prompt, self.max_model_len)
        max_tokens = prompt.max_tokens
        request_id = f"stand-in-{uuid.uuid4().hex}"
        started, ttft, sent = time.monotonic(), None, 0
        self._unfinished += 1
        try:
            while sent < max_tokens:
                steps = int((time.monotonic() - started) / self.step_s)
                due = min(max_tokens, steps * self.tokens_per_step)
                if due <= sent:  # sleep until the next step makes tokens
                    await asyncio.sleep(started + (steps + 1) * self.step_s - time.monotonic())
                    continue
                text = "".join(" " + WORDS[i % len(WORDS)] for i in range(sent, due))
                if due == max_tokens and on_finished is not None:
                    on_finished()
                # With the plain Decoding (the API asks it): Pieces, the last one finished.
                yield text if decoding is None else Piece(
                    0, text, None, "length" if due == max_tokens else None)
                sent = due
                if ttft is None:
                    ttft = time.monotonic() - started
        finally:
            self._unfinished -= 1
        yield TurnStats(request_id, preset or self.preset, prompt.prompt_tokens, sent, ttft,
                        time.monotonic() - started, "length")
