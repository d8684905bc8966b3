"""The decoding fields of an OpenAI request, read and bounded into the engine's `Decoding`
(engine/decoding.py): `n`, `stop`, the penalties, `logit_bias`, `logprobs` /
`top_logprobs`, `response_format`, vLLM's `top_k`, `min_p` and `repetition_penalty`, and
what `tools` ask of the decoding (api/tools.py).

A request that asks for none of it gets no Decoding and runs the engines' plain path.
Each number is held to the profile's bounds (engine/limits.py: `n` and `top_logprobs` by
profiles.yaml's limits, the penalties by OpenAI's -2 to 2); what vLLM itself refuses (a
token id outside the vocabulary, a schema it cannot compile) comes back as a 400 too.
"""

from __future__ import annotations

from engine import Profile
from engine.decoding import Decoding
from engine.limits import Bound, bounds

from api.errors import ApiError
from api.tools import Tools

MAX_STOPS = 4  # stop sequences in one request (OpenAI's limit)
STOP_CHARS = 200  # characters in one stop sequence
MAX_BIASED = 300  # tokens in one logit_bias
BIAS_MAX = 100  # a bias, either way (OpenAI's range)
FORMATS = ("text", "json_object", "json_schema")
# The numbers read as they are, within engine/limits.py's bounds: OpenAI's, then vLLM's own
# sampling fields (which `vllm serve` takes too; Qwen's model card recommends top_k 20).
NUMBERS = ("n", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty")


def read_decoding(body: dict, profile: Profile, tools: Tools | None, chat: bool = True
                  ) -> Decoding | None:
    """The request's Decoding, or None where it asks for nothing beyond the plain path.
    `chat`: a chat completion (logprobs true/false with top_logprobs) or not (a legacy
    completion: logprobs is the number of alternatives)."""
    checks = bounds(profile.limits)
    asked = {}
    for name in NUMBERS:
        value = body.get(name)
        if value is not None:
            within(checks[name], value, profile)
            asked[name] = value
    if asked.get("top_k") == -1:  # vLLM's other word for "off"
        asked["top_k"] = 0
    asked["stop"] = stops(body.get("stop"))
    asked["logit_bias"] = logit_bias(body.get("logit_bias"))
    asked["logprobs"] = logprobs(body, checks["top_logprobs"], profile, chat)
    schema, json_object = response_format(body.get("response_format"))
    if tools is not None:
        if tools.schema() is not None:
            if schema is not None or json_object:
                raise ApiError(400, "'response_format' cannot be combined with a "
                               "'tool_choice' of \"required\" or a named function.")
            schema = tools.schema()
        asked["special_tokens"] = tools.marks_calls
    decoding = Decoding(**asked, json_schema=schema, json_object=json_object)
    return None if decoding == Decoding() else decoding


def within(bound: Bound, value, profile: Profile, name: str | None = None) -> None:
    """A 400 naming the field (`name`, else the bound's) unless `value` keeps `bound`."""
    if not bound.holds(value):
        raise ApiError(400, f"'{name or bound.name}' must be a number {bound.span()} for "
                       f"{profile.name}, got {str(value)[:50]!r}.")


def stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) \
            or len(items) > MAX_STOPS or any(len(s) > STOP_CHARS for s in items):
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOPS} "
                       f"non-empty strings of at most {STOP_CHARS} characters each.")
    return tuple(items)


def logit_bias(biases) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} (ids as strings, as JSON keys are) as (id, bias) pairs."""
    if biases is None:
        return ()
    if not isinstance(biases, dict) or len(biases) > MAX_BIASED:
        raise ApiError(400, f"'logit_bias' must be an object of at most {MAX_BIASED} "
                       "token ids with a bias each.")
    pairs = []
    for key, bias in biases.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10) \
                or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -BIAS_MAX <= bias <= BIAS_MAX:
            raise ApiError(400, f"'logit_bias' maps token ids to numbers from -{BIAS_MAX} to "
                           f"{BIAS_MAX}; {str(key)[:20]!r}: {str(bias)[:20]!r} is not one.")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def logprobs(body: dict, bound, profile: Profile, chat: bool) -> int | None:
    """Alternatives per token to return (0: the chosen token's only), None: none asked."""
    if not chat:
        top = body.get("logprobs")
        if top is not None:
            within(bound, top, profile, "logprobs")
        return top
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "'logprobs' must be true or false.")
    if top is not None:
        if not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true.")
        within(bound, top, profile)
    return (top or 0) if wanted else None


def response_format(form) -> tuple[dict | None, bool]:
    """(the JSON schema the reply follows, or None; whether it is any JSON object)."""
    if form is None:
        return None, False
    kind = form.get("type") if isinstance(form, dict) else None
    if kind not in FORMATS:
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                       "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                       "{\"name\": ..., \"schema\": {...}}}.")
    if kind != "json_schema":
        return None, kind == "json_object"
    spec = form.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "'response_format.json_schema' must hold the JSON schema as "
                       "'schema' (an object).")
    return spec["schema"], False
