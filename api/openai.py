"""An OpenAI-compatible API on the app's own engines, for scripts and tools:

    GET  /v1/models            each chat profile is a model (its name is the model id)
    POST /v1/chat/completions  streaming (server-sent events) or not

Requests share everything with the chat UI: the engines and their presets, the admission
line (a full line answers 429), the profile's limits (message length, max tokens,
temperature, system prompt length: over them answers 400 naming the limit) and the
metrics and per-turn log lines (service/turn_metrics.py). Every request needs a key
(`Authorization: Bearer ...`): the operator's `VCHAT_API_KEY`, or an account's key
(`python -m store keys add NAME`); keys never reach the log. A client that goes away
mid-reply aborts its request in the engine. Errors come in OpenAI's shape:
{"error": {"message", "type", "code"}}, for every bad input a 4xx (issue 26 found 500s).

A request is read and checked in api/requests.py; a large one is read and fitted in a
worker thread, and only the newest turns that can fit are tokenized (engine/history.py), so
it does not stall other users' streams (bench/big_request.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.requests import ApiError, read_body, session_key
from engine import Busy, ChatError, ConfigError, Engines, Profile, Prompt
from engine.config import Config
from service.turn import Stopped, Turn
from service.turn_metrics import TurnMetrics
from store.usage import Usage

log = logging.getLogger(__name__)

OPERATOR = "operator"  # the turn log's user for the operator's key (VCHAT_API_KEY)

DISCONNECT_POLL_S = 0.5
INLINE_BYTES = 64 * 1024  # larger requests are read and fitted in a worker thread


async def off_the_loop(size: int, work, *args):
    """`work(*args)`, in a worker thread for a large request: reading and fitting a
    history of megabytes on the event loop stalled every user's stream (issue 26)."""
    if size <= INLINE_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


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
                 operator_key: str | None, usage: Usage, ignore_eos: bool = False):
        self.engines, self.config, self.turns = engines, config, turns
        self.usage = usage  # each turn's cost stored, an account's quota checked
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
            account = await self.caller(request)
            if refused := await self.usage.refusal(account):
                raise ApiError(429, refused, "insufficient_quota", "quota_exceeded")
            session = session_key(request)
            raw = await request.body()  # at most VCHAT_API_MAX_BODY_MB (chat/guard.py)
            profile, asked = await off_the_loop(len(raw), read_body, raw, self.config)
        except ApiError as exc:
            return exc.response()
        turn = Turn(self.engines, self.turns, profile.name,
                    user=OPERATOR if account is None else account,
                    message=asked["new"].content, ignore_eos=self.ignore_eos,
                    usage=self.usage, source="api", account=account, session=session)
        call = Call(request, profile, asked, turn)
        try:
            call.prompt = await off_the_loop(len(raw), call.fit)
        except ChatError as exc:  # too long for the context, the engine not serving
            turn.end(exc)
            return refusal(exc).response()
        except Exception as exc:
            return call.failed(exc)
        if asked["stream"]:
            return await call.streamed(asked["include_usage"])
        return await call.whole()

    async def caller(self, request: Request) -> str | None:
        """Who is asking: the key's account, or None for VCHAT_API_KEY (no account, no
        quota; its turns are logged as OPERATOR's); else 401."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key:
            if self.operator_key and secrets.compare_digest(key.encode(),
                                                            self.operator_key.encode()):
                return None
            account = await self.account_of(key)
            if account is not None:
                return account
        raise ApiError(401, "A valid API key is needed: 'Authorization: Bearer KEY'.",
                       "authentication_error", "invalid_api_key")

class Call:
    """One chat completion in OpenAI's shapes; its turn (service/turn.py) fits, streams and
    counts it."""

    def __init__(self, request: Request, profile: Profile, asked: dict, turn: Turn):
        self.request, self.profile, self.asked, self.turn = request, profile, asked, turn
        self.prompt: Prompt | None = None
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.reply: list[str] = []

    def fit(self) -> Prompt:
        return self.turn.fit(self.asked["history"], self.asked["new"],
                             system_prompt=self.asked["system_prompt"],
                             max_tokens=self.asked["max_tokens"])

    def items(self) -> AsyncIterator[str]:
        return self.turn.stream(self.prompt, **self.asked["sampling"])

    def end(self, exc: BaseException | None = None) -> None:
        self.turn.reply = "".join(self.reply)
        self.turn.end(exc)

    def failed(self, exc: BaseException) -> Response:
        """An unexpected error: logged with its trace (service/turn.py), answered in words."""
        self.end(exc)
        return ApiError(500, "Something went wrong on our side; it has been logged. "
                        "Please try again.", "server_error").response()

    async def whole(self) -> Response:
        try:
            await until_gone(self.request, self._collect())
        except ChatError as exc:
            self.end(exc)
            return refusal(exc).response()
        except ClientGone as exc:
            self.end(exc)
            return Response(status_code=499)
        except Exception as exc:
            return self.failed(exc)
        self.end()
        return JSONResponse({
            **self.head("chat.completion"),
            "choices": [{"index": 0, "finish_reason": self.turn.stats.finish_reason,
                         "message": {"role": "assistant", "content": "".join(self.reply)}}],
            "usage": self.usage()})

    async def _collect(self) -> None:
        async for text in self.items():
            self.reply.append(text)

    async def streamed(self, include_usage: bool) -> Response:
        """Server-sent events. The first piece is awaited before answering, so a refusal
        (busy, not serving, too long) is still an HTTP status, not an event."""
        items = self.items_or_refusal()
        try:
            first = await until_gone(self.request, first_of(items))
        except ApiError as exc:
            return exc.response()
        except ClientGone as exc:
            await items.aclose()
            self.end(exc)
            return Response(status_code=499)
        except Exception as exc:
            await items.aclose()
            return self.failed(exc)
        return StreamingResponse(self.events(first, items, include_usage),
                                 media_type="text/event-stream")

    async def items_or_refusal(self) -> AsyncIterator[str]:
        try:
            async for text in self.items():
                yield text
        except ChatError as exc:
            self.end(exc)
            raise refusal(exc) from None

    async def events(self, first: str | None, items, include_usage: bool
                     ) -> AsyncIterator[str]:
        # Leaving early (the client went away: Starlette cancels this generator) closes
        # `items`, which aborts the request in the engine.
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            text = first
            while text is not None:
                self.reply.append(text)
                yield self.chunk({"content": text})
                text = await first_of(items)
            yield self.chunk({}, self.turn.stats.finish_reason)
            if include_usage:
                yield sse({**self.head("chat.completion.chunk"), "choices": [],
                           "usage": self.usage()})
            yield "data: [DONE]\n\n"
            self.end()
        except ApiError as exc:  # refused mid-stream (the engine died): said as an event
            yield sse({"error": {"message": str(exc), "type": exc.kind, "code": exc.code}})
        except (asyncio.CancelledError, GeneratorExit) as exc:
            self.end(exc)
            raise
        except Exception as exc:
            self.end(exc)
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
        s = self.turn.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.output_tokens,
                "total_tokens": s.prompt_tokens + s.output_tokens}


async def first_of(items: AsyncIterator[str]) -> str | None:
    """The next piece, or None once there is none."""
    try:
        return await anext(items)
    except StopAsyncIteration:
        return None


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class ClientGone(Stopped):
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
