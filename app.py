"""The Chainlit chat app: hooks only. Engines, presets, models and the history policy live
in `engine/`, a session's state in `chat/session.py`.

    chainlit run app.py            (or `make run`, which also sets up and prepares the model)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.input_widget import Slider, Switch, TextInput
from chainlit.server import app as http
from starlette.responses import JSONResponse

from chat.input import check_message
from chat.session import Conversation
from chat.shutdown import Shutdown
from chat.streaming import Coalescer, Pace
from chat.view import dropped_notice, queued_notice, stats_line
from engine import ChatError, ConfigError, Engines, Message, TurnStats, load_config

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("app")

try:
    CONFIG = load_config()
    ENGINES = Engines(CONFIG)
except ConfigError as exc:  # a config mistake is a message, not a stack trace
    raise SystemExit(f"Configuration error: {exc}") from None
DEFAULT_PROFILE = next((p for p in CONFIG.profiles if p.default), CONFIG.profiles[0])
STARTING = ("The model is still starting (about half a minute on a CPU). You can type "
            "already: your message will be answered as soon as it is ready.")
WITHDRAWN = "*Stopped before the reply began: that message is not part of the conversation.*"
UNEXPECTED = ("Sorry, something went wrong on our side while answering, and it has been "
              "logged. Your message was not added to the conversation; please send it again.")
CLOSING = ("The app is restarting or shutting down, so your message was not sent. Please "
           "send it again in a minute.")
NOT_ANSWERED = ("The app shut down before your message could be answered; it is not part of "
                "the conversation. Please send it again in a minute.")
CUT_SHORT = ("\n\n*Cut short: the app is shutting down. Send your message again once it is "
             "back for a full reply.*")
STAND_IN = ("**Benchmark mode:** this server runs a stand-in engine, not a model. Replies are "
            "filler text produced at a set speed to measure the chat layer.")
# Benchmarks only: every reply runs to max_tokens, so runs compare equal work.
IGNORE_EOS = os.environ.get("VCHAT_BENCH_IGNORE_EOS") == "1"
# Streamed text goes out at most every 40 ms per reply; when many replies stream at once, up
# to every 200 ms but at most two engine pieces per update (chat/streaming.py). 0: one
# event per engine delta (benchmarks only).
_FASTEST_S = int(os.environ.get("VCHAT_STREAM_INTERVAL_MS", "40")) / 1000
_SLOWEST_S = int(os.environ.get("VCHAT_STREAM_MAX_INTERVAL_MS", "200")) / 1000
PACE = Pace(_FASTEST_S, _SLOWEST_S if _FASTEST_S > 0 else 0)
# On SIGTERM or Ctrl+C, turns in flight get this long to finish before they are cut short.
SHUTDOWN = Shutdown(float(os.environ.get("VCHAT_SHUTDOWN_GRACE_S", "10")))
_startup: asyncio.Task | None = None
_drain: asyncio.Task | None = None


# -- process lifecycle -----------------------------------------------------------------


@cl.on_app_startup
async def start_engines() -> None:
    """Start the engines in the background: the server answers while they load."""
    global _startup
    _startup = asyncio.create_task(ENGINES.start())
    drain_before_exit(asyncio.get_running_loop())


def drain_before_exit(loop: asyncio.AbstractEventLoop) -> None:
    """Put a drain in front of the server's own SIGTERM/SIGINT handling (uvicorn's, which
    closes every connection at once): the first signal stops new turns and gives the turns
    in flight SHUTDOWN.grace_s to finish, then the server stops as before; a second signal
    stops it at once."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        server_handler = signal.getsignal(sig)
        if not callable(server_handler):  # not under a server that handles it: leave it
            continue

        def on_signal(signum, frame, server_handler=server_handler):
            if SHUTDOWN.closing:
                server_handler(signum, frame)
                return
            SHUTDOWN.closing = True
            loop.call_soon_threadsafe(start_drain, server_handler, signum, frame)

        signal.signal(sig, on_signal)


def start_drain(server_handler, signum, frame) -> None:
    global _drain  # held here: the loop keeps only a weak reference to a task
    _drain = asyncio.get_running_loop().create_task(drain_then(server_handler, signum, frame))


async def drain_then(server_handler, signum, frame) -> None:
    finished, cut = await SHUTDOWN.drain()
    if finished or cut:
        log.info("stopping: %d turn(s) finished, %d cut short", finished, cut)
        await asyncio.sleep(0.5)  # let the last messages leave before connections close
    server_handler(signum, frame)


@cl.on_app_shutdown
async def stop_engines() -> None:
    if _startup is not None and not _startup.done():
        _startup.cancel()
    ENGINES.shutdown()


async def engines_ready() -> None:
    """Wait for start-up to finish; tell the user once if they have to wait."""
    if _startup is None:
        raise ChatError("The model was not started.")
    if not _startup.done():
        note = None
        if not cl.user_session.get("told_starting"):
            note = await cl.Message(content=STARTING).send()
        await asyncio.wait([_startup])
        if note is not None:
            await note.remove()
    failure = None if _startup.cancelled() else _startup.exception()
    if isinstance(failure, ChatError):
        raise ChatError(f"The model failed to start: {failure}")
    if failure is not None or _startup.cancelled():
        raise ChatError("The model failed to start; the server log says why.")


@http.get("/ready")
async def ready() -> JSONResponse:
    """Readiness: 200 once every engine is up, 503 while starting or after a failure."""
    health = await ENGINES.health()
    health["turns_in_flight"] = SHUTDOWN.turns
    if SHUTDOWN.closing:
        health["status"] = "stopping"
    return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)


# Chainlit registers a catch-all GET route for its UI before app.py is imported; put ours
# first so it is reachable.
http.router.routes.sort(key=lambda route: getattr(route, "path", "") != "/ready")


# -- chat ------------------------------------------------------------------------------


def chat_profiles(current_user=None, language=None) -> asyncio.Future:
    """The profile list, handed to Chainlit as an already finished future.

    Chainlit works out each new socket session's config with
    `loop.run_until_complete(set_chat_profiles(...))` under nest_asyncio
    (`WebsocketSession.get_config`). Given a coroutine, that runs the whole event loop nested
    inside the connect handler, other sessions' connects included, and those nest in turn:
    a few dozen browsers connecting at once pass Python's recursion limit and their
    connections fail (RecursionError in engineio's JSON decoding). A finished future makes
    `run_until_complete` return without running the loop, and `await` on it works as usual.
    Test: test_app.py::test_many_sessions_connect_at_once.
    """
    done = asyncio.get_running_loop().create_future()
    done.set_result([
        cl.ChatProfile(
            name=p.name, markdown_description=p.description, icon=p.icon or None,
            default=p is DEFAULT_PROFILE,
            starters=[cl.Starter(label=s.label, message=s.message) for s in p.starters],
        )
        for p in CONFIG.profiles
    ])
    return done


# Not through @cl.set_chat_profiles: that would wrap the function in a coroutine again.
chainlit_config.code.set_chat_profiles = chat_profiles


def conversation() -> Conversation:
    return cl.user_session.get("conversation")


@cl.on_chat_start
async def chat_start() -> None:
    name = cl.user_session.get("chat_profile")
    profile = next((p for p in CONFIG.profiles if p.name == name), DEFAULT_PROFILE)
    conv = Conversation.start(profile)
    cl.user_session.set("conversation", conv)
    await settings_panel(conv).send()
    if ENGINES.stand_in:
        await cl.Message(content=STAND_IN).send()
    if ENGINES.state == "starting":
        cl.user_session.set("told_starting", True)
        await cl.Message(content=STARTING).send()


@cl.on_chat_end
async def chat_end() -> None:
    """The browser went away (or started a new chat): stop generating for it, so the
    engine does not keep writing a reply nobody reads (closing the stream aborts it)."""
    task = cl.context.session.current_task
    if task is not None and not task.done():
        task.cancel()


def settings_panel(conv: Conversation) -> cl.ChatSettings:
    limits, now = conv.profile.limits, conv.settings
    return cl.ChatSettings([
        Slider(id="temperature", label="Temperature", initial=now.temperature, min=0,
               max=limits.temperature, step=0.05,
               description="Higher is more varied, lower more focused."),
        Slider(id="max_tokens", label="Max tokens", initial=now.max_tokens, min=16,
               max=limits.max_tokens, step=16, description="Longest reply, in tokens."),
        TextInput(id="system_prompt", label="System prompt", initial=now.system_prompt,
                  multiline=True,
                  description=f"At most {limits.system_prompt_chars:,} characters."),
        Switch(id="show_stats", label="Show stats under replies", initial=now.show_stats),
    ])


@cl.on_settings_update
async def settings_update(values: dict) -> None:
    conv = conversation()
    problems = conv.update_settings(values)
    if problems:
        await cl.Message(content="\n".join(problems)).send()
        await settings_panel(conv).send()  # show the values actually in force


@cl.on_message
async def on_message(message: cl.Message) -> None:
    if SHUTDOWN.closing:
        await cl.Message(content=CLOSING).send()
        return
    with SHUTDOWN.turn():
        await take_turn(conversation(), message)


async def take_turn(conv: Conversation, message: cl.Message) -> None:
    try:
        checked = check_message(message.content, conv.profile.limits.message_chars)
        conv.begin_turn()
    except ChatError as exc:  # refused: nothing is stored, the chat goes on
        await cl.Message(content=str(exc)).send()
        return
    try:
        if checked.notice:
            await cl.Message(content=checked.notice).send()
        await answer(conv, checked.text)
    except Exception:  # a bug or an engine failure: logged, never a trace to the user
        log.exception("turn failed")
        await cl.Message(content=UNEXPECTED).send()
    finally:
        conv.end_turn()


async def answer(conv: Conversation, text: str) -> None:
    """One turn: fit the history, stream the reply, record it."""
    try:
        await engines_ready()
        fitted = ENGINES.fit(conv.profile.name, conv.history(), Message("user", text),
                             system_prompt=conv.settings.system_prompt,
                             max_tokens=conv.settings.max_tokens)
    except ChatError as exc:
        await cl.Message(content=str(exc)).send()
        return
    if fitted.dropped_turns and not conv.told_about_dropping:
        conv.told_about_dropping = True
        await cl.Message(content=dropped_notice(fitted.dropped_turns)).send()

    reply, stats = cl.Message(content=""), None
    out = Coalescer(reply.stream_token, pace=PACE)
    queue_note: cl.Message | None = None

    async def on_queued(place: int) -> None:  # the engine is full: show where we wait
        nonlocal queue_note
        if queue_note is None:
            queue_note = cl.Message(content=queued_notice(place))
            await queue_note.send()
        else:
            queue_note.content = queued_notice(place)
            await queue_note.update()

    async def drop_queue_note() -> None:
        nonlocal queue_note
        if queue_note is not None:
            note, queue_note = queue_note, None
            await note.remove()

    try:
        async for item in ENGINES.stream(fitted.messages, conv.profile.name,
                                         on_queued=on_queued, prompt_ids=fitted.prompt_ids,
                                         ignore_eos=IGNORE_EOS, **conv.sampling()):
            await drop_queue_note()
            if isinstance(item, TurnStats):
                stats = item
            else:
                await out.add(item)
        await out.close()
    except asyncio.CancelledError:  # Stop, or shutdown's grace ran out: keep what was shown
        out.discard()
        await drop_queue_note()
        closing = SHUTDOWN.closing
        if not reply.content:  # withdrawn before the reply began: not part of the chat
            await cl.Message(content=NOT_ANSWERED if closing else WITHDRAWN).send()
            raise
        conv.record(text, reply.content, stopped=True)
        reply.metadata = {"stopped": True, "profile": conv.profile.name,
                          "cut_by_shutdown": closing}
        reply.content += CUT_SHORT if closing else "\n\n*Stopped.*"
        await reply.send()
        raise
    except ChatError as exc:  # EngineBusy (queue full) among them: nothing is recorded
        out.discard()
        await drop_queue_note()
        await cl.Message(content=str(exc)).send()
        return
    except Exception:
        out.discard()
        await drop_queue_note()
        raise
    conv.record(text, reply.content)
    reply.metadata = {"profile": conv.profile.name, "preset": stats.preset,
                      "prompt_tokens": stats.prompt_tokens,
                      "output_tokens": stats.output_tokens, "ttft_s": stats.ttft_s,
                      "tokens_per_s": stats.tokens_per_s, "finish_reason": stats.finish_reason,
                      "dropped_turns": fitted.dropped_turns}
    if conv.settings.show_stats:
        reply.content += "\n\n" + stats_line(stats, conv.profile.name)
    await reply.send()
