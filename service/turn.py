"""One turn, the same for the chat and the OpenAI API: fitted to its profile's engine,
streamed as text (the engine's stats kept aside), and counted and logged once however it
ends (turn_metrics.py). The front ends keep what is theirs: Chainlit's rendering, pacing,
Stop and Regenerate (chat/turns.py), JSON and server-sent events (api/openai.py).

    turn = Turn(engines, metrics, profile_name, user="alice", message=text)
    try:
        prompt = turn.fit(history, Message("user", text), system_prompt="", max_tokens=512)
        async for piece in turn.stream(prompt, temperature=0.7, top_p=0.9):
            ...                      # text only; turn.stats once the engine is done
    except BaseException as exc:
        turn.end(exc)                # stopped, refused or failed (logged with its trace)
        raise
    turn.end()                       # finished

What a user may send is checked before a turn begins, against the profile's limits
(service/input.py for a message, engine/limits.py for the numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from engine import ChatError, Engines, Message, Prompt, TurnStats

from store.admission import Hold
from store.usage import Spent, Usage

from .turn_metrics import Arrival, TurnMetrics, TurnRecord

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The turn ended because its user went away (a client that closed its connection);
    Stop, a closed browser and shutdown cancel the task instead. Either is `stopped`."""


def outcome_of(exc: BaseException | None) -> str:
    """How a turn that ended with `exc` is counted (None: it finished)."""
    if exc is None:
        return "finished"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, Stopped)):
        return "stopped"
    if isinstance(exc, ChatError):  # explained: the line full, the engine not serving...
        return "refused"
    return "failed"


class Turn:
    """Begun when made: counted `started`, and ended once by `end`."""

    def __init__(self, engines: Engines, metrics: TurnMetrics, profile: str, *,
                 user: str | None, message: str, arrival: Arrival | None = None,
                 ignore_eos: bool = False, usage: Usage | None = None, source: str = "chat",
                 account: str | None = None, thread_id: str | None = None,
                 session: str | None = None, hold: Hold | None = None):
        self.engines, self.metrics, self.profile = engines, metrics, profile
        # Where its cost is stored when it ends (store/usage.py), and for which account
        # (None: the API's operator key, which has none); `hold`: its place in the
        # account's limits (store/admission.py), which its cost replaces or it gives back.
        self.usage, self.source, self.account = usage, source, account
        self.hold = hold
        self.thread_id = thread_id
        # What keeps its turns on one model server behind a router (engine/remote.py): the
        # chat's id, or what an API client sent as its session.
        self.session = session or thread_id
        # Whose turn it is, for each one's fair share of the engine's line (engine/
        # admission.py): its account; without one, its chat, or the operator's API key.
        self.who = f"account:{account}" if account is not None else \
            f"chat:{thread_id}" if thread_id else "operator"
        self.ignore_eos = ignore_eos  # benchmarks: every reply runs to max_tokens
        self.record = TurnRecord("failed", user, profile, message=message)
        self.record.arrival = arrival  # when the message reached the server, and its way
        self.record.turn_began()
        self.prompt: Prompt | None = None  # once fitted
        self.stats: TurnStats | None = None  # the engine's, once it finished the reply
        self.reply = ""  # what the user got, for the log line (the front end says)
        # Every reply's text where a request asked for several (the API's `n`): a stopped
        # turn's cost counts them all, not the first alone.
        self.replies: Sequence[str] = ()
        self._ended = False
        metrics.begin(profile)

    def fit(self, history: Sequence[Message], new: Message, *, system_prompt: str,
            max_tokens: int, tools: Sequence[dict] | None = None,
            template: dict | None = None, reserve: int | None = None) -> Prompt:
        """The conversation fitted to the engine's context (engine/history.py); `template`:
        the chat template's options an API request gives; `reserve`: history.py's."""
        self.prompt = self.engines.fit(self.profile, history, new,
                                       system_prompt=system_prompt, max_tokens=max_tokens,
                                       tools=tools, template=template, reserve=reserve)
        return self.prompt

    def take_prompt(self, prompt: str | list[int], max_tokens: int,
                    truncate: tuple[int, str] | None = None) -> Prompt:
        """A prompt as given, text or token ids (a legacy completion: no template, no
        history to fit), with room for `max_tokens`; `truncate`: (k, side), only k of its
        tokens kept (engine/pool.py raw_prompt)."""
        self.prompt = self.engines.raw_prompt(self.profile, prompt, max_tokens, truncate)
        return self.prompt

    async def stream(self, prompt: Prompt,
                     on_queued: Callable[[int], Awaitable[None]] | None = None,
                     on_admitted: Callable[[], Awaitable[None]] | None = None,
                     **sampling) -> AsyncIterator[str]:
        """The reply's text as the engine writes it (after its place in line, which
        `on_queued(place)` hears about, and `on_admitted()` of its end); `stats` holds the
        engine's figures at the end. Leaving early ends the turn on the engine."""
        async with contextlib.aclosing(self.engines.stream(
                prompt, self.profile, on_queued=on_queued, on_admitted=on_admitted,
                ignore_eos=self.ignore_eos, session=self.session, who=self.who,
                **sampling)) as items:
            async for item in items:
                if isinstance(item, TurnStats):
                    self.stats = item
                else:
                    self.record.first_token_sent()
                    yield item

    def end(self, exc: BaseException | None = None) -> str:
        """Counted and logged, once (a later call changes nothing); the outcome."""
        if self._ended:
            return self.record.outcome
        self._ended = True
        self.record.outcome = outcome_of(exc)
        if self.record.outcome == "failed":  # a bug or an engine failure: with its trace
            log.error("turn failed", exc_info=exc)
        self.record.reply = self.reply
        self.metrics.end(self.record, self.stats if self.record.outcome == "finished"
                         else None)
        self._store_usage()
        return self.record.outcome

    def _store_usage(self) -> None:
        """A finished or stopped turn that the engine worked on is stored as spent: its
        replies' tokens as the engine counted them, or, stopped before it could say, as the
        profile's tokenizer counts the text the user got, every reply's, at most its room."""
        if self.usage is None:
            return
        reply_tokens = None
        if self.prompt is None or self.record.outcome not in ("finished", "stopped"):
            pass  # refused or failed: no cost
        elif self.stats is not None:
            reply_tokens = self.stats.output_tokens
        elif any(self.replies or (self.reply,)):
            # Text re-counted can come out longer than the tokens that wrote it: no reply
            # costs more than its room.
            reply_tokens = sum(min(self.engines.count_tokens(self.profile, text),
                                   self.prompt.max_tokens)
                               for text in self.replies or (self.reply,) if text)
        if reply_tokens is None:  # withdrawn before the engine wrote anything, too
            if self.hold is not None:
                self.usage.release(self.hold)
            return
        self.usage.record(Spent(self.account, self.profile, self.source, self.prompt.prompt_tokens,
                                reply_tokens, self.record.outcome == "stopped",
                                self.thread_id), self.hold)
