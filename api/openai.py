"""An OpenAI-compatible API on the app's own engines, for scripts and tools:

    GET  /v1/models            each chat profile is a model (its name is the model id)
    POST /v1/chat/completions  streaming (server-sent events) or not; stop, JSON output,
                               tools, log probabilities, penalties, logit_bias, n
                               (api/options.py, api/tools.py; README "The API's fields")
    POST /v1/completions       prompts as given, without the chat template (completions.py)
    POST /v1/chat/completions/batch  vLLM's batched chat: one choice per conversation
                               (batches.py, which also answers a list of prompts)
    POST /invocations          SageMaker's route, as vLLM's: a body with `messages` is a chat
                               completion, one with `prompt` a completion
    POST /tokenize, /detokenize  vLLM's token routes (tokens.py)
    POST /v1/responses         OpenAI's Responses API on the same turns (responses.py); a
                               stored one: GET and DELETE /v1/responses/{id}, POST .../cancel

Requests share everything with the chat UI: the engines and their presets, the admission
line (a full line answers 429), the profile's limits (message length, max tokens,
temperature, system prompt length: over them answers 400 naming the limit) and the
metrics and per-turn log lines (service/turn_metrics.py). Every request needs a key
(`Authorization: Bearer ...`): the operator's `VCHAT_API_KEY`, or an account's key
(`python -m store keys add NAME`); keys never reach the log. A client that goes away
mid-reply aborts its request in the engine. Errors come in OpenAI's shape:
{"error": {"message", "type", "code"}}, for every bad input a 4xx, never a 500.

A request is read and checked in api/requests.py; a large one is read and fitted in a
worker thread, and only the newest turns that can fit are tokenized (engine/history.py), so
it does not stall other users' streams (bench/big_request.py).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from api.batches import answer_all, read_chat_batch
from api.call import Call, refusal
from api.completions import CompletionCall, read_completion
from api.errors import ApiError
from api.files import read_files
from api.requests import json_body, profile_of, read, session_key, with_model_defaults
from api.responses import KEY as RESPONSE_FIELDS
from api.responses import (ResponseCall, cancel_running, cancelled, not_found, read_responses,
                           to_chat)
from api.tokens import detokenize, tokenize
from engine import ChatError, Engines
from engine.config import Config
from service.admission import Gate, Refusal
from service.documents import Reader
from service.loop import off_the_loop
from service.turn import Turn
from service.turn_metrics import TurnMetrics
from store.responses import StoredResponses
from store.usage import Usage

log = logging.getLogger(__name__)

OPERATOR = "operator"  # the turn log's user for the operator's key (VCHAT_API_KEY)
OPERATOR_OWNER = ""  # whose stored responses the operator's are (no account name is empty)


class OpenAIApi:
    """The routes, bound to the app's engines, config, turn metrics and key check.
    `account_of(key)` answers the account a key acts as (None: not a key)."""

    def __init__(self, engines: Engines, config: Config, turns: TurnMetrics,
                 account_of: Callable[[str], Awaitable[str | None]],
                 operator_key: str | None, usage: Usage, gate: Gate,
                 ignore_eos: bool = False, reader: Reader | None = None,
                 stored: StoredResponses | None = None):
        self.engines, self.config, self.turns = engines, config, turns
        # Responses kept for GET /v1/responses/ID and previous_response_id (None or keep 0:
        # none, as `vllm serve` without its store)
        self.stored = stored if stored is not None and stored.keep else None
        self.reader = reader  # files in messages read to text (api/files.py); None: off
        self.usage = usage  # each turn's cost stored (store/usage.py)
        # May a request's turns start: the app not shutting down, the account's quota
        # decided as each turn's place is taken (service/admission.py).
        self.gate = gate
        self.account_of, self.operator_key = account_of, operator_key
        self.ignore_eos = ignore_eos  # benchmarks only, as in the chat (VCHAT_BENCH_IGNORE_EOS)
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        for path, route in (("/v1/chat/completions", self.chat_completions),
                            ("/v1/chat/completions/batch", self.chat_batch),
                            ("/v1/completions", self.completions),
                            ("/invocations", self.invocations),
                            ("/tokenize", self.tokenize), ("/detokenize", self.detokenize)):
            self.router.add_api_route(path, route, methods=["POST"])
        self.router.add_api_route("/v1/responses", self.responses, methods=["POST"])
        self.router.add_api_route("/v1/responses/{response_id}", self.stored_response,
                                  methods=["GET", "DELETE"])
        self.router.add_api_route("/v1/responses/{response_id}/cancel", self.cancel_response,
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
        return await self.answer(request, read, Call)

    async def completions(self, request: Request) -> Response:
        """A legacy completion (api/completions.py): a prompt as given, no chat template."""
        return await self.answer(request, read_completion, CompletionCall)

    async def chat_batch(self, request: Request) -> Response:
        """vLLM's batched chat completion (api/batches.py): one turn per conversation."""
        return await self.answer(request, read_chat_batch, Call)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's route, as `vllm serve` routes it: by the body's shape (the key
        checked and the body parsed once, here)."""
        try:
            known = await self.read_request(request)
        except ApiError as exc:
            return exc.response()
        body = known[2]
        if "messages" in body:
            return await self.answer(request, read, Call, known)
        if "prompt" in body:
            return await self.answer(request, read_completion, CompletionCall, known)
        return ApiError(400, "An invocation is a chat completion ('messages') or a "
                        "completion ('prompt').").response()

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (api/responses.py): read into a chat completion's turn;
        `previous_response_id` continues one of the caller's stored responses."""
        try:
            account, session, body = await self.read_request(request)
            owner = OPERATOR_OWNER if account is None else account
            previous = body.get("previous_response_id")
            history = None
            if previous is not None:
                found = await self.stored.get(str(previous)[:200], owner) \
                    if self.stored and isinstance(previous, str) else None
                if found is None:
                    raise not_found(previous)
                history = found.messages
            raw = await request.body()
            chat = await off_the_loop(len(raw), to_chat, body, history,
                                      self.config.profiles[0].name)
            if chat[RESPONSE_FIELDS]["background"] and self.stored is None:
                raise ApiError(400, "background can only be used where responses are "
                               "stored, and this server keeps none (VCHAT_API_STORED_RESPONSES"
                               "=0).")
            chat = await read_files(chat, self.reader)
        except ApiError as exc:
            return exc.response()

        def call(*args) -> ResponseCall:
            made = ResponseCall(*args)
            made.stored, made.owner = self.stored, owner
            return made

        return await self.answer(request, read_responses, call,
                                 (account, session, chat))

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """GET: one of the caller's stored responses (404 for anyone else's); DELETE: it
        forgotten (a background one stopped first)."""
        try:
            owner = await self.owner(request)
            if request.method == "DELETE":
                if self.stored is None or await self.stored.get(response_id, owner) is None:
                    raise not_found(response_id)
                await cancel_running(response_id)  # the caller's own, found just now
                await self.stored.forget(response_id, owner)
                return JSONResponse({"id": response_id, "object": "response",
                                     "deleted": True})
            if request.query_params.get("stream") in ("true", "1"):
                raise ApiError(400, "A stored response is given whole here; leave out "
                               "'stream'.")
            found = await self.stored.get(response_id, owner) if self.stored else None
            if found is None:
                raise not_found(response_id)
            return JSONResponse(found.response)
        except ApiError as exc:
            return exc.response()

    async def cancel_response(self, request: Request, response_id: str) -> Response:
        """A background response stopped (vLLM's and OpenAI's: one that has ended cannot
        be)."""
        try:
            owner = await self.owner(request)
            found = await self.stored.get(response_id, owner) if self.stored else None
            if found is None:
                raise not_found(response_id)
            body = cancelled(found.response)
            if not await self.stored.cancel(response_id, owner, body):
                raise ApiError(400, "Cannot cancel a synchronous response.",
                               code="invalid_request_error")
            await cancel_running(response_id)
            return JSONResponse(body)
        except ApiError as exc:
            return exc.response()

    async def owner(self, request: Request) -> str:
        account = await self.caller(request)
        return OPERATOR_OWNER if account is None else account

    async def tokenize(self, request: Request) -> Response:
        return await self.tokens(request, tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self.tokens(request, detokenize)

    async def tokens(self, request: Request, work) -> Response:
        """/tokenize or /detokenize (api/tokens.py): the model's tokenizer, no turn."""
        try:
            await self.caller(request)
            raw = await request.body()
            return JSONResponse(await off_the_loop(len(raw), work, raw, self.config,
                                                   self.engines))
        except ApiError as exc:
            return exc.response()
        except ChatError as exc:  # the engine not serving
            return refusal(exc).response()

    async def read_request(self, request: Request) -> tuple[str | None, str | None, dict]:
        """(who asks: `caller`, the session key, the body as JSON: a large one parsed in a
        worker thread)."""
        account = await self.caller(request)
        session = session_key(request)
        raw = await request.body()  # at most VCHAT_API_MAX_BODY_MB (chat/guard.py)
        body = await off_the_loop(len(raw), json_body, raw)
        return account, session, await read_files(body, self.reader)

    async def answer(self, request: Request, read, call_class, known: tuple | None = None
                     ) -> Response:
        """A request read by `read` (its JSON body checked), answered by a `call_class` (a
        Call) for each of its turns (several: a list of prompts or conversations,
        api/batches.py); `known`: what `read_request` gave already."""
        try:
            account, session, body = known or await self.read_request(request)
            raw = await request.body()  # read already: its size
            profile, asked = await off_the_loop(len(raw), read, self.model_defaults(body),
                                                self.config)
        except ApiError as exc:
            return exc.response()
        calls = []
        for part in asked.get("batch") or [asked]:
            turn = Turn(self.engines, self.turns, profile.name,
                        user=OPERATOR if account is None else account,
                        message=part["new"].content,
                        ignore_eos=self.ignore_eos or part["ignore_eos"],
                        usage=self.usage, source="api", account=account, session=session)
            calls.append(call_class(request, profile, part, turn))
            try:
                calls[-1].prompt = await off_the_loop(len(raw), calls[-1].fit)
            except ChatError as exc:  # too long for the context, the engine not serving
                for call in calls:
                    call.turn.end(exc)
                return refusal(exc).response()
            except Exception as exc:
                for call in calls[:-1]:
                    call.turn.end(exc)
                return calls[-1].failed(exc)
        # Every turn's place is taken before any runs, and a refusal gives back the places
        # already taken: a request is admitted whole or not at all, each step decided in
        # one (store/admission.py), so requests at the same moment cannot pass the quota.
        try:
            self.gate.start(account, profile.name, count=False)  # each turn's end counts it
            for call in calls:
                decoding = call.asked.get("decoding")
                call.turn.hold = await self.gate.place(
                    account, profile=profile.name, source="api",
                    reserve=call.prompt.prompt_tokens + (decoding.n if decoding else 1)
                    * call.prompt.max_tokens, count=False)
        except Refusal as exc:
            for each in calls:
                each.turn.end(exc)
            return (ApiError(503, str(exc), "server_error", "unavailable")
                    if exc.reason == "closing" else
                    ApiError(429, str(exc), "insufficient_quota", "quota_exceeded")).response()
        if len(calls) > 1:
            return await answer_all(calls)
        call = calls[0]
        if asked["stream"]:
            return await call.streamed(asked["include_usage"])
        return await call.whole()

    def model_defaults(self, body: dict) -> dict:
        """The body with its profile's model's sampling defaults where it leaves them out
        (api/requests.py)."""
        profile = profile_of(body, self.config)
        return with_model_defaults(body, self.engines.model_sampling(profile.name), profile)

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

