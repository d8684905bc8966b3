"""Chat messages -> prompt token ids, with the model's own chat template.

The template is rendered with a placeholder in place of each message's text; the rendered
string is then encoded piece by piece: the template's own pieces with special tokens
recognised, the users' and assistant's text with special tokens split into plain text.
So a user who types `<|im_end|>` gets the characters, never the control token, and cannot
end their own turn or open a system turn (rendering the whole string and encoding it would
let them).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ChatError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def as_messages(items: Sequence[Message | dict]) -> list[Message]:
    """Accept `Message`s or `{role, content}` dicts; refuse anything else clearly."""
    out = []
    for item in items:
        msg = item if isinstance(item, Message) else Message(item["role"], item["content"])
        if msg.role not in ROLES:
            raise ChatError(f"Unknown message role {msg.role!r}; allowed: {', '.join(ROLES)}.")
        if not isinstance(msg.content, str):
            raise ChatError("Message content must be text.")
        out.append(msg)
    return out


class ChatFormatter:
    """Builds prompt token ids for one tokenizer (one per engine)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError("The model's tokenizer has no chat template; pick an instruct model.")
        self.tokenizer = tokenizer

    def prompt_ids(self, messages: Sequence[Message | dict], system_prompt: str = "") -> list[int]:
        """Token ids for `messages` (system prompt first when given), ready for generation."""
        msgs = as_messages(messages)
        if system_prompt and not (msgs and msgs[0].role == "system"):
            msgs.insert(0, Message("system", system_prompt))
        # 1. Render with unique placeholders, which contain nothing a template would trim.
        tag = secrets.token_hex(8)
        marks = [f"VCHATMSG{tag}N{i}E" for i in range(len(msgs))]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": mark} for m, mark in zip(msgs, marks)],
            tokenize=False,
            add_generation_prompt=True,
        )
        # 2. Split on them; template text and message text alternate.
        pieces = re.split(f"(VCHATMSG{tag}N\\d+E)", rendered)
        ids: list[int] = []
        for piece in pieces:
            match = re.fullmatch(f"VCHATMSG{tag}N(\\d+)E", piece)
            if match:
                ids += self._encode(msgs[int(match.group(1))].content, special=False)
            elif piece:
                ids += self._encode(piece, special=True)
        return ids

    def count(self, messages: Sequence[Message | dict], system_prompt: str = "") -> int:
        """Prompt length in tokens, as the engine will see it."""
        return len(self.prompt_ids(messages, system_prompt))

    def _encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(
            text, add_special_tokens=False, split_special_tokens=not special
        )["input_ids"]
