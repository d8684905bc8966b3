"""The product past one machine, on this one: app replicas on one PostgreSQL behind HAProxy
(deploy/haproxy-app.cfg), their presets on `vllm serve` processes behind a router that
keeps each chat on one server: a second HAProxy (deploy/haproxy-models.cfg) or vLLM Router
(deploy/model-router.sh, `model_router="vllm-router"`). The configuration files
are the shipped ones; only addresses differ. For tests/test_deploy.py and
bench/replicas.py.

    async with Deployment(folder, database_url, replicas=2, model_servers=2) as site:
        ChatClient(site.url, "Latency-first", cookies=site.pin(0))   # through the proxy
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tools.vllm_server import VllmServer
from engine.model import resolve_model
from tools.chainlit_client import ROOT, TEST_PASSWORD, TEST_USER, Server, free_port
from tools.header_log import log_path

DEPLOY = ROOT / "deploy"
SERVED = "smol"  # the name the model servers serve the embedded model under
MAX_MODEL_LEN = 2048
REPLICA_COOKIE = "chat_replica"  # deploy/haproxy-app.cfg's


def haproxy_binary() -> str | None:
    """Debian's haproxy (/usr/sbin, not on every PATH), else None."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None)


class Haproxy:
    """`haproxy -f CONFIG` in the foreground, its own process group, the config's
    addresses from `addresses` (its ${...} variables)."""

    def __init__(self, config: Path, addresses: dict, log_path: Path):
        self.config, self.log_path = config, log_path
        self.env = {**os.environ, **addresses}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = haproxy_binary()
        if binary is None:
            raise FileNotFoundError("no haproxy installed (Debian: haproxy)")
        check = subprocess.run([binary, "-c", "-f", str(self.config)], env=self.env,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused {self.config}: {check.stdout}{check.stderr}")
        self.proc = subprocess.Popen([binary, "-db", "-f", str(self.config)], env=self.env,
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class ModelRouter(Haproxy):
    """deploy/model-router.sh (vLLM Router) in the foreground, its own process group, with
    `addresses` (MODELS, ROUTER_PORT, ROUTER_METRICS_PORT) in its environment."""

    def __init__(self, addresses: dict, log_path: Path):
        super().__init__(DEPLOY / "model-router.sh", {
            "VLLM_ROUTER": str(Path(sys.executable).with_name("vllm-router")),
            "ROUTER_HOST": "127.0.0.1", **addresses}, log_path)

    def start(self) -> None:
        self.proc = subprocess.Popen(["sh", str(self.config)], env=self.env,
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)


async def wait_for(url: str, proxy: Haproxy, timeout: float = 60.0) -> None:
    """Until GET url (through `proxy`) answers 200."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proxy.proc.poll() is not None:
                raise RuntimeError(f"{proxy.config.name} exited: "
                                   f"{proxy.log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url, timeout=5)).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


def two(addresses: list[str]) -> list[str]:
    """The shipped configs name two servers: one process stands for both when alone."""
    return (addresses * 2)[:2]


class Deployment:
    """Everything started by `__aenter__` (model servers first, then the replicas all at
    once on `database_url`, which may be empty), and stopped on leaving."""

    def __init__(self, folder: Path, database_url: str, replicas: int = 2,
                 model_servers: int = 2, extra_env: dict | None = None,
                 model_router: str = "haproxy"):
        self.folder, self.database_url = Path(folder), database_url
        self.n_replicas, self.n_models = replicas, model_servers
        self.model_router = model_router  # "haproxy" or "vllm-router" (deploy/)
        self.extra_env = extra_env or {}
        self.models: list[VllmServer] = []
        self.replicas: list[Server] = []
        self.model_proxy: Haproxy | None = None
        self.app_proxy: Haproxy | None = None  # in front of every replica, at self.url
        self.proxies: list[Haproxy] = []  # every app proxy
        self.models_url = self.url = ""
        self.header_logs: list[Path] = []

    async def __aenter__(self) -> "Deployment":
        try:
            await self._start_models()
            await self._start_replicas()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop()

    async def _start_models(self) -> None:
        model = await asyncio.to_thread(resolve_model, "embedded")
        cores = os.cpu_count() or 1
        for i in range(self.n_models):
            self.models.append(VllmServer(
                {"model": model, "dtype": "float16", "enforce_eager": True,
                 "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True},
                {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                 # Alone: every core. Several: each its own core while there are enough
                 # (two servers on the same cores slow each other down far more).
                 **({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if self.n_models == 1 else
                    {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)})},
                SERVED, extra_flags=("--middleware", "tools.header_log.record")))
        for server in self.models:
            self.header_logs.append(log_path(server.port))
            self.header_logs[-1].unlink(missing_ok=True)  # a port used before
            server.start()
        await asyncio.gather(*(s.wait_ready() for s in self.models))
        port = free_port()
        self.models_url = f"http://127.0.0.1:{port}"
        if self.model_router == "vllm-router":
            self.model_proxy = ModelRouter({
                "MODELS": " ".join(s.url for s in self.models), "ROUTER_PORT": str(port),
                "ROUTER_METRICS_PORT": str(free_port())}, self.folder / "model-router.log")
        else:
            self.model_proxy = Haproxy(DEPLOY / "haproxy-models.cfg", {
                "MODELS_BIND": f"127.0.0.1:{port}",
                **dict(zip(("MODEL1", "MODEL2"),
                           two([s.url.removeprefix("http://") for s in self.models])))},
                self.folder / "haproxy-models.log")
        self.model_proxy.start()
        await wait_for(self.models_url + "/health", self.model_proxy)

    def profiles(self) -> Path:
        """deploy/profiles.yaml with this machine's router, served name and tokenizer."""
        data = yaml.safe_load((DEPLOY / "profiles.yaml").read_text())
        data["model"] = "embedded"
        for preset in data["presets"].values():
            preset["remote"].update(base_url=self.models_url + "/v1", model=SERVED)
        for profile in data["profiles"]:
            profile["sampling"]["max_tokens"] = 24
        path = self.folder / "profiles.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    async def _start_replicas(self) -> None:
        shared = {"DATABASE_URL": self.database_url, "VCHAT_PROFILES": str(self.profiles()),
                  "CHAINLIT_AUTH_SECRET": secrets.token_urlsafe(48),
                  "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD,
                  **self.extra_env}
        for i in range(self.n_replicas):  # each its own data folder, as on its own machine
            data = self.folder / f"replica{i + 1}"
            data.mkdir(exist_ok=True)
            self.replicas.append(Server({**shared, "VCHAT_DATA_DIR": str(data)}))
        await asyncio.gather(*(r.wait_ready() for r in self.replicas))
        self.app_proxy, self.url = await self.add_proxy(range(self.n_replicas))

    async def add_proxy(self, replicas) -> tuple[Haproxy, str]:
        """One more app proxy (deploy/haproxy-app.cfg) in front of the replicas numbered
        `replicas` (0-based), up; it and its URL (stopped with the rest)."""
        port = free_port()
        proxy = Haproxy(DEPLOY / "haproxy-app.cfg", {
            "APP_BIND": f"127.0.0.1:{port}",
            **dict(zip(("APP1", "APP2"),
                       two([f"127.0.0.1:{self.replicas[i].port}" for i in replicas])))},
            self.folder / f"haproxy-app-{port}.log")
        proxy.start()
        self.proxies.append(proxy)
        url = f"http://127.0.0.1:{port}"
        await wait_for(url + "/health", proxy)
        return proxy, url

    async def restart_replica(self, replica: int) -> None:
        """Start replica `replica` again (after it was killed) on its port; the proxy takes
        it back once its health check passes twice."""
        old = self.replicas[replica]
        old.stop()
        self.replicas[replica] = Server(old.env, base_env={}, port=old.port)
        await self.replicas[replica].wait_ready()
        await asyncio.sleep(3)  # deploy/haproxy-app.cfg: checked each second, up after two

    @staticmethod
    def pin(replica: int) -> dict:
        """The proxy's cookie that sends a browser to replica `replica` (0-based)."""
        return {REPLICA_COOKIE: f"app{replica + 1}"}

    def stop(self) -> None:
        for part in [*self.proxies, *self.replicas, self.model_proxy, *self.models]:
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
