"""Every environment variable the product reads, in one table, each checked: the engine
layer's, the app's, the store's and the benchmarks'. Its own are named `VCHAT_*`; two keep
the names other software gives them (DATABASE_URL, Chainlit's CHAINLIT_AUTH_SECRET). The
README's table lists exactly these (tests/test_config.py checks it).

A value that cannot be read is a `ConfigError` naming the variable and what it takes, never
a traceback or a silent default (`VCHAT_ENFORCE_EAGER=ture` is an error, not "false"); a
secret's value is never repeated. `check_all` reads every one at start. Variables that
override a `profiles.yaml` field name it in `overrides`; engine/config.py applies them.
Names that were renamed still work (`aliases`), with one warning each in the log.

    from engine.settings import setting
    grace_s = setting("VCHAT_SHUTDOWN_GRACE_S")
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE or word in FALSE:
        return word in TRUE
    raise ValueError(f"must be one of {', '.join(TRUE + FALSE)}")


def whole(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("must be a whole number") from None
        if value < lowest:
            raise ValueError(f"must be at least {lowest}")
        return value
    return parse


def number(lowest: float, above: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
        if value != value or value < lowest or (above and value == lowest):
            raise ValueError(f"must be {'above' if above else 'at least'} {lowest:g}")
        return value
    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return parse


def text(value: str) -> str:
    return value


def auto_or(parse: Callable[[str], int]) -> Callable[[str], int | str]:
    """`auto`, or what `parse` reads."""
    def read(value: str) -> int | str:
        if value.strip() == "auto":
            return "auto"
        try:
            return parse(value)
        except ValueError as exc:
            raise ValueError(f"must be auto or {str(exc).removeprefix('must be ')}") from None
    return read


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], object]
    default: str | None  # None: unset means "as profiles.yaml (or the code) says"
    doc: str
    overrides: str | None = None  # the profiles.yaml field it replaces
    secret: bool = False  # its value is never repeated in an error
    aliases: tuple[str, ...] = ()  # its former names, still read (with a warning)


SETTINGS = {s.name: s for s in (
    Setting("VCHAT_PROFILES", text, None, "the profiles file (default ./profiles.yaml)"),
    Setting("VCHAT_MODEL", text, None, "auto, embedded, a hub id or a checkpoint folder",
            overrides="model"),
    Setting("VCHAT_MAX_MODEL_LEN", whole(-1), None, "context length in tokens (-1: fit memory)",
            overrides="vllm.max_model_len"),
    Setting("VCHAT_ENFORCE_EAGER", flag, None, "skip torch.compile and CUDA graphs",
            overrides="vllm.enforce_eager"),
    Setting("VCHAT_KV_CACHE_GIB", number(0, above=True), None,
            "KV cache for all engines without a GPU, GiB", overrides="memory.cpu_kv_cache_gib"),
    Setting("VCHAT_GPU_MEMORY", number(0, above=True), None,
            "share of the GPU's memory for all engines together",
            overrides="memory.gpu_memory_utilization"),
    Setting("VCHAT_CACHE_DIR", text, None, "where the embedded model is prepared and the "
            "GPU's compiled kernels are kept (default ~/.cache/vchat)"),
    Setting("VCHAT_ENGINES", one_of("auto", "shared", "per-preset"), None,
            "one engine for the presets on a GPU (shared), one each (per-preset), or auto: "
            "shared with a GPU, per-preset without", overrides="engines"),
    Setting("VCHAT_DATA_DIR", text, "data", "the data folder: the chat database (SQLite, "
            "unless DATABASE_URL is set) and the login secret"),
    Setting("DATABASE_URL", text, None, "PostgreSQL instead of the data folder's SQLite "
            "(postgresql://user:pass@host/db)", secret=True),
    Setting("VCHAT_DB_WAIT_S", number(0), "120",
            "how long a chat's write waits for a database that went away (restarting, "
            "unreachable, its disk full), tried again in order, before the user is told it "
            "was lost"),
    Setting("CHAINLIT_AUTH_SECRET", text, None, "signs login tokens (default: one made in "
            "the data folder on the first start)", secret=True),
    Setting("VCHAT_ADMIN_USER", text, None, "the first admin's name, when no account exists "
            "yet (with VCHAT_ADMIN_PASSWORD)", aliases=("CHAT_ADMIN_USER",)),
    Setting("VCHAT_ADMIN_PASSWORD", text, None, "the first admin's password", secret=True,
            aliases=("CHAT_ADMIN_PASSWORD",)),
    Setting("VCHAT_PASSWORD_LOGIN", flag, "1", "the login page's name and password form "
            "(0: single sign-on only)"),
    Setting("VCHAT_SSO_DOMAINS", text, None, "single sign-on: the e-mail domains let in, "
            "comma separated (default: any address the provider vouches for)"),
    Setting("VCHAT_SSO_GROUPS", text, None, "single sign-on: only members of one of these "
            "groups get in, comma separated (default: no group needed)"),
    Setting("VCHAT_SSO_ADMIN_GROUPS", text, None, "single sign-on: members of these groups "
            "are admins, comma separated"),
    Setting("VCHAT_SSO_GROUPS_CLAIM", text, "groups", "single sign-on: the claim (or "
            "header's) list of the user's groups"),
    Setting("VCHAT_PUBLIC_URL", text, "http://localhost:8000", "the app's address as people "
            "open it, for the invite links `store invites add` prints"),
    Setting("VCHAT_DEMO", one_of("off", "open"), "off", "open: anyone who opens the page "
            "chats as a demo guest, no account needed", aliases=("CHAT_DEMO",)),
    Setting("VCHAT_DEMO_BY", text, None, "who runs the open demo, said on its page and banner"),
    Setting("VCHAT_DEMO_GUESTS", whole(1), "100", "open demo: guests at most, counting "
            "those whose login is live"),
    Setting("VCHAT_DEMO_GUESTS_PER_ADDRESS", whole(1), "25", "open demo: of those, guests "
            "who joined from one client address at most"),
    Setting("VCHAT_GUEST_DAILY_TOKENS", whole(0), "100000", "a demo guest's tokens a day "
            "(prompt and reply; store/guests.py)"),
    Setting("VCHAT_GUEST_CHATS", whole(1), "5", "the chats a demo guest may keep at most"),
    Setting("VCHAT_GUEST_TURNS_PER_MINUTE", whole(1), "10", "messages a minute a demo "
            "guest may send"),
    Setting("VCHAT_GUEST_ADDRESS_TURNS_PER_MINUTE", whole(1), "1200", "messages a minute "
            "that the demo guests who joined from one client address may send together"),
    Setting("VCHAT_GUEST_ADDRESS_DAILY_TOKENS", whole(0), "20000000", "tokens a day that "
            "the demo guests who joined from one client address share"),
    Setting("VCHAT_GUEST_JOINS_PER_ADDRESS", whole(1), "1200", "demo guests one client "
            "address may make in an hour (a room often shares one address)"),
    Setting("VCHAT_GUEST_LOGIN_HOURS", number(0, above=True), "12", "how long a demo "
            "guest's login lasts (then its chats are out of its reach)"),
    Setting("VCHAT_GUEST_RETENTION_DAYS", number(0, above=True), "7",
            "days after which a demo guest goes, with its chats"),
    Setting("VCHAT_HEADER_AUTH", text, None, "login by a trusted proxy's header: the header "
            "naming the user, e.g. X-Forwarded-Email (default: off)"),
    Setting("VCHAT_HEADER_AUTH_GROUPS", text, None, "the proxy's header with the user's "
            "groups, comma separated (optional)"),
    Setting("VCHAT_HEADER_AUTH_PROXIES", text, None, "the addresses (or CIDR ranges) the "
            "header login is taken from, comma separated; needed with VCHAT_HEADER_AUTH"),
    Setting("VCHAT_API_KEY", text, None, "the operator's key for the OpenAI-compatible API "
            "(default: account keys only)", secret=True, aliases=("CHAT_API_KEY",)),
    Setting("VCHAT_STREAM_INTERVAL_MS", whole(0), "40",
            "shortest time between a reply's streamed updates; 0 sends every engine piece"),
    Setting("VCHAT_STREAM_EVENTS_PER_S", whole(1), None,
            "streamed updates a second for all replies together before each reply's "
            "interval grows (default: 160 without a GPU, 2000 with one)"),
    Setting("VCHAT_READING_NOTE_S", number(0), "2",
            "the chat shows how far the model has read a message (an estimate) when reading "
            "it should take at least this many seconds"),
    Setting("VCHAT_SHARE_VIEWERS", one_of("accounts", "anyone", "off"), "accounts",
            "who may open a chat's share link: anyone logged in (guests too), anyone with "
            "the link (a public demo), or nobody (off: no sharing at all)"),
    Setting("VCHAT_SHARE_LINKS", whole(1), "100", "live share links an account may hold"),
    Setting("VCHAT_GUEST_SHARING", flag, "0", "demo guests may share their chats too"),
    Setting("VCHAT_DOCUMENTS", flag, "1", "files attached to a message (text, code, CSV, "
            "JSON, HTML, PDF, DOCX): their text goes to the model (0: no attach button)"),
    Setting("VCHAT_DOCUMENT_MAX_MB", number(0, above=True), "20",
            "the largest attached file, MB (refused while it arrives)"),
    Setting("VCHAT_GUEST_DOCUMENT_MAX_MB", number(0), "2",
            "the largest file a demo guest may attach, MB (0: guests attach nothing)"),
    Setting("VCHAT_DOCUMENT_FILES", whole(1), "10", "files attached to one message at most"),
    Setting("VCHAT_DOCUMENT_CHARS", whole(1), "1000000",
            "characters of text one attached file may hold (about 250K tokens)"),
    Setting("VCHAT_DOCUMENT_PAGES", whole(1), "1000", "pages an attached PDF may have"),
    Setting("VCHAT_DOCUMENT_STORAGE_MB", number(0), "200", "the attached files' text that "
            "one account may keep with its chats, MB (0: no limit)"),
    Setting("VCHAT_DOCUMENT_READ_S", whole(1), "30", "CPU seconds a file's text may take to "
            "read (in a process of its own)"),
    Setting("VCHAT_DOCUMENT_READ_MB", whole(64), "1024", "memory the process reading a file "
            "may use, MB"),
    Setting("VCHAT_GC_YOUNG_OBJECTS", whole(1), "50000",
            "new objects between Python's young garbage collections (Python's own: 700): "
            "fewer short-lived objects reach the full collections, which stop every session"),
    Setting("VCHAT_EVENT_LOOP", one_of("asyncio", "uvloop"), "asyncio",
            "the server's event loop: Python's asyncio or uvloop (slower on the H200 here, "
            "BENCHMARKS.md); either with asyncio's C tasks, not the Python ones Chainlit's "
            "nest_asyncio puts there"),
    Setting("VCHAT_FRONT_ENDS", auto_or(whole(1)), "auto", "app processes sharing each "
            "engine's core under `make run` (launcher.py); auto: with an NVIDIA GPU "
            "one per 4 cores, at most 4; without, 1. `chainlit run app.py` is always one"),
    Setting("VCHAT_CONNECTION_SPREAD", one_of("hash", "first-free"), "hash",
            "how the front ends share the port's connections: hash (a socket each, "
            "SO_REUSEPORT: the kernel spreads them evenly) or first-free (one socket, "
            "whichever front end accepts first)"),
    Setting("VCHAT_SHUTDOWN_GRACE_S", number(0), "10",
            "on SIGTERM/Ctrl+C, how long replies being written may still take"),
    Setting("VCHAT_LOG_FORMAT", one_of("text", "json"), "text",
            "the log's lines: text, or one JSON object each (a turn's with its fields)"),
    Setting("VCHAT_LOG_MESSAGES", flag, "0",
            "the per-turn log line also holds the user's message and the reply"),
    Setting("VCHAT_API_MAX_BODY_MB", number(0, above=True), "4",
            "the largest OpenAI API request body, MB (a 256K-token context of text fits)"),
    Setting("VCHAT_API_STORED_RESPONSES", whole(0), "1000",
            "responses the API keeps per account for GET /v1/responses/ID and a follow-up's "
            "previous_response_id, the oldest dropped first (0: none kept, `store` ignored "
            "as by `vllm serve`, `background` refused)"),
    Setting("VCHAT_API_STORED_MB", number(0, above=True), "100",
            "the most the API's stored responses of one account may hold, MB (their JSON; "
            "the oldest dropped first)"),
    Setting("VCHAT_ENGINE", one_of("vllm", "stand-in"), "vllm",
            "benchmarks only: stand-in replaces the model with filler text"),
    Setting("VCHAT_STANDIN_TOKENS_PER_S", number(0, above=True), "1000",
            "benchmarks only: the stand-in's tokens/s per reply"),
    Setting("VCHAT_BENCH_IGNORE_EOS", flag, "0",
            "benchmarks only: every reply runs to its max tokens"),
    Setting("VCHAT_BASELINE_BASE_URL", text, "http://127.0.0.1:8000/v1",
            "benchmarks only: the server behind the usual Chainlit app (bench/baseline_app.py, "
            "which reads these itself: it uses nothing of this app)"),
    Setting("VCHAT_BASELINE_MODEL", text, "default", "benchmarks only: its model's name"),
    Setting("VCHAT_BASELINE_API_KEY", text, "none", "benchmarks only: its API key",
            secret=True),
    Setting("VCHAT_BASELINE_PASSWORD", text, "", "benchmarks only: the password of any login "
            "to the usual Chainlit app", secret=True),
    Setting("VCHAT_BASELINE_IGNORE_EOS", flag, "0", "benchmarks only: its replies run to "
            "their max tokens"),
)}
_WARNED: set[str] = set()  # former names seen, each warned about once


def setting(name: str, env: Mapping[str, str] | None = None):
    """The checked value of `name` (its default when unset or empty; None if it has none)."""
    spec = SETTINGS[name]
    env = os.environ if env is None else env
    given, raw = name, env.get(name)
    for alias in spec.aliases if not raw else ():
        if env.get(alias):
            given, raw = alias, env[alias]
            if alias not in _WARNED:
                _WARNED.add(alias)
                log.warning("%s is now called %s; the old name still works for now", alias,
                            name)
            break
    raw = raw or spec.default
    if raw is None:
        return None
    try:
        return spec.parse(raw)
    except ValueError as exc:
        shown = "" if spec.secret else f", got {raw!r}"
        raise ConfigError("environment", given, f"{exc}{shown} ({spec.doc})") from None


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Every setting read once: the first one that cannot be is a ConfigError."""
    for name in SETTINGS:
        setting(name, env)


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where prepared models and compiled kernels live: $VCHAT_CACHE_DIR, else
    ~/.cache/vchat."""
    return Path(setting("VCHAT_CACHE_DIR", env) or Path.home() / ".cache" / "vchat")
