"""What a turn may ask of decoding beyond its temperature, top_p and seed (the OpenAI API's
fields: api/requests.py reads and bounds them), in vLLM's terms, and what such a turn yields.

A turn that asks for none of it (every chat turn, most API requests) passes no `Decoding`
and runs the engines' plain path: text only, one reply. A turn with a `Decoding` gets
`Piece`s: each choice's text with its index, its tokens' log probabilities where asked, and
its finish reason on its last piece.

    decoding = Decoding(n=2, stop=("\\n\\n",), logprobs=3, json_object=True)
    async for item in engines.stream(prompt, profile, decoding=decoding):
        ...  # Piece(index, text, logprobs, finish_reason), then one TurnStats
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decoding:
    n: int = 1  # replies to the one prompt (vLLM's parallel sampling; a seed gives seed + i)
    stop: tuple[str, ...] = ()  # the reply ends before the first of these (not included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    top_k: int = 0  # sample among the k likeliest tokens (0: all); vLLM's own, as min_p
    min_p: float = 0.0  # drop tokens below min_p x the likeliest one's probability
    repetition_penalty: float = 1.0  # vLLM's own: above 1 discourages repeating tokens
    logprobs: int | None = None  # alternatives per token (0: the chosen one's only); None: no
    json_schema: dict | None = field(default=None, hash=False)  # the reply follows it
    json_object: bool = False  # the reply is a JSON object
    special_tokens: bool = False  # kept in the text (Qwen's tool-call markers are special)
    token_ids: bool = False  # each Piece carries its token ids (the API's usage so far)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's own: the reply uses only these
    tokens_as_ids: bool = False  # log probabilities' tokens as "token_id:N" (vLLM's own)
    # vLLM's own: each place reports these tokens' log probabilities (and the sampled
    # one's) in place of the `logprobs` likeliest
    logprob_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # vLLM's own: no end (EOS or stop) before this many tokens
    prompt_logprobs: int | None = None  # vLLM's own: alternatives per prompt token; None: no
    # vLLM's own structured outputs as asked (StructuredOutputsParams' fields: json, regex,
    # choice, grammar...), in place of json_schema / json_object
    structured_outputs: dict | None = field(default=None, hash=False)

    def reported(self) -> int | None:
        """How many alternatives each token's log probability comes with (piece_of's
        `top`): -1 for every token vLLM reports (logprob_token_ids'), None: none asked."""
        return -1 if self.logprob_token_ids and self.logprobs is not None else self.logprobs

    def structured(self) -> dict | None:
        """vLLM's structured outputs for the reply's form (StructuredOutputsParams'
        fields), or None for free text."""
        if self.structured_outputs is not None:
            return dict(self.structured_outputs)
        if self.json_schema is not None:
            return {"json": self.json_schema}
        if self.json_object:
            return {"json_object": True}
        return None

    def vllm_params(self) -> dict:
        """Arguments for vLLM's SamplingParams."""
        from vllm.sampling_params import StructuredOutputsParams

        structured = self.structured()
        return {"n": self.n, "stop": list(self.stop) or None,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "logit_bias": dict(self.logit_bias) or None,
                "logprobs": None if self.logprob_token_ids else self.logprobs,
                "logprob_token_ids": list(self.logprob_token_ids) or None,
                "min_tokens": self.min_tokens, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "skip_special_tokens": not self.special_tokens,
                "allowed_token_ids": list(self.allowed_token_ids) or None,
                "prompt_logprobs": self.prompt_logprobs,
                "structured_outputs": StructuredOutputsParams(**structured)
                if structured else None}

    def completion_fields(self) -> dict:
        """The same, as fields of a vLLM server's /v1/completions request (a remote
        preset: engine/remote.py): the OpenAI ones, and vLLM's own under "extra_body"."""
        extra = {"skip_special_tokens": not self.special_tokens, "top_k": self.top_k,
                 "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        if (structured := self.structured()) is not None:
            extra["structured_outputs"] = structured
        if self.token_ids:
            extra["return_token_ids"] = True
        if self.allowed_token_ids:
            extra["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.tokens_as_ids:
            extra["return_tokens_as_token_ids"] = True
        if self.logprob_token_ids:
            extra["logprob_token_ids"] = list(self.logprob_token_ids)
        if self.min_tokens:
            extra["min_tokens"] = self.min_tokens
        return {"n": self.n, "stop": list(self.stop) or None,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "logit_bias": {str(k): v for k, v in self.logit_bias} or None,
                "logprobs": self.logprobs, "extra_body": extra}


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability, and the likeliest tokens at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # (token, logprob), likeliest first


@dataclass(frozen=True)
class Piece:
    index: int  # the choice it belongs to
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None  # where asked: one per token of `text`
    finish_reason: str | None = None  # on the choice's last piece
    token_ids: tuple[int, ...] | None = None  # the tokens of `text`, where the engine says
    # The prompt's log probabilities where asked (a first, empty Piece holds them), in
    # vLLM's JSON shape: per prompt token None or {"id": {"logprob", "rank", "decoded_token"}}
    prompt_logprobs: list | None = field(default=None, hash=False, compare=False)


def piece_of(completion, top: int | None, as_ids: bool = False) -> Piece:
    """A Piece from one of vLLM's CompletionOutputs (a delta), with `top` alternatives per
    token where log probabilities were asked for (`as_ids`: each token as "token_id:N";
    `top` -1: every token vLLM reports, as for logprob_token_ids)."""
    logprobs = None
    if top is not None and completion.logprobs is not None:
        logprobs = tuple(token_logprob(token_id, alternatives, top, as_ids)
                         for token_id, alternatives
                         in zip(completion.token_ids, completion.logprobs))
    finish = completion.finish_reason if completion.finished() else None
    return Piece(completion.index, completion.text, logprobs, finish,
                 tuple(completion.token_ids))


# What a log probability of -inf (a token a structured output rules out) is sent as: JSON
# has no infinity (the reply was a 500), and vLLM's server sends this.
LOWEST_LOGPROB = -9999.0


def prompt_logprobs_of(logprobs) -> list | None:
    """vLLM's prompt log probabilities (per token None or {id: Logprob}) in its server's
    JSON shape, -inf as -9999.0 (as its server clamps them)."""
    if logprobs is None:
        return None
    return [None if place is None else {
        str(i): {"logprob": max(p.logprob, LOWEST_LOGPROB), "rank": p.rank,
                 "decoded_token": p.decoded_token} for i, p in place.items()}
        for place in logprobs]


def token_logprob(token_id: int, alternatives: dict, top: int, as_ids: bool = False
                  ) -> TokenLogprob:
    """vLLM's {token id: Logprob} at one place (the chosen token and the `top` likeliest;
    `as_ids`: each token named "token_id:N", as vLLM's return_tokens_as_token_ids)."""
    def name(i: int, p) -> str:
        return f"token_id:{i}" if as_ids else p.decoded_token or ""

    chosen = alternatives[token_id]
    if top == -1:  # every token reported, in vLLM's order (the sampled one first)
        ranked = list(alternatives.items())
    else:
        ranked = sorted(((i, p) for i, p in alternatives.items()
                         if p.rank is not None and p.rank <= top),
                        key=lambda ip: ip[1].rank)
    return TokenLogprob(name(token_id, chosen), max(chosen.logprob, LOWEST_LOGPROB),
                        tuple((name(i, p), max(p.logprob, LOWEST_LOGPROB)) for i, p in ranked))


def remote_logprobs(logprobs, top: int) -> tuple[TokenLogprob, ...] | None:
    """A /v1/completions choice's log probabilities (tokens, token_logprobs, top_logprobs:
    vLLM's server puts the chosen token among the alternatives) as TokenLogprobs with the
    `top` likeliest (-1: every one the server sent, as for logprob_token_ids)."""
    if logprobs is None or not logprobs.tokens:
        return None
    tops = logprobs.top_logprobs or [None] * len(logprobs.tokens)
    cut = None if top == -1 else top
    return tuple(TokenLogprob(token, logprob if logprob is not None else LOWEST_LOGPROB,
                              tuple(sorted((alt or {}).items(), key=lambda kv: -kv[1])[:cut]))
                 for token, logprob, alt in zip(logprobs.tokens, logprobs.token_logprobs, tops))
