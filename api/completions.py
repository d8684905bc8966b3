"""POST /v1/completions, the legacy completion: one prompt, as text or token ids, continued
by the model as given (no chat template, no system prompt, no history to fit), for scripts
and tools written against `vllm serve`.

It takes the chat completion's decoding fields (api/options.py: n, stop, penalties,
logit_bias, response_format; `logprobs` here is the number of alternatives per token, as in
OpenAI's legacy API), `max_tokens` (16 when not given, as OpenAI's and vLLM's), temperature,
top_p, seed, stream and stream_options, within the profile's limits, and vLLM's
`ignore_eos`. One prompt per request; `echo`, `suffix` and `best_of` are refused unless
given as their no-op values. The prompt's text is held to the profile's message length;
prompt and reply must fit the context.
"""

from __future__ import annotations

from api.call import Call
from api.choices import legacy_logprobs
from api.errors import ApiError
from api.options import read_decoding
from api.requests import (extra_fields, given, json_body, only_known, profile_of,
                          sampling_of, streaming)
from engine import Message, Profile, Prompt
from engine.config import Config
from engine.decoding import Piece

FIELDS = frozenset((
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream",
    "stream_options", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "response_format", "user", "ignore_eos", "top_k", "min_p",
    "repetition_penalty", "echo", "suffix", "best_of"))
DEFAULT_MAX_TOKENS = 16
NO_OPS = {"echo": False, "suffix": "", "best_of": 1}


def read_completion(raw: bytes, config: Config) -> tuple[Profile, dict]:
    """A legacy completion's body, checked: (profile, the turn's parts)."""
    body = json_body(raw)
    profile = profile_of(body, config)
    only_known(body, FIELDS)
    for name, no_op in NO_OPS.items():
        if given(body, name, no_op) not in (no_op, None) and not (
                name == "best_of" and body[name] == given(body, "n", 1)):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out.",
                           code="unsupported_parameter")
    stream, include_usage = streaming(body)
    extras = extra_fields(body)
    text, ids = prompt_of(body.get("prompt"), profile.limits.message_chars)
    max_tokens = given(body, "max_tokens", DEFAULT_MAX_TOKENS)
    sampling = sampling_of(body, profile, max_tokens)
    return profile, {"new": Message("user", text), "prompt": text if ids is None else ids,
                     "max_tokens": max_tokens, "stream": stream,
                     "include_usage": include_usage, "tools": None, **extras,
                     "decoding": read_decoding(body, profile, None, chat=False),
                     "sampling": sampling}


def prompt_of(prompt, max_chars: int) -> tuple[str, list[int] | None]:
    """(the prompt's text, its token ids where given as ids): a string or a list of token
    ids, or a list holding one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if len(prompt) > max_chars:
            raise ApiError(400, f"The prompt is {len(prompt):,} characters long; this model "
                           f"takes at most {max_chars:,}.", code="message_refused")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt):
        return f"({len(prompt)} token ids)", prompt
    raise ApiError(400, "'prompt' must be one non-empty string or one list of token ids.")


class CompletionCall(Call):
    kind = chunk_kind = "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.id = "cmpl-" + self.id.partition("-")[2]
        self.offsets = [0] * len(self.choices.texts)  # each choice's text so far, streamed

    def fit(self) -> Prompt:
        return self.turn.take_prompt(self.asked["prompt"], self.asked["max_tokens"])

    def whole_choices(self) -> list[dict]:
        return self.choices.completions(self.turn.stats.finish_reason, self.logprobs)

    def opening(self) -> list[str]:
        return []

    def piece_chunks(self, piece: Piece) -> list[tuple[dict, str | None]]:
        logprobs = None
        if self.logprobs:
            logprobs = legacy_logprobs(piece.logprobs, self.offsets[piece.index])
        self.offsets[piece.index] += len(piece.text)
        if not piece.text and not piece.finish_reason:
            return []
        return [({"text": piece.text, "logprobs": logprobs}, piece.finish_reason)]

    def ending(self, index: int) -> list[tuple[dict, str | None]]:
        return [({"text": "", "logprobs": None}, self.turn.stats.finish_reason)]
