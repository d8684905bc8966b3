"""The Chainlit chat app: hooks only. Engines, presets and models live in `engine/`.

    chainlit run app.py            (or `make run`, which also sets up and prepares the model)
"""

from __future__ import annotations

import asyncio
import logging

import chainlit as cl

from engine import ChatError, ConfigError, Engines, TurnStats, load_config

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("app")

try:
    CONFIG = load_config()
except ConfigError as exc:  # a config mistake is a message, not a stack trace
    raise SystemExit(f"Configuration error: {exc}") from None
ENGINES = Engines(CONFIG)
_startup: asyncio.Task | None = None


@cl.on_app_startup
async def start_engines() -> None:
    """Start the engines in the background: the server answers while they load."""
    global _startup
    _startup = asyncio.create_task(ENGINES.start())


@cl.on_app_shutdown
async def stop_engines() -> None:
    if _startup is not None and not _startup.done():
        _startup.cancel()
    ENGINES.shutdown()


async def engines_ready() -> None:
    """Wait for start-up to finish; tell the user once if they have to wait."""
    if _startup is None:
        raise ChatError("The engines were not started.")
    if not _startup.done():
        note = cl.Message(content="The model is still starting; your message will be "
                                  "answered as soon as it is ready.")
        await note.send()
        await asyncio.shield(_startup)
        await note.remove()
    failure = _startup.exception()
    if isinstance(failure, ChatError):
        raise ChatError(f"The model failed to start: {failure}")
    if failure is not None:
        raise ChatError("The model failed to start; the server log says why.")


@cl.set_chat_profiles
async def chat_profiles(current_user=None, language=None):
    return [
        cl.ChatProfile(
            name=p.name, markdown_description=p.description, icon=p.icon or None,
            default=p.default,
            starters=[cl.Starter(label=s.label, message=s.message) for s in p.starters],
        )
        for p in CONFIG.profiles
    ]


@cl.on_chat_start
async def chat_start() -> None:
    cl.user_session.set("history", [])


@cl.on_message
async def on_message(message: cl.Message) -> None:
    profile = cl.user_session.get("chat_profile") or CONFIG.profiles[0].name
    history = cl.user_session.get("history") or []
    turn = history + [{"role": "user", "content": message.content}]
    reply = cl.Message(content="")
    try:
        await engines_ready()
        async for item in ENGINES.stream(turn, profile):
            if isinstance(item, TurnStats):
                continue
            await reply.stream_token(item)
    except ChatError as exc:
        await cl.Message(content=str(exc)).send()
        return
    await reply.send()
    cl.user_session.set("history", turn + [{"role": "assistant", "content": reply.content}])
