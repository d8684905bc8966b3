"""The Chainlit chat app: hooks and the wiring of the parts. Engines, presets, models and
the history policy live in `engine/`, a turn's course in `service/turn.py` (shown in the
chat by `chat/turns.py`), a session's state in `chat/session.py`, the OpenAI API and the
operator's routes in `api/`, accounts and chats in `store/`.

    chainlit run app.py            (or `make run`, which also sets up and prepares the model)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.oauth_providers import get_configured_oauth_providers
from chainlit.server import app as http
from chainlit.server import sio
from chainlit.types import ThreadDict

from api.openai import OpenAIApi
from api.ops import Ops
from chat import emits, forget, stalls
from chat.downloads import Downloads
from chat.front_ends import SessionRouting
from chat.guard import Guard
from chat.invites import InvitePage, OpenDemo
from chat.logins import Logins, slow_failing_addresses
from chat.page import serve_own_origin_only
from chat.panel import profile_menu, settings_panel
from chat.session import Conversation, cut_off_run, stored_turns
from chat.sso import HeaderLogin, SingleSignOn
from chat.streaming import Pace
from chat.turns import REGENERATE, Turns, reply_room, user_name
from chat.view import CLOSING, CUT_OFF, RANDOM_WEIGHTS, STAND_IN, page_notice
from engine import ChatError, ConfigError, Engines, Message, load_config
from engine.settings import check_all, setting
from service import front_ends, loop
from service.input import check_message
from service.shutdown import Shutdown
from service.turn_metrics import JsonLines, TurnMetrics, TurnRecord
from store.accounts import Accounts, AddressThrottle
from store.admission import Admission
from store.api_keys import ApiKeys
from store.data_layer import ChatDataLayer, StoreError
from store.guests import Guests, invited_profile
from store.invites import Invites
from store.schema import database_url, migrate
from store.sessions import LoginSessions
from store.setup import auth_secret, data_dir, first_admin
from store.usage import Usage

# Chainlit's own routes, registered when its server module was imported (sorted below).
CHAINLIT_ROUTES = {id(route) for route in http.router.routes}
# Chainlit's Message and Step constructors block the event loop for 1 ms each: not here.
stalls.skip_constructor_pause()
# Its page fetches a font and a stylesheet from other origins: not here (chat/page.py).
serve_own_origin_only()
# It keeps every chat session's messages after the session is gone: not here.
forget.install()
# It sends each socket event through a task its sender waits for; one for one browser goes
# out in line here (chat/emits.py).
emits.install(sio)

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("app")
# A remote preset's HTTP clients (engine/remote.py) would log every request, health checks too.
for _client_log in ("httpx", "httpx2"):
    logging.getLogger(_client_log).setLevel(logging.WARNING)

try:
    check_all()  # every environment variable the app reads, before anything starts
    # The server's loop and asyncio's C tasks, before Chainlit starts it (service/loop.py).
    loop.own_loop(setting("VCHAT_EVENT_LOOP"))
    CONFIG = load_config()
    ENGINES = Engines(CONFIG)
    # Benchmarks only: every reply runs to max_tokens, so runs compare equal work.
    IGNORE_EOS = setting("VCHAT_BENCH_IGNORE_EOS")
    SETTLING: set[asyncio.Task] = set()
    # A reply's text goes out at most this often (chat/streaming.py; 0: every piece), at
    # the CPU's pace until the engines know their device (settle_after_start).
    PACE = Pace.starting_at(setting("VCHAT_STREAM_INTERVAL_MS") / 1000)
    # On SIGTERM or Ctrl+C, turns in flight get this long to finish before they are cut short.
    SHUTDOWN = Shutdown(setting("VCHAT_SHUTDOWN_GRACE_S"))
    # Accounts and chats: the data folder's database (or DATABASE_URL), migrated at start;
    # the login tokens' secret kept there unless the environment gives one (store/setup.py).
    DATA_DIR = data_dir()
    if setting("DATABASE_URL") and not setting("CHAINLIT_AUTH_SECRET"):
        log.warning("DATABASE_URL is set but CHAINLIT_AUTH_SECRET is not: this replica signs "
                    "logins with its data folder's secret, which replicas on other hosts do "
                    "not share (their users would be logged out when the proxy moves them)")
    os.environ["CHAINLIT_AUTH_SECRET"] = auth_secret(DATA_DIR)
    STORE = ChatDataLayer(database_url(DATA_DIR))
    ACCOUNTS = Accounts(STORE.engine)
    # What each turn cost and each account's daily token quota (store/usage.py).
    USAGE = Usage(STORE.engine)
    slow_failing_addresses(http, AddressThrottle(STORE.engine))
    # A login token works while its session in the database is live (chat/logins.py); what
    # clients send is checked where it enters, bodies bounded, origins kept to this server's
    # and those listed in .chainlit/config.toml (chat/guard.py).
    LOGINS = Logins(LoginSessions(STORE.engine, STORE.reader),
                    chainlit_config.project.user_session_timeout)
    # Who may log in: the password form (unless VCHAT_PASSWORD_LOGIN=0), single sign-on by
    # OpenID Connect when Chainlit's OAUTH_GENERIC_* are set, and a sign-in proxy's header
    # when VCHAT_HEADER_AUTH is (chat/sso.py).
    PASSWORD_LOGIN = setting("VCHAT_PASSWORD_LOGIN")
    SSO = SingleSignOn(ACCOUNTS, LOGINS.open)
    OIDC = bool(get_configured_oauth_providers())
    HEADER_LOGIN = HeaderLogin.from_settings(SSO)
    if not (PASSWORD_LOGIN or OIDC or HEADER_LOGIN):
        raise ConfigError("environment", "VCHAT_PASSWORD_LOGIN", "with the password form off,"
                          " set up single sign-on (OAUTH_GENERIC_*) or VCHAT_HEADER_AUTH, or "
                          "nobody can log in")
    if HEADER_LOGIN:
        HEADER_LOGIN.install(http)
    # A demo's guests (store/invites.py, store/guests.py): their chats capped, and gone
    # after the retention.
    GUESTS = Guests(STORE.engine, setting("VCHAT_GUEST_CHATS"),
                    setting("VCHAT_GUEST_RETENTION_DAYS"),
                    setting("VCHAT_GUEST_ADDRESS_DAILY_TOKENS"),
                    setting("VCHAT_GUEST_TURNS_PER_MINUTE"),
                    setting("VCHAT_GUEST_ADDRESS_TURNS_PER_MINUTE"))
    # Whether an account may take a turn now, its place taken at once (store/admission.py).
    ADMISSION = Admission(STORE.engine, GUESTS.limits, STORE.reader)
    GUARD = Guard(LOGINS, STORE, sharing=chainlit_config.features.allow_thread_sharing,
                  admission=ADMISSION, reply_room=reply_room,
                  refusal_of=lambda session, text: TURNS.refusal_of(session, text))
    GUARD.install(http, sio, chainlit_config.project.allow_origins,
                  api_body_bytes=int(setting("VCHAT_API_MAX_BODY_MB") * 1e6))
    # One of several processes sharing each engine's core (service/front_ends.py): calls
    # naming a chat session reach the one holding it, and pages use WebSockets only.
    FRONT_END = front_ends.current()
    if FRONT_END is not None and FRONT_END.count > 1:
        http.add_middleware(SessionRouting, front=FRONT_END)
        chainlit_config.project.transports = ["websocket"]
    # VCHAT_DEMO=open: anyone who opens the page chats as a guest (chat/invites.py), and
    # every page's banner says it is a demo.
    DEMO = OpenDemo(setting("VCHAT_DEMO_GUESTS"), setting("VCHAT_DEMO_BY"),
                    setting("VCHAT_DEMO_GUESTS_PER_ADDRESS")) \
        if setting("VCHAT_DEMO") == "open" else None
    # GET /ready, /notice and /metrics (api/ops.py), the app's series by profile in it.
    OPS = Ops(ENGINES, SHUTDOWN, STORE, page_notice if DEMO is None else (
        lambda status: page_notice(status) or DEMO.banner(GUESTS.retention_days)), FRONT_END)
    http.include_router(OPS.router)
    # GET /export/chats[/ID]: a user's own chats as Markdown or JSON (chat/downloads.py).
    http.include_router(Downloads(STORE.engine).router)
    # GET/POST /invite/TOKEN: a demo's invite link, a guest's name, its chat (chat/invites.py).
    JOINING = InvitePage(Invites(STORE.engine), setting("VCHAT_GUEST_LOGIN_HOURS") * 3600,
                         chainlit_config.ui.name,
                         setting("VCHAT_GUEST_DAILY_TOKENS"), DEMO,
                         setting("VCHAT_GUEST_JOINS_PER_ADDRESS"))
    http.include_router(JOINING.router)
    if DEMO is not None:
        JOINING.send_visitors_to_the_demo(http, LOGINS.live_token)
    TURN_METRICS = TurnMetrics(OPS.registry, log_text=setting("VCHAT_LOG_MESSAGES"))
    # How late the event loop that every session shares runs what is due, how long the
    # collector stops it (service/loop.py), and what stays of chats in memory.
    LOOP_LAG = loop.LoopLag(TURN_METRICS.loop_lag.observe)
    GC_PAUSES = loop.GcPauses(TURN_METRICS.gc_paused)
    forget.report_to(TURN_METRICS.sessions_held)
    # /v1: the OpenAI-compatible API on the same engines, for the operator's key and accounts'.
    API = OpenAIApi(ENGINES, CONFIG, TURN_METRICS, ApiKeys(STORE.engine).account_of,
                    setting("VCHAT_API_KEY"), USAGE, ADMISSION, ignore_eos=IGNORE_EOS)
    http.include_router(API.router)
    # A turn from admission to its stored reply (chat/turns.py).
    TURNS = Turns(ENGINES, TURN_METRICS, SHUTDOWN, STORE, PACE, USAGE, GUARD.hold,
                  ignore_eos=IGNORE_EOS)
    if setting("VCHAT_LOG_FORMAT") == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
except (ConfigError, ValueError) as exc:  # a config mistake is a message, not a trace
    raise SystemExit(f"Configuration error: {exc}") from None


@cl.data_layer
def chat_store() -> ChatDataLayer:
    return STORE


async def login(username: str, password: str) -> cl.User | None:
    """The same refusal whatever was wrong; repeated failures wait (store/accounts.py)."""
    account = await ACCOUNTS.verify(username, password)
    if account is None:
        log.info("login refused for %r", username[:100])
        return None
    return cl.User(identifier=account.identifier,
                   metadata={"role": account.role, **await LOGINS.open(account.identifier)})


if PASSWORD_LOGIN:
    cl.password_auth_callback(login)
if OIDC:
    cl.oauth_callback(SSO.oauth)
if HEADER_LOGIN:
    cl.header_auth_callback(HEADER_LOGIN.login)


@cl.on_app_startup
async def start_engines() -> None:
    """Bring the database up to date and make sure someone can log in, then start the
    engines in the background: the server answers while they load."""
    before, after = await migrate(STORE.engine)
    if before != after:
        log.info("database schema brought from version %d to %d", before, after)
    made = await first_admin(ACCOUNTS) if PASSWORD_LOGIN else None
    if made and made[1]:  # shown once: only its hash is kept
        print(f"\n  First start: log in as {made[0]!r} with the password {made[1]!r}\n"
              f"  (add users: .venv/bin/python -m store users add NAME)\n", flush=True)
    elif made:
        log.info("created the admin account %r from VCHAT_ADMIN_USER", made[0])
    ENGINES.launch()
    LOGINS.start_sweeping()
    GUESTS.start_expiring()
    LOOP_LAG.start()
    GC_PAUSES.start()
    SHUTDOWN.handle_signals(asyncio.get_running_loop())
    SETTLING.add(task := asyncio.create_task(settle_after_start()))  # referenced till done
    task.add_done_callback(SETTLING.discard)


async def settle_after_start() -> None:
    """Once the engines are up: the streaming pace for their device, and what the app and
    its engines keep for life out of the collector's walks, which would otherwise stop
    every session for a while (service/loop.py)."""
    loop.freeze_heap()
    loop.collect_less_often(setting("VCHAT_GC_YOUNG_OBJECTS"))
    with contextlib.suppress(ChatError):  # a failed start is reported elsewhere
        await ENGINES.ready()
    PACE.events_per_s = setting("VCHAT_STREAM_EVENTS_PER_S") or Pace.events_for(bool(ENGINES.gpu))
    frozen, took = loop.timed(loop.freeze_heap)  # a full collection: all sessions wait
    log.info("streaming pace: %d updates/s in all before replies slow down; Chainlit's "
             "constructor pause skipped: %s; %d long-lived objects out of garbage collection"
             " (%.2f s); event loop: %s", PACE.events_per_s, stalls.constructor_pause_skipped(),
             frozen, took, loop.running_loop())


@cl.on_app_shutdown
async def stop_engines() -> None:
    await USAGE.settle()  # the last turns' costs written
    LOOP_LAG.stop()
    GC_PAUSES.stop()
    ENGINES.shutdown()


# Chainlit registers its routes (a catch-all GET among them) before app.py is imported; put
# the app's first, so that they are reachable and answer in place of Chainlit's own.
http.router.routes.sort(key=lambda route: id(route) in CHAINLIT_ROUTES)


# Not through @cl.set_chat_profiles: that would wrap the function in a coroutine again.
chainlit_config.code.set_chat_profiles = profile_menu(CONFIG)


def session_profile():
    """The profile the page chose; for a guest whose invite names one, that one, whatever
    the page sent (store/invites.py)."""
    return CONFIG.profile_or_default(invited_profile(cl.user_session.get("user"))
                                     or cl.user_session.get("chat_profile"))


@cl.on_chat_start
async def chat_start() -> None:
    if await take_over_chat():
        return
    conv = Conversation.start(session_profile())
    cl.user_session.set("conversation", conv)
    await settings_panel(conv).send()
    if ENGINES.stand_in:
        await cl.Message(content=STAND_IN).send()
    elif CONFIG.random_weights:
        await cl.Message(content=RANDOM_WEIGHTS).send()
    # While the model starts, the page says so above the chat (public/model-status.js), not
    # in it: a message here switched Chainlit's view and lost what the user was typing.


@cl.on_chat_resume
async def chat_resume(thread: ThreadDict) -> None:
    """A stored chat reopened: its profile and its turns as they were, so the next turn
    is fitted exactly as it would have been in the live chat."""
    conv = await continue_chat(thread)
    if conv.turns:
        await TURNS.offer_regenerate(conv.turns[-1].reply_id)
    log.info("chat %s resumed with %d turns", thread.get("id"), len(conv.turns))


async def continue_chat(thread: ThreadDict) -> Conversation:
    """This session goes on with a stored chat: its turns, its settings panel, the chat
    marked as this session's (a later reconnect elsewhere finds it), and a turn that its
    process's end cut off said."""
    conv = Conversation.start(session_profile())
    conv.restore(stored_turns(thread.get("steps") or [], conv.profile.limits.message_chars))
    cl.user_session.set("conversation", conv)
    with contextlib.suppress(StoreError):  # only a later reconnect elsewhere would miss it
        await STORE.take_over(thread["id"], cl.context.session.id)
    await settings_panel(conv).send()
    if run := cut_off_run(thread.get("steps") or []):  # said once: the run is ended
        note = cl.Message(content=CUT_OFF)
        await note.send()
        # Chainlit draws a resumed chat from `thread` once this returns: the note with it.
        thread.setdefault("steps", []).append(note.to_dict())
        with contextlib.suppress(StoreError):
            await STORE.end_run(run)
    return conv


async def take_over_chat() -> bool:
    """A page whose app replica went away (killed, restarted, its session forgotten) comes
    back to this one with its socket session's id and no chat id: its chat goes on from
    the database, and the page keeps what it shows. (Chainlit's own page carries the
    chat's id once it moved to /thread/ID, and Chainlit resumes it: chat_resume.)"""
    session = cl.context.session
    try:
        thread_id = session.user and await STORE.chat_of_session(session.id,
                                                                 session.user.identifier)
        thread = thread_id and await STORE.get_thread(thread_id)
    except StoreError:  # the database away: a new chat, as before
        return False
    if not thread:
        return False
    session.thread_id, session.has_first_interaction = thread_id, True
    conv = await continue_chat(thread)
    log.info("chat %s taken over by this process with %d turns", thread_id, len(conv.turns))
    return True


@cl.on_chat_end
async def chat_end() -> None:
    """The browser went away (or started a new chat): stop generating for it, so the
    engine does not keep writing a reply nobody reads (closing the stream aborts it)."""
    task = cl.context.session.current_task
    if task is not None and not task.done():
        task.cancel()


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
    arrival = GUARD.arrival(cl.context.session.id)  # taken whatever happens to the message
    hold = GUARD.hold(cl.context.session.id)  # its place in the account's limits, likewise
    conv: Conversation = cl.user_session.get("conversation")
    if SHUTDOWN.closing:
        TURNS.give_back(hold)
        TURN_METRICS.refuse(TurnRecord("refused", user_name(), conv.profile.name,
                                       reason="closing", message=message.content))
        await cl.Message(content=CLOSING).send()
        return
    if dropped := conv.rewind(message.id):  # an edit: Chainlit took the later turns off the page
        log.info("message edited: %d turns leave the history", dropped)
    try:
        checked = check_message(message.content, conv.profile.limits.message_chars)
        conv.begin_turn()
    except ChatError as exc:  # refused: nothing is stored, the chat goes on
        TURNS.give_back(hold)
        TURN_METRICS.refuse(TurnRecord("refused", user_name(), conv.profile.name,
                                       reason="message", message=message.content[:1000]))
        await cl.Message(content=str(exc)).send()
        return
    await TURNS.take(conv, Message("user", checked.text), message.id, checked.notice,
                     arrival=arrival, hold=hold)


@cl.action_callback(REGENERATE)
async def regenerate(button: cl.Action) -> None:
    await TURNS.regenerate(button)
