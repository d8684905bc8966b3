"""A chat turn as Chainlit shows it, from admission to its stored reply: wait for the
engines (saying so), fit the history, stream the reply at the app's pace, record it, offer
Regenerate under it. The turn itself (fitting, streaming, counting and logging it once
however it ends) is service/turn.py's, as for the API; whatever goes wrong, the user gets
a plain message.

app.py's hooks hand admitted turns here (`Turns.take`) and Regenerate presses
(`Turns.regenerate`); the engines are reached through engine/'s `Engines` only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import chainlit as cl
from chainlit.chat_context import chat_context

from chat.clock import CLOCK
from chat.data_layer import ChatDataLayer
from chat.session import HISTORY_CHARS, Conversation, Exchange
from chat.streaming import Coalescer, Pace, Reading
from chat.view import (CUT_SHORT, NOT_ANSWERED, NOT_REGENERATED, NOT_SAVED, STARTING_TURN,
                       UNEXPECTED, WITHDRAWN, queued_notice, reading_notice, reply_metadata,
                       stats_line)
from engine import ChatError, Engines, Message, Prompt
from engine.settings import setting
from service.admission import Gate, Refusal
from service.documents import Document
from service.loop import off_the_loop
from service.shutdown import Shutdown
from service.turn import Turn
from service.turn_metrics import Arrival, TurnMetrics
from store.admission import Hold
from store.usage import Usage

log = logging.getLogger(__name__)

REGENERATE = "regenerate"  # the action under the last reply


class RegenerateButton(cl.Action):
    """Chainlit's action with its event's dict made field by field, the same dict as
    Chainlit's to_dict (dataclasses_json), which is slow on every turn's way to its first
    token (the last reply's button goes)."""

    def to_dict(self, encode_json: bool = False) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def user_name() -> str | None:
    user = cl.user_session.get("user")
    return getattr(user, "identifier", None)


class WaitNote:
    """A turn's note while it waits (for the model to start, then for its place in line,
    updated as it moves up, or for a long message to be read), removed once the reply
    starts or the turn ends. Shown, never stored: it is not part of the chat (and in a line
    of hundreds, storing each new place was a database write per place per turn)."""

    def __init__(self, profile: str, metrics: TurnMetrics):
        self.profile = profile
        self.metrics = metrics
        self.message: cl.Message | None = None
        self.in_line = False  # counted in vchat_turns_waiting

    async def say(self, text: str) -> None:
        new, self.message = self.message is None, self.message or cl.Message(content="")
        self.message.content = text
        if new:
            self.message.created_at = CLOCK.utc_now()
        emitter, step = cl.context.emitter, self.message.to_dict()
        await (emitter.send_step(step) if new else emitter.update_step(step))

    async def show(self, place: int) -> None:
        if not self.in_line:
            self.in_line = True
            self.metrics.waiting.labels(self.profile).inc()
        await self.say(queued_notice(place))

    async def remove(self) -> None:
        if self.in_line:
            self.in_line = False
            self.metrics.waiting.labels(self.profile).dec()
        if self.message is not None:
            message, self.message = self.message, None
            await cl.context.emitter.delete_step(message.to_dict())


class Turns:
    def __init__(self, engines: Engines, metrics: TurnMetrics, shutdown: Shutdown, gate: Gate,
                 store: ChatDataLayer, pace: Pace, usage: Usage,
                 hold_of: Callable[[str], Hold | None], ignore_eos: bool = False,
                 reading_note_s: float | None = None):
        self.engines = engines
        self.gate = gate  # may a Regenerate's turn start (service/admission.py)
        # A message whose reading should take this long shows its progress meanwhile.
        self.reading_note_s = setting("VCHAT_READING_NOTE_S") if reading_note_s is None \
            else reading_note_s
        self.usage = usage  # each turn's cost stored (store/usage.py)
        # The place chat/guard.py took in the account's limits for a session's next turn.
        self.hold_of = hold_of
        self.metrics = metrics
        self.shutdown = shutdown
        self.store = store
        self.pace = pace
        self.ignore_eos = ignore_eos  # benchmarks: every reply runs to max_tokens
        self._tasks: set[asyncio.Task] = set()  # regenerated answers, referenced till done

    async def take(self, conv: Conversation, user: Message, message_id: str,
                   notice: str | None = None, arrival: Arrival | None = None,
                   hold: Hold | None = None, documents: tuple[Document, ...] = ()) -> None:
        """An admitted turn (service/admission.py), answered; whatever goes wrong is said
        plainly. Counted and logged once, however it ends (service/turn.py). `arrival`: when the
        message reached the server and passed each step before its turn (time.monotonic),
        for the turn's first token as the app sends it."""
        account = user_name()
        turn = Turn(self.engines, self.metrics, conv.profile.name, user=account,
                    message=user.content, arrival=arrival, ignore_eos=self.ignore_eos,
                    usage=self.usage, account=account, thread_id=cl.context.session.thread_id,
                    hold=hold)
        ended = None
        try:
            with self.shutdown.turn():
                await self.withdraw_regenerate()  # the reply that offered it is not the last
                if notice:
                    await cl.Message(content=notice).send()
                await self._answer(conv, turn, user, message_id, tuple(documents))
        except asyncio.CancelledError as exc:  # Stop, a closed browser, shutdown: text kept
            ended = exc
            raise
        except ChatError as exc:  # explained (queue full, engine restarting...): not stored
            ended = exc
            await cl.Message(content=str(exc)).send()
        except Exception as exc:  # a bug or an engine failure: logged, never a trace shown
            ended = exc
            await cl.Message(content=UNEXPECTED).send()
        finally:
            conv.end_turn()
            turn.end(ended)

    async def offer_regenerate(self, reply_id: str | None) -> None:
        """A "Regenerate" button under the last reply (only there: the one before goes)."""
        await self.withdraw_regenerate()
        if reply_id is not None and not self.shutdown.closing:
            button = RegenerateButton(name=REGENERATE, payload={}, label="Regenerate",
                                      icon="refresh-cw", tooltip="Write this reply again")
            await button.send(for_id=reply_id)
            cl.user_session.set(REGENERATE, button)

    async def withdraw_regenerate(self) -> None:
        button: cl.Action | None = cl.user_session.get(REGENERATE)
        if button is not None:
            cl.user_session.set(REGENERATE, None)
            await button.remove()

    async def regenerate(self, button: cl.Action) -> None:
        """The last reply written again: it leaves the page, the stored chat and the
        history, and its message is answered anew. Chainlit calls this from an HTTP request,
        not as a turn: the answer runs as the session's task, so Stop ends it as it ends
        any reply."""
        conv: Conversation = cl.user_session.get("conversation")
        hold = self.hold_of(cl.context.session.id)  # chat/guard.py admitted the press
        last = None if conv is None or conv.in_flight else conv.take_back(button.forId)
        try:
            if last is None:  # not the last reply, or one being written (shutting down first)
                self.gate.start(user_name(), conv.profile.name if conv else "?")
                raise Refusal(NOT_REGENERATED, "turn")
            self.gate.start(user_name(), conv.profile.name, conv.pace)
        except Refusal as exc:  # shutting down, or too many turns this minute: it stays
            self.give_back(hold)
            if last is not None:
                conv.turns.append(last)
            await cl.Message(content=str(exc)).send()
            return
        task = asyncio.create_task(self._answer_again(conv, last, hold))
        cl.context.session.current_task = task  # what Stop cancels
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def give_back(self, hold: Hold | None) -> None:
        """The place held for a turn that will not run."""
        if hold is not None:
            self.usage.release(hold)

    async def _answer_again(self, conv: Conversation, exchange: Exchange,
                            hold: Hold | None) -> None:
        await cl.context.emitter.task_start()
        try:
            shown = next((m for m in chat_context.get() if m.id == exchange.reply_id), None)
            await (shown or cl.Message(content="", id=exchange.reply_id)).remove()
            await self.take(conv, exchange.user, exchange.message_id, hold=hold,
                            documents=exchange.documents)
        except asyncio.CancelledError:
            pass  # stopped: _answer kept what was shown (or said it was withdrawn)
        finally:
            await cl.context.emitter.task_end()

    async def _answer(self, conv: Conversation, turn: Turn, user: Message,
                      message_id: str, documents: tuple[Document, ...]) -> None:
        """One turn: wait for the engines, fit the history, stream the reply, record it.
        A long history or message (attached files) is fitted off the event loop."""
        note, reply = WaitNote(conv.profile.name, self.metrics), cl.Message(content="")
        try:
            if self.engines.state == "starting":
                await note.say(STARTING_TURN)
            await self.engines.ready()
            history = conv.history()
            prompt = await off_the_loop(
                sum(len(m.content) for m in history) + len(user.content), turn.fit, history,
                user, system_prompt=conv.settings.system_prompt,
                max_tokens=conv.settings.max_tokens)
            for notice in conv.notices(prompt):
                await cl.Message(content=notice).send()
            await self._stream_reply(conv, turn, prompt, reply, note)
        except asyncio.CancelledError:  # Stop, a closed browser, or shutdown's grace ran out
            turn.reply = reply.content
            await self._end_early(conv, user, reply, message_id, documents)
            raise
        finally:
            await note.remove()
        turn.reply = reply.content
        conv.record(user, reply.content, message_id, reply.id, documents)
        reply.metadata = {**reply_metadata(turn.stats, conv.profile.name, prompt.dropped_turns),
                          HISTORY_CHARS: len(reply.content)}
        if conv.settings.show_stats:
            reply.content += "\n\n" + stats_line(turn.stats, conv.profile.name)
        await reply.send()
        await self.offer_regenerate(reply.id)
        # The next message need not wait for the database: the turn ends now, and the check
        # runs after it (a shutdown waits for it).
        self.shutdown.finish_later(self._check_saved())

    async def _check_saved(self) -> None:
        """Writes of this chat that the database refused are said, not lost in a log."""
        thread_id = cl.context.session.thread_id
        failed = await self.store.settle(thread_id)
        if failed:
            log.error("chat %s: %d writes failed, last: %s", thread_id, len(failed), failed[-1])
            await cl.Message(content=NOT_SAVED).send()

    async def _stream_reply(self, conv: Conversation, turn: Turn, prompt: Prompt,
                            reply: cl.Message, note: WaitNote) -> None:
        """Stream the reply into `reply` as the engine writes it; until it begins, say how
        far the engine has read a long prompt."""
        out = Coalescer(reply.stream_token, pace=self.pace,
                        rank=self.engines.priority(conv.profile.name))
        reading = self._reading(conv, prompt, note)
        waited = False

        async def queued(place: int) -> None:
            nonlocal waited
            waited = True
            await reading.stop()  # in line: its place is said instead
            await note.show(place)

        async def admitted() -> None:
            if waited:  # out of the line: the engine starts reading it now
                self._start_reading(reading)

        try:
            async for text in turn.stream(prompt, on_queued=queued, on_admitted=admitted,
                                          **conv.sampling()):
                await reading.stop()
                await note.remove()
                await out.feed(text)  # pulls the engine once per update
            await out.close()
        finally:
            await reading.stop()  # stopped or failed while reading: the note goes with it
            out.discard()  # stopped or failed: what was not shown yet is not sent

    def _reading(self, conv: Conversation, prompt: Prompt, note: WaitNote) -> Reading:
        """The progress of the engine reading `prompt`, said in the turn's note (started
        when the engine should take at least `reading_note_s` over it). An estimate: vLLM
        says nothing of a prompt until its first token (engine/reading.py)."""
        tokens = conv.new_tokens(prompt)
        try:
            seconds = self.engines.reading_s(conv.profile.name, tokens)
        except ChatError:  # its engine is not serving: the turn says so
            seconds = 0.0
        reading = Reading(lambda percent: note.say(reading_notice(tokens, percent)), seconds)
        self._start_reading(reading)
        return reading

    def _start_reading(self, reading: Reading) -> None:
        if reading.seconds > 0 and reading.seconds >= self.reading_note_s:
            reading.start()

    async def _end_early(self, conv: Conversation, user: Message, reply: cl.Message,
                         message_id: str, documents: tuple[Document, ...]) -> None:
        """Keep what was shown of a reply that ended early, marked as such; a turn withdrawn
        before its reply began is not part of the conversation."""
        closing = self.shutdown.closing
        if not reply.content:
            await cl.Message(content=NOT_ANSWERED if closing else WITHDRAWN).send()
            return
        conv.record(user, reply.content, message_id, reply.id, documents)
        reply.metadata = {"stopped": True, "profile": conv.profile.name,
                          "cut_by_shutdown": closing, HISTORY_CHARS: len(reply.content)}
        reply.content += CUT_SHORT if closing else "\n\n*Stopped.*"
        await reply.send()
        await self.offer_regenerate(reply.id)
