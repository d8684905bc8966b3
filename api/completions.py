"""POST /v1/completions, the legacy completion: prompts continued by the model as given (no
chat template, no system prompt, no history to fit), for scripts and tools written against
`vllm serve`.

`prompt` is a string, a list of token ids, or a list of either (one choice per prompt and
reply, indexed prompt by prompt as vLLM's: prompt i's reply j is choice i * n + j; each
prompt is a turn of its own, all admitted before any runs: api/batches.py). It takes the
chat completion's decoding fields (api/options.py: n, stop, penalties, logit_bias,
response_format; `logprobs` here is the number of alternatives per token, as in OpenAI's
legacy API: each token's alternatives hold the sampled token first, then the likeliest, as
vLLM's), `max_tokens` (16 when not given, as OpenAI's and vLLM's), temperature, top_p, seed,
stream and stream_options, within the profile's limits, and vLLM's `ignore_eos`. `echo`
puts the prompt's text before each reply (with `logprobs`, a 400: the engine does not
compute the prompt's log probabilities); `suffix` and `best_of` are refused unless given as
their no-op values. Each prompt's text is held to the profile's message length; prompt
and reply must fit the context.
"""

from __future__ import annotations

from dataclasses import replace

from api.call import Call
from api.errors import ApiError
from api.options import read_decoding
from api.requests import (extra_fields, given, json_body, only_known, profile_of,
                          sampling_of, streaming)
from engine import Message, Profile, Prompt
from engine.config import Config
from engine.decoding import Decoding, Piece

FIELDS = frozenset((
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream",
    "stream_options", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "response_format", "user", "ignore_eos", "top_k", "min_p",
    "repetition_penalty", "echo", "suffix", "best_of"))
DEFAULT_MAX_TOKENS = 16
NO_OPS = {"suffix": "", "best_of": 1}
MAX_PROMPTS = 64  # prompts in one request: each is a turn in the admission line


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
    stream, include_usage, continuous = streaming(body)
    extras = extra_fields(body)
    echo = given(body, "echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be true or false.")
    prompts = prompts_of(body.get("prompt"), profile.limits.message_chars)
    if stream and len(prompts) > 1:
        raise ApiError(400, "A list of prompts is answered whole here; send 'stream': false "
                       "or one prompt per request.", code="unsupported_parameter")
    max_tokens = given(body, "max_tokens", DEFAULT_MAX_TOKENS)
    sampling = sampling_of(body, profile, max_tokens)
    decoding = read_decoding(body, profile, None, chat=False)
    if continuous:  # the usage so far in every chunk: each piece's tokens counted
        decoding = replace(decoding or Decoding(), token_ids=True)
    if echo and decoding is not None and decoding.logprobs is not None:
        raise ApiError(400, "'echo' with 'logprobs' needs the prompt's log probabilities, "
                       "which this server does not compute; leave one of them out.",
                       code="unsupported_parameter")
    asked = [{"new": Message("user", text), "prompt": text if ids is None else ids,
              "echo": echo, "max_tokens": max_tokens, "stream": stream,
              "include_usage": include_usage, "continuous_usage": continuous, "tools": None, **extras,
              "decoding": decoding, "sampling": sampling} for text, ids in prompts]
    return profile, asked[0] if len(asked) == 1 else {**asked[0], "batch": asked}


def prompts_of(prompt, max_chars: int) -> list[tuple[str, list[int] | None]]:
    """Each prompt's (text, token ids where given as ids): a string or a list of token ids,
    or a non-empty list of them (vLLM's forms)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"A request may hold at most {MAX_PROMPTS} prompts; this one "
                           f"has {len(prompt):,}.")
        return [prompt_of(p, max_chars) for p in prompt]
    return [prompt_of(prompt, max_chars)]


def prompt_of(prompt, max_chars: int) -> tuple[str, list[int] | None]:
    """(the prompt's text, its token ids where given as ids): a string or a list of token
    ids."""
    if isinstance(prompt, str) and prompt:
        if len(prompt) > max_chars:
            raise ApiError(400, f"The prompt is {len(prompt):,} characters long; this model "
                           f"takes at most {max_chars:,}.", code="message_refused")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt):
        return f"({len(prompt)} token ids)", prompt
    raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a "
                   "list of them.")


class CompletionCall(Call):
    kind = chunk_kind = "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.id = "cmpl-" + self.id.partition("-")[2]
        self.offsets = [0] * len(self.choices.texts)  # each choice's text so far, streamed

    def fit(self) -> Prompt:
        return self.turn.take_prompt(self.asked["prompt"], self.asked["max_tokens"])

    def echoed(self) -> str:
        """The prompt's text where `echo` asks for it (token ids decoded), else ""."""
        if not self.asked.get("echo"):
            return ""
        prompt = self.asked["prompt"]
        if isinstance(prompt, str):
            return prompt
        return self.turn.engines.for_profile(self.profile.name).formatter.tokenizer.decode(
            prompt)

    def whole_choices(self) -> list[dict]:
        echo = self.echoed()
        return [{"index": i, "text": echo + self.choices.text(i),
                 "logprobs": completion_logprobs(self.choices.logprobs[i])
                 if self.logprobs else None,
                 "finish_reason": self.choices.finish[i] or self.turn.stats.finish_reason}
                for i in range(len(self.choices.texts))]

    def opening(self) -> list[str]:
        echo = self.echoed()
        return [self.chunk(i, {"text": echo, "logprobs": None})
                for i in range(len(self.choices.texts))] if echo else []

    def piece_chunks(self, piece: Piece) -> list[tuple[dict, str | None]]:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(piece.logprobs, self.offsets[piece.index])
        self.offsets[piece.index] += len(piece.text)
        if not piece.text and not piece.finish_reason:
            return []
        return [({"text": piece.text, "logprobs": logprobs}, piece.finish_reason)]

    def ending(self, index: int) -> list[tuple[dict, str | None]]:
        return [({"text": "", "logprobs": None}, self.turn.stats.finish_reason)]


def completion_logprobs(tokens, offset: int = 0) -> dict:
    """/v1/completions' shape, as vLLM's: parallel lists; each place's alternatives as
    {token: logprob}, the sampled token first and then the likeliest (with `logprobs: 0`,
    the sampled one alone)."""
    tokens, offsets, at = tokens or (), [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{t.token: t.logprob, **dict(t.top)} for t in tokens],
            "text_offset": offsets}
