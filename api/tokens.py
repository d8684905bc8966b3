"""vLLM's token routes, on the model of a profile (no turn: nothing is generated):

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}, or
                      {"model"?, "messages", "add_generation_prompt"?, "return_token_strs"?}
                      (the chat template applied, as for a chat completion):
                      {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model"?, "tokens"}: {"prompt"}

`model` may be left out, as with `vllm serve`: the first profile's model. A prompt or a
message is held to the profile's `message_chars`, as everywhere in the API.
"""

from __future__ import annotations

from api.errors import ApiError
from api.requests import json_body, messages_of, only_known, profile_of
from engine import Engines, Profile
from engine.config import Config

TOKENIZE = frozenset(("model", "prompt", "messages", "add_special_tokens",
                      "add_generation_prompt", "return_token_strs"))
DETOKENIZE = frozenset(("model", "tokens"))
MAX_TOKEN_IDS = 1 << 20  # ids in one /detokenize


def profile_or_first(body: dict, config: Config) -> Profile:
    return config.profiles[0] if body.get("model") is None else profile_of(body, config)


def tokenize(raw: bytes, config: Config, engines: Engines) -> dict:
    body = json_body(raw)
    profile = profile_or_first(body, config)
    only_known(body, TOKENIZE)
    flags = {name: body.get(name) for name in
             ("add_special_tokens", "add_generation_prompt", "return_token_strs")}
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"'{name}' must be true or false.")
    engine = engines.for_profile(profile.name)
    tokenizer = engine.formatter.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "Give either 'prompt' (text) or 'messages' (a conversation).")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or len(prompt) > profile.limits.message_chars:
            raise ApiError(400, "'prompt' must be text of at most "
                           f"{profile.limits.message_chars:,} characters.")
        tokens = tokenizer(prompt, add_special_tokens=flags["add_special_tokens"]
                           is not False)["input_ids"]
    else:
        if flags["add_generation_prompt"] is False:
            raise ApiError(400, "'add_generation_prompt': false is not supported by this "
                           "server; leave it out.", code="unsupported_parameter")
        history, system = messages_of(body["messages"], profile.limits.message_chars)
        tokens = engine.formatter.prompt_ids(
            history, "\n\n".join(m.content for m in system))
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens)
            if flags["return_token_strs"] else None}


def detokenize(raw: bytes, config: Config, engines: Engines) -> dict:
    body = json_body(raw)
    profile = profile_or_first(body, config)
    only_known(body, DETOKENIZE)
    tokens = body.get("tokens")
    tokenizer = engines.for_profile(profile.name).formatter.tokenizer
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer)
            for t in tokens):
        raise ApiError(400, "'tokens' must be a list of the model's token ids.")
    return {"prompt": tokenizer.decode(tokens)}
