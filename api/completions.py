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
stream and stream_options, within the profile's limits, and vLLM's own fields as the chat
completion takes them (`ignore_eos`, `min_tokens`, `return_token_ids`, `prompt_logprobs`...).
`echo` puts the prompt's text before each reply (with `logprobs`, the prompt's tokens come
first in them, with their log probabilities, as vLLM's; such a reply is not streamed);
`suffix` and `best_of` are refused unless given as their no-op values. Each prompt's text is
held to the profile's message length; prompt and reply must fit the context.
"""

from __future__ import annotations

from dataclasses import replace

from api.call import Call
from api.errors import ApiError
from api.options import min_tokens_fit, read_decoding
from api.requests import (extra_fields, given, only_known, profile_of, sampling_of,
                          streaming)
from engine import Message, Profile, Prompt
from engine.config import Config
from engine.decoding import Decoding, Piece

FIELDS = frozenset((
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream",
    "stream_options", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "response_format", "user", "ignore_eos", "top_k", "min_p",
    "repetition_penalty", "echo", "suffix", "best_of", "min_tokens", "logprob_token_ids",
    "return_token_ids", "return_tokens_as_token_ids", "allowed_token_ids",
    "structured_outputs", "prompt_logprobs", "truncate_prompt_tokens", "truncation_side"))
DEFAULT_MAX_TOKENS = 16
NO_OPS = {"suffix": "", "best_of": 1}
MAX_PROMPTS = 64  # prompts in one request: each is a turn in the admission line


def read_completion(body: dict, config: Config) -> tuple[Profile, dict]:
    """A legacy completion's body (JSON), checked: (profile, the turn's parts)."""
    profile = profile_of(body, config)
    if body.get("prompt_embeds") in ([], ""):  # vLLM's "none given"
        body = {k: v for k, v in body.items() if k != "prompt_embeds"}
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
    # Always a Decoding (the plain one where nothing more is asked): its Pieces end with
    # their finish reason, so a stream's last chunk carries the last text and the finish
    # together, as `vllm serve` sends it.
    decoding = read_decoding(body, profile, None, chat=False) or Decoding()
    if continuous:  # the usage so far in every chunk: each piece's tokens counted
        decoding = replace(decoding, token_ids=True)
    min_tokens_fit(decoding, max_tokens)
    if echo and decoding.logprobs is not None:
        # The prompt's tokens come with their log probabilities (vLLM's: prompt_logprobs
        # as many as `logprobs` where not asked for itself).
        if stream:
            raise ApiError(400, "'echo' with 'logprobs' is answered whole here; send "
                           "'stream': false, or leave one of them out.",
                           code="unsupported_parameter")
        if decoding.prompt_logprobs is None:
            decoding = replace(decoding, prompt_logprobs=decoding.logprobs)
    shared = {"echo": echo, "max_tokens": max_tokens, "stream": stream,
              "return_token_ids": decoding.token_ids and bool(body.get("return_token_ids")),
              "truncate": truncation(body), "include_usage": include_usage,
              "continuous_usage": continuous, "tools": None, **extras,
              "decoding": decoding, "sampling": sampling}
    asked = [{"new": Message("user", text), "prompt": text if ids is None else ids, **shared}
             for text, ids in prompts]
    return profile, asked[0] if len(asked) == 1 else {**asked[0], "batch": asked}


def truncation(body: dict) -> tuple[int, str] | None:
    """vLLM's truncate_prompt_tokens (k: the prompt's last k tokens kept; -1: as many as
    fit) and truncation_side ("left", its default: the last ones; "right": the first)."""
    keep, side = body.get("truncate_prompt_tokens"), given(body, "truncation_side", "left")
    if side not in ("left", "right"):
        raise ApiError(400, "'truncation_side' must be \"left\" or \"right\".")
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1 \
            or keep >= 2**31:
        raise ApiError(400, "'truncate_prompt_tokens' must be -1 (as many as fit) or a "
                       "number of tokens from 1.")
    return keep, side


def prompts_of(prompt, max_chars: int) -> list[tuple[str, list[int] | None]]:
    """Each prompt's (text, token ids where given as ids): a string or a list of token ids,
    or a non-empty list of them (vLLM's forms)."""
    if prompt in (None, "", []):  # in the words of vLLM's server (its tests match them)
        raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty "
                       "('prompt_embeds' are not taken here: send 'prompt' as text or token "
                       "ids).")
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
        return self.turn.take_prompt(self.asked["prompt"], self.asked["max_tokens"],
                                     self.asked.get("truncate"))

    def echoed(self) -> str:
        """The prompt's text where `echo` asks for it (token ids decoded), else ""."""
        if not self.asked.get("echo"):
            return ""
        prompt = self.asked["prompt"]
        return prompt if isinstance(prompt, str) else self.tokenizer().decode(prompt)

    def tokenizer(self):
        """The profile's model's tokenizer."""
        return self.turn.engines.for_profile(self.profile.name).formatter.tokenizer

    def whole_choices(self) -> list[dict]:
        echo, decoding = self.echoed(), self.asked["decoding"]
        prompt_places = self.prompt_places() if echo and self.logprobs else []
        return [{"index": i, "text": echo + self.choices.text(i),
                 "logprobs": completion_logprobs(
                     prompt_places + places(self.choices.logprobs[i]))
                 if self.logprobs else None,
                 "finish_reason": self.choices.finish[i] or self.turn.stats.finish_reason,
                 # vLLM's own keys, null unless asked
                 "token_ids": self.choices.ids[i] if self.token_ids else None,
                 "prompt_logprobs": self.choices.prompt_logprobs
                 if decoding.prompt_logprobs is not None else None,
                 "prompt_token_ids": self.prompt.token_ids if self.token_ids else None}
                for i in range(len(self.choices.texts))]

    def prompt_places(self) -> list[tuple[str, float | None, dict | None]]:
        """The prompt's tokens for `echo` with `logprobs`, as vLLM's: each with its log
        probability and alternatives (itself first, then the `logprobs` likeliest); the
        first has none."""
        decoding = self.asked["decoding"]
        top, as_ids = decoding.logprobs, decoding.tokens_as_ids
        tokenizer = self.tokenizer()
        out = []
        for token_id, place in zip(self.prompt.token_ids, self.choices.prompt_logprobs or ()):
            if place is None:
                out.append((f"token_id:{token_id}" if as_ids
                            else tokenizer.decode([token_id]), None, None))
                continue
            ranked = sorted(place.items(), key=lambda kv: (kv[0] != str(token_id),
                                                           kv[1]["rank"] or 0))
            names = {k: f"token_id:{k}" if as_ids else v["decoded_token"] or ""
                     for k, v in ranked}
            out.append((names[str(token_id)], place[str(token_id)]["logprob"],
                        {names[k]: v["logprob"] for k, v in ranked[:top + 1]}))
        return out

    def opening(self) -> list[str]:
        echo = self.echoed()
        return [self.chunk(i, {"text": echo, "logprobs": None})
                for i in range(len(self.choices.texts))] if echo else []

    def piece_chunks(self, piece: Piece) -> list[tuple[dict, str | None]]:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(places(piece.logprobs), self.offsets[piece.index])
        first = self.offsets[piece.index] == 0
        self.offsets[piece.index] += len(piece.text)
        sent = bool(piece.text or piece.finish_reason)
        ids = self.held_ids(piece, sent) if self.token_ids else None
        if not sent:
            return []
        choice = {"text": piece.text, "logprobs": logprobs}
        if self.token_ids:  # vLLM's return_token_ids: the prompt's ids on the first chunk
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = self.prompt.token_ids
        return [(choice, piece.finish_reason)]

    def ending(self, index: int) -> list[tuple[dict, str | None]]:
        return [({"text": "", "logprobs": None}, self.turn.stats.finish_reason)]


def places(tokens) -> list[tuple[str, float | None, dict | None]]:
    """Generated tokens' log probabilities as (token, logprob, alternatives): the sampled
    token first among its alternatives, then the likeliest (with `logprobs: 0`, alone)."""
    return [(t.token, t.logprob, {t.token: t.logprob, **dict(t.top)}) for t in tokens or ()]


def completion_logprobs(tokens, offset: int = 0) -> dict:
    """/v1/completions' shape, as vLLM's: parallel lists of `places`' tokens, their log
    probabilities and alternatives as {token: logprob}, and each token's text offset."""
    offsets, at = [], offset
    for token, _, _ in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": [token for token, _, _ in tokens],
            "token_logprobs": [logprob for _, logprob, _ in tokens],
            "top_logprobs": [top for _, _, top in tokens], "text_offset": offsets}
