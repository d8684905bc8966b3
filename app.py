"""The Chainlit chat app's hooks. The parts they use are built in `chat/wiring.py`;
engines, presets, models and the history policy live in `engine/`, a turn's course in
`service/turn.py` (shown in the chat by `chat/turns.py`), a session's state in
`chat/session.py`, a reopened chat in `chat/resume.py`, the OpenAI API and the operator's
routes in `api/`, accounts and chats in `store/`.

    chainlit run app.py            (or `make run`, which also sets up and prepares the model)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.server import app as http
from chainlit.server import sio
from chainlit.types import ThreadDict

from chat import patches, stalls
from chat.data_layer import ChatDataLayer
from chat.panel import settings_panel
from chat.resume import Resuming, session_profile
from chat.session import Conversation
from chat.streaming import Pace
from chat.turns import REGENERATE, user_name
from chat.wiring import build, configure_logging
from engine import ChatError, ConfigError, Message
from engine.settings import setting
from service import loop
from service.admission import Refusal
from service.documents import with_documents
from store.schema import migrate
from store.setup import first_admin

CHAINLIT_ROUTES = patches.before_app(http, sio)
configure_logging()
log = logging.getLogger("app")
try:
    APP = build(http, sio, chainlit_config)
except (ConfigError, ValueError) as exc:  # a config mistake is a message, not a trace
    raise SystemExit(f"Configuration error: {exc}") from None
RESUMING = Resuming(APP.config, APP.store, APP.attachments.store)


@cl.data_layer
def chat_store() -> ChatDataLayer:
    return APP.store


async def login(username: str, password: str) -> cl.User | None:
    """The same refusal whatever was wrong; repeated failures wait (store/accounts.py)."""
    account = await APP.accounts.verify(username, password)
    if account is None:
        log.info("login refused for %r", username[:100])
        return None
    return cl.User(identifier=account.identifier,
                   metadata={"role": account.role, **await APP.logins.open(account.identifier)})


if APP.password_login:
    cl.password_auth_callback(login)
if APP.oidc:
    cl.oauth_callback(APP.sso.oauth)
if APP.header_login:
    cl.header_auth_callback(APP.header_login.login)
patches.after_app(http, CHAINLIT_ROUTES, chainlit_config, APP.config)


@cl.on_app_startup
async def start_engines() -> None:
    """Bring the database up to date and make sure someone can log in, then start the
    engines in the background: the server answers while they load."""
    before, after = await migrate(APP.store.engine)
    if before != after:
        log.info("database schema brought from version %d to %d", before, after)
    made = await first_admin(APP.accounts) if APP.password_login else None
    if made and made[1]:  # shown once: only its hash is kept
        print(f"\n  First start: log in as {made[0]!r} with the password {made[1]!r}\n"
              f"  (add users: .venv/bin/python -m store users add NAME)\n", flush=True)
    elif made:
        log.info("created the admin account %r from VCHAT_ADMIN_USER", made[0])
    APP.engines.launch()
    APP.logins.start_sweeping()
    APP.guests.start_expiring()
    APP.loop_lag.start()
    APP.gc_pauses.start()
    APP.shutdown.handle_signals(asyncio.get_running_loop())
    APP.settling.add(task := asyncio.create_task(settle_after_start()))
    task.add_done_callback(APP.settling.discard)


async def settle_after_start() -> None:
    """Once the engines are up: the streaming pace for their device, and what the app and
    its engines keep for life out of the collector's walks, which would otherwise stop
    every session for a while (service/loop.py)."""
    loop.freeze_heap()
    loop.collect_less_often(setting("VCHAT_GC_YOUNG_OBJECTS"))
    with contextlib.suppress(ChatError):  # a failed start is reported elsewhere
        await APP.engines.ready()
    APP.pace.events_per_s = setting("VCHAT_STREAM_EVENTS_PER_S") or \
        Pace.events_for(bool(APP.engines.gpu))
    frozen, took = loop.timed(loop.freeze_heap)  # a full collection: all sessions wait
    log.info("streaming pace: %d updates/s in all before replies slow down; Chainlit's "
             "constructor pause skipped: %s; %d long-lived objects out of garbage collection"
             " (%.2f s); event loop: %s", APP.pace.events_per_s,
             stalls.constructor_pause_skipped(), frozen, took, loop.running_loop())


@cl.on_app_shutdown
async def stop_engines() -> None:
    await APP.usage.settle()  # the last turns' costs written
    APP.loop_lag.stop()
    APP.gc_pauses.stop()
    APP.engines.shutdown()


@cl.on_chat_start
async def chat_start() -> None:
    if await RESUMING.take_over():
        return
    conv = Conversation.start(session_profile(APP.config))
    cl.user_session.set("conversation", conv)
    await settings_panel(conv).send()
    # The model's state and a test mode the page says above the chat (public/model-status.js),
    # not in it: a message here switched Chainlit's view and lost what the user was typing.


@cl.on_chat_resume
async def chat_resume(thread: ThreadDict) -> None:
    """A stored chat reopened, as it was (chat/resume.py)."""
    conv = await RESUMING.continue_chat(thread)
    if conv.turns:
        await APP.turns.offer_regenerate(conv.turns[-1].reply_id)
    log.info("chat %s resumed with %d turns", thread.get("id"), len(conv.turns))


@cl.on_chat_end
async def chat_end() -> None:
    """The browser went away (or started a new chat): stop generating for it, so the
    engine does not keep writing a reply nobody reads (closing the stream aborts it)."""
    task = cl.context.session.current_task
    if task is not None and not task.done():
        task.cancel()
    APP.attachments.drop(cl.context.session.id)  # files attached and never sent
    APP.guard.documents(cl.context.session.id)  # a message's files its turn never took


@cl.on_settings_update
async def settings_update(values: dict) -> None:
    conv: Conversation = cl.user_session.get("conversation")
    problems = conv.update_settings(values)
    if problems:
        await cl.Message(content="\n".join(problems)).send()
        await settings_panel(conv).send()  # show the values actually in force


@cl.on_message
async def on_message(message: cl.Message) -> None:
    """Check the message, answer it; whatever goes wrong, the user gets a plain message."""
    arrival = APP.guard.arrival(cl.context.session.id)  # taken whatever happens to it
    hold = APP.guard.hold(cl.context.session.id)  # its place in the account's limits, likewise
    conv: Conversation = cl.user_session.get("conversation")
    # The files that came with it (chat/guard.py stored them); an edit keeps its message's.
    attached = APP.guard.documents(cl.context.session.id)
    documents = tuple(attached) or conv.documents_of(message.id)
    if dropped := conv.rewind(message.id):  # an edit: Chainlit took the later turns off the page
        log.info("message edited: %d turns leave the history", dropped)
    user = user_name()
    try:  # chat/guard.py asked the rest before Chainlit stored the message
        checked = APP.gate.message(message.content, conv.profile, user=user,
                                   documents=documents)
        APP.gate.start(user, conv.profile.name, conv.pace, message.content)
    except Refusal as exc:  # refused: nothing is stored, the chat goes on
        APP.turns.give_back(hold)
        if attached:
            await APP.attachments.forget(message.id, user)
        await cl.Message(content=str(exc)).send()
        return
    await APP.attachments.show(attached, message.id)
    await APP.turns.take(conv, Message("user", with_documents(checked.text, documents)),
                         message.id, checked.notice, arrival=arrival, hold=hold,
                         documents=documents)


@cl.action_callback(REGENERATE)
async def regenerate(button: cl.Action) -> None:
    await APP.turns.regenerate(button)
