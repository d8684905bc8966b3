"""One chat session's state, in one place: profile, user settings and history.

No UI code here: app.py's hooks keep one `Conversation` per Chainlit session, and
chat/turns.py answers its turns.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from engine import ChatError, Message, Profile, Prompt
from engine.limits import bounds, shown, system_prompt_fits

from service.admission import Pace
from service.documents import Document, with_documents
from service.input import check_message
from .view import dropped_notice, short_reply_notice


@dataclass(frozen=True)
class Settings:
    """What the user may change in the settings panel, within the profile's limits."""

    temperature: float
    max_tokens: int
    system_prompt: str
    show_stats: bool = True

    @classmethod
    def defaults(cls, profile: Profile) -> "Settings":
        return cls(profile.sampling.temperature, profile.sampling.max_tokens,
                   profile.system_prompt)


@dataclass(frozen=True)
class Exchange:
    """A user's message and the reply to it, as the conversation keeps them."""

    user: Message
    reply: Message  # as shown: a stopped reply is the part the user saw
    message_id: str | None = None  # the user's message in the chat (for edits)
    reply_id: str | None = None  # the reply's message in the chat (to answer again)
    documents: tuple[Document, ...] = ()  # the files attached to the message (in `user`)


@dataclass
class Conversation:
    profile: Profile
    settings: Settings
    turns: list[Exchange] = field(default_factory=list)
    told_about_dropping: bool = False
    told_about_short_replies: bool = False
    # One turn at a time, the profile's turns a minute (service/admission.py).
    pace: Pace | None = None
    # The last prompt this chat sent, in hashed pieces (prompt_pieces): vLLM's prefix cache
    # likely holds it still, so the next prompt is read from where the two part.
    _last_prompt: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.pace is None and self.profile is not None:
            self.pace = Pace(self.profile.limits.turns_per_minute)

    @classmethod
    def start(cls, profile: Profile) -> "Conversation":
        return cls(profile, Settings.defaults(profile))

    @property
    def in_flight(self) -> bool:
        """A turn of this session is being answered."""
        return self.pace.in_flight

    def history(self) -> list[Message]:
        """The turns as messages (the same objects each time: they keep their token ids)."""
        return [msg for turn in self.turns for msg in (turn.user, turn.reply)]

    def end_turn(self) -> None:
        self.pace.end()

    def record(self, user: Message, reply: str, message_id: str | None = None,
               reply_id: str | None = None, documents: tuple[Document, ...] = ()) -> None:
        self.turns.append(Exchange(user, Message("assistant", reply), message_id, reply_id,
                                   tuple(documents)))

    def restore(self, turns: list[tuple[str, str, str, str]],
                documents: dict[str, list[Document]] | None = None) -> None:
        """A stored chat's turns (stored_turns), as if they had just been recorded, each
        message with the files it came with (store/documents.py's, by message id): the
        same text as in the live chat."""
        for message_id, user, reply, reply_id in turns:
            attached = tuple((documents or {}).get(message_id, ()))
            self.record(Message("user", with_documents(user, attached)), reply, message_id,
                        reply_id, attached)

    def documents_of(self, message_id: str | None) -> tuple[Document, ...]:
        """The files that came with one of the chat's messages (an edit keeps them)."""
        return next((t.documents for t in self.turns if t.message_id == message_id), ())

    def take_back(self, reply_id: str | None) -> Exchange | None:
        """The user asked for the last reply again: its turn leaves the history (and is
        returned, to answer its message again). None if `reply_id` is not the last reply."""
        if not self.turns or reply_id is None or self.turns[-1].reply_id != reply_id:
            return None
        return self.turns.pop()

    def rewind(self, message_id: str | None) -> int:
        """The user edited an earlier message: that turn and every later one leave the
        history, as they leave the page. Returns how many turns went (0: not an edit)."""
        if message_id is None:
            return 0
        for i, turn in enumerate(self.turns):
            if turn.message_id == message_id:
                dropped = len(self.turns) - i
                del self.turns[i:]
                return dropped
        return 0

    def new_tokens(self, prompt: Prompt) -> int:
        """About how many of the prompt's tokens the engine has to read: those past what it
        shares with the last prompt sent (unless the cache has let that go since), which
        it now is."""
        pieces = prompt_pieces(prompt.token_ids)
        shared = next((i for i, (a, b) in enumerate(zip(pieces, self._last_prompt)) if a != b),
                      min(len(pieces), len(self._last_prompt)))
        self._last_prompt = pieces
        return prompt.prompt_tokens - shared * PROMPT_PIECE

    def sampling(self) -> dict:
        """The user's sampling settings, for the engine's stream() call."""
        return {"temperature": self.settings.temperature}

    def notices(self, prompt: Prompt) -> list[str]:
        """What to tell the user about how this turn's prompt was fitted, once per chat."""
        out = []
        if prompt.dropped_turns and not self.told_about_dropping:
            self.told_about_dropping = True
            out.append(dropped_notice(prompt.dropped_turns))
        if prompt.reply_shortened and not self.told_about_short_replies:
            self.told_about_short_replies = True
            out.append(short_reply_notice(prompt.max_tokens, prompt.asked_max_tokens))
        return out

    def update_settings(self, values: dict) -> list[str]:
        """Apply valid values; return one message per refused value (those stay as they were)."""
        limits, problems, changes = self.profile.limits, [], {}
        checks = bounds(limits)
        for key in ("temperature", "max_tokens"):
            if key not in values:
                continue
            bound = checks[key]
            value = _number(values[key], bound.kind)
            if value is None or not bound.holds(value):
                problems.append(f"{bound.label} must be between {shown(bound.lo)} and "
                                f"{shown(bound.hi)}; kept {getattr(self.settings, key):g}.")
            else:
                changes[key] = value
        if "system_prompt" in values:
            prompt = values["system_prompt"]
            if not isinstance(prompt, str) or not system_prompt_fits(limits, prompt):
                problems.append(f"The system prompt may be at most "
                                f"{limits.system_prompt_chars:,} characters; kept the old one.")
            else:
                changes["system_prompt"] = prompt
        if "show_stats" in values:
            changes["show_stats"] = bool(values["show_stats"])
        self.settings = replace(self.settings, **changes)
        return problems


# Tokens per piece of a prompt that a chat keeps as one hash (not its ids, which would be
# megabytes for a long chat): what it shares with the next prompt is counted in these.
PROMPT_PIECE = 256


def prompt_pieces(token_ids: list[int]) -> list[int]:
    """The hashes of a prompt's whole pieces of PROMPT_PIECE tokens, in order."""
    return [hash(tuple(token_ids[i:i + PROMPT_PIECE]))
            for i in range(0, len(token_ids) - PROMPT_PIECE + 1, PROMPT_PIECE)]


# A reply's metadata key: how much of its stored text is the reply the history holds (what
# follows is the stats line or the "Stopped." mark, shown but never part of the history).
HISTORY_CHARS = "history_chars"


def stored_turns(steps: list[dict], message_chars: int, with_files: Collection[str] = ()
                 ) -> list[tuple[str, str, str, str]]:
    """A stored chat's turns, as the live chat recorded them: (the user message's id, its
    text, the reply that answered it (a reply carries HISTORY_CHARS), the reply's id). A
    message that got no reply
    (refused, withdrawn, failed) and the notes around turns are not part of it, as they
    were not live. The user's text goes through the same check as when it was sent;
    `with_files`: the messages that came with files, which need no text."""
    turns, asked = [], None
    for step in sorted(steps, key=lambda s: s.get("createdAt") or ""):
        if step.get("type") == "user_message":
            asked = step
        elif step.get("type") == "assistant_message" and asked is not None:
            chars = (step.get("metadata") or {}).get(HISTORY_CHARS)
            if isinstance(chars, int) and not isinstance(chars, bool):
                try:
                    text = asked.get("output") or ""
                    if text.strip() or asked.get("id") not in with_files:
                        text = check_message(text, message_chars).text
                    turns.append((asked.get("id"), text, (step.get("output") or "")[:chars],
                                  step.get("id")))
                except ChatError:
                    pass
                asked = None
    return turns


def cut_off_run(steps: list[dict]) -> str | None:
    """The id of a stored chat's last turn if it never ended: Chainlit stores the "run"
    step around each message's handling when it begins and its end when it ends, so a run
    with no end was cut off with its process (its reply, stored only when finished, is
    lost)."""
    runs = [s for s in steps if s.get("type") == "run"]
    last = max(runs, key=lambda s: s.get("createdAt") or "", default=None)
    return last.get("id") if last is not None and not last.get("end") else None


def _number(value, kind):
    if isinstance(value, bool):
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        return None
    if kind is int and isinstance(value, float) and not value.is_integer():
        return None
    return number
