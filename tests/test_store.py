"""store/: the schema on a real SQLite file (created, migrated, matching what Chainlit 2.12
writes) and password accounts. Not yet wired into the app (issue 15 continues)."""

import asyncio
import time

import pytest
from chainlit.context import init_http_context
from chainlit.element import Text
from chainlit.message import Message
from chainlit.step import Step
from sqlalchemy import inspect, text

from store import accounts as accounts_module
from store.accounts import AccountError, Accounts, failure_delay
from store.schema import SCHEMA_VERSION, connect, database_url, migrate, schema_version


@pytest.fixture
async def engine(tmp_path):
    eng = connect(database_url(tmp_path / "data", env={}))
    yield eng
    await eng.dispose()


async def columns(engine, table: str) -> set[str]:
    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync: {c["name"] for c in inspect(sync).get_columns(table)})


def test_the_database_is_sqlite_in_the_data_folder_unless_database_url_says_otherwise(tmp_path):
    assert database_url(tmp_path, env={}) == f"sqlite+aiosqlite:///{tmp_path / 'chat.db'}"
    for given in ("postgres://u:p@db:5432/chat", "postgresql://u:p@db:5432/chat"):
        assert database_url(tmp_path, env={"DATABASE_URL": given}) == \
            "postgresql+asyncpg://u:p@db:5432/chat"


async def test_an_empty_database_is_created_at_the_current_version_and_left_alone_after(
        engine, tmp_path):
    assert await schema_version(engine) == 0
    assert await migrate(engine) == (0, SCHEMA_VERSION)
    assert (tmp_path / "data" / "chat.db").is_file(), "the data folder is created"
    assert await migrate(engine) == (SCHEMA_VERSION, SCHEMA_VERSION), "a second start: no-op"
    async with engine.connect() as conn:
        tables = await conn.run_sync(lambda sync: set(inspect(sync).get_table_names()))
    assert tables >= {"users", "threads", "steps", "elements", "feedbacks", "accounts",
                      "schema_version"}


async def test_a_database_newer_than_the_app_is_refused(engine):
    await migrate(engine)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE schema_version SET version = :v"),
                           {"v": SCHEMA_VERSION + 1})
    with pytest.raises(RuntimeError, match="newer than this app"):
        await migrate(engine)


async def test_every_column_chainlit_writes_exists(engine):
    """Chainlit's documented schema lacks newer columns; a missing one fails its INSERT."""
    await migrate(engine)
    init_http_context()
    step_keys = set(Step(name="s").to_dict()) | set(Message(content="m").to_dict())
    step_keys.add("feedback")  # read through a join, never written to steps
    assert step_keys - {"feedback"} <= await columns(engine, "steps")
    assert set(Text(content="t", name="n").to_dict()) <= await columns(engine, "elements")


async def test_accounts_keep_only_a_strong_hash_and_refuse_alike(engine, monkeypatch):
    await migrate(engine)
    accounts = Accounts(engine)
    await accounts.add("alice", "correct horse battery", role="admin")
    await accounts.add("bob", "another long secret")
    async with engine.connect() as conn:
        stored = (await conn.execute(text('SELECT "passwordHash" FROM accounts'))).scalars().all()
    assert all(h.startswith("$argon2id$") and "correct horse" not in h for h in stored)
    assert [a.identifier for a in await accounts.list()] == ["alice", "bob"]
    assert (await accounts.verify("alice", "correct horse battery")).role == "admin"
    monkeypatch.setattr(accounts_module, "failure_delay", lambda n: 0.0)  # no waiting here
    assert await accounts.verify("alice", "wrong") is None
    assert await accounts.verify("nobody", "correct horse battery") is None
    with pytest.raises(AccountError, match="exists already"):
        await accounts.add("alice", "yet another secret")
    with pytest.raises(AccountError, match="at least 8"):
        await accounts.add("carol", "short")
    await accounts.remove("bob")
    assert await accounts.verify("bob", "another long secret") is None
    with pytest.raises(AccountError, match="no user"):
        await accounts.remove("bob")


async def test_repeated_failures_are_slowed_down_and_a_success_resets_them(engine):
    assert [failure_delay(n) for n in range(6)] == [0, 0.25, 0.5, 1.0, 2.0, 4.0]
    assert failure_delay(50) == accounts_module.MAX_DELAY_S
    await migrate(engine)
    accounts = Accounts(engine)
    await accounts.add("alice", "correct horse battery")
    for _ in range(3):
        assert await accounts.verify("alice", "wrong") is None
    started = time.monotonic()
    assert await accounts.verify("alice", "correct horse battery") is not None
    # The 4th attempt waited for the 3rd failure's delay (1 s), less the time since.
    assert time.monotonic() - started >= failure_delay(3) - 0.3
    async with engine.connect() as conn:
        assert (await conn.execute(text('SELECT "failedLogins" FROM accounts'))).scalar_one() == 0
