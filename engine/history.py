"""The history policy: which turns of a conversation go into the next prompt, and how much
room the reply gets. The result, a `Prompt`, is the one thing a turn hands the engine.

Tokens are counted exactly as the engine will see them (the model's tokenizer and chat
template, system prompt included). One rule for the context: the prompt may use
`max_model_len - reserve` tokens, where `reserve` is the reply's `max_tokens` but at most
half the context, so a prompt always has room (an API request that names no max_tokens
reserves one token: its reply runs to the context's end, as `vllm serve`'s does, bounded by
the profile's limit); the reply then gets what the prompt leaves,
up to `max_tokens` (less only when `max_tokens` is over half the context: `Prompt` says so,
and the UI tells the user). The system prompt and the newest turns are kept; the oldest
whole turns (a user message and its reply) are dropped until the rest fits. A new message
that cannot fit even alone is refused with the limit named.

Fitting is arithmetic on the token ids each message keeps once encoded (chat_format.py),
and only the newest messages' text is encoded, back to the first that cannot fit:
the prompt is put together, its exact length checked, and when turns must go, as many as
cover the excess are dropped and the result checked again, since a template may change
its pieces where a conversation now starts.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .chat_format import ChatFormatter, Message, as_messages
from .errors import ChatError


@dataclass(frozen=True)
class Prompt:
    messages: list[Message]  # the kept history and the new message (no system prompt)
    system_prompt: str
    token_ids: list[int]  # all of it, formatted for the engine
    max_tokens: int  # the reply's room
    asked_max_tokens: int  # what the user's settings asked for
    dropped_turns: int = 0  # whole turns left out, oldest first

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def reply_shortened(self) -> bool:
        """The context leaves the reply less room than the settings ask for."""
        return self.max_tokens < self.asked_max_tokens


def fit_history(
    formatter: ChatFormatter,
    history: Sequence[Message],
    new_message: Message,
    *,
    system_prompt: str,
    max_model_len: int,
    max_tokens: int,
    tools: Sequence[dict] | None = None,
    template: dict | None = None,
    reserve: int | None = None,
) -> Prompt:
    """Keep the newest turns that fit the context with the new message (module docstring).
    `reserve`: the tokens kept for the reply while fitting (default: `max_tokens`, at most
    half the context); the reply may then run to `max_tokens` or the context's end."""
    reserve = min(max_tokens, max_model_len // 2) if reserve is None else reserve
    budget = max_model_len - reserve
    history, new = as_messages(history), as_messages([new_message])[0]
    starts = turn_starts(history)
    drop = _cannot_fit(formatter, history, starts, new, budget)
    while True:
        kept = history[starts[drop]:] + [new] if drop < len(starts) else [new]
        messages = formatter.with_system(kept, system_prompt)
        ids, ends = formatter.assemble(messages, tools, template)
        if len(ids) <= budget:
            break
        if drop == len(starts):
            raise ChatError(
                f"Your message is {len(ids):,} tokens long (with the system prompt), "
                f"{len(ids) - budget:,} tokens over what this chat takes: at most {budget:,} "
                f"tokens per prompt ({max_model_len:,} in all, {reserve:,} kept for the reply). "
                "Please shorten it, or lower 'Max tokens' in the settings. Nothing was sent "
                "and your chat is unchanged.")
        drop = _more_to_drop(ends, len(messages) - len(kept), starts + [len(history)], drop,
                             len(ids) - budget)
    return Prompt(kept, system_prompt, ids, min(max_tokens, max_model_len - len(ids)),
                  max_tokens, drop)


def turn_starts(history: Sequence[Message]) -> list[int]:
    """Indexes where turns begin: the first message, and each later user message."""
    return [i for i, m in enumerate(history) if i == 0 or m.role == "user"]


def _cannot_fit(formatter: ChatFormatter, history: Sequence[Message], starts: list[int],
                new: Message, budget: int) -> int:
    """How many of the oldest turns cannot be kept whatever else: walking back from the
    newest message, the turn of the first whose text takes the total over the budget, and
    every older one. No older message's text is encoded, not even the rest of that turn's,
    so a history of megabytes or of 10,000 messages (an API request may carry either:
    issues 26 and 52) costs what fits the context, not what was sent."""
    total = len(formatter.content_ids(new))
    for i in range(len(history) - 1, -1, -1):
        total += len(formatter.content_ids(history[i]))
        if total > budget:
            return bisect.bisect_right(starts, i)  # the turns up to and with message i's
    return 0


def _more_to_drop(ends: list[int], offset: int, bounds: list[int], drop: int, excess: int) -> int:
    """How many turns to drop in all for `excess` more tokens to go: whole turns, oldest
    first, each with the template's pieces before its messages. `ends`: where each message
    of the current prompt ends in its ids (chat_format.py), the first kept turn's first
    message `offset` places in (after the system prompt); turn t spans
    history[bounds[t]:bounds[t + 1]]."""
    base = bounds[drop]
    while excess > 0 and drop < len(bounds) - 1:
        first, last = bounds[drop] - base + offset, bounds[drop + 1] - base + offset - 1
        excess -= ends[last] - (ends[first - 1] if first > 0 else 0)
        drop += 1
    return drop


def check_fits(prompt: Prompt, max_model_len: int) -> None:
    """The engine's side of the context rule: the prompt and the reply's room fit. Prompts
    from fit_history always do; this catches any other caller's."""
    if prompt.prompt_tokens + max(prompt.max_tokens, 1) > max_model_len:
        raise ChatError(f"The conversation is {prompt.prompt_tokens:,} tokens long and the "
                        f"reply may take {prompt.max_tokens:,}; this model takes at most "
                        f"{max_model_len:,} tokens in all.")
