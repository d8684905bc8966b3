"""The database behind persistence: the tables Chainlit's SQLAlchemy data layer writes
(users, threads, steps, elements, feedbacks) and the app's password accounts, created and
migrated by the app itself on start (Chainlit creates no tables), versioned.

SQLite by default (a file in the data folder), PostgreSQL when DATABASE_URL says so. The
columns are what Chainlit 2.12 actually writes, not its documented schema, which lacks the
newer step and element columns (a missing column fails the INSERT, which Chainlit only
logs): tests/test_store.py checks every key of Chainlit's own step, message and element
dicts against these tables. Ids are text on both databases; JSON is JSONB on PostgreSQL and
text on SQLite; tag lists are TEXT[] on PostgreSQL and JSON text on SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from engine.settings import setting

READ_WAIT_S = 0.25  # longest a SQLite read on the event loop's thread waits for a lock
SETUP_LOCK = 0x76636861  # PostgreSQL's advisory lock for setting a database up ("vcha")


class StoreError(RuntimeError):
    """A write or read the database refused."""


def failure_text(exc: Exception) -> str:
    """A failed statement's error, short enough for a log line and a StoreError."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def database_url(data_dir: Path, env: dict | None = None) -> str:
    """DATABASE_URL (postgres:// or postgresql:// as servers hand them out, driven by
    asyncpg), else SQLite in `data_dir`."""
    url = (setting("DATABASE_URL", env) or "").strip()
    if not url:
        return f"sqlite+aiosqlite:///{Path(data_dir).resolve() / 'chat.db'}"
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix):]
    return url


def connect(url: str) -> AsyncEngine:
    """The engine every part of the app shares. SQLite gets one connection, in WAL mode with
    synchronous=NORMAL: SQLite writes one at a time anyway, and through one connection the
    writes wait in the pool's queue, in the order they came, instead of in SQLite's busy
    handler (sleeps of up to 100 ms); WAL commits without a sync of the disk each time and
    keeps every committed write across a crash of the app (not of the machine's power).
    Measured: BENCHMARKS.md, "Writes to the database"."""
    if not url.startswith("sqlite"):
        return create_async_engine(url)
    Path(url.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, pool_size=1, max_overflow=0, pool_timeout=600)
    event.listen(engine.sync_engine, "connect", _sqlite_settings)
    return engine


class Reader:
    """Where checks that only read go (a login's session on every message, /ready's).

    On SQLite: a connection of its own, which in WAL mode reads while the writer's is busy
    (no wait in the writer's queue behind the chats' writes), driven by the standard sqlite3
    module on the event loop's own thread: a check is a lookup by primary key of a few rows
    in pages the cache holds, tens of microseconds, where every hand-off to another thread
    waits for the GIL behind whatever the loop runs, and every await for the loop's next
    turn behind every stream's update. Measured (BENCHMARKS.md, "2026-12-03: what holds
    Latency-first's first token", item 7): through aiosqlite (five awaited calls a query)
    or a thread of our own per query, a message's check cost far more on a busy loop than
    reading in line. SQLite waits at most `READ_WAIT_S` for a lock (WAL readers seldom meet
    one). Elsewhere, or with `own=False`: the writer's pool, awaited."""

    def __init__(self, writer: AsyncEngine, own: bool = True):
        self._writer: AsyncEngine | None = None
        if not own or writer.url.get_backend_name() != "sqlite":
            self._writer, self.sync_engine = writer, writer.sync_engine
            return
        self.sync_engine = create_engine(f"sqlite:///{writer.url.database}", pool_size=1,
                                         max_overflow=0,
                                         connect_args={"timeout": READ_WAIT_S})
        event.listen(self.sync_engine, "connect", _sqlite_reader_settings)

    async def rows(self, statement, params: dict | None = None) -> list:
        """The statement's rows."""
        if self._writer is not None:
            async with self._writer.connect() as conn:
                return (await conn.execute(statement, params or {})).all()
        with self.sync_engine.connect() as conn:  # in line: see the class's docstring
            return conn.execute(statement, params or {}).all()

    async def dispose(self) -> None:
        """Its own connection closed (the writer's pool is its owner's to close)."""
        if self._writer is None:
            self.sync_engine.dispose()


def _sqlite_reader_settings(connection, record) -> None:
    _sqlite_settings(connection, record)
    cursor = connection.cursor()
    cursor.execute("PRAGMA query_only=ON")
    cursor.close()


def _sqlite_settings(connection, _record) -> None:
    cursor = connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _tables() -> list[str]:
    """Version 1's statements, with {json} and {tags} for the database's types."""
    return [
        """CREATE TABLE users (
            "id" TEXT PRIMARY KEY, "identifier" TEXT NOT NULL UNIQUE,
            "metadata" {json} NOT NULL, "createdAt" TEXT)""",
        """CREATE TABLE threads (
            "id" TEXT PRIMARY KEY, "createdAt" TEXT, "name" TEXT,
            "userId" TEXT REFERENCES users ("id") ON DELETE CASCADE,
            "userIdentifier" TEXT, "tags" {tags}, "metadata" {json})""",
        """CREATE TABLE steps (
            "id" TEXT PRIMARY KEY, "name" TEXT NOT NULL, "type" TEXT NOT NULL,
            "threadId" TEXT NOT NULL REFERENCES threads ("id") ON DELETE CASCADE,
            "parentId" TEXT, "command" TEXT, "modes" {json}, "streaming" BOOLEAN NOT NULL,
            "waitForAnswer" BOOLEAN, "isError" BOOLEAN, "metadata" {json}, "tags" {tags},
            "input" TEXT, "output" TEXT, "createdAt" TEXT, "start" TEXT, "end" TEXT,
            "generation" {json}, "showInput" TEXT, "defaultOpen" BOOLEAN,
            "autoCollapse" BOOLEAN, "language" TEXT, "icon" TEXT)""",
        """CREATE TABLE elements (
            "id" TEXT PRIMARY KEY,
            "threadId" TEXT REFERENCES threads ("id") ON DELETE CASCADE,
            "type" TEXT, "url" TEXT, "chainlitKey" TEXT, "name" TEXT NOT NULL,
            "display" TEXT, "objectKey" TEXT, "size" TEXT, "page" INTEGER, "language" TEXT,
            "forId" TEXT, "mime" TEXT, "props" {json}, "autoPlay" BOOLEAN,
            "playerConfig" {json})""",
        """CREATE TABLE feedbacks (
            "id" TEXT PRIMARY KEY, "forId" TEXT NOT NULL,
            "threadId" TEXT NOT NULL REFERENCES threads ("id") ON DELETE CASCADE,
            "value" INTEGER NOT NULL, "comment" TEXT)""",
        # The app's own: password accounts (store/accounts.py).
        """CREATE TABLE accounts (
            "identifier" TEXT PRIMARY KEY, "passwordHash" TEXT NOT NULL,
            "role" TEXT NOT NULL, "createdAt" TEXT NOT NULL,
            "failedLogins" INTEGER NOT NULL DEFAULT 0, "lastFailedAt" DOUBLE PRECISION)""",
        'CREATE INDEX threads_by_user ON threads ("userId", "createdAt")',
        'CREATE INDEX steps_by_thread ON steps ("threadId", "createdAt")',
    ]


def migrations(postgres: bool) -> list[list[str]]:
    """Each version's statements, in order: version N is migrations(...)[N - 1]. A change
    to the schema is a new entry at the end, never an edit of a shipped one."""
    return [
        [sql.format(json="JSONB" if postgres else "TEXT", tags="TEXT[]" if postgres else "TEXT")
         for sql in _tables()],
        # 2: API keys of accounts (store/api_keys.py): only a hash of each key is kept.
        ["""CREATE TABLE api_keys (
            "id" TEXT PRIMARY KEY, "keyHash" TEXT NOT NULL UNIQUE,
            "identifier" TEXT NOT NULL REFERENCES accounts ("identifier") ON DELETE CASCADE,
            "label" TEXT, "createdAt" TEXT NOT NULL)"""],
        # 3: login sessions (store/sessions.py): a token is good while its session is live.
        ["""CREATE TABLE login_sessions (
            "id" TEXT PRIMARY KEY, "identifier" TEXT NOT NULL,
            "createdAt" DOUBLE PRECISION NOT NULL, "expiresAt" DOUBLE PRECISION NOT NULL,
            "endedAt" DOUBLE PRECISION)""",
         'CREATE INDEX login_sessions_by_account ON login_sessions ("identifier")'],
        # 4: what each turn cost (store/usage.py), an account's daily token quota, and how
        # it logs in: "password", or "sso" (an account single sign-on made: no password).
        ["""CREATE TABLE usage (
            "id" TEXT PRIMARY KEY, "identifier" TEXT, "profile" TEXT NOT NULL,
            "source" TEXT NOT NULL, "day" TEXT NOT NULL, "createdAt" TEXT NOT NULL,
            "promptTokens" INTEGER NOT NULL, "replyTokens" INTEGER NOT NULL,
            "stopped" BOOLEAN NOT NULL, "threadId" TEXT)""",
         'CREATE INDEX usage_by_account ON usage ("identifier", "day")',
         'CREATE INDEX usage_by_day ON usage ("day")',
         'ALTER TABLE accounts ADD COLUMN "dailyTokens" INTEGER',
         """ALTER TABLE accounts ADD COLUMN "kind" TEXT NOT NULL DEFAULT 'password'"""],
        # 5: state that several app processes on one database share: failed
        # logins per client address (store/accounts.py's AddressThrottle), and the socket
        # session that opened each chat, so that another replica can take the chat over
        # when the page reconnects to it (chat/data_layer.py's `chat_of_session`).
        ["""CREATE TABLE login_failures (
            "address" TEXT PRIMARY KEY, "failures" INTEGER NOT NULL,
            "lastFailedAt" DOUBLE PRECISION NOT NULL)""",
         'ALTER TABLE threads ADD COLUMN "sessionId" TEXT',
         'CREATE INDEX threads_by_session ON threads ("sessionId")'],
        # 6: invite links for demo sessions (store/invites.py), and guest accounts: the
        # invite each came through, the name it chose and the address it joined from
        # ("kind" = 'guest').
        ['''CREATE TABLE invites (
            "id" TEXT PRIMARY KEY, "tokenHash" TEXT NOT NULL UNIQUE,
            "uses" INTEGER NOT NULL, "used" INTEGER NOT NULL,
            "expiresAt" DOUBLE PRECISION NOT NULL, "profile" TEXT, "createdAt" TEXT NOT NULL,
            "revokedAt" DOUBLE PRECISION)''',
         'ALTER TABLE accounts ADD COLUMN "invite" TEXT',
         'ALTER TABLE accounts ADD COLUMN "displayName" TEXT',
         'ALTER TABLE accounts ADD COLUMN "address" TEXT',
         'CREATE INDEX accounts_by_invite ON accounts ("invite")',
         'CREATE INDEX accounts_by_address ON accounts ("address", "createdAt")'],
        # 7: limits decided where they are counted. A turn's usage row is
        # written when the turn is admitted, "pending" with what it may cost, and holds
        # its place in every per-minute limit and quota until it ends (store/usage.py).
        # One feedback per step (its chat's owner is the only one who may rate it): the
        # duplicates that concurrent first ratings made are dropped, one kept.
        ['ALTER TABLE usage ADD COLUMN "pending" BOOLEAN NOT NULL DEFAULT FALSE',
         'DELETE FROM feedbacks WHERE "id" NOT IN '
         '(SELECT MAX("id") FROM feedbacks GROUP BY "forId")',
         'CREATE UNIQUE INDEX feedbacks_one_per_step ON feedbacks ("forId")'],
        # 8: files attached to messages (store/documents.py): the text the model read of
        # each, with its name, the message it came with and its owner; "stored" is the
        # text's size in UTF-8, what the account's storage limit counts.
        ['''CREATE TABLE documents (
            "id" TEXT PRIMARY KEY, "threadId" TEXT NOT NULL, "messageId" TEXT NOT NULL,
            "identifier" TEXT NOT NULL, "position" INTEGER NOT NULL, "name" TEXT NOT NULL,
            "kind" TEXT NOT NULL, "size" INTEGER NOT NULL, "stored" INTEGER NOT NULL,
            "text" TEXT NOT NULL, "createdAt" TEXT NOT NULL)''',
         'CREATE INDEX documents_by_thread ON documents ("threadId", "messageId")',
         'CREATE INDEX documents_by_account ON documents ("identifier")'],
        # 9: responses the API keeps (store/responses.py, OpenAI's `store`): each as
        # answered, the conversation it ended, its owner and its status.
        ['''CREATE TABLE api_responses (
            "id" TEXT PRIMARY KEY, "identifier" TEXT NOT NULL,
            "createdAt" DOUBLE PRECISION NOT NULL, "status" TEXT NOT NULL,
            "response" TEXT NOT NULL, "messages" TEXT NOT NULL)''',
         'CREATE INDEX api_responses_by_account ON api_responses ("identifier", "createdAt")'],
        # 10: read-only links to a chat as it was when shared (store/shares.py): the copy
        # of its messages ("snapshot", JSON), its owner, and when it was revoked.
        ['''CREATE TABLE shares (
            "id" TEXT PRIMARY KEY, "identifier" TEXT NOT NULL, "threadId" TEXT NOT NULL,
            "title" TEXT NOT NULL, "snapshot" TEXT NOT NULL, "createdAt" TEXT NOT NULL,
            "revokedAt" TEXT)''',
         'CREATE INDEX shares_by_account ON shares ("identifier", "revokedAt")',
         'CREATE INDEX shares_by_thread ON shares ("threadId")'],
        # 11: a guest's chats counted by their owner at each of its turns (store/admission.py)
        # without reading every chat.
        ['CREATE INDEX threads_by_owner ON threads ("userIdentifier")'],
    ]


SCHEMA_VERSION = len(migrations(False))


async def schema_version(engine: AsyncEngine) -> int:
    """0 for an empty database."""
    async with engine.connect() as conn:
        exists = await conn.run_sync(
            lambda sync: sync.dialect.has_table(sync, "schema_version"))
        if not exists:
            return 0
        return (await conn.execute(text("SELECT version FROM schema_version"))).scalar_one()


@contextlib.asynccontextmanager
async def one_at_a_time(engine: AsyncEngine):
    """Held by one process at a time per database: app replicas starting together on an
    empty database (and the operator's commands beside them) set it up once, not all at
    once (two CREATE TABLEs, two first admins). PostgreSQL: a session advisory lock on a
    connection of its own, let go when the block ends or the process dies; SQLite: an
    exclusive lock on a file beside the database."""
    if engine.dialect.name == "postgresql":
        async with engine.connect() as conn:
            await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": SETUP_LOCK})
            await conn.commit()
            try:
                yield
            finally:
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": SETUP_LOCK})
                await conn.commit()
        return
    database = engine.url.database
    if not database or database == ":memory:":  # one process can reach it
        yield
        return
    with open(f"{database}.setup-lock", "a") as held:
        await asyncio.to_thread(fcntl.flock, held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


async def migrate(engine: AsyncEngine) -> tuple[int, int]:
    """Bring the database to SCHEMA_VERSION, each version in one transaction (on SQLite and
    PostgreSQL alike, a failed step leaves the previous version whole). Returns (from, to).
    A database newer than this app is refused rather than written to. One process at a
    time: the others wait, then find it done."""
    async with one_at_a_time(engine):
        return await _migrate(engine)


async def _migrate(engine: AsyncEngine) -> tuple[int, int]:
    postgres = engine.dialect.name == "postgresql"
    found = await schema_version(engine)
    if found > SCHEMA_VERSION:
        raise RuntimeError(f"the database is at schema version {found}, newer than this "
                           f"app's {SCHEMA_VERSION}: update the app first")
    steps = migrations(postgres)
    for version in range(found + 1, SCHEMA_VERSION + 1):
        async with engine.begin() as conn:
            if version == 1:
                await conn.execute(text("CREATE TABLE schema_version (version INTEGER NOT NULL)"))
                await conn.execute(text("INSERT INTO schema_version VALUES (0)"))
            for sql in steps[version - 1]:
                await conn.execute(text(sql))
            await conn.execute(text("UPDATE schema_version SET version = :v"), {"v": version})
    return found, SCHEMA_VERSION
