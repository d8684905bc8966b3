"""One API request answered in OpenAI's shapes (api/openai.py routes it here): its turn
(service/turn.py) fits, streams and counts it; `Choices` (choices.py) assembles the reply,
whole as JSON or as server-sent events. `CompletionCall` (completions.py) is the legacy
completion's variant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api.choices import Choices
from api.errors import ApiError
from engine import Busy, ChatError, ConfigError, Profile, Prompt
from engine.decoding import Piece
from service.turn import Stopped, Turn

DISCONNECT_POLL_S = 0.5


def refusal(exc: ChatError) -> ApiError:
    """An engine-side refusal as an HTTP answer: busy 429, not serving 503, else 400."""
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), "rate_limit_error", "busy")
    if isinstance(exc, ConfigError) or type(exc) is ChatError:
        return ApiError(400, str(exc))
    return ApiError(503, str(exc), "server_error", "unavailable")


class Call:
    """One chat completion in OpenAI's shapes; its turn (service/turn.py) fits, streams and
    counts it."""

    kind, chunk_kind = "chat.completion", "chat.completion.chunk"

    def __init__(self, request: Request, profile: Profile, asked: dict, turn: Turn):
        self.request, self.profile, self.asked, self.turn = request, profile, asked, turn
        self.prompt: Prompt | None = None
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        decoding, tools = asked.get("decoding"), asked.get("tools")
        self.choices = Choices(decoding.n if decoding else 1, tools)
        self.logprobs = decoding is not None and decoding.logprobs is not None
        # vLLM's return_token_ids: the prompt's ids and each choice's (each chunk's) too
        self.token_ids = bool(asked.get("return_token_ids"))
        self.unsent_ids: dict[int, list[int]] = {}  # per choice, for the next chunk

    def fit(self) -> Prompt:
        tools = self.asked["tools"]
        return self.turn.fit(self.asked["history"], self.asked["new"],
                             system_prompt=self.asked["system_prompt"],
                             max_tokens=self.asked["max_tokens"],
                             tools=None if tools is None else list(tools.specs),
                             template=self.asked.get("template"),
                             reserve=self.asked.get("reserve"))

    def items(self) -> AsyncIterator[str | Piece]:
        return self.turn.stream(self.prompt, decoding=self.asked["decoding"],
                                **self.asked["sampling"])

    def end(self, exc: BaseException | None = None) -> None:
        self.turn.reply = self.choices.text(0)
        self.turn.replies = [self.choices.text(i) for i in range(len(self.choices.texts))]
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
        return JSONResponse(await self.whole_body())

    async def whole_body(self) -> dict:
        """The answer once the reply has ended."""
        body = {**self.head(self.kind), "choices": self.whole_choices(), "usage": self.usage()}
        if self.kind == "chat.completion":  # vLLM's own keys, null unless asked
            body.update(prompt_logprobs=self.choices.prompt_logprobs,
                        prompt_token_ids=self.prompt.token_ids if self.token_ids else None)
        return body

    def whole_choices(self) -> list[dict]:
        choices = self.choices.messages(self.turn.stats.finish_reason, self.logprobs,
                                        self.token_ids)
        if echo := self.echoed():
            for choice in choices:
                choice["message"]["content"] = echo + (choice["message"]["content"] or "")
        return choices

    def echoed(self) -> str:
        """What vLLM's `echo` puts before each reply (api/requests.py echoed), or ""."""
        return self.asked.get("echo") or ""

    async def _collect(self) -> None:
        async for item in self.items():
            self.choices.take(item)

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

    async def items_or_refusal(self) -> AsyncIterator[str | Piece]:
        try:
            async for text in self.items():
                yield text
        except ChatError as exc:
            self.end(exc)
            raise refusal(exc) from None

    async def events(self, first: str | Piece | None, items, include_usage: bool
                     ) -> AsyncIterator[str]:
        """The stream's events (`event_lines`); a refusal mid-stream said as an event.
        Leaving early (the client went away: Starlette cancels this generator) closes
        `items`, which aborts the request in the engine."""
        try:
            async with contextlib.aclosing(self.event_lines(first, items, include_usage)) \
                    as lines:
                async for line in lines:
                    yield line
        except ApiError as exc:  # refused mid-stream (the engine died)
            yield self.error_event(exc)
        except (asyncio.CancelledError, GeneratorExit) as exc:
            self.end(exc)
            raise
        except Exception as exc:
            self.end(exc)
            raise
        finally:
            await items.aclose()

    async def event_lines(self, first: str | Piece | None, items, include_usage: bool
                          ) -> AsyncIterator[str]:
        for chunk in self.opening():
            yield chunk
        item = first
        while item is not None:
            piece = self.choices.take(item)
            for choice, finish in self.piece_chunks(piece):
                yield self.chunk(piece.index, choice, finish, self.usage_so_far(piece.index))
            item = await first_of(items)
        for index in self.choices.open():  # the plain path ends in the turn's stats
            for choice, finish in self.ending(index):
                yield self.chunk(index, choice, finish, self.usage_so_far(index))
        if include_usage:
            yield sse({**self.head(self.chunk_kind), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"
        self.end()

    def error_event(self, exc: ApiError) -> str:
        return sse({"error": {"message": str(exc), "type": exc.kind, "code": exc.code}})

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.profile.name}

    def opening(self) -> list[str]:
        """Each choice's first chunk: its role; then each one's echo where asked."""
        n, echo = len(self.choices.texts), self.echoed()
        return [self.chunk(i, {"delta": {"role": "assistant", "content": ""}}, None,
                           self.usage_so_far(i), self.prompt.token_ids if self.token_ids
                           else None) for i in range(n)] + \
            [self.chunk(i, {"delta": {"content": echo}}, None, self.usage_so_far(i))
             for i in range(n) if echo]

    def piece_chunks(self, piece: Piece) -> list[tuple[dict, str | None]]:
        chunks = self.choices.deltas(piece, self.logprobs)
        if self.token_ids:  # the piece's token ids on its first chunk
            ids = self.held_ids(piece, bool(chunks))
            for n, (choice, _) in enumerate(chunks):
                choice["token_ids"] = ids if n == 0 else []
        return chunks

    def held_ids(self, piece: Piece, sent: bool) -> list[int]:
        """The token ids a chunk for `piece` carries: those of pieces that made no chunk
        (a character's first bytes, not yet text) and the piece's own; held for the next
        chunk where this piece makes none."""
        held = self.unsent_ids.setdefault(piece.index, [])
        held.extend(piece.token_ids or ())
        if not sent:
            return []
        self.unsent_ids[piece.index] = []
        return held

    def ending(self, index: int) -> list[tuple[dict, str | None]]:
        return self.choices.ending(index, self.turn.stats.finish_reason)

    def chunk(self, index: int, choice: dict, finish_reason: str | None = None,
              usage: dict | None = None, prompt_token_ids: list | None = None) -> str:
        body = {**self.head(self.chunk_kind), "choices": [
            {"index": index, **choice, "finish_reason": finish_reason}]}
        if usage is not None:
            body["usage"] = usage
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        return sse(body)

    def usage_so_far(self, index: int) -> dict | None:
        """A chunk's usage with stream_options.continuous_usage_stats (as vLLM's: the
        prompt and choice `index`'s tokens so far), else None."""
        if not self.asked.get("continuous_usage"):
            return None
        prompt, reply = self.prompt.prompt_tokens, self.choices.tokens[index]
        return {"prompt_tokens": prompt, "completion_tokens": reply,
                "total_tokens": prompt + reply}

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
