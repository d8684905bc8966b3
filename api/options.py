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

# `vllm serve` bounds neither; these bound what each new token is checked against.
MAX_STOPS = 16  # stop sequences in one request
STOP_CHARS = 2048  # characters in one stop sequence
MAX_BIASED = 300  # tokens in one logit_bias
BIAS_MAX = 100  # a bias, either way (OpenAI's range)
MAX_ALLOWED = 300_000  # ids in allowed_token_ids (no vocabulary holds more)
MAX_LOGPROB_IDS = 128  # ids in logprob_token_ids (vLLM's own bound)
FORMATS = ("text", "json_object", "json_schema")
# The numbers read as they are, within engine/limits.py's bounds: OpenAI's, then vLLM's own
# sampling fields (which `vllm serve` takes too; Qwen's model card recommends top_k 20).
NUMBERS = ("n", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens")


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
    asked["allowed_token_ids"] = allowed_token_ids(body.get("allowed_token_ids"))
    asked["logprob_token_ids"] = logprob_token_ids(body.get("logprob_token_ids"))
    if asked["logprob_token_ids"] and asked["logprobs"] is None:
        raise ApiError(400, "'logprob_token_ids' needs 'logprobs'"
                       + (": true." if chat else "."))
    if (prompt := body.get("prompt_logprobs")) is not None:  # vLLM's own
        within(checks["top_logprobs"], prompt, profile, "prompt_logprobs")
        if body.get("stream") and prompt > 0:
            raise ApiError(400, "'prompt_logprobs' are not available with 'stream': true.")
        asked["prompt_logprobs"] = prompt
    asked["token_ids"] = flag(body, "return_token_ids")
    asked["tokens_as_ids"] = flag(body, "return_tokens_as_token_ids")
    schema, json_object = response_format(body.get("response_format"))
    asked["structured_outputs"] = structured = structured_outputs(body.get("structured_outputs"))
    if structured is not None and (schema is not None or json_object or (
            tools is not None and tools.schema() is not None)):
        raise ApiError(400, "'structured_outputs' cannot be combined with a JSON "
                       "'response_format' or a 'tool_choice' that holds the reply to a schema.")
    if tools is not None:
        if tools.schema() is not None:
            if schema is not None or json_object:
                raise ApiError(400, "'response_format' cannot be combined with a "
                               "'tool_choice' of \"required\" or a named function.")
            schema = tools.schema()
        asked["special_tokens"] = tools.marks_calls
    decoding = Decoding(**asked, json_schema=schema, json_object=json_object)
    return None if decoding == Decoding() else decoding


def min_tokens_fit(decoding: Decoding | None, max_tokens: int) -> None:
    """vLLM's `min_tokens` may not exceed the reply's `max_tokens`."""
    if decoding is not None and decoding.min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' ({decoding.min_tokens}) must be at most "
                       f"'max_tokens' ({max_tokens}).")


def within(bound: Bound, value, profile: Profile, name: str | None = None) -> None:
    """A 400 naming the field (`name`, else the bound's) unless `value` keeps `bound`."""
    if not bound.holds(value):
        raise ApiError(400, f"'{name or bound.name}' must be a number {bound.span()} for "
                       f"{profile.name}, got {str(value)[:50]!r} ({bound.broken(value)}).")


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
    # Every bad key named, then every bad bias (as vLLM names all its bad keys at once).
    keys = [str(key)[:20] for key in list(biases)[:MAX_BIASED]
            if not (key.isascii() and key.isdigit() and len(key) < 10)]
    if keys:
        raise ApiError(400, "'logit_bias' maps token ids to biases; these keys are not "
                       f"token ids: {keys!r}.")
    bad = [f"{key[:20]!r}: {str(bias)[:20]!r}" for key, bias in biases.items()
           if isinstance(bias, bool) or not isinstance(bias, (int, float))
           or not -BIAS_MAX <= bias <= BIAS_MAX]
    if bad:
        raise ApiError(400, f"'logit_bias' maps token ids to numbers from -{BIAS_MAX} to "
                       f"{BIAS_MAX}; these are not: {', '.join(bad)}.")
    return tuple((int(key), float(bias)) for key, bias in biases.items())


# vLLM's StructuredOutputsParams: its constraints (exactly one is given) and options.
CONSTRAINTS = {"json": (str, dict), "regex": str, "choice": list, "grammar": str,
               "json_object": bool, "structural_tag": str}
STRUCTURED_OPTIONS = {"disable_any_whitespace": bool, "disable_additional_properties": bool,
                      "whitespace_pattern": str}


def structured_outputs(asked) -> dict | None:
    """vLLM's `structured_outputs` checked in shape (what vLLM cannot compile is its 400)."""
    if asked is None:
        return None
    kinds = {**CONSTRAINTS, **STRUCTURED_OPTIONS}
    given = {k: v for k, v in asked.items() if v is not None} \
        if isinstance(asked, dict) else None
    if given is None or set(given) - set(kinds) or not all(
            isinstance(v, kinds[k]) for k, v in given.items()) or \
            sum(k in CONSTRAINTS for k in given) != 1 or not all(
            isinstance(c, str) for c in given.get("choice", ())):
        raise ApiError(400, "'structured_outputs' must be an object with one of "
                       f"{', '.join(CONSTRAINTS)} (and optionally "
                       f"{', '.join(STRUCTURED_OPTIONS)}).")
    return given


def flag(body: dict, name: str) -> bool:
    """A true/false field (null: false)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false.")
    return bool(value)


def allowed_token_ids(ids) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids`: the only tokens the reply may use (an id outside the
    vocabulary is vLLM's 400)."""
    if ids is None:
        return ()
    if not isinstance(ids, list) or not ids or len(ids) > MAX_ALLOWED or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ApiError(400, f"'allowed_token_ids' must be a non-empty list of at most "
                       f"{MAX_ALLOWED:,} token ids.")
    return tuple(ids)


def logprob_token_ids(ids) -> tuple[int, ...]:
    """vLLM's `logprob_token_ids`: the tokens whose log probabilities each place reports
    (with the sampled one), in place of the likeliest."""
    if ids is None:
        return ()
    if not isinstance(ids, list) or len(ids) > MAX_LOGPROB_IDS or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ApiError(400, f"'logprob_token_ids' must be a list of at most "
                       f"{MAX_LOGPROB_IDS} token ids.")
    return tuple(ids)


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
