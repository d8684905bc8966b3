"""May this turn start, and if not, what the user is told: one place for a chat message, an
edit, Regenerate and an API request. Three questions, asked where each can be answered:

- `message`: the text as the model will get it (service/input.py), or why it cannot be
  sent: too long for the profile, or for the context even alone with the system prompt. The
  chat asks before Chainlit stores the message (chat/guard.py), the API as it reads a body.
- `place`: the account's limits (a quota, a demo guest's chats and messages a minute), decided
  and the turn's place held in one transaction (store/admission.py), so requests at the same
  moment cannot pass a cap together.
- `start`: the app shutting down, and the chat session's own pace (`Pace`: one turn at a
  time, the profile's turns a minute), at the moment the turn begins.

Each no is a `Refusal`, with the user's words and a reason, counted and logged once, here.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine import ChatError, Engines, Message, Profile
from service.documents import Document, with_documents
from service.input import CheckedMessage, check_message
from service.shutdown import Shutdown
from service.turn_metrics import TurnMetrics, TurnRecord
from store.admission import Admission, Hold, Refused

CLOSING = ("The app is restarting or shutting down, so your message was not sent. Please "
           "send it again in a minute.")
IN_FLIGHT = ("Still answering your previous message: wait for the reply to finish, or press "
             "Stop, then send this one again.")
LOGGED_CHARS = 1000  # a refused message's text in the log, at most (where the operator asks)


class Refusal(ChatError):
    """A turn that may not start: `str()` is what the user is told; `reason` labels the
    metric (message, limit, closing, turn)."""

    def __init__(self, text: str, reason: str):
        super().__init__(text)
        self.reason = reason


@dataclass
class Pace:
    """One chat session's pace: one turn at a time, at most `per_minute` begun in any minute."""

    per_minute: int
    in_flight: bool = False
    _started: collections.deque = field(default_factory=collections.deque)

    def begin(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.in_flight:
            raise Refusal(IN_FLIGHT, "turn")
        while self._started and now - self._started[0] >= 60:
            self._started.popleft()
        if len(self._started) >= self.per_minute:
            wait = math.ceil(60 - (now - self._started[0]))
            raise Refusal(f"You are sending messages faster than this chat allows "
                          f"({self.per_minute} a minute). Please wait {wait} s and send it "
                          "again.", "turn")
        self._started.append(now)
        self.in_flight = True

    def end(self) -> None:
        self.in_flight = False


class Gate:
    def __init__(self, engines: Engines, shutdown: Shutdown, limits: Admission | None,
                 metrics: TurnMetrics):
        self.engines = engines
        self.shutdown = shutdown
        self.limits = limits  # None: no account limits (a deployment without a database)
        self.metrics = metrics

    def message(self, text: object, profile: Profile, *, user: str | None,
                system_prompt: str | None = None, max_tokens: int | None = None,
                documents: Sequence[Document] = ()) -> CheckedMessage:
        """The message as the user wrote it, checked (service/input.py); with `max_tokens`,
        also refused when the profile's context could not hold it, with its `documents`
        (service/documents.py), even as a chat's first message. With documents, the user
        need not write anything."""
        try:
            checked = CheckedMessage("") if documents and isinstance(text, str) and \
                not text.strip() else check_message(text, profile.limits.message_chars)
            refused = None if max_tokens is None else self.engines.refusal_alone(
                profile.name, Message("user", with_documents(checked.text, documents)),
                system_prompt=system_prompt or "", max_tokens=max_tokens)
            if refused and documents:
                refused += (f" The attached files ({', '.join(d.name for d in documents)}) "
                            "are most of it: attach only the part you need (some pages, a "
                            "section), or choose a profile with a longer context.")
        except ChatError as exc:
            refused = str(exc)
        if refused:
            raise self._refused(refused, "message", user, profile.name, text)
        return checked

    async def place(self, user: str | None, *, profile: str, source: str, reserve: int,
                    thread_id: str | None = None, starts_chat: bool = False,
                    count: bool = True) -> Hold | None:
        """The turn's place in the account's limits (None: none apply), or a Refusal.
        `count`: False where the turn is begun already and its end counts it (the API's)."""
        if self.limits is None:
            return None
        try:
            return await self.limits.take(user, profile=profile, source=source,
                                          reserve=reserve, thread_id=thread_id,
                                          starts_chat=starts_chat)
        except Refused as exc:
            if not count:
                raise Refusal(str(exc), "limit") from None
            raise self._refused(str(exc), "limit", user, profile) from None

    def start(self, user: str | None, profile: str, pace: Pace | None = None,
              text: str | None = None, count: bool = True) -> None:
        """The turn begins now (its session's pace counts it), or a Refusal: the app is
        shutting down, or the session is answering already or past its turns a minute."""
        if self.shutdown.closing:
            if not count:
                raise Refusal(CLOSING, "closing")
            raise self._refused(CLOSING, "closing", user, profile, text)
        if pace is not None:
            try:
                pace.begin()
            except Refusal as exc:
                raise self._refused(str(exc), exc.reason, user, profile, text) from None

    def _refused(self, text: str, reason: str, user: str | None, profile: str,
                 message: object = None) -> Refusal:
        self.metrics.refuse(TurnRecord(
            "refused", user, profile, reason=reason,
            message=message[:LOGGED_CHARS] if isinstance(message, str) else None))
        return Refusal(text, reason)
