"""One engine core for several front-end processes: what vLLM's `--api-server-count` does
for its own server, done for this app.

vLLM's `AsyncLLM` is two parts: the engine core (its own process: the scheduler and the
model) and the client in the caller's process, which turns every step's outputs into text
(detokenizing, RequestOutputs). With one app process that client and every user's socket
share one Python thread. Here a launcher (launcher.py) starts each local engine's
core once, for N front ends; each front end's `PresetEngine` (llm.py) attaches to the core
through its `Link` instead of starting one, and handles only its own users' requests. The
core's scheduler batches all front ends' requests as one.

    cores = Cores()
    with cores.launching({"throughput-first": setup}, count=2) as links:
        ...start front end i with links[i]...   # each calls attach(links[i]) first
    # here every core has started; cores.shutdown() at the end

Both vLLM builds this project runs are handled: 0.24 (GPU) lets each front end bind its own
ZMQ sockets at the paths given; 0.32 (CPU) binds them here and hands them over.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .launch import EngineSetup, importable_here, neutral_main, process_env

log = logging.getLogger(__name__)

MAX_FRONT_ENDS = 16


@dataclass(frozen=True)
class Link:
    """A front end's way to one engine's core: vLLM's client addresses (ZMQ paths, and with
    vLLM 0.32 the sockets bound for them), its index among the core's `count` clients."""

    addresses: dict
    index: int
    count: int


_attached: dict[str, Link] = {}


def attach(links: Mapping[str, Link]) -> None:
    """This process is a front end: its engines named in `links` attach to running cores."""
    _attached.clear()
    _attached.update(links)


def link_of(engine: str) -> Link | None:
    """How this process reaches `engine`'s core, if another process started it."""
    return _attached.get(engine)


def vllm_config_of(setup: EngineSetup, engine: str, link: Link | None = None,
                   clients: int = 1):
    """vLLM's config of one engine: the same in the process that starts its core (`clients`
    front ends) and in each front end (`link`), as vLLM's own servers build it."""
    from vllm import AsyncEngineArgs

    from .errors import ConfigError

    args = AsyncEngineArgs(**setup.args)
    if link is not None or clients > 1:
        args._api_process_count = link.count if link else clients
        args._api_process_rank = link.index if link else -1
    try:
        config = args.create_engine_config()
    except (ValueError, TypeError) as exc:  # vLLM's own check of the option set
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("profiles.yaml", f"presets.{engine}.vllm",
                          f"vLLM refused these options: {text}") from exc
    from .steps import STEP_CLASSES_KEY

    if STEP_CLASSES_KEY in (config.additional_config or {}):
        from .scheduler import scheduler_for  # vLLM's scheduler: loaded only here

        config.scheduler_config.scheduler_cls = scheduler_for(config)
    return config


class Cores:
    """The cores of this machine's local engines, each serving `count` front ends."""

    def __init__(self):
        self._managers: list = []
        self._listeners: list = []  # vLLM 0.32's: dropping them unlinks their paths

    @contextlib.contextmanager
    def launching(self, engines: Mapping[str, EngineSetup], count: int
                  ) -> Iterator[list[dict[str, Link]]]:
        """Start each engine's core and yield every front end's links ({engine: Link}, one
        dict per front end); start the front ends inside the block. Leaving it waits until
        every core has loaded its model and met its clients (vLLM's handshake)."""
        if not 1 <= count <= MAX_FRONT_ENDS:
            raise ValueError(f"front ends: 1 to {MAX_FRONT_ENDS}, not {count}")
        links: list[dict[str, Link]] = [{} for _ in range(count)]
        with contextlib.ExitStack() as waits:
            for engine, setup in engines.items():
                # The core's processes start here, seeing the engine's environment.
                with process_env(setup.env), neutral_main(), importable_here():
                    manager, clients, listeners = _launch(waits, setup, engine, count)
                self._managers.append(manager)
                self._listeners += listeners
                for i, addresses in enumerate(clients):
                    links[i][engine] = Link(addresses, i, count)
                log.info("engine %r: its core started for %d front ends", engine, count)
            yield links
            for listener in self._listeners:  # the front ends have their copies now
                listener.close()

    def alive(self) -> bool:
        """Every core's processes still run."""
        return all(proc.is_alive() for manager in self._managers
                   for proc in getattr(manager, "processes", ()))

    def shutdown(self) -> None:
        for manager in self._managers:
            with contextlib.suppress(Exception):
                manager.shutdown()
        self._managers.clear()
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                listener.cleanup()
        self._listeners.clear()


def _launch(waits: contextlib.ExitStack, setup: EngineSetup, engine: str, count: int):
    """Start one engine's core for `count` clients (its wait pushed on `waits`). Returns
    vLLM's engine manager, each client's addresses, and the listeners bound here for them."""
    from vllm.v1.engine import utils as core_utils
    from vllm.v1.executor import Executor

    config = vllm_config_of(setup, engine, clients=count)
    executor = Executor.get_class(config)
    listeners = []
    if hasattr(core_utils, "bind_engine_zmq_listeners"):  # vLLM 0.32: bound here
        bound = core_utils.bind_engine_zmq_listeners(config, count)
        launched = waits.enter_context(core_utils.launch_core_engines(
            config, executor, True, bound.addresses))
        pairs = list(zip(bound.inputs, bound.outputs))
        clients = [{"input_address": i.address, "output_address": o.address,
                    "input_listener": i.socket, "output_listener": o.socket} for i, o in pairs]
        listeners = [*bound.inputs, *bound.outputs]
        bound.inputs, bound.outputs = [], []  # theirs to close, not this object's
    else:  # vLLM 0.24: each front end binds its own ZMQ sockets at the (local) paths
        addresses = core_utils.get_engine_zmq_addresses(config, count)
        launched = waits.enter_context(core_utils.launch_core_engines(
            config, executor, True, addresses, count))
        clients = [{"input_address": i, "output_address": o}
                   for i, o in zip(addresses.inputs, addresses.outputs)]
    if isinstance(launched, tuple):  # 0.24: (manager, coordinator, addresses, tensor queue)
        manager, coordinator = launched[0], launched[1]
    else:
        manager, coordinator = launched.engine_manager, launched.coordinator
    if coordinator is not None:  # only with data parallelism, which a preset here never has
        stats = coordinator.get_stats_publish_address()
        clients = [{**client, "stats_update_address": stats} for client in clients]
    return manager, clients, listeners


def local_engines(config) -> dict[str, EngineSetup]:
    """The engines whose cores run on this machine, by name and set up as `Engines.start`
    sets them up (remote presets have none here)."""
    from .launch import Machine, engine_groups, group_setup
    from .model import resolve_model

    groups = [g for g in engine_groups(config) if g.presets[0].remote is None]
    if not groups:
        return {}
    model, machine = resolve_model(config.model), Machine.here()
    return {group.name: group_setup(config, group, model, machine) for group in groups}
