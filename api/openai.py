"""An OpenAI-compatible API on the app's own engines, for scripts and tools:

    GET  /v1/models            each chat profile is a model (its name is the model id)
    POST /v1/chat/completions  streaming (server-sent events) or not

Requests share everything with the chat UI: the engines and their presets, the admission
line (a full line answers 429), the profile's limits (message length, max tokens,
temperature, system prompt length: over them answers 400 naming the limit) and the
metrics and per-turn log lines (chat/metrics.py). Every request needs a key
(`Authorization: Bearer ...`): the operator's `CHAT_API_KEY`, or an account's key
(`python -m store keys add NAME`); keys never reach the log. A client that goes away
mid-reply aborts its request in the engine. Errors come in OpenAI's shape:
{"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chat.input import check_message
from chat.metrics import TurnMetrics, TurnRecord
from engine import Busy, ChatError, ConfigError, Engines, Message, Profile, TurnStats
from engine.config import Config

ROLES = ("system", "user", "assistant")
DISCONNECT_POLL_S = 0.5


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind,
                                       "code": self.code}}, status_code=self.status)


def refusal(exc: ChatError) -> ApiError:
    """An engine-side refusal as an HTTP answer: busy 429, not serving 503, else 400."""
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), "rate_limit_error", "busy")
    if isinstance(exc, ConfigError) or type(exc) is ChatError:
        return ApiError(400, str(exc))
    return ApiError(503, str(exc), "server_error", "unavailable")


class OpenAIApi:
    """The routes, bound to the app's engines, config, turn metrics and key check.
    `account_of(key)` answers the account a key acts as (None: not a key)."""

    def __init__(self, engines: Engines, config: Config, turns: TurnMetrics,
                 account_of: Callable[[str], Awaitable[str | None]],
                 operator_key: str | None, ignore_eos: bool = False):
        self.engines, self.config, self.turns = engines, config, turns
        self.account_of, self.operator_key = account_of, operator_key
        self.ignore_eos = ignore_eos  # benchmarks only, as in the chat (VCHAT_BENCH_IGNORE_EOS)
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/models", self.models, methods=["GET"])
        self.router.add_api_route("/chat/completions", self.chat_completions,
                                  methods=["POST"])

    async def models(self, request: Request) -> Response:
        try:
            await self.caller(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [
            {"id": p.name, "object": "model", "created": 0, "owned_by": "vchat"}
            for p in self.config.profiles]})

    async def chat_completions(self, request: Request) -> Response:
        try:
            user = await self.caller(request)
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "The request body is not JSON.") from None
            profile, turn = self.read(body)
        except ApiError as exc:
            return exc.response()
        record = TurnRecord("failed", user, profile.name, message=turn["new"].content)
        self.turns.begin(profile.name)
        call = Call(self, request, profile, turn, record)
        if body.get("stream"):
            return await call.streamed(bool((body.get("stream_options") or {}).get(
                "include_usage")))
        return await call.whole()

    async def caller(self, request: Request) -> str:
        """Who is asking: "operator" for CHAT_API_KEY, else the key's account; else 401."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key:
            if self.operator_key and secrets.compare_digest(key.encode(),
                                                            self.operator_key.encode()):
                return "operator"
            account = await self.account_of(key)
            if account is not None:
                return account
        raise ApiError(401, "A valid API key is needed: 'Authorization: Bearer KEY'.",
                       "authentication_error", "invalid_api_key")

    def read(self, body) -> tuple[Profile, dict]:
        """The request checked against the profile's limits: (profile, the turn's parts)."""
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        names = [p.name for p in self.config.profiles]
        if body.get("model") not in names:
            raise ApiError(404, f"Unknown model {body.get('model')!r}; this server has: "
                           f"{', '.join(names)}.", code="model_not_found")
        profile = self.config.profile(body["model"])
        limits, sampling = profile.limits, profile.sampling
        if body.get("n", 1) != 1:
            raise ApiError(400, "Only n=1 is supported.")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list.")
        system, history = [], []
        for n, item in enumerate(messages):
            role = item.get("role") if isinstance(item, dict) else None
            if role not in ROLES:
                raise ApiError(400, f"messages[{n}].role must be one of {', '.join(ROLES)}.")
            text = content_text(item.get("content"), f"messages[{n}].content")
            (system if role == "system" else history).append(Message(role, text))
        if not history or history[-1].role != "user":
            raise ApiError(400, "The last message must be the user's.")
        try:
            new = check_message(history[-1].content, limits.message_chars)
        except ChatError as exc:
            raise ApiError(400, str(exc), code="message_refused") from None
        system_prompt = "\n\n".join(m.content for m in system) or profile.system_prompt
        if len(system_prompt) > limits.system_prompt_chars:
            raise ApiError(400, f"The system prompt is {len(system_prompt):,} characters; "
                           f"{profile.name} takes at most {limits.system_prompt_chars:,}.")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens",
                                                                sampling.max_tokens))
        temperature = body.get("temperature", sampling.temperature)
        top_p = body.get("top_p", sampling.top_p)
        seed = body.get("seed")
        within("max_tokens", max_tokens, int, 1, limits.max_tokens, profile)
        within("temperature", temperature, (int, float), 0, limits.temperature, profile)
        within("top_p", top_p, (int, float), 0, 1, profile)
        if seed is not None:
            within("seed", seed, int, 0, 2**63 - 1, profile)
        return profile, {"history": history[:-1], "new": Message("user", new.text),
                         "system_prompt": system_prompt, "max_tokens": max_tokens,
                         "sampling": {"temperature": float(temperature),
                                      "top_p": float(top_p), "seed": seed}}


def content_text(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (other kinds are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where} must be text (a string or a list of text parts).")


def within(name: str, value, kind, lo, hi, profile: Profile) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be a number from {lo} to {hi} for "
                       f"{profile.name}, got {value!r}.")


class Call:
    """One chat completion: fitted, answered on the profile's engine, counted once."""

    def __init__(self, api: OpenAIApi, request: Request, profile: Profile, turn: dict,
                 record: TurnRecord):
        self.api, self.request, self.profile, self.turn = api, request, profile, turn
        self.record, self.stats = record, None
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.reply: list[str] = []

    def items(self) -> AsyncIterator[str | TurnStats]:
        prompt = self.api.engines.fit(self.profile.name, self.turn["history"], self.turn["new"],
                                      system_prompt=self.turn["system_prompt"],
                                      max_tokens=self.turn["max_tokens"])
        return self.api.engines.stream(prompt, self.profile.name, ignore_eos=self.api.ignore_eos,
                                       **self.turn["sampling"])

    def end(self, outcome: str) -> None:
        self.record.outcome = outcome
        self.record.reply = "".join(self.reply)
        self.api.turns.end(self.record, self.stats)

    async def whole(self) -> Response:
        try:
            await until_gone(self.request, self._collect())
        except ChatError as exc:
            self.end("refused")
            return refusal(exc).response()
        except ClientGone:
            self.end("stopped")
            return Response(status_code=499)
        except Exception:
            self.end("failed")
            raise
        self.end("finished")
        return JSONResponse({
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.profile.name,
            "choices": [{"index": 0, "finish_reason": self.stats.finish_reason,
                         "message": {"role": "assistant", "content": "".join(self.reply)}}],
            "usage": self.usage()})

    async def _collect(self) -> None:
        async for item in self.items():
            if isinstance(item, TurnStats):
                self.stats = item
            else:
                self.reply.append(item)

    async def streamed(self, include_usage: bool) -> Response:
        """Server-sent events. The first piece is awaited before answering, so a refusal
        (busy, not serving, too long) is still an HTTP status, not an event."""
        items = self.items_or_refusal()
        try:
            first = await until_gone(self.request, anext(items))
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            await items.aclose()
            self.end("stopped")
            return Response(status_code=499)
        return StreamingResponse(self.events(first, items, include_usage),
                                 media_type="text/event-stream")

    async def items_or_refusal(self) -> AsyncIterator[str | TurnStats]:
        try:
            async for item in self.items():
                yield item
        except ChatError as exc:
            self.end("refused")
            raise refusal(exc) from None

    async def events(self, first, items, include_usage: bool) -> AsyncIterator[str]:
        # Leaving early (the client went away: Starlette cancels this generator) closes
        # `items`, which aborts the request in the engine.
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            item = first
            while True:
                if isinstance(item, TurnStats):
                    self.stats = item
                else:
                    self.reply.append(item)
                    yield self.chunk({"content": item})
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    break
            yield self.chunk({}, self.stats.finish_reason)
            if include_usage:
                yield sse({**self.head("chat.completion.chunk"), "choices": [],
                           "usage": self.usage()})
            yield "data: [DONE]\n\n"
            self.end("finished")
        except ApiError as exc:  # refused mid-stream (the engine died): said as an event
            yield sse({"error": {"message": str(exc), "type": exc.kind, "code": exc.code}})
        except (asyncio.CancelledError, GeneratorExit):
            self.end("stopped")
            raise
        except Exception:
            self.end("failed")
            raise
        finally:
            await items.aclose()

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.profile.name}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> str:
        return sse({**self.head("chat.completion.chunk"), "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    def usage(self) -> dict:
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.output_tokens,
                "total_tokens": s.prompt_tokens + s.output_tokens}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class ClientGone(Exception):
    """The client closed its connection before the answer."""


async def until_gone(request: Request, awaitable):
    """`awaitable`'s result, or ClientGone (and it cancelled: the engine's request aborted)
    when the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
