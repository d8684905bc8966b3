"""An OpenAI chat completion request read and checked against a chat profile's limits,
for api/openai.py: what it asks for, or an `ApiError` saying in OpenAI's error shape what
is wrong (always a 4xx, never a 500: for `top_p: 0`, a text `stream_options`, a body nested
100,000 deep alike).

Each message is held to the profile's `message_chars`, their number to MAX_MESSAGES (the
body is bounded before it is read: VCHAT_API_MAX_BODY_MB, chat/guard.py). A field given as
null means its default, as in OpenAI's API; a field this server does not honour (any not
in FIELDS) is refused by name, not ignored. The decoding fields are read in api/options.py,
the tools in api/tools.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from api.errors import ApiError
from api.options import flag, min_tokens_fit, read_decoding, within
from api.tools import read_tools
from engine import ChatError, Message, Profile
from engine.chat_format import API_ROLES
from engine.config import Config
from engine.decoding import Decoding
from engine.limits import bounds, system_prompt_fits
from service.input import check_message

MAX_MESSAGES = 10_000  # in one request (the body is bounded too: VCHAT_API_MAX_BODY_MB)
# The fields of a chat completion this server honours (README, "The API's fields"); any
# other is refused by name, never silently ignored. `user` (an end user's id, for the
# provider's abuse monitoring) is accepted and not used, as by `vllm serve`; `ignore_eos`
# (its benchmark client sends it: every reply runs to max_tokens), `top_k`, `min_p`,
# `repetition_penalty`, `return_token_ids`, `return_tokens_as_token_ids`,
# `allowed_token_ids`, `structured_outputs`, `prompt_logprobs`, `min_tokens`,
# `logprob_token_ids`, `echo` and the chat template's options (`add_generation_prompt`,
# `continue_final_message`, `chat_template_kwargs`) are vLLM's own.
FIELDS = frozenset((
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stream", "stream_options", "n", "stop", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "user", "ignore_eos", "top_k", "min_p", "repetition_penalty",
    "return_token_ids", "return_tokens_as_token_ids", "allowed_token_ids",
    "structured_outputs", "prompt_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "echo", "min_tokens", "logprob_token_ids"))
# What a request's chat_template_kwargs may not set: the template's own arguments.
TEMPLATE_RESERVED = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))
TEMPLATE_KWARGS_CHARS = 10_000


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


def json_body(raw: bytes) -> dict:
    """A request body as a JSON object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except ValueError:
        raise ApiError(400, "The request body is not JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def profile_of(body: dict, config: Config) -> Profile:
    """The profile the request's `model` names (404 for another name)."""
    names = [p.name for p in config.profiles]
    if body.get("model") not in names:
        raise ApiError(404, f"Unknown model {str(body.get('model'))[:200]!r}; this server "
                       f"has: {', '.join(names)}.", code="model_not_found")
    return config.profile(body["model"])


def read(body: dict, config: Config) -> tuple[Profile, dict]:
    """The request checked against the profile's limits: (profile, the turn's parts).
    A field given as null means its default, as in OpenAI's API."""
    profile = profile_of(body, config)
    limits = profile.limits
    only_known(body, FIELDS)
    stream, include_usage, continuous = streaming(body)
    extras = extra_fields(body)
    tools = read_tools(body, limits.tools)
    # Always a Decoding (the plain one where nothing more is asked): its Pieces end with
    # their finish reason, so a stream's last chunk carries the last text and the finish
    # together, as `vllm serve` sends it.
    decoding = read_decoding(body, profile, tools) or Decoding()
    if continuous:  # the usage so far in every chunk: each piece's tokens counted
        decoding = replace(decoding, token_ids=True)
    template = template_options(body)
    history, system = messages_of(body.get("messages"), limits.message_chars,
                                  answered=bool(template))
    # The request's own system messages only: without one the model's template decides,
    # as with `vllm serve` (the profile's system prompt is the chat's).
    system_prompt = "\n\n".join(m.content for m in system)
    if not system_prompt_fits(limits, system_prompt):
        raise ApiError(400, f"The system prompt is {len(system_prompt):,} characters; "
                       f"{profile.name} takes at most {limits.system_prompt_chars:,}.")
    if not history:  # system messages only (as `vllm serve`, the model answers them)
        history, text = [Message("system", system_prompt)], system_prompt
    else:
        try:
            text = check_message(history[-1].content, limits.message_chars).text
        except ChatError as exc:
            raise ApiError(400, str(exc), code="message_refused") from None
    # None given: the reply may run to the context's end (as `vllm serve`'s), at most the
    # profile's limit; the prompt then keeps one token for it while fitting.
    asked_max = given(body, "max_completion_tokens", given(body, "max_tokens", None))
    max_tokens = limits.max_tokens if asked_max is None else asked_max
    sampling = sampling_of(body, profile, max_tokens)
    min_tokens_fit(decoding, max_tokens)
    last = history[-1]
    return profile, {"echo": echoed(body, template),"history": history[:-1],
                     "new": Message(last.role, text, tool_calls=last.tool_calls,
                                   tool_call_id=last.tool_call_id),
                     "system_prompt": system_prompt, "max_tokens": max_tokens,
                     "reserve": 1 if asked_max is None else None,
                     "stream": stream, "include_usage": include_usage,
                     "continuous_usage": continuous, "template": template,
                     "return_token_ids": decoding.token_ids and body.get("return_token_ids"),
                     "tools": tools, "decoding": decoding, **extras, "sampling": sampling}


def echoed(body: dict, template: dict | None) -> str:
    """What vLLM's `echo` puts before each reply: the last message's text where the reply
    continues its role (the template adds no assistant turn, or the last message is the
    assistant's), else ""."""
    if not flag(body, "echo"):
        return ""
    last = body["messages"][-1]
    if (template is None or template["add_generation_prompt"]) and \
            last["role"] != "assistant":
        return ""
    content = last.get("content")
    return "" if content is None else content_text(content, "the last message's content")


def sampling_of(body: dict, profile: Profile, max_tokens) -> dict:
    """The turn's temperature, top_p and seed (1.0 where not given: the body holds the
    model's own defaults already, `with_model_defaults`), each and `max_tokens` held to the
    profile's bounds."""
    temperature = given(body, "temperature", 1.0)
    top_p = given(body, "top_p", 1.0)
    seed = given(body, "seed", None)
    checks = bounds(profile.limits)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("seed", seed)):
        if value is not None:
            within(checks[name], value, profile)
    return {"temperature": float(temperature), "top_p": float(top_p), "seed": seed}


# The model's generation-config fields an API request takes (Engine.model_sampling).
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")


def with_model_defaults(body: dict, defaults: dict, profile: Profile) -> dict:
    """The body with the model's own sampling defaults where it leaves a field out (or
    null), as `vllm serve` applies its model's generation config; a default outside the
    profile's bounds is left out (a request that names nothing is never refused for it)."""
    checks = bounds(profile.limits)
    filled = dict(body)
    for name in MODEL_DEFAULTS:
        if filled.get(name) is None and defaults.get(name) is not None:
            try:
                within(checks[name], defaults[name], profile)
            except ApiError:
                continue
            filled[name] = defaults[name]
    return filled


def only_known(body: dict, fields: frozenset) -> None:
    """Refuse, by name, a field this server does not honour (a null one is as if absent)."""
    unknown = sorted(str(k) for k, v in body.items() if k not in fields and v is not None)
    if unknown:
        raise ApiError(400, f"'{unknown[0][:100]}' is not supported by this server; leave it "
                       "out.", code="unsupported_parameter")


def extra_fields(body: dict) -> dict:
    """`user` checked (and not used), vLLM's `ignore_eos`."""
    user, ignore_eos = given(body, "user", ""), given(body, "ignore_eos", False)
    if not isinstance(user, str) or len(user) > 256:
        raise ApiError(400, "'user' must be text of at most 256 characters.")
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be true or false.")
    return {"ignore_eos": ignore_eos}


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def streaming(body: dict) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, its continuous_usage_stats: usage so far in
    every chunk, as vLLM's, only with include_usage). Stream options without `stream`
    are refused, as by `vllm serve` (an empty object passes)."""
    stream, options = given(body, "stream", False), given(body, "stream_options", {})
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {str(stream)[:50]!r}.")
    if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS) or \
            not all(isinstance(given(options, k, False), bool) for k in STREAM_OPTIONS):
        raise ApiError(400, "'stream_options' must be an object such as "
                       '{"include_usage": true, "continuous_usage_stats": false}.')
    if options and not stream:
        raise ApiError(400, "'stream_options' can only be given with 'stream': true.")
    usage = given(options, "include_usage", False)
    return stream, usage, usage and given(options, "continuous_usage_stats", False)


def template_options(body: dict) -> dict | None:
    """The chat template's options a request gives (vLLM's add_generation_prompt,
    continue_final_message, chat_template_kwargs), or None for the defaults."""
    generation = given(body, "add_generation_prompt", True)
    final = given(body, "continue_final_message", False)
    kwargs = given(body, "chat_template_kwargs", {})
    if not isinstance(generation, bool) or not isinstance(final, bool):
        raise ApiError(400, "'add_generation_prompt' and 'continue_final_message' must be "
                       "true or false.")
    if generation and final:
        raise ApiError(400, "'continue_final_message' needs 'add_generation_prompt': false "
                       "(they cannot both be true).")
    if not isinstance(kwargs, dict) or set(kwargs) & TEMPLATE_RESERVED or not all(
            isinstance(k, str) and k.isidentifier() for k in kwargs) or \
            len(json.dumps(kwargs)) > TEMPLATE_KWARGS_CHARS:
        raise ApiError(400, "'chat_template_kwargs' must be an object of the template's own "
                       f"variables (not {', '.join(sorted(TEMPLATE_RESERVED))}), at most "
                       f"{TEMPLATE_KWARGS_CHARS:,} characters as JSON.")
    if generation and not final and not kwargs:
        return None
    return {**kwargs, "add_generation_prompt": generation, "continue_final_message": final}


def messages_of(messages, message_chars: int, answered: bool = False
                ) -> tuple[list[Message], list[Message]]:
    """(the conversation, the system messages): each message within the profile's
    `limits.message_chars`, as a chat message is, at most MAX_MESSAGES of them.
    `answered`: the template's options are given, and the last message may be the
    assistant's (continued, or a prompt without the generation prompt)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list.")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"A request may hold at most {MAX_MESSAGES:,} messages; this "
                       f"one has {len(messages):,}.")
    system, history = [], []
    for n, item in enumerate(messages):
        role = item.get("role") if isinstance(item, dict) else None
        if role not in API_ROLES:
            raise ApiError(400, f"messages[{n}].role must be one of {', '.join(API_ROLES)}.")
        calls = tool_calls(item.get("tool_calls"), n) if role == "assistant" else ()
        content = item.get("content")
        text = "" if content is None and calls else content_text(content,
                                                                 f"messages[{n}].content")
        if len(text) > message_chars:
            raise ApiError(400, f"messages[{n}] is {len(text):,} characters long; this "
                           f"model takes at most {message_chars:,} per message.",
                           code="message_refused")
        call_id = item.get("tool_call_id") if role == "tool" else None
        if call_id is not None and not (isinstance(call_id, str) and len(call_id) <= 128):
            raise ApiError(400, f"messages[{n}].tool_call_id must be text of at most 128 "
                           "characters.")
        (system if role == "system" else history).append(
            Message(role, text, tool_calls=calls, tool_call_id=call_id or ""))
    if history and history[-1].role not in ("user", "tool") + (
            ("assistant",) if answered else ()):
        raise ApiError(400, "The last message must be the user's (or a tool's result).")
    return history, system


def tool_calls(calls, n: int) -> tuple:
    """An assistant message's tool calls for the chat template: arguments as objects."""
    if calls is None:
        return ()
    where = f"messages[{n}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list.")
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(function["arguments"])
            assert isinstance(function["name"], str) and isinstance(arguments, dict)
        except (AssertionError, KeyError, TypeError, ValueError):
            raise ApiError(400, f"Each of {where} must be {{\"type\": \"function\", "
                           "\"function\": {\"name\": ..., \"arguments\": \"a JSON "
                           "object\"}}.") from None
        read.append({"id": str(call.get("id", ""))[:128], "type": "function",
                     "function": {"name": function["name"][:64], "arguments": arguments}})
    return tuple(read)



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


