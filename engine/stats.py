"""What the engine layer reports: per-turn stats, and the scheduler's own per-step view."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TurnStats:
    """The last item a turn's stream yields."""

    request_id: str
    preset: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # time to first token; None when no token came
    elapsed_s: float
    finish_reason: str  # "stop", "length", "abort", ...
    # Where the first token's time went (FIRST_TOKEN_LEGS, seconds); None where the engine
    # does not say (a remote server, the stand-in, or no token came).
    first_token_legs: dict[str, float] | None = None
    # Of prompt_tokens, those vLLM's prefix cache held (not read again); None where the
    # engine does not say.
    cached_tokens: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (vLLM's definition, 1 / TPOT)."""
        if self.ttft_s is None or self.output_tokens < 2 or self.elapsed_s <= self.ttft_s:
            return 0.0
        return (self.output_tokens - 1) / (self.elapsed_s - self.ttft_s)


# The legs of a first token in an in-process vLLM engine, in order; they add up to ttft_s.
FIRST_TOKEN_LEGS = (
    "to_engine",  # from the turn's call to vLLM's engine process taking the request in
    "queued",  # waiting in vLLM's scheduler for its first step
    "prefill",  # from that step to the first token's output (prompt steps, the GPU's time)
    "back",  # from that output to the turn holding the token (this process's output path)
)


@dataclass(frozen=True)
class StepSample:
    running: int
    waiting: int
    kv_cache_usage: float


# vLLM's native KV offloading (its OffloadingConnector) counts what each step moved between
# the GPU and CPU memory, in SchedulerStats.kv_connector_stats: bytes, and the copies' own
# time on the GPU (CUDA events around them), each way. Our names for them:
OFFLOAD_COUNTERS = {"vllm:kv_offload_load_bytes": "loaded_bytes",
                    "vllm:kv_offload_load_time": "load_s",
                    "vllm:kv_offload_store_bytes": "stored_bytes",
                    "vllm:kv_offload_store_time": "store_s"}


def offload_moved(payload) -> dict[str, float]:
    """The offloading counters in one step's connector payload (vLLM's OffloadingConnector
    stats: {"data": {name: {labels: value}}}), summed over their labels; {} for none or
    another connector's."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, dict):
        return {}
    moved = {}
    for name, ours in OFFLOAD_COUNTERS.items():
        values = data.get(name)
        if isinstance(values, dict):
            moved[ours] = sum(v for v in values.values() if isinstance(v, (int, float)))
    return moved


class StepStats:
    """Collects vLLM's SchedulerStats for one engine (fed by a vLLM stat logger)."""

    HISTORY = 4096  # samples kept for inspection; counters cover everything

    def __init__(self):
        self._lock = threading.Lock()
        self.samples: collections.deque[StepSample] = collections.deque(maxlen=self.HISTORY)
        self.steps = 0
        self.max_running = 0
        self.cache_queries = self.cache_hits = 0  # prompt tokens looked up in / found in
        self.preempted = 0  # requests vLLM had to take out and recompute (KV cache full)
        self.offload = dict.fromkeys(OFFLOAD_COUNTERS.values(), 0.0)  # KV to and from CPU

    def reset(self) -> None:
        with self._lock:
            self.samples.clear()
            self.steps = self.max_running = 0
            self.cache_queries = self.cache_hits = self.preempted = 0
            self.offload = dict.fromkeys(OFFLOAD_COUNTERS.values(), 0.0)

    def add(self, scheduler_stats) -> None:
        if scheduler_stats is None:
            return
        sample = StepSample(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                            scheduler_stats.kv_cache_usage)
        cache = scheduler_stats.prefix_cache_stats
        moved = offload_moved(scheduler_stats.kv_connector_stats)
        with self._lock:
            self.samples.append(sample)
            self.steps += 1
            self.max_running = max(self.max_running, sample.running)
            self.cache_queries += cache.queries
            self.cache_hits += cache.hits
            self.preempted += cache.preempted_requests
            for name, amount in moved.items():
                self.offload[name] += amount

    @property
    def cache_hit_rate(self) -> float | None:
        """The share of prompt tokens vLLM's prefix cache had (None before any prompt)."""
        with self._lock:
            return self.cache_hits / self.cache_queries if self.cache_queries else None

    def logger_factory(self):
        """A vLLM per-engine stat logger factory that feeds this collector."""
        from vllm.v1.metrics.loggers import StatLoggerBase  # vLLM only where an engine runs

        sink = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0):
                sink.add(scheduler_stats)

            def log_engine_initialized(self):
                pass

        return _Recorder
