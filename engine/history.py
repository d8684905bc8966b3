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
    prompt_tokens: int


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
    alone = formatter.count([new_message], system_prompt)
    if alone > budget:
        raise MessageTooLong(
            f"Your message is {alone:,} tokens long (with the system prompt), but this chat "
            f"takes at most {budget:,} tokens per prompt ({max_model_len:,} in all, "
            f"{max_tokens:,} kept for the reply). Please shorten it, or lower "
            "'Max tokens' in the settings. Nothing was sent and your chat is unchanged."
        )
    starts = turn_starts(history)
    # Binary search for the fewest dropped turns that fit: counting is exact but costly.
    lo, hi = 0, len(starts)  # dropping `hi` turns (everything) is known to fit
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(formatter, history, starts, mid, new_message, system_prompt) <= budget:
            hi = mid
        else:
            lo = mid + 1
    kept = list(history[starts[lo]:]) if lo < len(starts) else []
    messages = kept + [new_message]
    return Fitted(messages, lo, formatter.count(messages, system_prompt))


def turn_starts(history: Sequence[Message]) -> list[int]:
    """Indexes where turns begin: each user message opens one."""
    return [i for i, m in enumerate(history) if m.role == "user"] or (
        [0] if history else [])


def _count(formatter, history, starts, drop, new_message, system_prompt) -> int:
    kept = list(history[starts[drop]:]) if drop < len(starts) else []
    return formatter.count(kept + [new_message], system_prompt)
