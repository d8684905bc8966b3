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

A core that died is launched again in place (`Cores.restart`), at the same addresses: the
launcher tells the front ends (LOST_SIGNAL, `cores_lost`), whose engines end the turns in
flight and rejoin the new core as below, once it has loaded its model.

A front end that died is started again alone (`Link.rejoining`): it binds its sockets at the
same paths, where the core's sockets connect again by themselves (ZMQ reconnects). vLLM's
client waits for the core's "ready" message, which the core sends once, at its start: each
front end keeps it (`ready_path`) and one that rejoins reads it there (`joining`). Once
attached, it has the core abort the requests its predecessor left running
(`abort_left_behind`, a utility that engine/scheduler.py gives vLLM's engine core).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .launch import EngineSetup, importable_here, neutral_main, process_env
from .processes import CoreProcesses

log = logging.getLogger(__name__)

MAX_FRONT_ENDS = 16
LOST_SIGNAL = signal.SIGUSR1  # the launcher's word to its front ends: a core died


@dataclass(frozen=True)
class Link:
    """A front end's way to one engine's core: vLLM's client addresses (ZMQ paths, and with
    vLLM 0.32 the sockets bound for them), its index among the core's `count` clients."""

    addresses: dict
    index: int
    count: int
    ready_path: str | None = None  # where the core's "ready" message is kept for a rejoin
    rejoin: bool = False  # the core runs already: this front end replaces one that died

    def rejoining(self) -> Link:
        """This link for a front end started again in the place of one that died: the same
        paths, bound anew (vLLM 0.32's sockets bound at the start were handed over once)."""
        addresses = {k: v for k, v in self.addresses.items() if not k.endswith("_listener")}
        return dataclasses.replace(self, addresses=addresses, rejoin=True)


_attached: dict[str, Link] = {}


def attach(links: Mapping[str, Link]) -> None:
    """This process is a front end: its engines named in `links` attach to running cores."""
    _attached.clear()
    _attached.update(links)


def link_of(engine: str) -> Link | None:
    """How this process reaches `engine`'s core, if another process started it."""
    return _attached.get(engine)


_on_lost: dict[str, tuple] = {}  # engine -> (event loop, callback), in a front end


def on_core_lost(engine: str, callback) -> None:
    """(A front end) `callback(expected_s)` on this event loop when the launcher says that
    `engine`'s core died and is being started again, in about `expected_s` seconds."""
    _on_lost[engine] = (asyncio.get_running_loop(), callback)


LOST_FILE = "lost-cores"  # in the run's folder: the engines whose core died, for LOST_SIGNAL


def write_whole(path: Path, data: bytes) -> None:
    """`data` in `path`, whole or not at all (another process may read it at any moment)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)


def write_lost(folder: str | Path, engine: str, expected_s: float) -> None:
    """(The launcher, before LOST_SIGNAL) `engine`'s core died and should be back in about
    `expected_s`: what `cores_lost` reads."""
    write_whole(Path(folder) / LOST_FILE, f"{engine}\t{expected_s:.1f}\n".encode())


def cores_lost(folder: str | Path) -> None:
    """(A front end's handler of LOST_SIGNAL) The launcher has written in `folder` the
    engines whose core died (`write_lost`): from now on their links rejoin, and their
    engines hear it."""
    try:
        lines = (Path(folder) / LOST_FILE).read_text().splitlines()
    except OSError:  # a stray signal (not the launcher's): nothing to hear
        log.warning("%s without the launcher's note: ignored", LOST_SIGNAL.name)
        return
    for line in lines:
        engine, expected = line.rsplit("\t", 1)
        if (link := _attached.get(engine)) is not None:
            _attached[engine] = link.rejoining()
        if (heard := _on_lost.get(engine)) is not None:
            loop, callback = heard
            loop.call_soon_threadsafe(callback, float(expected))


def vllm_config_of(setup: EngineSetup, engine: str, link: Link | None = None,
                   clients: int = 1):
    """vLLM's config of one engine: the same in the process that starts its core (`clients`
    front ends) and in each front end (`link`), as vLLM's own servers build it."""
    from vllm import AsyncEngineArgs

    from .errors import ConfigError

    args = AsyncEngineArgs(**setup.args)
    shared = link is not None or clients > 1
    if shared:
        args._api_process_count = link.count if link else clients
        args._api_process_rank = link.index if link else -1
    try:
        config = args.create_engine_config()
    except (ValueError, TypeError) as exc:  # vLLM's own check of the option set
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("profiles.yaml", f"presets.{engine}.vllm",
                          f"vLLM refused these options: {text}") from exc
    from .steps import STEP_CLASSES_KEY

    # A shared core's scheduler is this project's: its module also gives the core the
    # utility by which a rejoining front end has its predecessor's requests aborted.
    if shared or STEP_CLASSES_KEY in (config.additional_config or {}):
        from .scheduler import scheduler_for  # vLLM's scheduler: loaded only here

        config.scheduler_config.scheduler_cls = scheduler_for(config)
    return config


@dataclass
class _Core:
    """One engine's core as launched: enough to launch it again in place."""

    engine: str
    setup: EngineSetup
    count: int
    inputs: list[str]  # each front end's addresses, which a restarted core connects to
    outputs: list[str]
    manager: object = None  # vLLM's engine manager of its processes
    started_in_s: float = 0.0
    processes: CoreProcesses = field(default_factory=lambda: CoreProcesses(()))


class Cores:
    """The cores of this machine's local engines, each serving `count` front ends."""

    def __init__(self):
        self._cores: list[_Core] = []
        self._listeners: list = []  # vLLM 0.32's: dropping them unlinks their paths

    @contextlib.contextmanager
    def launching(self, engines: Mapping[str, EngineSetup], count: int, folder: str
                  ) -> Iterator[list[dict[str, Link]]]:
        """Start each engine's core and yield every front end's links ({engine: Link}, one
        dict per front end); start the front ends inside the block. Leaving it waits until
        every core has loaded its model and met its clients (vLLM's handshake). `folder`
        (this user's only) keeps each core's ready message for front ends that rejoin."""
        if not 1 <= count <= MAX_FRONT_ENDS:
            raise ValueError(f"front ends: 1 to {MAX_FRONT_ENDS}, not {count}")
        links: list[dict[str, Link]] = [{} for _ in range(count)]
        started = time.monotonic()
        with contextlib.ExitStack() as waits:
            for engine, setup in engines.items():
                core = _Core(engine, setup, count, [], [])
                clients, listeners = self._launch(waits, core)
                self._cores.append(core)
                self._listeners += listeners
                ready = str(Path(folder) / f"ready-{len(self._cores)}")
                for i, addresses in enumerate(clients):
                    links[i][engine] = Link(addresses, i, count, ready)
                log.info("engine %r: its core started for %d front ends", engine, count)
            yield links
            for listener in self._listeners:  # the front ends have their copies now
                listener.close()
        for core in self._cores:
            core.started_in_s = time.monotonic() - started
            core.processes = CoreProcesses.of_manager(core.manager)

    def dead(self) -> list[str]:
        """The engines whose core's processes do not all run."""
        return [core.engine for core in self._cores
                if not all(proc.is_alive() for proc in getattr(core.manager, "processes", ()))]

    def restart(self, engine: str) -> float:
        """Launch `engine`'s dead core again, in place: its processes ended, new ones that
        connect to the same front ends' addresses (each front end binds them again and
        rejoins: `Link.rejoining`). Returns once it has loaded its model: the seconds taken."""
        core = self._core(engine)
        with contextlib.suppress(Exception):
            core.manager.shutdown()
        core.processes.ended()  # its workers' memory free for the new ones
        started = time.monotonic()
        with contextlib.ExitStack() as waits:
            self._launch(waits, core)
        core.started_in_s = time.monotonic() - started
        core.processes = CoreProcesses.of_manager(core.manager)
        return core.started_in_s

    def expected_restart_s(self, engine: str) -> float:
        """How long `engine`'s core took to start the last time."""
        return self._core(engine).started_in_s

    def _core(self, engine: str) -> _Core:
        return next(c for c in self._cores if c.engine == engine)

    def shutdown(self) -> None:
        for core in self._cores:
            with contextlib.suppress(Exception):
                core.manager.shutdown()
        self._cores.clear()
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                listener.cleanup()
        self._listeners.clear()

    @staticmethod
    def _launch(waits: contextlib.ExitStack, core: _Core) -> tuple[list[dict], list]:
        """Start `core`'s processes (its wait pushed on `waits`), at its front ends'
        addresses where it has them (a restart: the front ends bind them themselves), else
        at new ones. Returns each front end's addresses, and the listeners bound here for
        them (vLLM 0.32; 0.24 lets each front end bind its own at the paths given)."""
        from vllm.v1.engine import utils as core_utils
        from vllm.v1.executor import Executor

        # The core's processes start here, seeing the engine's environment.
        with process_env(core.setup.env), neutral_main(), importable_here():
            config = vllm_config_of(core.setup, core.engine, clients=core.count)
            executor = Executor.get_class(config)
            listeners, binds = [], hasattr(core_utils, "bind_engine_zmq_listeners")
            if core.inputs:
                addresses = core_utils.EngineZmqAddresses(list(core.inputs),
                                                          list(core.outputs))
            elif binds:
                bound = core_utils.bind_engine_zmq_listeners(config, core.count)
                addresses, listeners = bound.addresses, [*bound.inputs, *bound.outputs]
                bound.inputs, bound.outputs = [], []  # theirs to close, not this object's
            else:
                addresses = core_utils.get_engine_zmq_addresses(config, core.count)
            core.inputs, core.outputs = list(addresses.inputs), list(addresses.outputs)
            launched = waits.enter_context(core_utils.launch_core_engines(
                config, executor, True, *((addresses,) if binds else (addresses, core.count))))
        if isinstance(launched, tuple):  # 0.24: (manager, coordinator, addresses, queue)
            core.manager, coordinator = launched[0], launched[1]
        else:
            core.manager, coordinator = launched.engine_manager, launched.coordinator
        clients = [{"input_address": i, "output_address": o}
                   for i, o in zip(core.inputs, core.outputs)]
        if listeners:
            half = len(listeners) // 2
            clients = [{**client, "input_listener": i.socket, "output_listener": o.socket}
                       for client, i, o in zip(clients, listeners[:half], listeners[half:])]
        if coordinator is not None:  # only with data parallelism, which a preset here never has
            stats = coordinator.get_stats_publish_address()
            clients = [{**client, "stats_update_address": stats} for client in clients]
        return clients, listeners


_joining = threading.Lock()  # one client built at a time while vLLM's zmq is wrapped


@contextlib.contextmanager
def joining(link: Link) -> Iterator[None]:
    """Around building vLLM's client of a core through `link`: the core's ready message,
    kept in `link.ready_path` as it comes, or for a rejoining front end read from there in
    its place (the core sends it once, to the first front end in this place)."""
    from vllm.v1.engine import core_client

    if link.ready_path is None:
        yield
        return
    path = Path(link.ready_path)
    kept = path.read_bytes() if link.rejoin else None
    with _joining:
        real = core_client.zmq
        core_client.zmq = _ReadyKept(real, path, kept)
        try:
            yield
        finally:
            core_client.zmq = real


class _ReadyKept(types.ModuleType):
    """pyzmq as vLLM's client module sees it while a client is built: the one socket it
    waits on for the core's ready message (`zmq.Socket.shadow(...)`) is a `_ReadyWait`."""

    def __init__(self, real, path: Path, kept: bytes | None):
        super().__init__(real.__name__)
        self._real = real

        class Socket(real.Socket):
            @classmethod
            def shadow(cls, address):
                return _ReadyWait(real.Socket.shadow(address), path, kept)

        self.Socket = Socket

    def __getattr__(self, name):
        return getattr(self._real, name)


class _ReadyWait:
    """The socket vLLM's client reads the core's ready message from: it keeps that message
    in `path` (an engine's 2-byte identity, then the message), or, `kept`, gives it back
    from there without waiting for a message that will not come again."""

    def __init__(self, socket, path: Path, kept: bytes | None):
        self._socket, self._path, self._kept = socket, path, kept

    def poll(self, *args, **kwargs):
        return True if self._kept is not None else self._socket.poll(*args, **kwargs)

    def recv_multipart(self, *args, **kwargs):
        if self._kept is not None:
            return [self._kept[:2], self._kept[2:]]
        identity, payload = self._socket.recv_multipart(*args, **kwargs)
        if len(identity) == 2:  # (one engine per core here: no data parallelism)
            write_whole(self._path, bytes(identity) + bytes(payload))
        return [identity, payload]

    def __getattr__(self, name):
        return getattr(self._socket, name)


ABORT_LEFT_BEHIND = "vchat_abort_client"  # the core's utility (engine/scheduler.py)
REJOIN_WAIT_S = 2.0  # a call to the core unanswered this long is sent again
REJOIN_PATIENCE_S = 900.0  # a core started again loads its model meanwhile


async def abort_left_behind(llm, link: Link) -> int:
    """A rejoining front end's first call to the core: abort the requests that the front
    end before it in this place left running (their users' pages went to a live one).
    Asked again until answered: a call sent before the core's sockets have connected (or,
    the core started again, before it has loaded its model) is dropped by ZMQ. How many
    the core aborted."""
    deadline = time.monotonic() + REJOIN_PATIENCE_S
    while time.monotonic() < deadline:
        call = llm.engine_core.call_utility_async(ABORT_LEFT_BEHIND, link.index)
        try:
            return await asyncio.wait_for(call, REJOIN_WAIT_S)
        except asyncio.TimeoutError:
            continue
    raise TimeoutError(f"the engine core did not answer in {REJOIN_PATIENCE_S:.0f} s")


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
