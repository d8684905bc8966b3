"""A preset whose model runs on an OpenAI-compatible server (say a `vllm serve` fleet behind
a load balancer) instead of in this process: `remote:` in profiles.yaml.

Same surface as `PresetEngine` (llm.py), so `Engines` routes turns to it unchanged: the app
keeps the history, the limits and the line of waiting turns; the server runs the model.
The history is fitted here with the model's tokenizer (the top-level `model:`, or the
remote block's `tokenizer:`), which must be the one the server runs. Closing or cancelling
a stream closes its HTTP response, and vLLM's server aborts the request.

A server that cannot be reached is not a dead engine: nothing here restarts it. Its turns
get a clear message, /ready says so, and turns work again once the server is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

import httpx
import openai

from .base import Engine
from .chat_format import ChatFormatter
from .config import Remote
from .decoding import Decoding, Piece, remote_logprobs
from .errors import Busy, ChatError, ConfigError, Unavailable
from .history import Prompt, check_fits
from .stats import TurnStats

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0  # the longest silence in a reply (a busy fleet's own queue)
CHECK_TIMEOUT_S = 3.0  # GET /models, at start and as the health check
HEALTH_CACHE_S = 1.0  # /ready and every open page's /notice ask: the server hears once a second
START_RETRY_S = (1, 2, 4, 8, 15, 30)  # between attempts while the server cannot be reached
UNREACHABLE = ("The model server for this chat cannot be reached right now. Please try again "
               "in a minute.")
BROKEN_OFF = ("The model server for this chat stopped answering during this reply. Please "
              "send your message again in a minute.")
BUSY = "The model server for this chat is busy right now. Please try again in a minute."
REFUSED = ("The model server for this chat could not answer this message (the operator's log "
           "says why). Please try again later.")
_CLOSING: set[asyncio.Task] = set()  # clients being closed after shutdown, referenced till done


class Unreachable(Exception):
    """The server did not answer, or answered that it cannot serve now (5xx)."""


class RemoteEngine(Engine):
    """Turns of one preset on a remote OpenAI-compatible server, with the chat formatting
    of its model here. The server's scheduler is not ours to see (no step stats), nor the
    server ours to restart."""

    restartable = False

    def __init__(self, preset: str, remote: Remote, tokenizer: str | None = None):
        super().__init__(preset)
        self.remote = remote
        self.tokenizer = remote.tokenizer or tokenizer  # a folder or hub id
        self._client: openai.AsyncOpenAI | None = None  # turns
        self._http: httpx.AsyncClient | None = None  # GET /models
        self._unfinished = 0
        self._healthy, self._checked_at = False, float("-inf")
        self._health_lock = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until the server answers and serves the model, then load the tokenizer.
        A server that answers "no" (unknown model, key refused) is an error at once."""
        started = time.monotonic()
        key = self._api_key()
        self._http = httpx.AsyncClient(
            timeout=CHECK_TIMEOUT_S, headers={"Authorization": f"Bearer {key}"} if key else {})
        log.info("Starting remote engine %r: %s at %s", self.preset, self.remote.model,
                 self.remote.base_url)
        try:
            served = await self._wait_for_server()
            self.max_model_len = self._context(served)
            tokenizer = await asyncio.to_thread(self._load_tokenizer)
            self._formatter = ChatFormatter(tokenizer)
        except BaseException:
            self.shutdown()
            raise
        self._client = openai.AsyncOpenAI(
            base_url=self.remote.base_url, api_key=key or "none", max_retries=1,
            timeout=openai.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self._healthy, self._checked_at = True, time.monotonic()
        self.started_in_s = time.monotonic() - started
        log.info("Remote engine %r ready in %.1f s (max_model_len %d, %d seats)", self.preset,
                 self.started_in_s, self.max_model_len, self.max_num_seqs)

    def _api_key(self) -> str | None:
        name = self.remote.api_key_env
        if name is None:
            return None
        if not os.environ.get(name):
            raise ConfigError("environment", name,
                              f"not set; presets.{self.preset}.remote.api_key_env names it as "
                              "the variable holding the model server's API key")
        return os.environ[name]

    async def _wait_for_server(self) -> dict:
        for attempt in itertools.count():
            try:
                return await self._served_model()
            except Unreachable as exc:
                wait = START_RETRY_S[min(attempt, len(START_RETRY_S) - 1)]
                log.warning("Remote engine %r: the model server at %s cannot be reached (%s); "
                            "next try in %d s", self.preset, self.remote.base_url, exc, wait)
                await asyncio.sleep(wait)

    async def _served_model(self) -> dict:
        """The model's entry in the server's GET /models."""
        url = f"{self.remote.base_url}/models"
        try:
            answer = await self._http.get(url)
        except httpx.HTTPError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        if answer.status_code >= 500:
            raise Unreachable(f"HTTP {answer.status_code}")
        if answer.status_code in (401, 403):
            raise ChatError(f"The model server at {url} refused this app's API key (HTTP "
                            f"{answer.status_code}); check presets.{self.preset}.remote."
                            "api_key_env and the variable it names.")
        try:
            answer.raise_for_status()
            models = {m["id"]: m for m in answer.json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ChatError(f"The model server at {url} did not answer like an OpenAI-"
                            f"compatible API ({type(exc).__name__}: {exc}).") from exc
        if self.remote.model not in models:
            raise ChatError(f"The model server at {url} does not serve "
                            f"{self.remote.model!r}; it serves {', '.join(models) or 'none'} "
                            f"(presets.{self.preset}.remote.model).")
        return models[self.remote.model]

    def _context(self, served: dict) -> int:
        """The context length: the remote block's, at most the server's own."""
        own, wanted = served.get("max_model_len"), self.remote.max_model_len
        if not isinstance(own, int):
            if wanted is None:
                raise ChatError(f"The model server at {self.remote.base_url} does not say "
                                "its context length (max_model_len in /models); set "
                                f"presets.{self.preset}.remote.max_model_len.")
            return wanted
        if wanted is not None and wanted > own:
            log.warning("Remote engine %r: max_model_len %d is over the server's %d; using "
                        "the server's", self.preset, wanted, own)
        return min(wanted or own, own)

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.tokenizer)
        except Exception as exc:  # offline, unknown id, not a tokenizer folder, ...
            raise ChatError(
                f"The tokenizer for preset {self.preset!r} could not be loaded from "
                f"{self.tokenizer!r} ({type(exc).__name__}). Set `tokenizer:` in its remote "
                "block to a local folder or hub id of the model the server runs.") from exc

    def shutdown(self) -> None:
        clients = [c for c in (self._client, self._http) if c is not None]
        self._client = self._http = self._formatter = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop left: the process is ending, and the sockets with it
            return
        for client in clients:
            task = loop.create_task(client.close() if isinstance(client, openai.AsyncOpenAI)
                                    else client.aclose())
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)

    @property
    def running(self) -> bool:
        """Started and not shut down: an unreachable server does not stop it (module doc)."""
        return self._client is not None

    @property
    def max_num_seqs(self) -> int:
        """How many turns this app sends the server at once (its admission seats)."""
        return self.remote.max_num_seqs

    async def check_health(self) -> bool:
        """Whether the server answers and serves the model: one GET /models a second at
        most, whoever asks."""
        if self._http is None:
            return False
        async with self._health_lock:
            if time.monotonic() - self._checked_at >= HEALTH_CACHE_S:
                try:
                    await self._served_model()
                    healthy = True
                except (Unreachable, ChatError):
                    healthy = False
                self._note_health(healthy)
        return self._healthy

    def _note_health(self, healthy: bool) -> None:
        if healthy != self._healthy:
            log.log(logging.INFO if healthy else logging.ERROR,
                    "Remote engine %r: the model server at %s is %s", self.preset,
                    self.remote.base_url, "back" if healthy else "unreachable")
        self._healthy, self._checked_at = healthy, time.monotonic()

    def num_unfinished_requests(self) -> int:
        """Turns this process has in flight on the server."""
        return self._unfinished

    # -- turns -------------------------------------------------------------------------

    async def stream(self, prompt: Prompt, *, temperature: float, top_p: float,
                     ignore_eos: bool = False, seed: int | None = None, priority: int = 0,
                     preset: str | None = None, session: str | None = None,
                     decoding: Decoding | None = None,
                     on_finished: Callable[[], None] | None = None
                     ) -> AsyncIterator[str | Piece | TurnStats]:
        """Yield text deltas, then one TurnStats (`on_finished()` once the server's stream
        has ended, before the stats). Leaving early closes the HTTP stream, which makes the
        server abort the request. `priority` is the server's own matter;
        `session` goes in the remote block's `session_header`, for a router in front of
        several servers to keep a chat on one of them (and its prefix cache warm); a
        `decoding` goes as the request's own fields (vLLM's server's)."""
        client = self._client
        if client is None:
            raise self.not_running()
        check_fits(prompt, self.max_model_len)
        if decoding is not None and decoding.prompt_logprobs is not None:
            # The server is asked for a stream, and vLLM gives prompt_logprobs in none.
            raise ChatError("This model runs on a remote server, which cannot return "
                            "'prompt_logprobs'; leave it out.")
        request_id = f"chat-{uuid.uuid4().hex}"
        started = time.monotonic()
        ttft, pieces, usage, finish, stream, done = None, 0, None, "abort", None, False
        self._unfinished += 1
        try:
            # The fitted prompt as token ids, not the messages: the server runs exactly what
            # was counted here, and cannot read a typed "<|im_end|>" as a control token (a
            # chat completion would apply the template to the text and re-encode it).
            fields = decoding.completion_fields() if decoding else {"extra_body": {}}
            if ignore_eos:
                fields["extra_body"]["ignore_eos"] = True  # vLLM's own field
            stream = await client.completions.create(
                model=self.remote.model, prompt=prompt.token_ids, stream=True,
                stream_options={"include_usage": True}, max_tokens=prompt.max_tokens,
                temperature=temperature, top_p=top_p, seed=seed,
                extra_headers=self._headers(request_id, session), **fields)
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if choice.text and ttft is None:
                        ttft = time.monotonic() - started
                    pieces += bool(choice.text)
                    if choice.finish_reason and choice.index == 0:
                        finish = choice.finish_reason
                    if decoding is not None and (choice.text or choice.finish_reason):
                        ids = getattr(choice, "token_ids", None)  # return_token_ids
                        yield Piece(choice.index, choice.text, remote_logprobs(
                            choice.logprobs, decoding.reported() or 0), choice.finish_reason,
                            None if ids is None else tuple(ids))
                    elif choice.text:
                        yield choice.text
            done = True
            if on_finished is not None:
                on_finished()
        except openai.APIError as exc:
            done = True  # the server ended it
            message, unreachable = _explain(exc, answered=pieces > 0)
            if unreachable:
                self._note_health(False)
            log.error("remote turn %s preset=%s failed after %d pieces at %s: %s: %s",
                      request_id, self.preset, pieces, self.remote.base_url,
                      type(exc).__name__, exc)
            raise (Unavailable if unreachable else Busy if message == BUSY else ChatError)(
                message) from exc
        finally:
            self._unfinished -= 1
            if stream is not None and not done:  # cancelled or closed early
                with contextlib.suppress(Exception):  # the server sees us go and aborts
                    await stream.close()
                log.debug("turn %s preset=%s aborted after %d pieces", request_id, self.preset,
                          pieces)
        self._note_health(True)
        stats = TurnStats(request_id, preset or self.preset,
                          usage.prompt_tokens if usage else prompt.prompt_tokens,
                          usage.completion_tokens if usage else pieces, ttft,
                          time.monotonic() - started, finish)
        log.debug("turn %s preset=%s remote in=%d out=%d ttft=%s tok/s=%.1f finish=%s",
                  request_id, self.preset, stats.prompt_tokens, stats.output_tokens,
                  f"{ttft * 1000:.0f}ms" if ttft is not None else "-", stats.tokens_per_s,
                  finish)
        yield stats


    def _headers(self, request_id: str, session: str | None) -> dict:
        headers = {"X-Request-Id": request_id}
        if session and self.remote.session_header:
            headers[self.remote.session_header] = session
        return headers


def _explain(exc: openai.APIError, answered: bool) -> tuple[str, bool]:
    """What the user is told about a failed request, and whether the server is out of reach
    (no answer, or a 5xx from it or its load balancer)."""
    status = getattr(exc, "status_code", None)
    if isinstance(exc, openai.APIConnectionError) or (status is not None and status >= 500):
        return (BROKEN_OFF if answered else UNREACHABLE), True
    if status == 429:
        return BUSY, False
    return REFUSED, False
