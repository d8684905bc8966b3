"""One vLLM `AsyncLLM` engine running one batching preset.

The engine knows nothing about the UI: it takes chat messages, yields text deltas as vLLM
produces them (RequestOutputKind.DELTA), and ends every stream with a `TurnStats`.
Closing or cancelling a stream aborts its request inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

from .chat_format import ChatFormatter, Message
from .errors import ChatError, ConfigError, EngineFailed, EngineUnavailable
from .stats import StepStats, TurnStats

log = logging.getLogger(__name__)


@contextlib.contextmanager
def neutral_main():
    """Hide the parent's `__main__` from processes spawned inside this block.

    vLLM starts its EngineCore with multiprocessing's `spawn`, which re-imports the
    parent's main module in the child. Under `chainlit run app.py` that module is
    Chainlit's CLI; the child then imports Chainlit, and vLLM's CPU worker, which scans
    every loaded module, trips over Chainlit's context proxy and dies. The engine process
    needs nothing from our main module, so during start-up `__main__` is a blank module:
    spawn then re-imports nothing. Scripts without a main guard work for the same reason.
    """
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


SMALL_CPU_CORES = 4


def cpu_thread_env(env: Mapping[str, str], cores: int) -> dict[str, str]:
    """Environment for vLLM's CPU workers: on small machines, every core for the model.

    vLLM reserves one core per worker for its scheduler process; on 2 cores that halves
    the model's share (measured: 1.7x the tokens/s at 32 users with both cores). An
    operator's own VLLM_CPU_* setting always wins.
    """
    if cores > SMALL_CPU_CORES or any(
            k in env for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")):
        return {}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class PresetEngine:
    """An in-process vLLM engine plus the chat formatting for its model."""

    def __init__(self, preset: str, engine_args: dict):
        self.preset = preset
        self.engine_args = dict(engine_args)
        self.step_stats = StepStats()
        self._llm = None
        self._formatter: ChatFormatter | None = None
        self.max_model_len: int | None = None
        self.started_in_s: float | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine in a worker thread, so the event loop keeps serving meanwhile."""
        started = time.monotonic()
        log.info("Starting engine %r (%s)", self.preset, self.engine_args.get("model"))
        self._llm = await asyncio.to_thread(self._build)
        self.max_model_len = self._llm.model_config.max_model_len
        self._formatter = ChatFormatter(self._llm.get_tokenizer())
        self.started_in_s = time.monotonic() - started
        log.info("Engine %r ready in %.1f s (max_model_len %d)", self.preset,
                 self.started_in_s, self.max_model_len)

    def _build(self):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.engine_args)
        try:
            vllm_config = args.create_engine_config()
        except (ValueError, TypeError) as exc:  # vLLM's own check of the option set
            raise ConfigError("profiles.yaml", f"presets.{self.preset}.vllm",
                              f"vLLM refused these options: {_first_line(exc)}") from exc
        if vllm_config.device_config.device_type == "cpu":  # read by the processes vLLM spawns
            os.environ.update(cpu_thread_env(os.environ, len(os.sched_getaffinity(0))))
        with neutral_main():
            return AsyncLLM.from_vllm_config(
                vllm_config, stat_loggers=[self.step_stats.logger_factory()]
            )

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def running(self) -> bool:
        return self._llm is not None and not self._llm.errored

    @property
    def llm(self):
        """The underlying vLLM AsyncLLM (for tests and metrics; turns go through stream)."""
        return self._require()

    @property
    def max_num_seqs(self) -> int:
        """How many turns vLLM runs at once on this engine."""
        return self.scheduler_config.max_num_seqs

    @property
    def scheduler_config(self):
        return self._require().vllm_config.scheduler_config

    @property
    def cache_config(self):
        return self._require().vllm_config.cache_config

    async def check_health(self) -> bool:
        if self._llm is None:
            return False
        try:
            await self._llm.check_health()
            return True
        except Exception:
            return False

    def num_unfinished_requests(self) -> int:
        return self._require().get_num_unfinished_requests()

    @property
    def formatter(self) -> ChatFormatter:
        self._require()
        return self._formatter

    def _require(self):
        if self._llm is None:
            raise EngineUnavailable(f"The {self.preset} engine is not running.")
        return self._llm

    # -- turns -------------------------------------------------------------------------

    async def stream(
        self,
        messages: Sequence[Message | dict],
        *,
        system_prompt: str = "",
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 512,
        ignore_eos: bool = False,
        seed: int | None = None,
        prompt_ids: list[int] | None = None,
    ) -> AsyncIterator[str | TurnStats]:
        """Yield text deltas, then one TurnStats. Leaving early aborts the request.

        `prompt_ids`: `messages` already formatted with `system_prompt` (as fit_history
        returns them), so a turn's history is not tokenized twice.
        """
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self._require()
        if prompt_ids is None:
            prompt_ids = self._formatter.prompt_ids(messages, system_prompt)
        if len(prompt_ids) + 1 > self.max_model_len:
            raise ChatError(f"The conversation is {len(prompt_ids)} tokens long; this model "
                            f"takes at most {self.max_model_len} tokens in all.")
        max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
            ignore_eos=ignore_eos, output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"chat-{uuid.uuid4().hex}"
        started = time.monotonic()
        ttft, out_tokens, finish, done = None, 0, "abort", False
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                                             params, request_id):
                completion = output.outputs[0]
                out_tokens += len(completion.token_ids)
                if ttft is None and completion.token_ids:
                    ttft = time.monotonic() - started
                if completion.text:
                    yield completion.text
                if output.finished:
                    finish, done = completion.finish_reason or "stop", True
        except EngineDeadError as exc:
            done = True  # nothing left to abort
            log.error("engine %r died during turn %s: %s", self.preset, request_id, exc)
            raise EngineFailed("The model stopped unexpectedly while answering. It is being "
                               "restarted; please send your message again in a minute.") from exc
        finally:
            if not done:  # cancelled or closed early: make sure vLLM stops generating
                with contextlib.suppress(Exception):
                    await llm.abort(request_id)
                log.info("turn %s preset=%s aborted after %d tokens", request_id,
                         self.preset, out_tokens)
        stats = TurnStats(request_id, self.preset, len(prompt_ids), out_tokens, ttft,
                          time.monotonic() - started, finish)
        log.info("turn %s preset=%s in=%d out=%d ttft=%s tok/s=%.1f finish=%s", request_id,
                 self.preset, stats.prompt_tokens, stats.output_tokens,
                 f"{ttft * 1000:.0f}ms" if ttft is not None else "-", stats.tokens_per_s,
                 finish)
        yield stats


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
