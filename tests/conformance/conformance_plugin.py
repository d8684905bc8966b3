"""pytest plugin for vLLM's own OpenAI-server tests (tools/conformance.py runs them): its
`RemoteOpenAIServer` becomes a handle on an already-running server, nothing in vLLM's test
files is edited. Loaded with `-p conformance_plugin` from vLLM's extracted `tests/` tree
(not importable as our `tests` package: vLLM's is).

From the environment (set by tools/conformance.py):
  CONFORMANCE_URL        the running server's root, e.g. http://127.0.0.1:8000
  CONFORMANCE_KEY        the API key sent with every request to it
  CONFORMANCE_MODEL      the served model name the tests' own model names become
  CONFORMANCE_TOKENIZER  the served model's folder: the tests' tokenizer loads come from it
  CONFORMANCE_DESELECT   the reviewed list of tests that cannot apply (tests/conformance)

At run time, not in the files: every JSON request body to the server whose "model" is one of
the tests' model names gets CONFORMANCE_MODEL instead; requests without an Authorization
header get the key; `vllm.tokenizers.get_tokenizer` of a tests' model name loads the served
model's tokenizer; LoRA adapter downloads give an empty folder (the server ignores them: the
LoRA tests stay failing, on both servers alike).
"""

from __future__ import annotations

import json
import os
import tempfile


# The models vLLM's files name (their MODEL_NAME constants and parametrized names).
TEST_MODELS = {"Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-0.6B", "facebook/opt-125m",
               "Qwen/Qwen2-1.5B-Instruct", "HuggingFaceH4/zephyr-7b-beta",
               "openai-community/gpt2", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"}

URL = os.environ.get("CONFORMANCE_URL", "").rstrip("/")
KEY = os.environ.get("CONFORMANCE_KEY", "EMPTY")
MODEL = os.environ.get("CONFORMANCE_MODEL", "Latency-first")
TOKENIZER = os.environ.get("CONFORMANCE_TOKENIZER", "")


def _rewrite_body(body: bytes | None) -> bytes | None:
    if not body:
        return body
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if isinstance(data, dict) and data.get("model") in TEST_MODELS:
        data["model"] = MODEL
        return json.dumps(data).encode()
    return body


def _ours(url: str) -> bool:
    return bool(URL) and str(url).startswith(URL)


def _patch_httpx() -> None:
    import httpx

    def rebuilt(request: httpx.Request) -> httpx.Request:
        if not _ours(request.url):
            return request
        headers = dict(request.headers)
        headers.setdefault("authorization", f"Bearer {KEY}")
        if not request.stream or not isinstance(request.stream, httpx.ByteStream):
            body = None
        else:
            body = _rewrite_body(request.content)
        headers.pop("content-length", None)
        if body is None:
            try:
                body = request.content
            except httpx.RequestNotRead:
                return request
        return httpx.Request(request.method, request.url, headers=headers, content=body,
                             extensions=request.extensions)

    sync_send = httpx.HTTPTransport.handle_request
    async_send = httpx.AsyncHTTPTransport.handle_async_request

    def handle_request(self, request):
        return sync_send(self, rebuilt(request))

    async def handle_async_request(self, request):
        return await async_send(self, rebuilt(request))

    httpx.HTTPTransport.handle_request = handle_request
    httpx.AsyncHTTPTransport.handle_async_request = handle_async_request


def _patch_openai() -> None:
    """The openai package sends through its own HTTP layer (not httpx's transports): its
    request bodies are rewritten where it builds them."""
    from openai import _base_client

    build = _base_client.BaseClient._build_request

    def _build_request(self, options, *args, **kwargs):
        if _ours(str(self.base_url)):
            for body in (options.json_data, options.extra_json):
                if isinstance(body, dict) and body.get("model") in TEST_MODELS:
                    body["model"] = MODEL
        return build(self, options, *args, **kwargs)

    _base_client.BaseClient._build_request = _build_request


def _patch_requests() -> None:
    import requests.adapters

    send = requests.adapters.HTTPAdapter.send

    def patched(self, request, *args, **kwargs):
        if _ours(request.url):
            request.headers.setdefault("Authorization", f"Bearer {KEY}")
            if isinstance(request.body, (bytes, str)):
                raw = request.body.encode() if isinstance(request.body, str) else request.body
                body = _rewrite_body(raw)
                if body is not raw:
                    request.body = body
                    request.headers["Content-Length"] = str(len(body))
        return send(self, request, *args, **kwargs)

    requests.adapters.HTTPAdapter.send = patched


def _patch_tokenizers() -> None:
    import vllm.tokenizers

    original = vllm.tokenizers.get_tokenizer

    def get_tokenizer(tokenizer_name, *args, **kwargs):
        if TOKENIZER and str(tokenizer_name) in TEST_MODELS:
            tokenizer_name = TOKENIZER
        return original(tokenizer_name, *args, **kwargs)

    vllm.tokenizers.get_tokenizer = get_tokenizer


def _patch_lora_downloads() -> None:
    from vllm.transformers_utils import repo_utils

    original = repo_utils.hf_api

    class OfflineApi:
        def __init__(self, api):
            self._api = api

        def snapshot_download(self, repo_id, *args, **kwargs):
            if "lora" in repo_id.lower() or repo_id == "charent/self_cognition_Alice":
                return tempfile.mkdtemp(prefix="lora-")
            return self._api.snapshot_download(repo_id, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._api, name)

    repo_utils.hf_api = lambda *a, **k: OfflineApi(original(*a, **k))


class RunningServer:
    """What vLLM's `RemoteOpenAIServer` gives a test, for the server already running at
    CONFORMANCE_URL: the model and arguments it is constructed with are ignored."""

    DUMMY_API_KEY = KEY

    def __init__(self, model: str = "", vllm_serve_args=None, *args, **kwargs):
        if not URL:
            raise RuntimeError("CONFORMANCE_URL is not set: run tools/conformance.py")
        self.model, self.args = model, vllm_serve_args
        host_port = URL.split("://", 1)[1]
        self.host, _, port = host_port.partition(":")
        self.port = int(port or 80)
        self.show_hidden_metrics = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def url_root(self) -> str:
        return URL

    def url_for(self, *parts: str) -> str:
        return URL + "/" + "/".join(parts)

    def get_client(self, **kwargs):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=KEY, max_retries=0,
                                  **kwargs)


def pytest_configure(config):
    _patch_httpx()
    _patch_openai()
    _patch_requests()
    _patch_tokenizers()
    _patch_lora_downloads()
    import sys

    import tests.utils  # vLLM's

    for name in ("RemoteOpenAIServer", "RemoteOpenAIServerCustom", "RemoteVLLMServer"):
        original = getattr(tests.utils, name, None)
        if original is None:
            continue
        setattr(tests.utils, name, RunningServer)
        # A conftest on the command line's path is imported before this hook and may hold
        # the class by name already (responses/conftest.py does).
        for key, module in list(sys.modules.items()):
            if key.startswith("tests.") and vars(module).get(name) is original:
                setattr(module, name, RunningServer)


def _deselect_list() -> dict[str, str]:
    path = os.environ.get("CONFORMANCE_DESELECT")
    if not path or not os.path.exists(path):
        return {}
    out = {}
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test, _, reason = line.partition("  # ")
        out[test.strip()] = reason.strip()
    return out


def _map_model_configs(items) -> None:
    """A test module's own `ModelConfig(model=<a tests' model>)` (its vocabulary size) reads
    the served model's folder; replaced in the test modules only, not in vLLM."""
    if not TOKENIZER:
        return
    for module in {item.module for item in items if getattr(item, "module", None)}:
        original = getattr(module, "ModelConfig", None)
        if original is None or getattr(original, "_conformance", False):
            continue

        def mapped(*args, _original=original, **kwargs):
            if kwargs.get("model") in TEST_MODELS:
                kwargs["model"] = TOKENIZER
            if args and args[0] in TEST_MODELS:
                args = (TOKENIZER, *args[1:])
            return _original(*args, **kwargs)

        mapped._conformance = True
        module.ModelConfig = mapped


def pytest_collection_modifyitems(config, items):
    _map_model_configs(items)
    listed = _deselect_list()
    if not listed:
        return
    keep, drop = [], []
    for item in items:
        nodeid = item.nodeid.split("tests/entrypoints/openai/", 1)[-1]
        (drop if nodeid in listed or nodeid.split("[")[0] in listed else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report):
    """Each test's outcome as it happens (CONFORMANCE_LOG, JSON lines): a run cut short
    still tells what it got through."""
    path = os.environ.get("CONFORMANCE_LOG")
    if not path or (report.when != "call" and report.passed):
        return
    if report.when == "call" or report.failed or report.skipped:
        text = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)[-300:]
            text = text.strip().splitlines()[0][:300] if text.strip() else ""
        line = {"id": report.nodeid.split("tests/entrypoints/openai/", 1)[-1],
                "when": report.when, "outcome": report.outcome, "error": text,
                "duration_s": round(report.duration, 2)}
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
