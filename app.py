"""The Chainlit chat app: hooks only. Engines, presets, models and the history policy live
in `engine/`, a session's state in `chat/session.py`, a turn's course in `chat/turns.py`.

    chainlit run app.py            (or `make run`, which also sets up and prepares the model)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.input_widget import Slider, Switch, TextInput
from chainlit.server import app as http
from chainlit.server import sio
from chainlit.types import ThreadDict
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector
from prometheus_client import generate_latest
from starlette.responses import JSONResponse, Response

from api.openai import OpenAIApi
from chat import forget, stalls
from chat.guard import Guard
from chat.input import check_message
from chat.logins import Logins
from chat.metrics import JsonLines, TurnMetrics, TurnRecord
from chat.page import serve_own_origin_only
from chat.session import Conversation, stored_turns
from chat.shutdown import Shutdown
from chat.streaming import Pace
from chat.turns import REGENERATE, Turns, user_name
from chat.view import CLOSING, RANDOM_WEIGHTS, STAND_IN, page_notice
from engine import ChatError, ConfigError, Engines, Message, load_config
from engine.metrics import PresetSeries
from engine.settings import setting
from store.accounts import Accounts, AddressThrottle
from store.api_keys import ApiKeys
from store.data_layer import ChatDataLayer
from store.schema import database_url, migrate
from store.sessions import LoginSessions
from store.setup import auth_secret, data_dir, first_admin

# Chainlit's own routes, registered when its server module was imported (see OWN_ROUTES).
CHAINLIT_ROUTES = {id(route) for route in http.router.routes}
# Chainlit's Message and Step constructors block the event loop for 1 ms each: not here.
stalls.skip_constructor_pause()
# Its page fetches a font and a stylesheet from other origins: not here (chat/page.py).
serve_own_origin_only()
# It keeps every chat session's messages after the session is gone: not here.
forget.install()

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("app")
# A remote preset's HTTP clients (engine/remote.py) would log every request, health checks too.
for _client_log in ("httpx", "httpx2"):
    logging.getLogger(_client_log).setLevel(logging.WARNING)

try:
    CONFIG = load_config()
    ENGINES = Engines(CONFIG)
    # Benchmarks only: every reply runs to max_tokens, so runs compare equal work.
    IGNORE_EOS = setting("VCHAT_BENCH_IGNORE_EOS")
    SETTLING: set[asyncio.Task] = set()
    # A reply's streamed text goes out at most this often (chat/streaming.py); 0: every piece.
    # Until the engines know their device (settle_after_start), the CPU's pace.
    PACE = Pace.starting_at(setting("VCHAT_STREAM_INTERVAL_MS") / 1000)
    # On SIGTERM or Ctrl+C, turns in flight get this long to finish before they are cut short.
    SHUTDOWN = Shutdown(setting("VCHAT_SHUTDOWN_GRACE_S"))
    # Accounts and chats: the data folder's database (or DATABASE_URL), its schema brought
    # up to date at start-up; the login tokens' secret kept there unless the environment
    # gives one (store/setup.py).
    DATA_DIR = data_dir()
    os.environ["CHAINLIT_AUTH_SECRET"] = auth_secret(DATA_DIR)
    STORE = ChatDataLayer(database_url(DATA_DIR))
    ACCOUNTS = Accounts(STORE.engine)
    LOGIN_ADDRESSES = AddressThrottle()
    # A login token works while its session in the database is live: logout, removing the
    # account or changing its password ends it everywhere (chat/logins.py). What clients
    # send is checked where it enters, bodies bounded, origins kept to this server's and
    # the ones listed in .chainlit/config.toml (chat/guard.py).
    LOGINS = Logins(LoginSessions(STORE.engine, STORE.reader),
                    chainlit_config.project.user_session_timeout)
    GUARD = Guard(LOGINS, STORE, sharing=chainlit_config.features.allow_thread_sharing)
    GUARD.install(http, sio, chainlit_config.project.allow_origins,
                  api_body_bytes=int(setting("VCHAT_API_MAX_BODY_MB") * 1e6))
    # GET /metrics: the app's series by profile (chat/metrics.py), every engine's vLLM
    # series by preset (engine/metrics.py), the process's own.
    METRICS = CollectorRegistry()
    TURN_METRICS = TurnMetrics(METRICS, log_text=setting("VCHAT_LOG_MESSAGES"))
    METRICS.register(PresetSeries(ENGINES.metric_registries))
    ProcessCollector(registry=METRICS)
    # How late the event loop that every session shares runs what is due (chat/stalls.py).
    LOOP_LAG = stalls.LoopLag(TURN_METRICS.loop_lag.observe)
    GC_PAUSES = stalls.GcPauses(TURN_METRICS.gc_paused)  # and how long collections stop it
    for _what in ("sessions", "message_lists"):  # what stays of chats in memory
        TURN_METRICS.sessions_held.labels(_what).set_function(
            lambda what=_what: forget.held()[what])
    # /v1: the OpenAI-compatible API on the same engines (api/openai.py); CHAT_API_KEY is the
    # operator's key, accounts have their own (python -m store keys add NAME).
    API = OpenAIApi(ENGINES, CONFIG, TURN_METRICS, ApiKeys(STORE.engine).account_of,
                    os.environ.get("CHAT_API_KEY") or None, ignore_eos=IGNORE_EOS)
    http.include_router(API.router)
    # A turn from admission to its stored reply (chat/turns.py).
    TURNS = Turns(ENGINES, TURN_METRICS, SHUTDOWN, STORE, PACE, ignore_eos=IGNORE_EOS)
    if setting("VCHAT_LOG_FORMAT") == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
except (ConfigError, ValueError) as exc:  # a config mistake is a message, not a trace
    raise SystemExit(f"Configuration error: {exc}") from None


@cl.data_layer
def chat_store() -> ChatDataLayer:
    return STORE


@cl.password_auth_callback
async def login(username: str, password: str) -> cl.User | None:
    """The same refusal whatever was wrong; repeated failures wait (store/accounts.py)."""
    account = await ACCOUNTS.verify(username, password)
    if account is None:
        log.info("login refused for %r", username[:100])
        return None
    return cl.User(identifier=account.identifier,
                   metadata={"role": account.role, **await LOGINS.open(account.identifier)})


@http.middleware("http")
async def slow_failing_addresses(request, call_next):
    """Logins from an address that keeps failing wait, whatever names it tries (Chainlit's
    login callback is not told the address, so this wraps its POST /login)."""
    if request.method != "POST" or request.url.path != "/login":
        return await call_next(request)
    address = request.client.host if request.client else "unknown"
    await asyncio.sleep(LOGIN_ADDRESSES.wait_s(address))
    response = await call_next(request)
    LOGIN_ADDRESSES.record(address, ok=response.status_code < 400)
    return response


@cl.on_app_startup
async def start_engines() -> None:
    """Bring the database up to date and make sure someone can log in, then start the
    engines in the background: the server answers while they load."""
    before, after = await migrate(STORE.engine)
    if before != after:
        log.info("database schema brought from version %d to %d", before, after)
    made = await first_admin(ACCOUNTS)
    if made and made[1]:  # shown once: only its hash is kept
        print(f"\n  First start: log in as {made[0]!r} with the password {made[1]!r}\n"
              f"  (add users: .venv/bin/python -m store users add NAME)\n", flush=True)
    elif made:
        log.info("created the admin account %r from CHAT_ADMIN_USER", made[0])
    ENGINES.launch()
    LOGINS.start_sweeping()
    LOOP_LAG.start()
    GC_PAUSES.start()
    SHUTDOWN.handle_signals(asyncio.get_running_loop())
    SETTLING.add(task := asyncio.create_task(settle_after_start()))  # referenced till done
    task.add_done_callback(SETTLING.discard)


async def settle_after_start() -> None:
    """Once the engines are up: the streaming pace for their device, and what the app and
    its engines keep for life out of the collector's walks, which would otherwise stop
    every session for a while (chat/stalls.py)."""
    stalls.freeze_heap()
    stalls.collect_less_often(setting("VCHAT_GC_YOUNG_OBJECTS"))
    with contextlib.suppress(ChatError):  # a failed start is reported elsewhere
        await ENGINES.ready()
    PACE.events_per_s = setting("VCHAT_STREAM_EVENTS_PER_S") or Pace.events_for(bool(ENGINES.gpu))
    log.info("streaming pace: %d updates/s in all before replies slow down; Chainlit's "
             "constructor pause skipped: %s; %d long-lived objects out of garbage collection",
             PACE.events_per_s, stalls.constructor_pause_skipped(), stalls.freeze_heap())


@cl.on_app_shutdown
async def stop_engines() -> None:
    LOOP_LAG.stop()
    GC_PAUSES.stop()
    ENGINES.shutdown()


@http.get("/ready")
async def ready() -> JSONResponse:
    """Readiness: 200 once every engine is up, 503 while starting or after a failure."""
    health = await ENGINES.health()
    health["turns_in_flight"] = SHUTDOWN.turns
    # Failed database writes are the operator's to see here, not only in the log.
    health["store"] = {"failed_writes": STORE.failures, "last_failure": STORE.last_failure}
    if SHUTDOWN.closing:
        health["status"] = "stopping"
    return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)


@http.get("/notice")
async def notice() -> JSONResponse:
    """What the page says about the engines' state, for public/model-status.js: always 200
    (a 503 would be logged as an error in every visitor's browser console)."""
    status = "stopping" if SHUTDOWN.closing else (await ENGINES.health())["status"]
    return JSONResponse({"ready": status == "ok", "notice": page_notice(status)})


@http.get("/metrics")
async def metrics() -> Response:
    """Prometheus' text format: turns by profile, vLLM's engine series by preset."""
    return Response(generate_latest(METRICS), media_type=CONTENT_TYPE_LATEST)


# Chainlit registers its routes (a catch-all GET among them) before app.py is imported; put
# the app's first, so that they are reachable and answer in place of Chainlit's own.
http.router.routes.sort(key=lambda route: id(route) in CHAINLIT_ROUTES)


def chat_profiles(current_user=None, language=None) -> asyncio.Future:
    """The profile list, as a finished future: Chainlit runs a coroutine here nested in the
    event loop once per connecting session, and a few dozen connects at once ended in
    RecursionError (test_app.py::test_many_sessions_connect_at_once)."""
    done = asyncio.get_running_loop().create_future()
    done.set_result([
        cl.ChatProfile(
            name=p.name, markdown_description=p.description, icon=p.icon or None,
            default=p is CONFIG.default_profile,
            starters=[cl.Starter(label=s.label, message=s.message) for s in p.starters],
        )
        for p in CONFIG.profiles
    ])
    return done


# Not through @cl.set_chat_profiles: that would wrap the function in a coroutine again.
chainlit_config.code.set_chat_profiles = chat_profiles


@cl.on_chat_start
async def chat_start() -> None:
    conv = Conversation.start(CONFIG.profile_or_default(cl.user_session.get("chat_profile")))
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
    conv = Conversation.start(CONFIG.profile_or_default(cl.user_session.get("chat_profile")))
    conv.restore(stored_turns(thread.get("steps") or [], conv.profile.limits.message_chars))
    cl.user_session.set("conversation", conv)
    await settings_panel(conv).send()
    if conv.turns:
        await TURNS.offer_regenerate(conv.turns[-1].reply_id)
    log.info("chat %s resumed with %d turns", thread.get("id"), len(conv.turns))


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
        Slider(id="max_tokens", label="Max tokens", initial=now.max_tokens, min=1,
               max=limits.max_tokens, step=1, description="Longest reply, in tokens."),
        TextInput(id="system_prompt", label="System prompt", initial=now.system_prompt,
                  multiline=True,
                  description=f"At most {limits.system_prompt_chars:,} characters."),
        Switch(id="show_stats", label="Show stats under replies", initial=now.show_stats),
    ])


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
    arrived = GUARD.arrival(cl.context.session.id)  # taken whatever happens to the message
    conv: Conversation = cl.user_session.get("conversation")
    if SHUTDOWN.closing:
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
        TURN_METRICS.refuse(TurnRecord("refused", user_name(), conv.profile.name,
                                       reason="message", message=message.content[:1000]))
        await cl.Message(content=str(exc)).send()
        return
    await TURNS.take(conv, Message("user", checked.text), message.id, checked.notice,
                     arrived=arrived)


@cl.action_callback(REGENERATE)
async def regenerate(button: cl.Action) -> None:
    await TURNS.regenerate(button)
