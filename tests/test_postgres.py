"""The store on a real PostgreSQL server (tools/postgres.py starts one from Debian's
binaries; `.ci/run` installs them): the schema created and migrated from an empty
database, Chainlit's data layer with native arrays and JSONB, and the app itself with
DATABASE_URL set (login, a chat, a restart, resume, two users kept apart)."""

import asyncio
import os

import pytest
from chainlit.context import init_http_context
from chainlit.message import Message
from sqlalchemy import inspect, text

from store.accounts import Accounts
from store.schema import SCHEMA_VERSION, connect, database_url, migrate, schema_version
from store.responses import StoredResponses
from tests.test_accounts import STAND_IN, add_user, thread_steps, threads
from tests.test_api_responses import race_for_the_limit
from tests.test_database_away import SLOW, problems, writes_wait_while_the_database_is_away
from tests.test_documents import storage_limit_holds
from tests.test_shares import share_cap_holds
from tests.test_store import (feedback_duplicates_go_at_migration_7, hostile_round,
                              one_feedback_per_step, set_up_at_once)
from tools.chainlit_client import TEST_PASSWORD, TEST_USER, ChatClient, serving
from tools.postgres import Postgres, binaries

# Skipped only where no server is installed and none is required (.ci/run installs Debian's
# postgresql and requires it: there a missing server fails these tests).
pytestmark = pytest.mark.skipif(
    binaries() is None and not os.environ.get("VCHAT_REQUIRE_POSTGRES"),
    reason="no PostgreSQL server installed here (Debian: postgresql)")


@pytest.fixture(scope="module")
def pg():
    with Postgres() as server:
        yield server


@pytest.fixture
def db_url(pg) -> str:
    return database_url(None, env={"DATABASE_URL": pg.new_database()})


async def test_processes_setting_up_one_postgresql_database_at_once_do_it_once(db_url):
    await set_up_at_once(db_url)


async def test_an_accounts_stored_files_stay_under_its_limit_when_messages_race(db_url):
    await storage_limit_holds(db_url)  # tests/test_documents.py


async def test_an_account_holds_no_more_share_links_than_allowed_when_asks_race(db_url):
    await share_cap_holds(db_url)  # tests/test_shares.py


async def test_an_owners_stored_responses_stay_under_its_limit_when_requests_race(db_url):
    engine = connect(db_url)  # tests/test_api_responses.py
    try:
        await migrate(engine)
        await race_for_the_limit(StoredResponses(engine, keep=5))
    finally:
        await engine.dispose()


async def test_the_schema_is_created_migrated_and_guarded_on_postgresql(db_url):
    engine = connect(db_url)
    try:
        assert await schema_version(engine) == 0
        assert await migrate(engine) == (0, SCHEMA_VERSION)
        assert await migrate(engine) == (SCHEMA_VERSION, SCHEMA_VERSION)
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda sync: set(inspect(sync).get_table_names()))
            kinds = await conn.run_sync(lambda sync: {
                c["name"]: type(c["type"]).__name__
                for c in inspect(sync).get_columns("threads")})
        assert tables >= {"users", "threads", "steps", "elements", "feedbacks", "accounts"}
        assert (kinds["tags"], kinds["metadata"]) == ("ARRAY", "JSONB")  # native types
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE schema_version SET version = :v"),
                               {"v": SCHEMA_VERSION + 1})
        with pytest.raises(RuntimeError, match="newer than this app"):
            await migrate(engine)
    finally:
        await engine.dispose()


async def test_chainlits_layer_round_trips_and_reports_failures_on_postgresql(db_url):
    from chainlit.types import Pagination, ThreadFilter
    from chainlit.user import User

    from chat.data_layer import ChatDataLayer
    from store.schema import StoreError

    engine = connect(db_url)
    await migrate(engine)
    await engine.dispose()
    layer = ChatDataLayer(db_url)
    try:
        init_http_context()
        user = await layer.create_user(User(identifier="alice", metadata={"role": "user"}))
        await layer.update_thread("t-1", name="First chat", user_id=user.id,
                                  metadata={"chat_profile": "Latency-first"}, tags=["a", "b"])
        for kind, said in (("user_message", "What is 2 + 2?"), ("assistant_message", "4")):
            m = Message(content=said, type=kind)
            m.thread_id, m.created_at = "t-1", await layer.get_current_timestamp()
            await layer.create_step({**m.to_dict(), "tags": ["turn"]})
        thread = await layer.get_thread("t-1")
        assert thread["tags"] == ["a", "b"] and thread["metadata"]["chat_profile"] == \
            "Latency-first"
        assert [s["output"] for s in thread["steps"]] == ["What is 2 + 2?", "4"]
        listed = await layer.list_threads(Pagination(first=10), ThreadFilter(userId=user.id))
        assert [t["id"] for t in listed.data] == ["t-1"]
        broken = {**Message(content="lost?").to_dict(), "threadId": "t-1", "noSuchColumn": 1}
        with pytest.raises(StoreError):
            await layer.create_step(broken)
        assert layer.failures == 1 and len(await layer.settle("t-1")) == 1
        accounts = Accounts(layer.engine)
        await accounts.add("bob", "a long enough password")
        assert (await accounts.verify("bob", "a long enough password")).identifier == "bob"
        assert await accounts.verify("bob", "wrong") is None
    finally:
        await layer.engine.dispose()


@pytest.fixture
async def layer(db_url):
    """The chat data layer on a new database at the current schema version."""
    from chat.data_layer import ChatDataLayer

    engine = connect(db_url)
    await migrate(engine)
    await engine.dispose()
    made = ChatDataLayer(db_url)
    yield made
    await made.close()


async def test_hostile_values_reach_no_statements_text_and_no_other_account_on_postgresql(
        layer):
    await hostile_round(layer)


async def test_one_feedback_per_step_however_many_ratings_come_at_once_on_postgresql(layer):
    await one_feedback_per_step(layer)


async def test_feedback_duplicates_go_at_migration_7_on_postgresql(db_url):
    engine = connect(db_url)
    try:
        await feedback_duplicates_go_at_migration_7(engine)
    finally:
        await engine.dispose()


async def test_the_app_on_postgresql_keeps_chats_apart_and_across_a_restart(pg, tmp_path):
    url = pg.new_database()
    env = {**STAND_IN, "DATABASE_URL": url, "VCHAT_DATA_DIR": str(tmp_path / "data"),
           "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
    first, second = "Remember the word heliotrope.", "Which word did I ask you to remember?"
    async with serving(env, timeout=120) as srv:  # creates the first admin, as no one exists
        add_user(srv, "other", "another long password")
        wrong = ChatClient(srv.url, "Throughput-first", password="not the password")
        with pytest.raises(PermissionError):
            await wrong.login()
        user = ChatClient(srv.url, "Throughput-first")
        await user.connect()
        await user.settings(max_tokens=12, show_stats=False)
        assert (await user.send(first)).reply is not None
        await user.close()
    async with serving(env, timeout=120) as srv:  # a restart
        (stored,) = await threads(srv, ChatClient(srv.url, "Throughput-first"))
        other = ChatClient(srv.url, "Throughput-first", user="other",
                           password="another long password")
        assert await threads(srv, other) == [], "another user sees none of it"
        async with other.api() as http:
            assert (await http.get(f"/project/thread/{stored['id']}")).status_code != 200
        resumed = ChatClient(srv.url, "Throughput-first")
        steps = await thread_steps(resumed, stored["id"])
        assert [s["output"] for s in steps if s["type"] == "user_message"] == [first]
        await resumed.connect(resume=stored["id"])
        await resumed.settings(max_tokens=12, show_stats=False)
        follow = await resumed.send(second)
        fresh = ChatClient(srv.url, "Throughput-first")
        await fresh.connect()
        await fresh.settings(max_tokens=12, show_stats=False)
        alone = await fresh.send(second)
        for c in (resumed, fresh):
            await c.close()
    assert follow.reply["metadata"]["prompt_tokens"] > alone.reply["metadata"]["prompt_tokens"]


async def test_postgresql_restarted_during_turns_loses_nothing_and_doubles_nothing(pg, tmp_path):
    """The server stopped as an operator's restart stops it, while replies stream, and
    started again: tests/test_database_away.py's checks (the replies go on, the chats'
    writes wait and go in, in order, once each)."""
    env = {**SLOW, "DATABASE_URL": pg.new_database(), "VCHAT_DATA_DIR": str(tmp_path / "data"),
           "VCHAT_ADMIN_USER": TEST_USER, "VCHAT_ADMIN_PASSWORD": TEST_PASSWORD}
    async with serving(env, timeout=120) as srv:
        clients = await writes_wait_while_the_database_is_away(srv, away=pg.stop, back=pg.start)
        assert "its writes wait, in order" in srv.log_path.read_text(errors="replace")
        again = await asyncio.gather(*[c.send("Still there?") for c in clients])
        assert all(r.shown and problems(r) == [] for r in again)
        _, health = await srv.ready_state()
        assert health["store"]["failed_writes"] == 0, health["store"]
        await asyncio.gather(*[c.close() for c in clients])
