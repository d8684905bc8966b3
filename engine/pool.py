"""The engines of one app process: one `PresetEngine` per preset that some profile uses.

Usage (the public surface the UI relies on):

    engines = Engines(load_config())
    await engines.start()
    async for item in engines.stream(messages, "Latency-first"):
        ...  # str deltas, then a TurnStats
    engines.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from .admission import Admission
from .chat_format import Message
from .config import Config, Preset
from .errors import ConfigError, EngineUnavailable
from .history import Fitted, fit_history
from .llm import PresetEngine
from .model import check_hub_model, cpu_dtype, has_cuda, resolve_model
from .standin import StandInEngine
from .stats import TurnStats

log = logging.getLogger(__name__)
GIB = 1 << 30
WATCH_INTERVAL_S = 1.0
RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30, 60)  # between restart attempts of a dead engine
RESTARTING = ("The model for this chat stopped unexpectedly and is being restarted. Please "
              "send your message again in a minute.")


def engine_args(config: Config, preset: Preset, model: str, gpu: bool) -> dict:
    """The full vLLM argument set for one preset's engine, memory share included."""
    args = {**config.vllm, **preset.options(gpu), "model": model}
    # Compilation pays off on a GPU; on CPU it quadruples start-up for ~11% (BENCHMARKS.md).
    args.setdefault("enforce_eager", not gpu)
    # Without a GPU the dtype follows the CPU's features (model.cpu_dtype, BENCHMARKS.md).
    args.setdefault("dtype", "auto" if gpu else cpu_dtype())
    if gpu:
        args["gpu_memory_utilization"] = config.memory.gpu_memory_utilization * preset.memory_share
    else:
        args["kv_cache_memory_bytes"] = int(
            config.memory.cpu_kv_cache_gib * preset.memory_share * GIB)
    return args


def _backoff(attempt: int) -> float:
    """Seconds to wait before restart attempt `attempt` (0-based) of a dead engine."""
    return RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]


def engine_kind(env: Mapping[str, str] = os.environ) -> Callable[[str, dict], PresetEngine]:
    """What runs each preset: vLLM (always, in the product) or, for benchmarks of the app
    layer only, the stand-in (`VCHAT_ENGINE=stand-in`, `VCHAT_STANDIN_TOKENS_PER_S`)."""
    kind = env.get("VCHAT_ENGINE", "vllm")
    if kind == "vllm":
        return PresetEngine
    if kind == "stand-in":
        rate = env.get("VCHAT_STANDIN_TOKENS_PER_S", "1000")
        try:
            tokens_per_s = float(rate)
        except ValueError:
            tokens_per_s = 0
        if tokens_per_s <= 0:
            raise ConfigError("environment", "VCHAT_STANDIN_TOKENS_PER_S",
                              f"must be a positive number of tokens per second, not {rate!r}")
        return functools.partial(StandInEngine, tokens_per_s=tokens_per_s)
    raise ConfigError("environment", "VCHAT_ENGINE", f"must be vllm or stand-in, not {kind!r}")


class Engines:
    """Starts, routes to and stops the per-preset engines."""

    def __init__(self, config: Config, engine_class: Callable[[str, dict], PresetEngine] | None = None):
        self.config = config
        self.engine_class = engine_class or engine_kind()
        self.stand_in = getattr(self.engine_class, "func", self.engine_class) is StandInEngine
        self.engines: dict[str, PresetEngine] = {}
        self.admission: dict[str, Admission] = {}
        self.restarting: set[str] = set()  # presets whose engine died and is starting again
        self.restarts: dict[str, int] = {}
        self._watchdog: asyncio.Task | None = None
        self.model: str | None = None
        self.state = "stopped"  # stopped -> starting -> ready | failed

    async def start(self) -> None:
        """Resolve the model once, then start each preset's engine in turn."""
        self.state = "starting"
        try:
            model = resolve_model(self.config.model)
            gpu = has_cuda()
            if "/" in model and not model.startswith("/"):
                check_hub_model(model)
            self.model = model
            for preset in self.config.used_presets():
                engine = self.engine_class(preset.name,
                                           engine_args(self.config, preset, model, gpu))
                self.engines[preset.name] = engine
                await engine.start()
                # Our queue, not vLLM's: at most as many turns inside as it runs at once.
                self.admission[preset.name] = Admission(engine.max_num_seqs,
                                                        preset.max_queued_turns, preset.name)
        except BaseException:
            self.state = "failed"
            self.shutdown(keep_state=True)
            raise
        self.state = "ready"
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Restart any engine that died, with back-off, while the others keep serving."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name, engine in list(self.engines.items()):
                if not engine.running and name not in self.restarting:
                    self.restarting.add(name)
                    asyncio.ensure_future(self._restart(name, engine))

    async def _restart(self, name: str, dead: PresetEngine) -> None:
        log.error("Engine %r died; restarting it", name)
        with contextlib.suppress(Exception):
            dead.shutdown()
        attempt = 0
        while True:
            await asyncio.sleep(_backoff(attempt))
            attempt += 1
            engine = self.engine_class(name, dead.engine_args)
            try:
                await engine.start()
            except Exception:
                log.exception("Restart %d of engine %r failed; next try in %s s", attempt,
                              name, _backoff(attempt))
                with contextlib.suppress(Exception):
                    engine.shutdown()
                continue
            self.engines[name] = engine
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.restarting.discard(name)
            log.info("Engine %r is back after %d attempt(s)", name, attempt)
            return

    def shutdown(self, keep_state: bool = False) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
        self.admission.clear()
        if not keep_state:
            self.state = "stopped"

    def for_profile(self, profile: str) -> PresetEngine:
        preset = self.config.profile(profile).preset
        if preset in self.restarting:
            raise EngineUnavailable(RESTARTING)
        engine = self.engines.get(preset)
        if engine is None or not engine.running:
            raise EngineUnavailable(f"The engine for {profile!r} is {self.state}.")
        return engine

    async def health(self) -> dict:
        """Overall verdict plus, per preset: healthy, requests in flight, peak batch."""
        engines = {}
        for name, engine in self.engines.items():
            healthy = await engine.check_health()
            engines[name] = {
                "healthy": healthy,
                "restarting": name in self.restarting,
                "restarts": self.restarts.get(name, 0),
                "unfinished_requests": engine.num_unfinished_requests() if healthy else None,
                "peak_running": engine.step_stats.max_running,
                "steps": engine.step_stats.steps,
            }
            gate = self.admission.get(name)
            if gate is not None:
                engines[name].update(admitted=gate.inside, queued=gate.waiting,
                                     max_admitted=gate.running, max_queued=gate.queued)
        ok = self.state == "ready" and bool(engines) and all(
            e["healthy"] for e in engines.values())
        status = "ok" if ok else ("restarting" if self.restarting else self.state)
        return {"status": status, "engines": engines, "model": self.model,
                "engine": StandInEngine.label if self.stand_in else "vllm"}

    def fit(self, profile: str, history: Sequence[Message], new_message: Message, *,
            system_prompt: str, max_tokens: int) -> Fitted:
        """Fit a conversation to the context of the profile's engine (see history.py)."""
        engine = self.for_profile(profile)
        return fit_history(engine.formatter, history, new_message, system_prompt=system_prompt,
                           max_model_len=engine.max_model_len, max_tokens=max_tokens)

    async def stream(
        self, messages: Sequence[Message | dict], profile: str,
        on_queued: Callable[[int], Awaitable[None]] | None = None, **overrides
    ) -> AsyncIterator[str | TurnStats]:
        """Stream one turn on the profile's engine with its system prompt and sampling.

        The turn first takes a place in the engine's admission queue (admission.py):
        `on_queued(place)` hears about waiting, EngineBusy means the queue is full.
        """
        prof = self.config.profile(profile)
        self.for_profile(profile)  # not running (starting, restarting): refused before queueing
        sampling = {"temperature": prof.sampling.temperature, "top_p": prof.sampling.top_p,
                    "max_tokens": prof.sampling.max_tokens, "system_prompt": prof.system_prompt}
        sampling.update(overrides)
        async with self.admission[prof.preset].slot(on_queued):
            # Looked up once admitted: the engine may have been restarted while we waited.
            engine = self.for_profile(profile)
            # aclosing: when our caller leaves early, the engine's stream is closed (and its
            # request aborted) now, not whenever the garbage collector gets to it.
            async with contextlib.aclosing(engine.stream(messages, **sampling)) as items:
                async for item in items:
                    yield item
