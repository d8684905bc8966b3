"""The app's parts, built once when Chainlit imports app.py: the engines, the store, the
login rules, the guards on what clients send, the operator's routes, the API and the
chat's turns, each given what it needs. app.py's hooks use them; nothing here is a hook.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass

from chainlit.config import SpontaneousFileUploadFeature
from chainlit.oauth_providers import get_configured_oauth_providers

from api.openai import OpenAIApi
from api.ops import Ops
from chat import forget
from chat.admin import AdminPage
from chat.attachments import Attachments
from chat.data_layer import ChatDataLayer
from chat.downloads import Downloads
from chat.shares import SharePages
from chat.front_ends import SessionRouting
from chat.guard import Guard
from chat.invites import InvitePage, OpenDemo
from chat.logins import Logins, slow_failing_addresses
from chat.sso import HeaderLogin, SingleSignOn
from chat.streaming import Pace
from chat.turns import Turns
from chat.view import RANDOM_WEIGHTS, STAND_IN, page_line
from engine import ConfigError, Engines, load_config
from engine.config import Config
from engine.settings import check_all, setting
from service import front_ends, loop
from service.admission import Gate
from service.documents import KINDS, Limits, Reader
from service.shutdown import Shutdown
from service.turn_metrics import JsonLines, TurnMetrics
from store.accounts import Accounts, AddressThrottle
from store.admission import Admission
from store.api_keys import ApiKeys
from store.documents import Documents
from store.guests import Guests
from store.invites import Invites
from store.operator import Operator
from store.responses import StoredResponses
from store.schema import database_url
from store.sessions import LoginSessions
from store.shares import Shares
from store.setup import auth_secret, data_dir
from store.usage import Usage

log = logging.getLogger("app")


@dataclass
class Parts:
    config: Config
    engines: Engines
    pace: Pace  # a reply's updates at most this often (chat/streaming.py)
    shutdown: Shutdown  # on SIGTERM, turns in flight get the grace to finish
    store: ChatDataLayer
    accounts: Accounts
    usage: Usage
    logins: Logins
    password_login: bool
    sso: SingleSignOn
    oidc: bool
    header_login: HeaderLogin | None
    guests: Guests
    guard: Guard
    attachments: Attachments
    turn_metrics: TurnMetrics
    loop_lag: loop.LoopLag
    gc_pauses: loop.GcPauses
    gate: Gate
    turns: Turns
    settling: set[asyncio.Task]  # the start's background tasks, referenced till done


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A remote preset's HTTP clients (engine/remote.py) would log every request.
    for client_log in ("httpx", "httpx2"):
        logging.getLogger(client_log).setLevel(logging.WARNING)


def page_accepts() -> dict[str, list[str]]:
    """What the page's file picker offers: the kinds service/documents.py reads, by media
    type with their extensions (the picker lets a file through by either)."""
    types = {"text": "text/plain", "html": "text/html", "pdf": "application/pdf",
             "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document"}
    accepts: dict[str, list[str]] = {}
    for extension, kind in KINDS.items():
        accepts.setdefault(types[kind], []).append(f".{extension}")
    return accepts


def documents_parts(store: ChatDataLayer, chainlit_config) -> tuple[Reader | None, Documents]:
    """What reads attached files (None: VCHAT_DOCUMENTS is off) and where they are kept;
    the page's attach button set to match (Chainlit's spontaneous_file_upload)."""
    limits = Limits.from_settings()
    on = setting("VCHAT_DOCUMENTS")
    chainlit_config.features.spontaneous_file_upload = SpontaneousFileUploadFeature(
        enabled=on, accept=page_accepts(), max_files=limits.files,
        max_size_mb=max(1, math.ceil(limits.max_bytes / (1 << 20))))
    return (Reader(limits) if on else None), Documents(store.engine, limits.storage_bytes)


def build(http, sio, chainlit_config) -> Parts:
    """Every part, its routes and middleware added to Chainlit's server `http`; a
    configuration mistake raises ConfigError or ValueError."""
    check_all()  # every environment variable the app reads, before anything starts
    # The server's loop and asyncio's C tasks, before Chainlit starts it (service/loop.py).
    loop.own_loop(setting("VCHAT_EVENT_LOOP"))
    config = load_config()
    front_end = front_ends.current()
    engines = Engines(config, front_ends=front_end.count if front_end else 1,
                      front_end=front_end.index if front_end else 0,
                      folder=front_end.folder if front_end else None)
    ignore_eos = setting("VCHAT_BENCH_IGNORE_EOS")  # benchmarks: replies run to max_tokens
    # At the CPU's pace until the engines know their device (app.py settle_after_start).
    pace = Pace.starting_at(setting("VCHAT_STREAM_INTERVAL_MS") / 1000)
    shutdown = Shutdown(setting("VCHAT_SHUTDOWN_GRACE_S"))
    # The data folder's database (or DATABASE_URL); the login tokens' secret kept there
    # unless the environment gives one (store/setup.py).
    folder = data_dir()
    if setting("DATABASE_URL") and not setting("CHAINLIT_AUTH_SECRET"):
        log.warning("DATABASE_URL is set but CHAINLIT_AUTH_SECRET is not: this replica signs "
                    "logins with its data folder's secret, which replicas on other hosts do "
                    "not share (their users would be logged out when the proxy moves them)")
    os.environ["CHAINLIT_AUTH_SECRET"] = auth_secret(folder)
    store = ChatDataLayer(database_url(folder))
    accounts = Accounts(store.engine)
    usage = Usage(store.engine)
    slow_failing_addresses(http, AddressThrottle(store.engine))
    # A login token works while its session in the database is live (chat/logins.py).
    logins = Logins(LoginSessions(store.engine, store.reader),
                    chainlit_config.project.user_session_timeout)
    # Who may log in: the password form, OpenID Connect when Chainlit's OAUTH_GENERIC_* are
    # set, a sign-in proxy's header when VCHAT_HEADER_AUTH is (chat/sso.py).
    password_login = setting("VCHAT_PASSWORD_LOGIN")
    sso = SingleSignOn(accounts, logins.open)
    oidc = bool(get_configured_oauth_providers())
    header_login = HeaderLogin.from_settings(sso)
    if not (password_login or oidc or header_login):
        raise ConfigError("environment", "VCHAT_PASSWORD_LOGIN", "with the password form off,"
                          " set up single sign-on (OAUTH_GENERIC_*) or VCHAT_HEADER_AUTH, or "
                          "nobody can log in")
    if header_login:
        header_login.install(http)
    # A demo's guests: their chats capped, and gone after the retention.
    guests = Guests(store.engine, setting("VCHAT_GUEST_CHATS"),
                    setting("VCHAT_GUEST_RETENTION_DAYS"),
                    setting("VCHAT_GUEST_ADDRESS_DAILY_TOKENS"),
                    setting("VCHAT_GUEST_TURNS_PER_MINUTE"),
                    setting("VCHAT_GUEST_ADDRESS_TURNS_PER_MINUTE"))
    # VCHAT_DEMO=open: anyone who opens the page chats as a guest, under a demo banner.
    demo = OpenDemo(setting("VCHAT_DEMO_GUESTS"), setting("VCHAT_DEMO_BY"),
                    setting("VCHAT_DEMO_GUESTS_PER_ADDRESS")) \
        if setting("VCHAT_DEMO") == "open" else None
    # The line above every page's chat: the engines' state, else a test mode and a demo's
    # banner (never a message in the chat: chat/view.py page_line).
    mode = STAND_IN if engines.stand_in else RANDOM_WEIGHTS if config.random_weights else None
    banner = demo.banner(guests.retention_days) if demo is not None else None
    ops = Ops(engines, shutdown, store, lambda status: page_line(status, mode, banner),
              front_end)
    turn_metrics = TurnMetrics(ops.registry, log_text=setting("VCHAT_LOG_MESSAGES"))
    # May a turn start (service/admission.py), for the chat and the API alike.
    admission = Admission(store.engine, guests.limits, store.reader)
    gate = Gate(engines, shutdown, admission, turn_metrics)
    # Files attached to messages, read in processes of their own (chat/attachments.py).
    attachments = Attachments(*documents_parts(store, chainlit_config), Guard.owned_session)
    # What clients send checked where it enters (chat/guard.py).
    guard = Guard(logins, store, sharing=chainlit_config.features.allow_thread_sharing,
                  gate=gate, release=usage.release, attachments=attachments)
    guard.install(http, sio, chainlit_config.project.allow_origins,
                  api_body_bytes=int(setting("VCHAT_API_MAX_BODY_MB") * 1e6))
    # One of several processes sharing each engine's core (launcher.py): calls
    # naming a chat session reach the one holding it, and pages use WebSockets only.
    if front_end is not None and front_end.count > 1:
        http.add_middleware(SessionRouting, front=front_end, upload_bytes=guard.upload_bytes)
        chainlit_config.project.transports = ["websocket"]
    http.include_router(ops.router)  # /ready, /notice, /metrics
    http.include_router(AdminPage(  # /admin
        Operator(store.engine, setting("VCHAT_GUEST_CHATS"), guests.retention_days), usage,
        logins.user_of, ops.state, [p.name for p in config.profiles],
        os.environ["CHAINLIT_AUTH_SECRET"]).router)
    http.include_router(Downloads(store.engine).router)  # /export/chats[/ID]
    http.include_router(SharePages(  # /share..., /shared/ID
        Shares(store.engine, setting("VCHAT_SHARE_LINKS")), setting("VCHAT_SHARE_VIEWERS"),
        setting("VCHAT_GUEST_SHARING"), logins.user_of).router)
    joining = InvitePage(Invites(store.engine), setting("VCHAT_GUEST_LOGIN_HOURS") * 3600,
                         chainlit_config.ui.name, setting("VCHAT_GUEST_DAILY_TOKENS"), demo,
                         setting("VCHAT_GUEST_JOINS_PER_ADDRESS"))
    http.include_router(joining.router)  # /invite/TOKEN
    if demo is not None:
        joining.send_visitors_to_the_demo(http, logins.live_token)
    forget.report_to(turn_metrics.sessions_held)
    api = OpenAIApi(engines, config, turn_metrics, ApiKeys(store.engine).account_of,
                    setting("VCHAT_API_KEY"), usage, gate, ignore_eos=ignore_eos,
                    reader=attachments.reader,
                    stored=StoredResponses(store.engine, setting("VCHAT_API_STORED_RESPONSES"),
                                           int(setting("VCHAT_API_STORED_MB") * 1e6)))
    http.include_router(api.router)  # /v1
    turns = Turns(engines, turn_metrics, shutdown, gate, store, pace, usage, guard.hold,
                  ignore_eos=ignore_eos)
    if setting("VCHAT_LOG_FORMAT") == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
    return Parts(config, engines, pace, shutdown, store, accounts, usage, logins,
                 password_login, sso, oidc, header_login, guests, guard, attachments,
                 turn_metrics,
                 loop.LoopLag(turn_metrics.loop_lag.observe),
                 loop.GcPauses(turn_metrics.gc_paused), gate, turns, set())
