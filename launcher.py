"""What `make run` starts: the app as several processes on one port, sharing each engine's
core:

    python -m launcher --host 0.0.0.0 --port 8000 [--front-ends N]
    (VCHAT_FRONT_ENDS gives the count, `auto` by default: with an NVIDIA GPU one per 4
    cores, at most 4; without, 1: then this is `chainlit run app.py`)

One app process streams every user's reply and runs vLLM's output handling on one Python
thread; on a GPU that thread is what limits the app at a few hundred streams (BENCHMARKS.md).
Here this launcher binds the port, starts each local engine's core once
(engine/cores.py) and then N front ends, each the whole app (`chainlit run app.py`'s
server) attached to those cores. Each front end listens on the port with a socket of its own
(SO_REUSEPORT) and the kernel hands each new connection to one of them by its addresses
(VCHAT_CONNECTION_SPREAD: `hash`, or `first-free`, one socket that whichever front end
accepts first), so a browser's socket, and with it its chat, lives in one front end; the
page is told to use WebSockets only (polling would spread one socket's requests over
several). The few HTTP calls that name a chat session (a button's action, a custom element)
reach the front end that holds it: another forwards them (chat/front_ends.py), over its own
Unix socket in a folder only this user can open, with a secret made for this run.

The launcher stays in front: SIGTERM or Ctrl+C goes to every front end (each finishes its
replies as `chainlit run` does), then the cores stop. A front end that dies is started
again alone, on the same listening socket, attached to the running cores (engine/cores.py:
it rejoins, with no warm-up): a spare process, kept with the app and vLLM imported, takes
its place in seconds. The others go on streaming, and its users' pages reconnect and go on
with their chats from the database, a reply it was streaming marked as cut off. A core
that dies is launched again in place, the front ends told first (their turns in flight
end, saying so; they rejoin the new core once it has loaded the model). More than RESTARTS
within RESTART_WINDOW_S, or a core that cannot start again, ends them all, with status 1,
for the supervisor (systemd, Docker) to start the app again.

Every front end shares the data folder's database and its login secret, as replicas do
(deploy/); each front end has lines of its own with a part of each preset's seats, and
takes those another leaves free (engine/seats.py: the front ends count seats and KV cache
together, in a file of the run's folder); /ready and /metrics answer for every front end
(api/ops.py).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from engine import load_config
from engine.cores import (LOST_SIGNAL, MAX_FRONT_ENDS, Cores, attach, cores_lost,
                          local_engines, write_lost)
from engine.errors import ChatError, ConfigError
from engine.pool import engine_kind
from engine.settings import check_all, setting
from engine.standin import StandInEngine
from service.front_ends import FrontEnd, become

ROOT = Path(__file__).resolve().parent
STOP_WAIT_S = 30  # past the replies' grace: a front end still running then is killed
# With a GPU: 4 front ends kept closest to the engine at 256 streams (BENCHMARKS.md); each
# front end's thread wants a core of its own beside the engine core's.
MOST_FRONT_ENDS, CORES_EACH = 4, 4
LISTEN_BACKLOG = 4096  # each front end's share of a burst of connections waits here
RESTARTS, RESTART_WINDOW_S = 3, 300  # a front end dying more often: something is wrong
SPARE = True  # keep a front end imported and waiting, to take a dead one's place at once
log = logging.getLogger("front_ends")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return start(argv)
    except (ConfigError, ChatError, ValueError) as exc:  # a message, not a trace
        raise SystemExit(f"Configuration error: {exc}") from None


def start(argv: list[str] | None) -> int:
    check_all()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", type=int, help="default: VCHAT_FRONT_ENDS")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    count = args.front_ends or front_ends_here(setting("VCHAT_FRONT_ENDS"))
    if not 1 <= count <= MAX_FRONT_ENDS:
        p.error(f"front ends: 1 to {MAX_FRONT_ENDS}, not {count}")
    if count == 1:  # the app alone: Chainlit's own command, in this process
        chainlit = Path(sys.executable).parent / "chainlit"
        command = [str(chainlit)] if chainlit.exists() else [sys.executable, "-m", "chainlit"]
        os.chdir(ROOT)
        os.execv(command[0], command + ["run", "app.py", "--headless", "--host", args.host,
                                        "--port", str(args.port)])
    return Launcher(count, args.host, args.port).run()


def front_ends_here(asked: int | str) -> int:
    """VCHAT_FRONT_ENDS's count on this machine: as given, or for `auto` one per CORES_EACH
    cores (at most MOST_FRONT_ENDS) where an NVIDIA GPU is present, else 1. (The device
    files tell; asking CUDA would load torch into a launcher that may only hand over.)"""
    if asked != "auto":
        return int(asked)
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 1
    return max(1, min(MOST_FRONT_ENDS, len(os.sched_getaffinity(0)) // CORES_EACH))


class Launcher:
    def __init__(self, count: int, host: str, port: int):
        self.count, self.host, self.port = count, host, port
        self.processes: list[multiprocessing.Process] = []
        self.started = self.stopping = False
        self.restarts: list[float] = []  # when front ends were started again
        self.links: list[dict] = []  # each front end's links to the cores, by index
        self.core_restarts: dict[str, threading.Thread] = {}  # engines whose core starts again
        self.failed = False  # a core could not start again
        self.folder = ""  # the run's own folder (0700): peers' sockets, the cores' notes
        self._start_front = None  # (index, links) -> its process, once the cores run
        self.spare: tuple | None = None  # (process, pipe): a front end ready to take a place

    def run(self) -> int:
        config = load_config()
        stand_in = getattr(engine_kind(), "func", None) is StandInEngine
        engines = {} if stand_in else local_engines(config)
        spread = setting("VCHAT_CONNECTION_SPREAD")
        listeners = self._listen(spread)
        folder = self.folder = tempfile.mkdtemp(prefix="vchat-front-ends-")  # 0700: this user's
        peers = tuple(str(Path(folder) / f"{i}.sock") for i in range(self.count))
        secret = secrets.token_urlsafe(32)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        cores = Cores()
        context = multiprocessing.get_context("spawn")

        def start_spare() -> None:
            ours, theirs = context.Pipe()
            spare = context.Process(target=standby, name="front-end-spare",
                                    args=(theirs, self.host, self.port, bool(engines)))
            spare.start()
            theirs.close()  # the spare's copy is its own
            self.spare = (spare, ours)

        def start_front(i: int, links: dict) -> multiprocessing.Process:
            """Front end `i`: the spare, told to become it, where one is ready (and the
            next spare started); else a new process."""
            front, spare = FrontEnd(i, self.count, peers, secret), self.spare
            if spare is None or not spare[0].is_alive():
                proc = context.Process(target=serve, name=f"front-end-{i}",
                                       args=(front, listeners[i], links))
                proc.start()
                return proc
            proc, conn = spare
            conn.send((front, listeners[i], links))
            proc.name = f"front-end-{i}"
            start_spare()
            return proc

        try:
            with cores.launching(engines, self.count, folder) as links:
                self.processes = [start_front(i, links[i]) for i in range(self.count)]
            self.links, self._start_front = links, start_front
            self.started = True
            if SPARE:  # ready for the first front end that dies
                start_spare()
            log.info("%d front ends on http://%s:%d (connections spread: %s), engines %s",
                     self.count, self.host, self.port, spread,
                     ", ".join(engines) or "(none local)")
            return self._watch(cores)
        except Exception as exc:  # an engine's core did not start: vLLM's log says why
            log.error("the engines could not start (%s): ending every front end", exc)
            return 1
        finally:
            self._end_all()
            cores.shutdown()
            for listener in set(listeners):
                listener.close()
            shutil.rmtree(folder, ignore_errors=True)  # peers' sockets, the cores' notes

    def _listen(self, spread: str) -> list[socket.socket]:
        """Each front end's listening socket on the port: one shared by all (`first-free`:
        whichever accepts first gets a connection; in a burst a few take most), or one
        each with SO_REUSEPORT (`hash`: the kernel spreads connections by their addresses,
        evenly, whatever each front end's load). A port already taken stops the launcher;
        a plain socket bound first says so also for another launcher's SO_REUSEPORT ones,
        which would otherwise share the port with these."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        address = (self.host, self.port)
        try:
            first = socket.create_server(address, family=family, backlog=LISTEN_BACKLOG)
            if spread == "first-free":
                return [first] * self.count
            self.port = first.getsockname()[1]  # port 0: the one the kernel chose
            address = (self.host, self.port)
            first.close()
            return [socket.create_server(address, family=family, backlog=LISTEN_BACKLOG,
                                         reuse_port=True) for _ in range(self.count)]
        except OSError as exc:
            raise SystemExit(f"Cannot listen on {self.host}:{self.port}: {exc.strerror}")

    def _watch(self, cores: Cores) -> int:
        while not self.stopping:
            if self.failed:
                return 1
            for engine in cores.dead():
                if engine in self.core_restarts:
                    continue
                what = f"engine {engine!r}: its core stopped"
                if not self._may_restart(what):
                    return 1
                self._restart_core(cores, engine)
            if self.spare is not None and self.spare[1].poll():
                try:
                    self.spare[1].recv()
                    log.info("a spare front end is ready (pid %d)", self.spare[0].pid)
                except (EOFError, OSError):  # it died importing: its log says why
                    log.error("the spare front end stopped (status %s): front ends that "
                              "die are started as new processes", self.spare[0].exitcode)
                    self.spare = None
            for i, proc in enumerate(self.processes):
                if proc.is_alive() or self.stopping:
                    continue
                what = f"front end {proc.name} (status {proc.exitcode}) stopped"
                if not self._may_restart(what):
                    return 1
                proc.join()
                self.processes[i] = self._start_front(
                    i, {name: link.rejoining() for name, link in self.links[i].items()})
                log.warning("%s: started again alone (pid %d); the others go on", what,
                            self.processes[i].pid)
            time.sleep(0.2)
        return 0

    def _may_restart(self, what: str) -> bool:
        """Whether a process that died may be started again: not past RESTARTS within
        RESTART_WINDOW_S (then something is wrong that a restart will not mend)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= RESTARTS:
            log.error("%s, after %d restarts within %d s: ending every front end, for a "
                      "restart", what, len(self.restarts), RESTART_WINDOW_S)
            return False
        self.restarts.append(now)
        return True

    def _restart_core(self, cores: Cores, engine: str) -> None:
        """Launch `engine`'s core again in place (in a thread: it loads its model), the
        front ends told first: their engines end the turns in flight and rejoin it."""
        expected = cores.expected_restart_s(engine)
        log.error("engine %r: its core stopped; starting it again in place (%.0f s the last "
                  "time), the front ends staying up", engine, expected)
        write_lost(self.folder, engine, expected)
        for proc in self.processes:
            with contextlib.suppress(Exception):
                os.kill(proc.pid, LOST_SIGNAL)

        def launch() -> None:
            try:
                took = cores.restart(engine)
            except Exception:
                log.exception("engine %r: its core could not start again: ending every "
                              "front end, for a restart", engine)
                self.failed = True
                return
            log.warning("engine %r: its core is back in %.1f s", engine, took)
            self.core_restarts.pop(engine, None)

        self.core_restarts[engine] = threading.Thread(target=launch, daemon=True,
                                                      name=f"restart-{engine}")
        self.core_restarts[engine].start()

    def _stop(self, signum, frame) -> None:
        if not self.started:  # still starting the cores: leave that at once, ending all
            raise SystemExit(1)
        if self.stopping:  # a second signal: at once
            for proc in self.processes:
                with contextlib.suppress(Exception):
                    proc.kill()
            return
        self.stopping = True

    def _end_all(self) -> None:
        """SIGTERM to every front end still running (each finishes its replies), then kill
        those still there after STOP_WAIT_S. The spare ends as its pipe closes."""
        if self.spare is not None:
            self.spare[1].close()
            self.spare[0].join(5)
            if self.spare[0].is_alive():
                self.spare[0].kill()
        for proc in self.processes:
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def standby(conn, host: str, port: int, model: bool) -> None:
    """A spare front end (a process the launcher keeps ready): Chainlit, the app's modules
    and (`model`) vLLM's client imported, waiting to be told which front end to become
    when one dies, so that its place serves again in seconds rather than after imports."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(LOST_SIGNAL, signal.SIG_IGN)  # no engines yet: nothing to tell it
    os.environ.update(CHAINLIT_HOST=str(host), CHAINLIT_PORT=str(port))
    os.chdir(ROOT)  # Chainlit reads .chainlit/ on import, from the folder it runs in
    for module in ("chainlit.cli", "chat.wiring", "vllm.v1.engine.async_llm")[:3 if model else 2]:
        importlib.import_module(module)
    conn.send("ready")
    try:
        front, listener, links = conn.recv()
    except (EOFError, OSError):  # the launcher is ending
        return
    multiprocessing.current_process().name = f"front-end-{front.index}"
    serve(front, listener, links)


def serve(front: FrontEnd, listener: socket.socket, links: dict) -> None:
    """One front end (a process the launcher spawned): the app's Chainlit server on the
    shared listening socket and on its own Unix socket, its engines attached to the cores."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; it sends SIGTERM
    # The run's folder, where the launcher writes its notes.
    signal.signal(LOST_SIGNAL, lambda signum, frame: cores_lost(front.folder))
    become(front)
    attach(links)
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):  # a front end's before it, in its place
        os.unlink(front.own_socket)
    own.bind(front.own_socket)
    own.listen(128)
    host, port = listener.getsockname()[:2]
    os.environ.update(CHAINLIT_HOST=str(host), CHAINLIT_PORT=str(port))
    os.chdir(ROOT)  # Chainlit reads .chainlit/ and chainlit.md from the folder it runs in
    sys.argv = ["chainlit", "run", "app.py", "--headless"]
    serve_on = uvicorn.Server.serve

    async def serve_both(server, sockets=None):  # Chainlit's CLI binds host:port itself
        return await serve_on(server, sockets=[listener, own])

    uvicorn.Server.serve = serve_both
    # Only now: Chainlit reads its config (.chainlit/, from the folder it runs in) on import.
    from chainlit.cli import run_chainlit

    run_chainlit(str(ROOT / "app.py"))


if __name__ == "__main__":  # through the module's own name, as the front ends import it
    from launcher import main as launch

    sys.exit(launch())
