"""What a user's message must be before it reaches the engine: checked, cleaned, or refused
with a message that says why. No UI calls here.

Kept as typed: any text, emoji, markup, text that looks like template syntax, the model's
special-token strings (engine/chat_format.py makes sure those stay text).
Cleaned, and the user told: invisible control characters (bidi overrides such as U+202E,
which can make text read differently from what the model gets, and C0/C1 controls other
than newline and tab) are removed; invalid code points (lone surrogates) become U+FFFD.
Refused: empty or whitespace-only messages, and messages over the profile's character limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine import ChatError

# C0 and C1 controls except tab and newline (\r is turned into \n first), and the
# bidirectional formatting characters: embeddings, overrides, isolates and marks.
INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f"
                       "\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")
SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class CheckedMessage:
    text: str
    removed: int = 0   # invisible control characters taken out
    replaced: int = 0  # invalid code points replaced with U+FFFD

    @property
    def notice(self) -> str | None:
        """What to tell the user about the changes, if any."""
        parts = []
        if self.removed:
            parts.append(f"removed {self.removed:,} invisible control "
                         f"character{'s' if self.removed != 1 else ''} (such as "
                         "right-to-left overrides)")
        if self.replaced:
            parts.append(f"replaced {self.replaced:,} invalid "
                         f"character{'s' if self.replaced != 1 else ''} with �")
        if not parts:
            return None
        return f"Note: before sending your message, the chat {' and '.join(parts)}."


def check_message(text: object, max_chars: int) -> CheckedMessage:
    """The message as the model will get it, or a ChatError saying why it cannot be sent."""
    if not isinstance(text, str):
        raise ChatError("That message could not be read as text. Please type it again.")
    if len(text) > max_chars:
        raise ChatError(
            f"Your message is {len(text):,} characters long; this chat takes at most "
            f"{max_chars:,} per message. Please shorten it or send it in parts.")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text, replaced = SURROGATE.subn("\ufffd", text)
    cleaned, removed = INVISIBLE.subn("", text)
    if not cleaned.strip():
        if removed:
            raise ChatError("Your message had only invisible control characters, so "
                            "there was nothing to send. Please type a message.")
        raise ChatError("Your message is empty. Please type something to send.")
    return CheckedMessage(cleaned, removed, replaced)
