"""The engines of one app process (each a base.Engine): vLLM's for the presets that some
profile uses (one shared by the presets on a device, or one each), or a `RemoteEngine` for
a preset whose model runs on a remote server (`remote:`).

Usage (the public surface the UI relies on):

    engines = Engines(load_config())
    await engines.start()
    prompt = engines.fit("Latency-first", history, Message("user", "Hi"),
                         system_prompt="...", max_tokens=512)
    async for item in engines.stream(prompt, "Latency-first"):
        ...  # str deltas, then a TurnStats
    engines.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from .admission import Admission, Line
from .seats import SharedSeats
from .base import Engine
from .chat_format import Message
from .config import Config, Profile
from .decoding import Decoding, Piece
from .errors import ChatError, ConfigError, Unavailable
from .history import Prompt, check_fits, fit_history
from .launch import (GIB, EngineGroup, EngineSetup, Machine, engine_groups, group_setup,
                     seats)
from .llm import PresetEngine
from .model import resolve_model
from .settings import setting
from .standin import StandInEngine
from .stats import TurnStats

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 1.0
# A waiting turn's new place is said at most this often: in a line of 700 each turn that
# ends moves every one behind it (engine/admission.py).
TELL_PLACE_EVERY_S = 0.5
WARM_UP_BATCHES = (1, 4, 16, 64, 256)  # and the seats: batch sizes warmed up on a GPU
TEMPLATE_TOKENS = 256  # more than a chat template adds around one message and a system prompt
RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30, 60)  # between restart attempts of a dead engine
RESTARTING = ("The model for this chat stopped unexpectedly and is being restarted. Please "
              "send your message again in a minute.")


def offload_tokens(offload_gib: float, bytes_per_token: int | None) -> int:
    """The tokens' KV that `offload_gib` of CPU memory holds (0 where the size is unknown)."""
    return int(offload_gib * GIB / bytes_per_token) if bytes_per_token else 0


def capacity_line(name: str, kv_tokens: int, bytes_per_token: int | None, offload_gib: float,
                  max_model_len: int | None, seats: dict[str, int]) -> str:
    """What an engine's KV cache holds, as the start-up log says it: tokens and bytes, what
    CPU memory adds for returning chats, full contexts and 2K-token turns at once, seats."""
    per = f" ({bytes_per_token / 1024:,.0f} KiB a token, {kv_tokens * bytes_per_token / GIB:,.1f}" \
          " GiB)" if bytes_per_token else ""
    offload = ""
    if offload_gib and bytes_per_token:
        offload = (f", and {offload_gib:,.1f} GiB of CPU memory hold "
                   f"{offload_tokens(offload_gib, bytes_per_token):,} more for returning "
                   "chats")
    whole = kv_tokens // max_model_len if max_model_len else 0
    fits = [f"{whole:,} turn{'' if whole == 1 else 's'} of the full {max_model_len:,}-token "
            "context"] if max_model_len else []
    if not max_model_len or max_model_len > 2048:
        fits.append(f"{kv_tokens // 2048:,} turns of 2,048 tokens")
    return (f"Engine {name!r}: its KV cache holds {kv_tokens:,} tokens{per}{offload}; that is "
            f"{' or '.join(fits)} at once; seats: "
            + ", ".join(f"{p} {n:,}" for p, n in seats.items()))


def _backoff(attempt: int) -> float:
    """Seconds to wait before restart attempt `attempt` (0-based) of a dead engine."""
    return RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]


def _log_failure(launch: asyncio.Task) -> None:
    if launch.cancelled() or launch.exception() is None:
        return
    if isinstance(launch.exception(), ConfigError):  # the operator's to fix: said plainly
        log.error("The engines cannot start: %s", launch.exception())
    else:
        log.error("The engines failed to start", exc_info=launch.exception())


def engine_kind(env: Mapping[str, str] | None = None
                ) -> Callable[[str, EngineSetup], Engine]:
    """What runs each preset: vLLM (always, in the product) or, for benchmarks of the app
    layer only, the stand-in (`VCHAT_ENGINE=stand-in`, `VCHAT_STANDIN_TOKENS_PER_S`)."""
    if setting("VCHAT_ENGINE", env) == "vllm":
        return PresetEngine
    return functools.partial(StandInEngine,
                             tokens_per_s=setting("VCHAT_STANDIN_TOKENS_PER_S", env))


class Engines:
    """Starts, routes to and stops the per-preset engines."""

    def __init__(self, config: Config,
                 engine_class: Callable[[str, EngineSetup], Engine] | None = None,
                 front_ends: int = 1, front_end: int = 0, folder: str | None = None):
        self.config = config
        # Processes that share each engine's core (launcher.py), each with lines of its own:
        # a preset's seats are split among them, so that all of them together seat no more
        # turns than the engine runs at once, and the rest wait in a line that says their
        # place (not in vLLM's, which says nothing). This is the `front_end`th; with the
        # launcher's private `folder`, a front end also takes the seats another leaves free
        # (engine/seats.py); without, each keeps to its part.
        self.front_ends = max(1, front_ends)
        self.front_end, self.folder = front_end, folder
        self._shared: list[SharedSeats] = []
        self.engine_class = engine_class or engine_kind()
        self.stand_in = getattr(self.engine_class, "func", self.engine_class) is StandInEngine
        self.engines: dict[str, Engine] = {}
        self.admission: dict[str, Admission] = {}  # by preset
        self.groups: dict[str, EngineGroup] = {}  # by engine name
        self.engine_of: dict[str, str] = {}  # preset -> the name of the engine it runs on
        self.warm_up_s: dict[str, float] = {}  # by engine name
        self.restarts: dict[str, int] = {}
        self._restarting: dict[str, asyncio.Task] = {}  # presets whose engine is starting again
        self._restart_due: dict[str, float] = {}  # when each should be back (monotonic)
        self._watchdog: asyncio.Task | None = None
        self.watch_rounds = 0
        self._launch: asyncio.Task | None = None
        self.model: str | None = None
        self.machine: Machine | None = None  # once known
        self.state = "stopped"  # stopped -> starting -> ready | failed

    async def start(self) -> None:
        """Resolve the model once (off the event loop: a first start converts the embedded
        model, a hub id is looked up), then start each engine in turn (launch.engine_groups:
        one per preset, or one shared by the presets on a GPU), warm it up, and put each
        preset's admission line in front of it. Remote presets need the model only for its
        tokenizer, unless they name their own."""
        self.state = "starting"
        presets = self.config.used_presets()
        try:
            if any(p.remote is None or p.remote.tokenizer is None for p in presets):
                self.model = await asyncio.to_thread(resolve_model, self.config.model)
            self.machine = machine = await asyncio.to_thread(Machine.here)
            for group in engine_groups(self.config):
                engine = self._engine(group, machine)
                self.engines[group.name] = engine
                self.groups[group.name] = group
                await engine.start()
                await self._warm_up(group, engine, machine)
                self._admit(group, engine, machine)
        except BaseException:
            self.state = "failed"
            self.shutdown(keep_state=True)
            raise
        self.state = "ready"
        self._watchdog = asyncio.ensure_future(self._watch())

    def _engine(self, group: EngineGroup, machine: Machine) -> Engine:
        first = group.presets[0]
        if first.remote is not None:  # (its HTTP clients loaded only where one is used)
            from .remote import RemoteEngine

            return RemoteEngine(first.name, first.remote, self.model)
        return self.engine_class(group.name, group_setup(self.config, group, self.model,
                                                         machine))

    def _admit(self, group: EngineGroup, engine: Engine, machine: Machine) -> None:
        """Our lines, not vLLM's: each preset at most its seats inside, all of them within
        the engine's KV cache; a preset keeps room in it for the lower ones' turns not to
        take (its seats x twice its longest default reply, about a prompt and a reply)."""
        shared = None
        if self.front_ends > 1 and self.folder is not None:
            shared = SharedSeats(self.folder, group.name, self.front_end, self.front_ends,
                                 [p.name for p in group.presets])
            self._shared.append(shared)
        line = Line(engine.kv_tokens, engine.block_size, shared)
        seated = {}
        for preset in group.presets:
            seated[preset.name] = seats(self.config, preset, machine.gpu) \
                if group.shared else engine.max_num_seqs
            running = max(1, seated[preset.name] // self.front_ends)  # this process's part
            replies = [p.sampling.max_tokens for p in self.config.profiles
                       if p.preset == preset.name]
            # The cache kept for a class is for its seats in every front end where the
            # front ends count the cache together, else for this one's part.
            kept_for = seated[preset.name] if shared else running
            self.admission[preset.name] = Admission(
                running, preset.max_queued_turns, line=line, priority=preset.priority,
                keep_tokens=kept_for * 2 * max(replies, default=0) if group.shared else 0,
                account_share=preset.account_share,
                account_queued_share=preset.account_queued_share,
                name=preset.name, whole=seated[preset.name], tell_every_s=TELL_PLACE_EVERY_S)
            self.engine_of[preset.name] = group.name
        if engine.kv_tokens:
            log.info("%s%s", capacity_line(group.name, engine.kv_tokens,
                                           engine.kv_bytes_per_token, engine.kv_offload_gib,
                                           engine.max_model_len, seated),
                     f" (split among {self.front_ends} front ends"
                     f"{', each taking those the others leave free' if shared else ''})"
                     if self.front_ends > 1 else "")

    async def _warm_up(self, group: EngineGroup, engine: Engine, machine: Machine) -> None:
        """Before /ready: the profiles' sampling in batches up to the seats (on a GPU; on a
        CPU one short turn each, as there is nothing to compile)."""
        if engine.warm:
            return
        started = time.monotonic()
        samplings = list({(p.sampling.temperature, p.sampling.top_p): None
                          for p in self.config.profiles
                          if p.preset in {q.name for q in group.presets}})
        top = engine.max_num_seqs
        batches = sorted({b for b in WARM_UP_BATCHES if b < top} | {top}) if machine.gpu \
            else [1]
        turns = await engine.warm_up([{"temperature": t, "top_p": p} for t, p in samplings],
                                     batches)
        self.warm_up_s[group.name] = time.monotonic() - started
        log.info("Engine %r warmed up: %d turns in %.1f s", group.name, turns,
                 self.warm_up_s[group.name])

    def launch(self) -> None:
        """Start in the background, so a server answers while the engines load; `ready()`
        waits for it."""
        self._launch = asyncio.ensure_future(self.start())
        self._launch.add_done_callback(_log_failure)

    async def ready(self) -> None:
        """Wait for a launch to finish; a ChatError if the engines could not start."""
        if self._launch is None:
            raise Unavailable("The model was not started.")
        await asyncio.wait([self._launch])  # a cancelled waiter leaves the launch running
        failure = None if self._launch.cancelled() else self._launch.exception()
        if isinstance(failure, ChatError):
            raise Unavailable(f"The model failed to start: {failure}")
        if failure is not None or self._launch.cancelled():
            raise Unavailable("The model failed to start; the server log says why.")

    async def _watch(self) -> None:
        """Restart any engine that died, with back-off, while the others keep serving. A
        remote server is not ours to restart: its engine recovers when the server is back."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name, engine in list(self.engines.items()):
                if engine.restartable and not engine.running and name not in self._restarting:
                    self._restarting[name] = asyncio.ensure_future(self._restart(name, engine))
            self.watch_rounds += 1  # what a test waits on to see a round change nothing

    async def _restart(self, name: str, dead: Engine) -> None:
        log.error("Engine %r died; restarting it", name)
        # How long a start took it (or its core, started again by the launcher, says)
        expected = dead.restart_expected_s or (dead.started_in_s or 0.0) + \
            self.warm_up_s.get(name, 0.0)
        self._restart_due[name] = time.monotonic() + expected
        with contextlib.suppress(Exception):
            dead.shutdown()
        with contextlib.suppress(Exception):  # its processes' memory free for the new one
            await dead.ended()
        attempt = 0
        while True:
            await asyncio.sleep(_backoff(attempt))
            attempt += 1
            engine = self.engine_class(name, dead.setup)
            try:
                await engine.start()
                await self._warm_up(self.groups[name], engine, self.machine)
            except Exception:
                log.exception("Restart %d of engine %r failed; next try in %s s", attempt,
                              name, _backoff(attempt))
                with contextlib.suppress(Exception):
                    engine.shutdown()
                continue
            self.engines[name] = engine
            self.restarts[name] = self.restarts.get(name, 0) + 1
            del self._restarting[name]
            log.info("Engine %r is back after %d attempt(s)", name, attempt)
            return

    def shutdown(self, keep_state: bool = False) -> None:
        """Stop a launch or restart under way, the watchdog and every engine."""
        tasks = [self._launch, self._watchdog, *self._restarting.values()]
        self._watchdog = None
        self._restarting.clear()
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
        for shared in self._shared:
            shared.close()
        self._shared.clear()
        self.admission.clear()
        self.engine_of.clear()
        self.groups.clear()
        if not keep_state:
            self.state = "stopped"

    @property
    def gpu(self) -> bool | None:
        """Whether the engines run on a GPU, once known."""
        return None if self.machine is None else self.machine.gpu

    @property
    def restarting(self) -> set[str]:
        """Engines that died and are being started again."""
        return set(self._restarting)

    def priority(self, profile: str) -> int:
        """The profile's class: its preset's `priority` (lower is served first)."""
        return self.config.presets[self.config.profile(profile).preset].priority

    def for_profile(self, profile: str) -> Engine:
        return self._serving(self.config.profile(profile))

    def _serving(self, profile: Profile) -> Engine:
        """The engine that runs the profile's turns now; Unavailable while it does not."""
        name = self.engine_of.get(profile.preset)
        if name in self._restarting:
            raise Unavailable(RESTARTING)
        engine = self.engines.get(name)
        if engine is None or not engine.running:
            raise Unavailable(f"The engine for {profile.name!r} is {self.state}.")
        return engine

    async def health(self) -> dict:
        """Overall verdict plus, per engine: healthy, requests in flight, peak batch, and
        each preset's line with how accounts share it (admission.py: figures, no names). A
        remote server out of reach makes the status "unreachable", naming its presets."""
        engines, restarting = {}, self.restarting
        # A copy: engines start (remote ones at once) while a check awaits.
        for name, engine in list(self.engines.items()):
            healthy = await engine.check_health()
            remote = engine.remote
            engines[name] = {
                "healthy": healthy,
                "remote": f"{remote.model} at {remote.base_url}" if remote else None,
                "restarting": name in restarting,
                # (seconds until it should be back, going by its last start; 0: any moment)
                "back_in_s": round(max(0.0, self._restart_due[name] - time.monotonic()), 1)
                if name in restarting and name in self._restart_due else None,
                "restarts": self.restarts.get(name, 0),
                "unfinished_requests": engine.num_unfinished_requests() if healthy else None,
                "peak_running": engine.step_stats.max_running,
                "steps": engine.step_stats.steps,
                "prefix_cache_hit_rate": engine.step_stats.cache_hit_rate,
                "preempted": engine.step_stats.preempted,
            }
            lines = {p.name: self.admission[p.name] for p in self.groups[name].presets
                     if p.name in self.admission}
            engines[name].update(
                admitted=sum(g.inside for g in lines.values()),
                queued=sum(g.waiting for g in lines.values()),
                max_admitted=sum(g.running for g in lines.values()),
                max_queued=sum(g.queued for g in lines.values()),
                kv_tokens=next((g.line.kv_tokens for g in lines.values()), None),
                kv_held=next((g.line.held for g in lines.values()), 0),
                kv_bytes_per_token=engine.kv_bytes_per_token if healthy else None,
                kv_offload_gib=engine.kv_offload_gib if healthy else 0.0,
                warm_up_s=self.warm_up_s.get(name),
                presets={p: {"priority": g.priority, "admitted": g.inside, "queued": g.waiting,
                             "seats": g.running, "max_queued": g.queued, "kv_held": g.held,
                             **g.shares()}
                         for p, g in lines.items()})
        ok = self.state == "ready" and bool(engines) and all(
            e["healthy"] for e in engines.values())
        unreachable = [n for n, e in engines.items() if e["remote"] and not e["healthy"]]
        status = "ok" if ok else ("restarting" if restarting else
                                  "unreachable" if unreachable and self.state == "ready" else
                                  self.state)
        return {"status": status, "engines": engines, "unreachable": unreachable,
                "model": self.model,
                "engine": StandInEngine.label if self.stand_in else Engine.label,
                "random_weights": self.config.random_weights}

    def metric_registries(self) -> dict:
        """Each running vLLM engine's Prometheus registry, by preset (metrics.py)."""
        return {name: engine.metrics for name, engine in self.engines.items()
                if engine.metrics is not None}

    def fit(self, profile: str, history: Sequence[Message], new_message: Message, *,
            system_prompt: str, max_tokens: int, tools: Sequence[dict] | None = None,
            template: dict | None = None, reserve: int | None = None) -> Prompt:
        """Fit a conversation to the context of the profile's engine (see history.py), with
        the `tools` it may call described by the model's template (rendered with
        `template`'s options, an API request's); `reserve`: history.py's."""
        engine = self.for_profile(profile)
        return fit_history(engine.formatter, history, new_message, system_prompt=system_prompt,
                           max_model_len=engine.max_model_len, max_tokens=max_tokens,
                           tools=tools, template=template, reserve=reserve)

    def model_sampling(self, profile: str) -> dict:
        """The sampling defaults of the profile's model (Engine.model_sampling); none while
        its engine is not serving (the turn is refused then anyway)."""
        try:
            return self.for_profile(profile).model_sampling
        except ChatError:
            return {}

    def refusal_alone(self, profile: str, new_message: Message, *, system_prompt: str,
                      max_tokens: int) -> str | None:
        """Why `new_message` could not be sent even as a chat's first message (with the
        system prompt it does not fit the profile's context), or None; None too while the
        profile's engine is not serving (its turn says so then). A message whose bytes
        leave room for the template is not tokenized: a token is at least one byte."""
        try:
            engine = self.for_profile(profile)
        except ChatError:
            return None
        room = engine.max_model_len - min(max_tokens, engine.max_model_len // 2)
        if len(new_message.content.encode()) + len(system_prompt.encode()) + \
                TEMPLATE_TOKENS <= room:
            return None
        try:
            self.fit(profile, [], new_message, system_prompt=system_prompt,
                     max_tokens=max_tokens)
        except ChatError as exc:
            return str(exc)
        return None

    def raw_prompt(self, profile: str, prompt: str | list[int], max_tokens: int,
                   truncate: tuple[int, str] | None = None) -> Prompt:
        """A prompt as given: token ids, or text encoded by the model's tokenizer with its
        control tokens read as such (as vLLM's server reads a completion's prompt: the
        caller writes the whole prompt), with room for `max_tokens` in the context.
        `truncate`: (k, side), vLLM's truncate_prompt_tokens: only the last k tokens kept
        (side "left") or the first k ("right"); k -1: as many as the context leaves."""
        engine = self.for_profile(profile)
        ids = prompt if isinstance(prompt, list) else \
            engine.formatter.tokenizer(prompt)["input_ids"]
        if truncate is not None:
            keep, side = truncate
            keep = max(engine.max_model_len - max_tokens, 1) if keep == -1 else keep
            ids = list(ids[:keep] if side == "right" else ids[-keep:])
        given = Prompt([], "", list(ids), max_tokens, max_tokens)
        check_fits(given, engine.max_model_len)
        return given

    def count_tokens(self, profile: str, text: str) -> int:
        """`text`'s length in tokens for the profile's model (a stopped reply's cost:
        store/usage.py); a rough count while its engine is not serving."""
        try:
            formatter = self.for_profile(profile).formatter
        except ChatError:
            return (len(text) + 3) // 4
        return len(formatter.content_ids(Message("assistant", text)))

    async def stream(
        self, prompt: Prompt, profile: str,
        on_queued: Callable[[int], Awaitable[None]] | None = None, session: str | None = None,
        decoding: Decoding | None = None, who: str | None = None,
        on_admitted: Callable[[], Awaitable[None]] | None = None, **sampling
    ) -> AsyncIterator[str | Piece | TurnStats]:
        """Stream one turn on the profile's engine, with the profile's sampling unless
        `sampling` (temperature, top_p, ignore_eos, seed) says otherwise; `session`: the
        chat's key, for a remote engine's router (engine/remote.py); `decoding`: the rest
        of what it asks (decoding.py: then it yields Pieces), its `n` replies holding the
        cache of n.

        The turn first takes a place in the engine's admission queue (admission.py):
        `on_queued(place)` hears about waiting, `on_admitted()` that the engine has the
        turn (queued or not); a ChatError says the queue is full. `who`:
        whose turn it is (an account; None: nobody's), for each one's fair share of the line.
        """
        prof = self.config.profile(profile)
        self._serving(prof)  # not running (starting, restarting): refused before queueing
        sampling = {"temperature": prof.sampling.temperature, "top_p": prof.sampling.top_p,
                    **sampling}
        gate = self.admission[prof.preset]
        if self.groups[self.engine_of[prof.preset]].shared:
            sampling.update(priority=gate.priority, preset=prof.preset)
        replies = decoding.n if decoding else 1
        async with gate.slot(on_queued, tokens=prompt.prompt_tokens + replies * prompt.max_tokens,
                             who=who) as leave:
            # Looked up once admitted: the engine may have been restarted while we waited.
            engine = self._serving(prof)
            if on_admitted is not None:
                await on_admitted()
            # aclosing: when our caller leaves early, the engine's stream is closed (and its
            # request aborted) now, not whenever the garbage collector gets to it.
            if decoding is not None:
                sampling["decoding"] = decoding
            # Its seat goes to the next turn as the engine finishes it, not once the caller
            # has sent the last words on (a reply's updates are paced: chat/streaming.py).
            async with contextlib.aclosing(engine.stream(prompt, session=session,
                                                         on_finished=leave,
                                                         **sampling)) as items:
                async for item in items:
                    yield item

    def reading_s(self, profile: str, tokens: int) -> float:
        """About how long the profile's engine takes to read `tokens` new prompt tokens
        (reading.py: the rate of its recent turns, or a default before any)."""
        return self.for_profile(profile).reading.seconds(tokens, gpu=bool(self.gpu))
