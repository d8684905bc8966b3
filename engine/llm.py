"""One vLLM `AsyncLLM` engine running one batching preset.

The engine knows nothing about the UI: it takes a fitted `Prompt` (history.py), yields text
deltas as vLLM produces them (RequestOutputKind.DELTA), and ends every stream with a
`TurnStats`. Closing or cancelling a stream aborts its request inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry

from .base import Engine
from .chat_format import ChatFormatter
from .cores import abort_left_behind, joining, link_of, on_core_lost, vllm_config_of
from .decoding import Decoding, Piece, piece_of, prompt_logprobs_of
from .errors import ChatError, Unavailable
from .history import Prompt, check_fits
from .launch import EngineSetup, importable_here, neutral_main, process_env
from .metrics import engine_series
from .processes import CoreProcesses
from .stats import FIRST_TOKEN_LEGS, TurnStats

log = logging.getLogger(__name__)


class PresetEngine(Engine):
    """An in-process vLLM engine plus the chat formatting for its model."""

    def __init__(self, preset: str, setup: EngineSetup):
        super().__init__(preset)
        self.setup = setup
        self.metrics = CollectorRegistry()  # vLLM's series for this engine (metrics.py)
        self._llm = None
        self._built = None  # handed over by the thread that builds the engine
        self._abandoned = False  # start() was cancelled: the build shuts its engine down
        self._processes = CoreProcesses(())  # its core's, where it runs one (not a link's)
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine in a worker thread, so the event loop keeps serving meanwhile.
        Cancelled, it leaves no engine behind, even one whose build finishes later."""
        started = time.monotonic()
        log.info("Starting engine %r (%s)", self.preset, self.setup.args.get("model"))
        try:
            await asyncio.to_thread(self._build)
        except asyncio.CancelledError:
            with self._lock:
                self._abandoned = True
                built, self._built = self._built, None
            if built is not None:
                built.shutdown()
            raise
        self._llm, self._built = self._built, None
        link = link_of(self.preset)
        if link is not None and link.rejoin:  # a front end or a core that died before
            left = await abort_left_behind(self._llm, link)
            log.info("Engine %r: rejoined its core as front end %d; requests the front end "
                     "before it left running, aborted: %d", self.preset, link.index, left)
        if link is not None:
            on_core_lost(self.preset, self.core_lost)
        self.max_model_len = self._llm.model_config.max_model_len
        self.model_sampling = dict(self._llm.model_config.get_diff_sampling_param())
        self._formatter = ChatFormatter(self._llm.get_tokenizer())
        self.started_in_s = time.monotonic() - started
        log.info("Engine %r ready in %.1f s (max_model_len %d)", self.preset,
                 self.started_in_s, self.max_model_len)

    def _build(self):
        from vllm.v1.engine.async_llm import AsyncLLM

        registry = CollectorRegistry()  # a restarted engine registers its series anew
        link = link_of(self.preset)  # a front end of several: the core runs elsewhere
        with process_env(self.setup.env):  # read by vLLM here and by the processes it starts
            vllm_config = vllm_config_of(self.setup, self.preset, link)
            loggers = [self.step_stats.logger_factory(), engine_series(registry)]
            if link is not None:
                with joining(link):
                    llm = AsyncLLM.from_vllm_config(
                        vllm_config, stat_loggers=loggers,
                        client_addresses=dict(link.addresses), client_count=link.count,
                        client_index=link.index)
            else:
                with neutral_main(), importable_here():
                    llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=loggers)
        self.metrics = registry
        with self._lock:
            if not self._abandoned:
                self._built = llm
                # (vLLM's client of a core in another process; an in-process one has none)
                resources = getattr(llm.engine_core, "resources", None)
                self._processes = CoreProcesses.of_manager(
                    getattr(resources, "engine_manager", None))
                return
        llm.shutdown()

    def core_lost(self, expected_s: float) -> None:
        """Its core (another process's) died and is being started again: every turn in
        flight ends now, as at an engine's death, and the pool builds this engine again,
        which rejoins the new core once that has loaded its model."""
        from vllm.v1.engine.exceptions import EngineDeadError

        self.restart_expected_s = expected_s
        llm = self._llm
        if llm is not None and not llm.errored:
            log.error("Engine %r: its core died; the launcher is starting it again (%.0f s "
                      "expected)", self.preset, expected_s)
            llm.engine_core.resources.engine_dead = True
            llm.output_processor.propagate_error(EngineDeadError())

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def ended(self) -> None:
        await self._processes.ended_async()

    @property
    def running(self) -> bool:
        return self._llm is not None and not self._llm.errored

    @property
    def warm(self) -> bool:
        """A front end that rejoins a running core: that core is warmed up already."""
        link = link_of(self.preset)
        return link is not None and link.rejoin

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

    @property
    def kv_tokens(self) -> int:
        """The tokens this engine's KV cache holds (its blocks, as vLLM sized them)."""
        config = self.cache_config
        return int(config.num_gpu_blocks or 0) * config.block_size

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's keys and values over every layer, in the cache's type (Qwen3-4B in
        bfloat16: 36 layers x 8 KV heads x 128 x 2 x 2 bytes = 144 KiB)."""
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        config = self._require().vllm_config
        model, parallel = config.model_config, config.parallel_config
        dtype = kv_cache_dtype_str_to_dtype(self.cache_config.cache_dtype, model)
        return (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
                * model.get_head_size() * dtype.itemsize)

    @property
    def kv_offload_gib(self) -> float:
        return float(self.cache_config.kv_offloading_size or 0.0)

    async def check_health(self) -> bool:
        if self._llm is None:
            return False
        try:
            await self._llm.check_health()
            return True
        except Exception:
            return False

    def num_unfinished_requests(self) -> int:
        # The output processor's count: AsyncLLM itself has no such method in vLLM 0.24.
        return self._require().output_processor.get_num_unfinished_requests()

    @property
    def formatter(self) -> ChatFormatter:
        self._require()
        return self._formatter

    def _require(self):
        if self._llm is None:
            raise self.not_running()
        return self._llm

    # -- turns -------------------------------------------------------------------------

    async def stream(self, prompt: Prompt, *, temperature: float, top_p: float,
                     ignore_eos: bool = False, seed: int | None = None, priority: int = 0,
                     preset: str | None = None, session: str | None = None,
                     decoding: Decoding | None = None,
                     on_finished: Callable[[], None] | None = None
                     ) -> AsyncIterator[str | Piece | TurnStats]:
        """Yield text deltas (Pieces with a `decoding`), then one TurnStats; `on_finished()`
        is called as vLLM finishes the request, before its last text. Leaving early
        aborts the request."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._require()
        check_fits(prompt, self.max_model_len)
        refused = request_errors()
        try:
            params = SamplingParams(
                temperature=temperature, top_p=top_p, max_tokens=prompt.max_tokens, seed=seed,
                ignore_eos=ignore_eos, output_kind=RequestOutputKind.DELTA,
                **(decoding.vllm_params() if decoding else {}))
        except refused as exc:  # vLLM's own check of what was asked (n with greedy...)
            raise ChatError(f"The model cannot decode as asked: {_first_line(exc)}") from None
        top = decoding.reported() if decoding else None
        request_id = f"chat-{uuid.uuid4().hex}"
        started = time.monotonic()
        ttft, legs, out_tokens, finish, done = None, None, 0, "abort", False
        cached = None  # prompt tokens found in the prefix cache (told with the first output)
        try:
            async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt.token_ids),
                                             params, request_id, **self._priority(priority)):
                completion = output.outputs[0]
                if cached is None:
                    cached = getattr(output, "num_cached_tokens", None)
                out_tokens += len(completion.token_ids) if decoding is None else \
                    sum(len(choice.token_ids) for choice in output.outputs)
                if ttft is None and out_tokens:
                    now = time.monotonic()
                    ttft, legs = now - started, first_token_legs(llm, request_id, started, now)
                if output.finished:
                    finish, done = completion.finish_reason or "stop", True
                    if on_finished is not None:
                        on_finished()
                if decoding is not None:  # every choice's delta, as a Piece
                    if getattr(output, "prompt_logprobs", None):  # in its first outputs
                        yield Piece(0, "", prompt_logprobs=prompt_logprobs_of(
                            output.prompt_logprobs))
                    for choice in output.outputs:
                        yield piece_of(choice, top, decoding.tokens_as_ids)
                elif completion.text:
                    yield completion.text
        except refused as exc:  # refused as it was added (a schema vLLM cannot compile)
            if out_tokens:
                raise
            done = True
            raise ChatError(f"The model cannot decode as asked: {_first_line(exc)}") from None
        except EngineDeadError as exc:
            done = True  # nothing left to abort
            log.error("engine %r died during turn %s: %s", self.preset, request_id, exc)
            raise Unavailable("The model stopped unexpectedly while answering. It is being "
                            "restarted; please send your message again in a minute.") from exc
        finally:
            if not done:  # cancelled or closed early: make sure vLLM stops generating
                with contextlib.suppress(Exception):
                    await llm.abort(request_id)
                log.debug("turn %s preset=%s aborted after %d tokens", request_id,
                          self.preset, out_tokens)
        stats = TurnStats(request_id, preset or self.preset, prompt.prompt_tokens, out_tokens,
                          ttft, time.monotonic() - started, finish, legs, cached)
        self.reading.add(stats)
        log.debug("turn %s preset=%s in=%d out=%d ttft=%s tok/s=%.1f finish=%s", request_id,
                  self.preset, stats.prompt_tokens, stats.output_tokens,
                  f"{ttft * 1000:.0f}ms" if ttft is not None else "-", stats.tokens_per_s,
                  finish)
        yield stats

    def _priority(self, priority: int) -> dict:
        """vLLM refuses a priority other than 0 unless the engine schedules by priority."""
        return {"priority": priority} if self.scheduler_config.policy == "priority" else {}

    async def warm_up(self, samplings: list[dict], batches: list[int]) -> int:
        """Run what the first users' turns will, before anyone waits on it: for each
        sampling, short turns in batches of each size in `batches` at once (vLLM captured its
        CUDA graphs at start; what is left to compile on first use is the sampling's own
        kernels, top-k/top-p's Triton kernel among them, specialised by batch size).
        Returns the turns run."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self._require()
        prompt = TokensPrompt(prompt_token_ids=self.formatter.prompt_ids(
            [{"role": "user", "content": "Warm-up."}]))

        async def one(params: SamplingParams, n: int) -> None:
            async for _ in llm.generate(prompt, params, f"warm-up-{uuid.uuid4().hex}-{n}"):
                pass

        turns = 0
        for sampling in samplings:
            params = SamplingParams(max_tokens=4, ignore_eos=True, seed=None,
                                    output_kind=RequestOutputKind.FINAL_ONLY, **sampling)
            for batch in batches:
                await asyncio.gather(*[one(params, n) for n in range(batch)])
                turns += batch
        return turns


def first_token_legs(llm, request_id: str, started: float, now: float
                     ) -> dict[str, float] | None:
    """Where a turn's first token spent its time (stats.FIRST_TOKEN_LEGS), from the
    timestamps vLLM's output processor keeps for a live request: the engine process's
    (taken in, first scheduled, first token out) between the turn's `started` and `now`,
    all `time.monotonic()`, one clock for every process on the machine. None where vLLM
    kept none (stats off, or the request already finished)."""
    processor = llm.output_processor
    try:
        internal = processor.external_req_ids.get(request_id) or [request_id]
        stats = processor.request_states[internal[0]].stats
        marks = (started, stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, now)
    except (AttributeError, KeyError, IndexError):  # another vLLM's layout: no legs
        return None
    if not all(marks[1:4]):
        return None
    return {leg: round(b - a, 6) for leg, a, b in zip(FIRST_TOKEN_LEGS, marks, marks[1:])}


def request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError (0.24), its own client error
    type (0.32)."""
    import vllm.exceptions

    client = getattr(vllm.exceptions, "VLLMClientError", None)
    return (ValueError,) if client is None else (ValueError, client)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
