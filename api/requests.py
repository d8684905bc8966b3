"""An OpenAI chat completion request read and checked against a chat profile's limits,
for api/openai.py: what it asks for, or an `ApiError` saying in OpenAI's error shape what
is wrong (always a 4xx: issue 26 found 500s for `top_p: 0`, a text `stream_options`, a body
nested 100,000 deep).

Each message is held to the profile's `message_chars`, their number to MAX_MESSAGES (the
body is bounded before it is read: VCHAT_API_MAX_BODY_MB, chat/guard.py). A field given as
null means its default, as in OpenAI's API; fields this server cannot honour
(UNSUPPORTED) are refused, not ignored.
"""

from __future__ import annotations

import json
import re

from starlette.responses import JSONResponse

from service.input import check_message
from engine import ChatError, Message, Profile
from engine.chat_format import ROLES
from engine.config import Config
from engine.limits import Bound, bounds, system_prompt_fits

MAX_MESSAGES = 10_000  # in one request (the body is bounded too: VCHAT_API_MAX_BODY_MB)
# OpenAI's fields this server cannot honour: refused, not silently ignored.
UNSUPPORTED = ("logprobs", "top_logprobs")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind,
                                       "code": self.code}}, status_code=self.status)


SESSION_HEADER = "X-Session-Id"
SESSION_KEY = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def session_key(request) -> str | None:
    """The client's key for its conversation, passed on to a remote preset's router (which
    keeps a session's requests on one model server); a malformed one is refused."""
    key = request.headers.get(SESSION_HEADER)
    if key is None:
        return None
    if not SESSION_KEY.fullmatch(key):
        raise ApiError(400, f"The {SESSION_HEADER} header must be 1 to 128 printable ASCII "
                       "characters without spaces.", code="invalid_session_id")
    return key


def read_body(raw: bytes, config: Config) -> tuple[Profile, dict]:
    """A request body as JSON, checked (`read`)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except ValueError:
        raise ApiError(400, "The request body is not JSON.") from None
    return read(body, config)


def read(body, config: Config) -> tuple[Profile, dict]:
    """The request checked against the profile's limits: (profile, the turn's parts).
    A field given as null means its default, as in OpenAI's API."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    names = [p.name for p in config.profiles]
    if body.get("model") not in names:
        raise ApiError(404, f"Unknown model {str(body.get('model'))[:200]!r}; this server "
                       f"has: {', '.join(names)}.", code="model_not_found")
    profile = config.profile(body["model"])
    limits, sampling = profile.limits, profile.sampling
    if given(body, "n", 1) != 1:
        raise ApiError(400, "Only n=1 is supported.")
    for field in UNSUPPORTED:
        if given(body, field, False) is not False:
            raise ApiError(400, f"'{field}' is not supported by this server; leave it "
                           "out.", code="unsupported_parameter")
    stream, options = given(body, "stream", False), given(body, "stream_options", {})
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {str(stream)[:50]!r}.")
    if not isinstance(options, dict) or not isinstance(given(options, "include_usage",
                                                             False), bool):
        raise ApiError(400, "'stream_options' must be an object such as "
                       '{"include_usage": true}.')
    history, system = messages_of(body.get("messages"), limits.message_chars)
    try:
        new = check_message(history[-1].content, limits.message_chars)
    except ChatError as exc:
        raise ApiError(400, str(exc), code="message_refused") from None
    system_prompt = "\n\n".join(m.content for m in system) or profile.system_prompt
    if not system_prompt_fits(limits, system_prompt):
        raise ApiError(400, f"The system prompt is {len(system_prompt):,} characters; "
                       f"{profile.name} takes at most {limits.system_prompt_chars:,}.")
    max_tokens = given(body, "max_completion_tokens",
                       given(body, "max_tokens", sampling.max_tokens))
    temperature = given(body, "temperature", sampling.temperature)
    top_p = given(body, "top_p", sampling.top_p)
    seed = given(body, "seed", None)
    asked = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    if seed is not None:
        asked["seed"] = seed
    checks = bounds(limits)
    for name, value in asked.items():
        within(checks[name], value, profile)
    return profile, {"history": history[:-1], "new": Message("user", new.text),
                     "system_prompt": system_prompt, "max_tokens": max_tokens,
                     "stream": stream, "include_usage": given(options, "include_usage",
                                                              False),
                     "sampling": {"temperature": float(temperature),
                                  "top_p": float(top_p), "seed": seed}}


def messages_of(messages, message_chars: int) -> tuple[list[Message], list[Message]]:
    """(the conversation, the system messages): each message within the profile's
    `limits.message_chars`, as a chat message is, at most MAX_MESSAGES of them."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list.")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"A request may hold at most {MAX_MESSAGES:,} messages; this "
                       f"one has {len(messages):,}.")
    system, history = [], []
    for n, item in enumerate(messages):
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"messages[{n}].role must be one of {', '.join(ROLES)}.")
        text = content_text(item.get("content"), f"messages[{n}].content")
        if len(text) > message_chars:
            raise ApiError(400, f"messages[{n}] is {len(text):,} characters long; this "
                           f"model takes at most {message_chars:,} per message.",
                           code="message_refused")
        (system if role == "system" else history).append(Message(role, text))
    if not history or history[-1].role != "user":
        raise ApiError(400, "The last message must be the user's.")
    return history, system



def given(body: dict, key: str, default):
    """body[key], or `default` where it is missing or null."""
    value = body.get(key)
    return default if value is None else value


def content_text(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (other kinds are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where} must be text (a string or a list of text parts).")


def within(bound: Bound, value, profile: Profile) -> None:
    if not bound.holds(value):
        raise ApiError(400, f"'{bound.name}' must be a number {bound.span()} for "
                       f"{profile.name}, got {str(value)[:50]!r}.")
