"""Requests that hold several turns, answered in one reply, as `vllm serve` answers them:

    POST /v1/completions             with a list of prompts (api/completions.py)
    POST /v1/chat/completions/batch  vLLM's batched chat: `messages` is a list of
                                     conversations, one choice each (index = its place)

Each prompt or conversation is a turn of its own (service/turn.py: limits, the line,
usage), and the request is admitted whole or not at all: api/openai.py takes every turn's
place in store/admission.py before any runs, and a refusal of one gives back the others'.
The turns then run side by side, and their answers become one: choices in order (prompt
i's reply j is choice i * n + j), usage summed. As vLLM's batched chat, a batch is not
streamed and takes no tools and n = 1.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse, Response

from api.errors import ApiError
from api.requests import read
from engine import Profile
from engine.config import Config

MAX_CONVERSATIONS = 64  # conversations in one batched chat: each is a turn in the line


def read_chat_batch(body: dict, config: Config) -> tuple[Profile, dict]:
    """A batched chat completion's body (JSON): each conversation read as a chat completion
    of its own (api/requests.py), the parts of the first with all of them under "batch"."""
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations or not all(
            isinstance(c, list) and c for c in conversations):
        raise ApiError(400, "'messages' must be a non-empty list of conversations, each a "
                       "non-empty list of messages.")
    if len(conversations) > MAX_CONVERSATIONS:
        raise ApiError(400, f"A batch may hold at most {MAX_CONVERSATIONS} conversations; "
                       f"this one has {len(conversations):,}.")
    for name, allowed in (("stream", False), ("n", 1), ("tools", None)):
        if body.get(name) not in (allowed, None):
            raise ApiError(400, f"'{name}' is not supported by the batched chat completion "
                           "(as vLLM's); send the conversations one by one to "
                           "/v1/chat/completions.", code="unsupported_parameter")
    parts = [read({**body, "messages": conversation}, config) for conversation in conversations]
    profile = parts[0][0]
    asked = [part for _, part in parts]
    return profile, {**asked[0], "batch": asked}


async def answer_all(calls) -> Response:
    """The calls (api/call.py, each fitted and admitted) run side by side, answered as one
    whole reply; the first refusal or failure answers for the request."""
    responses = await asyncio.gather(*(call.whole() for call in calls))
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        return failed
    bodies = [json.loads(r.body) for r in responses]
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for body in bodies:
        for choice in body["choices"]:
            choices.append({**choice, "index": len(choices)})
        for key in usage:
            usage[key] += body["usage"][key]
    return JSONResponse({**bodies[0], "choices": choices, "usage": usage})

