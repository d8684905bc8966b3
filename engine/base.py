"""What an engine of a preset is to the pool (pool.py) and so to the app, whichever runs
it: vLLM in this process (llm.py), a remote OpenAI-compatible server (remote.py), or the
benchmarks' stand-in (standin.py).

One surface with one set of errors: `Unavailable` while it cannot serve (not started,
stopped, out of reach), `Busy` when it is full, `ChatError` for a turn it cannot take. No
sampling defaults: a turn's temperature and top_p are its profile's, given by the pool,
so no engine can drift from profiles.yaml. What an engine tells is its model's own
defaults (`model_sampling`), which the API applies to a request that leaves a field out,
as `vllm serve` does.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

from .chat_format import ChatFormatter
from .decoding import Decoding, Piece
from .errors import Unavailable
from .history import Prompt
from .reading import ReadingRate
from .stats import StepStats, TurnStats


class Engine(abc.ABC):
    """One preset's engine (or the presets' one, shared): started, asked for turns,
    stopped."""

    label: ClassVar[str] = "vllm"  # what /ready calls the engines
    restartable: ClassVar[bool] = True  # the pool starts a dead one again (remote: the
    # server is not ours to restart; its engine recovers when the server is back)
    remote = None  # the preset's `remote:` block (config.Remote), where it has one
    kv_tokens: int | None = None  # tokens its KV cache holds, where it has one to count
    block_size: int = 1  # the cache's unit, in tokens
    kv_bytes_per_token: int | None = None  # one token's keys and values, all layers
    kv_offload_gib: float = 0.0  # CPU memory its KV blocks are offloaded to (0: none)
    metrics = None  # its own Prometheus registry of vLLM's series (metrics.py), if any
    warm = False  # needs no warm-up: it joined a running engine that had one
    restart_expected_s: float | None = None  # dead, how long its restart should take
    # The model's sampling defaults (its generation config: temperature, top_p, top_k,
    # min_p, penalties, max_tokens), once started; empty where it has none or none is known.
    model_sampling: dict = {}

    def __init__(self, preset: str):
        self.preset = preset
        self.step_stats = StepStats()  # vLLM's scheduler's view; empty where none is seen
        self.reading = ReadingRate()  # how fast it reads prompts (fed by its turns)
        self.max_model_len: int | None = None  # once started
        self.started_in_s: float | None = None
        self._formatter: ChatFormatter | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Ready for turns, or an error that says why not (ConfigError for the operator)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop; idempotent."""

    async def ended(self) -> None:
        """After `shutdown`: until every process of its own has ended (those of a dead
        engine, before it starts again: processes.py). None where it runs none."""

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Started and not stopped or dead (the pool restarts a dead restartable one)."""

    @property
    @abc.abstractmethod
    def max_num_seqs(self) -> int:
        """How many turns it runs at once: the seats admission gives it."""

    @abc.abstractmethod
    async def check_health(self) -> bool:
        """Whether it can serve turns now."""

    @abc.abstractmethod
    def num_unfinished_requests(self) -> int:
        """Turns in flight on it."""

    @abc.abstractmethod
    def stream(self, prompt: Prompt, *, temperature: float, top_p: float,
               ignore_eos: bool = False, seed: int | None = None, priority: int = 0,
               preset: str | None = None, session: str | None = None,
               decoding: Decoding | None = None,
               on_finished: Callable[[], None] | None = None
               ) -> AsyncIterator[str | Piece | TurnStats]:
        """Text deltas (with a `decoding`: Pieces, decoding.py), then one TurnStats; leaving
        early ends the turn on the engine.
        `priority`: the turn's class where the engine schedules by priority (lower first);
        `preset`: whose turn it is on a shared engine (for its stats); `session`: a key
        that stays the same for a chat's turns (its id), which a remote server's router may
        keep on one replica; `on_finished()`: called once the engine has finished the turn,
        as soon as it knows (before the last text where it can), so that its seat is free
        while the last words still go to the user."""

    async def warm_up(self, samplings: list[dict], batches: list[int]) -> int:
        """Run what the first users' turns will before anyone waits on it; the turns run.
        Nothing to warm up by default."""
        return 0

    @property
    def formatter(self) -> ChatFormatter:
        """The chat formatting and tokenizer of its model."""
        if self._formatter is None:
            raise self.not_running()
        return self._formatter

    def not_running(self) -> Unavailable:
        return Unavailable(f"The {self.preset} engine is not running.")
