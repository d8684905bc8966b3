"""The history policy: which turns of a conversation go into the next prompt.

Tokens are counted exactly as the engine will see them (the model's tokenizer and chat
template, system prompt included). The prompt may use `max_model_len - max_tokens` tokens,
so the reply always has room. The system prompt and the newest turns are kept; the oldest
whole turns (a user message and its reply) are dropped until the rest fits. A new message
that cannot fit even alone is refused with the limit named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .chat_format import ChatFormatter, Message
from .errors import ChatError


class MessageTooLong(ChatError):
    """A single message that does not fit the context even with no history."""


@dataclass(frozen=True)
class Fitted:
    messages: list[Message]  # what to send: kept history + the new message
    dropped_turns: int  # whole turns left out, oldest first
    prompt_ids: list[int]  # `messages` formatted for the engine (pass on; don't redo it)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def fit_history(
    formatter: ChatFormatter,
    history: Sequence[Message],
    new_message: Message,
    *,
    system_prompt: str,
    max_model_len: int,
    max_tokens: int,
) -> Fitted:
    """Keep the newest turns that fit `max_model_len - max_tokens` with the new message."""
    budget = max_model_len - max_tokens
    starts = turn_starts(history)
    formatted: dict[int, list[int]] = {}  # turns dropped -> prompt ids; each formatted once

    def ids(drop: int) -> list[int]:
        if drop not in formatted:
            formatted[drop] = formatter.prompt_ids(_kept(history, starts, drop) + [new_message],
                                                   system_prompt)
        return formatted[drop]

    alone = len(ids(len(starts)))  # every turn dropped: the new message alone
    if alone > budget:
        raise MessageTooLong(
            f"Your message is {alone:,} tokens long (with the system prompt), but this chat "
            f"takes at most {budget:,} tokens per prompt ({max_model_len:,} in all, "
            f"{max_tokens:,} kept for the reply). Please shorten it, or lower "
            "'Max tokens' in the settings. Nothing was sent and your chat is unchanged."
        )
    # Binary search for the fewest dropped turns that fit: counting is exact but costly.
    lo, hi = 0, len(starts)  # dropping `hi` turns (everything) is known to fit
    while lo < hi:
        mid = (lo + hi) // 2
        if len(ids(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return Fitted(_kept(history, starts, lo) + [new_message], lo, ids(lo))


def turn_starts(history: Sequence[Message]) -> list[int]:
    """Indexes where turns begin: each user message opens one."""
    return [i for i, m in enumerate(history) if m.role == "user"] or (
        [0] if history else [])


def _kept(history: Sequence[Message], starts: list[int], drop: int) -> list[Message]:
    """The history without its `drop` oldest turns."""
    return list(history[starts[drop]:]) if drop < len(starts) else []
