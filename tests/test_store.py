"""store/: the schema on a real SQLite file (created, migrated, matching what Chainlit 2.12
writes), Chainlit's data layer on it with its SQLite traps handled, password accounts, the
operator's users command and the data folder's secret and first admin (the app on them:
tests/test_accounts.py; the same on PostgreSQL: tests/test_postgres.py)."""

import asyncio
import os
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from chainlit.context import init_http_context
from chainlit.element import Text
from chainlit.message import Message
from chainlit.step import Step
from sqlalchemy import inspect, text

from store import accounts as accounts_module
from store.accounts import AccountError, Accounts, AddressThrottle, failure_delay
from store.schema import SCHEMA_VERSION, connect, database_url, migrate, schema_version
from store.setup import auth_secret, data_dir, first_admin
from tools.chainlit_client import ROOT


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


@pytest.fixture
async def layer(tmp_path):
    from chat.data_layer import ChatDataLayer

    url = database_url(tmp_path, env={})
    eng = connect(url)
    await migrate(eng)
    await eng.dispose()
    dl = ChatDataLayer(url)
    yield dl
    await dl.close()


async def test_sqlite_tags_trap_chainlits_own_layer_loses_the_thread_silently(tmp_path):
    """Regression for the trap the app's layer handles: Chainlit's SQLAlchemy layer binds
    thread tags as a Python list, SQLite refuses it, and Chainlit only logs a warning."""
    from chainlit.data.sql_alchemy import SQLAlchemyDataLayer

    url = database_url(tmp_path, env={})
    eng = connect(url)
    await migrate(eng)
    theirs = SQLAlchemyDataLayer(url)
    init_http_context()
    await theirs.update_thread("t-1", name="Tagged", tags=["a", "b"])  # no error raised...
    async with eng.connect() as conn:  # ...and nothing stored
        assert (await conn.execute(text("SELECT COUNT(*) FROM threads"))).scalar_one() == 0
    await theirs.engine.dispose()
    await eng.dispose()


async def test_a_thread_with_tags_and_steps_round_trips(layer):
    from chainlit.types import Pagination, ThreadFilter
    from chainlit.user import User

    init_http_context()
    user = await layer.create_user(User(identifier="alice", metadata={"role": "user"}))
    await layer.update_thread("t-1", name="First chat", user_id=user.id,
                              metadata={"chat_profile": "Latency-first"}, tags=["a", "b"])
    question = Message(content="What is 2 + 2?", author="alice", type="user_message")
    question.thread_id = "t-1"
    answer = Message(content="4", type="assistant_message")
    answer.thread_id = "t-1"
    for m in (question, answer):
        m.created_at = await layer.get_current_timestamp()  # as Message.send sets it
        await layer.create_step({**m.to_dict(), "tags": ["turn"]})
    assert await layer.settle("t-1") == []
    thread = await layer.get_thread("t-1")
    assert thread["tags"] == ["a", "b"] and thread["userIdentifier"] == "alice"
    assert thread["metadata"]["chat_profile"] == "Latency-first"
    steps = sorted(thread["steps"], key=lambda s: s["createdAt"])
    assert [(s["type"], s["output"]) for s in steps] == [
        ("user_message", "What is 2 + 2?"), ("assistant_message", "4")]
    assert all(s["tags"] == ["turn"] for s in steps)
    listed = await layer.list_threads(Pagination(first=10), ThreadFilter(userId=user.id))
    assert [t["id"] for t in listed.data] == ["t-1"]
    stamp = await layer.get_current_timestamp()
    assert stamp.endswith("Z") and abs(
        (datetime.utcnow() - datetime.fromisoformat(stamp[:-1])).total_seconds()) < 60


async def test_a_failed_write_is_raised_counted_and_reported_for_its_thread(layer):
    from store.schema import StoreError

    init_http_context()
    await layer.update_thread("t-2", name="Second")
    broken = {**Message(content="lost?").to_dict(), "threadId": "t-2", "noSuchColumn": 1}
    with pytest.raises(StoreError, match="noSuchColumn"):
        await layer.create_step(broken)
    assert layer.failures == 1 and "noSuchColumn" in layer.last_failure
    told = await layer.settle("t-2")
    assert len(told) == 1 and "noSuchColumn" in told[0]
    assert await layer.settle("t-2") == [], "each failure is reported once"
    assert await layer.healthy()


async def test_an_address_that_keeps_failing_waits_and_is_forgotten_after_success_or_an_hour(
        engine, tmp_path):
    await migrate(engine)
    throttle = AddressThrottle(engine)
    # Another process on the same database (a second replica) sees the same failures.
    other_engine = connect(database_url(tmp_path / "data", env={}))
    other = AddressThrottle(other_engine)
    try:
        for n in range(3):
            await (throttle if n % 2 else other).record("10.0.0.1", ok=False, now=100.0 + n)
        assert await throttle.wait_s("10.0.0.1", now=102.0) == failure_delay(3)
        assert await other.wait_s("10.0.0.1", now=102.5) == failure_delay(3) - 0.5
        assert await throttle.wait_s("10.0.0.2", now=102.0) == 0, "others are not slowed"
        await other.record("10.0.0.1", ok=True, now=103.0)
        assert await throttle.wait_s("10.0.0.1", now=103.0) == 0
        await throttle.record("10.0.0.1", ok=False, now=200.0)
        later = 200.0 + AddressThrottle.FORGET_S + 1
        assert await throttle.wait_s("10.0.0.1", now=later) == 0
        await throttle.record("10.0.0.1", ok=False, now=later)
        assert await throttle.wait_s("10.0.0.1", now=later) == failure_delay(1), \
            "an hour's quiet starts the count again"
        await throttle.record("10.0.0.2", ok=False, now=later + AddressThrottle.FORGET_S + 1)
        async with engine.connect() as conn:
            kept = (await conn.execute(text('SELECT "address" FROM login_failures'))).all()
        assert [r.address for r in kept] == ["10.0.0.2"], "an hour's quiet is deleted"
    finally:
        await other_engine.dispose()


async def set_up_at_once(url: str) -> None:
    """Replicas starting together on an empty database at `url`: each its own engine
    (connections and lock of its own, as separate processes have), all at once. The
    schema and the first admin are made once, and failed logins from one address are
    counted by all of them."""
    engines = [connect(url) for _ in range(4)]
    env = {"VCHAT_ADMIN_USER": "boss", "VCHAT_ADMIN_PASSWORD": "a-long-password"}
    try:
        done = await asyncio.gather(*(migrate(e) for e in engines))
        assert sorted(done) == [(0, SCHEMA_VERSION)] + [(SCHEMA_VERSION, SCHEMA_VERSION)] * 3
        made = await asyncio.gather(*(first_admin(Accounts(e), env) for e in engines))
        assert made.count(None) == 3 and ("boss", None) in made
        assert [a.identifier for a in await Accounts(engines[0]).list()] == ["boss"]
        throttles = [AddressThrottle(e) for e in engines]
        await asyncio.gather(*(t.record("10.1.1.1", ok=False, now=1000.0)
                               for t in throttles * 3))
        assert await throttles[0].wait_s("10.1.1.1", now=1000.0) == failure_delay(12)
    finally:
        for e in engines:
            await e.dispose()


async def test_processes_setting_up_one_database_at_once_do_it_once(tmp_path):
    await set_up_at_once(database_url(tmp_path / "data", env={}))


async def test_a_turns_writes_land_in_order_in_few_statements_on_a_wal_database(layer):
    """A step is written when its reply starts and again when it ends, both in tasks nobody
    awaits: through SQLite's one connection the end lands last, for every turn of a burst.
    A thread already written is not read again before each step (Chainlit's layer reads it
    every time): a turn's steps cost one statement each."""
    import asyncio

    from sqlalchemy import event

    init_http_context()
    async with layer.engine.connect() as conn:
        assert (await conn.execute(text("PRAGMA journal_mode"))).scalar_one() == "wal"
    statements = []
    event.listen(layer.engine.sync_engine, "before_cursor_execute",
                 lambda *args: statements.append(args[2].split()[0]))
    replies = []
    for n in range(64):
        await layer.update_thread(f"t-{n}", name=f"Chat {n}")
        reply = Message(content="", type="assistant_message")
        reply.thread_id = f"t-{n}"
        replies.append(reply)
    statements.clear()
    writes = []
    for reply in replies:  # the reply starts streaming, then ends, while others write
        writes.append(asyncio.create_task(layer.create_step(reply.to_dict())))
        reply.content = f"The whole reply {reply.thread_id}."
        writes.append(asyncio.create_task(layer.update_step(reply.to_dict())))
    await asyncio.gather(*writes)
    assert statements == ["INSERT"] * 128, statements[:6]
    for reply in replies:
        steps = (await layer.get_thread(reply.thread_id))["steps"]
        assert [s["output"] for s in steps] == [reply.content]


async def test_login_checks_asked_together_share_one_query_that_reads_past_the_writer(layer):
    """Regression (issue 27): every socket message checked its login session in a query of
    its own on SQLite's one connection, in line behind the chats' writes; under a saturated
    H200 the messages of a burst waited ~0.3 s for their first token. Checks asked together
    share one query, read on connections of their own while a write is under way, and each
    is answered from a query begun after it was asked. On SQLite the query is one call of
    the standard sqlite3 module on the event loop's thread: aiosqlite's awaited calls, or a
    thread per query, each wait behind everything a busy loop runs (BENCHMARKS.md,
    "2026-12-03: what holds Latency-first's first token", item 7). Regression (issue 52):
    the check asked only whether the session was live, so a token naming alice with bob's
    live session got in as alice; in the same shared query, bob's session is live for bob
    only, and only bob can end it."""
    import asyncio

    from sqlalchemy import event

    from store.sessions import LoginSessions

    await Accounts(layer.engine).add("alice", "correct horse battery")
    await Accounts(layer.engine).add("bob", "bob's battery staple")
    sessions = LoginSessions(layer.engine, layer.reader)
    ids = [await sessions.open("alice", 3600) for _ in range(4)]
    bobs = await sessions.open("bob", 3600)
    if layer.sqlite:
        assert layer.reader.sync_engine.dialect.driver == "pysqlite"
        threads = []
        on_thread = lambda *args: threads.append(threading.current_thread())  # noqa: E731
        event.listen(layer.reader.sync_engine, "before_cursor_execute", on_thread)
        assert await sessions.is_live(ids[0], "alice") is True
        assert threads == [threading.current_thread()], threads
        event.remove(layer.reader.sync_engine, "before_cursor_execute", on_thread)
    queries = []
    event.listen(layer.reader.sync_engine, "before_cursor_execute",
                 lambda *args: queries.append(args[2]))
    async with layer.engine.begin() as writing:  # the writer's connection and lock held
        await writing.execute(text('UPDATE accounts SET "role" = "role"'))
        answers = await asyncio.wait_for(asyncio.gather(
            *[sessions.is_live(s, "alice") for s in ids * 8],
            *[sessions.is_live(bobs, "alice"), sessions.is_live(ids[0], "bob"),
              sessions.is_live(bobs, "bob")] * 4,
            sessions.is_live("no such session", "alice"), sessions.is_live(None, "alice"),
            sessions.is_live(bobs, None)), timeout=10)
    assert answers == [True] * 32 + [False, False, True] * 4 + [False] * 3
    assert len(queries) == 1, queries
    assert await sessions.live([(bobs, "alice"), (bobs, "bob"), (ids[1], "bob"), None]) == \
        {(bobs, "bob")}, "the sweeper's check: pairs"
    assert await sessions.end(bobs, "alice") is False and await sessions.is_live(bobs, "bob")
    await sessions.end(ids[0], "alice")
    gone = asyncio.create_task(sessions.is_live(ids[1], "alice"))  # its caller goes away
    kept = asyncio.create_task(sessions.is_live(ids[0], "alice"))
    await asyncio.sleep(0)
    gone.cancel()
    assert await kept is False, "the end is seen by the next check"
    assert [await sessions.is_live(s, "alice") for s in ids] == [False, True, True, True]


def store_command(tmp_path, *args, stdin: str = ""):
    env = {**os.environ, "VCHAT_DATA_DIR": str(tmp_path / "data")}
    env.pop("DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "store", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_users_command_adds_lists_and_removes_accounts(tmp_path):
    first = store_command(tmp_path, "migrate")
    assert first.returncode == 0 and f"from version 0 to {SCHEMA_VERSION}" in first.stdout
    assert "schema at version" in store_command(tmp_path, "migrate").stdout
    added = store_command(tmp_path, "users", "add", "alice", "--admin", "--stdin",
                          stdin="correct horse battery\n")
    assert added.returncode == 0 and "added alice (admin)" in added.stdout
    store_command(tmp_path, "users", "add", "bob", "--stdin", stdin="another long secret\n")
    listed = store_command(tmp_path, "users", "list").stdout.splitlines()
    assert [line.split("\t")[:2] for line in listed] == [["alice", "admin"], ["bob", "user"]]
    again = store_command(tmp_path, "users", "add", "bob", "--stdin", stdin="whatever123\n")
    assert again.returncode == 1 and again.stderr.strip() == "error: user 'bob' exists already"
    assert "Traceback" not in again.stderr
    assert store_command(tmp_path, "users", "remove", "bob").returncode == 0
    gone = store_command(tmp_path, "users", "remove", "bob")
    assert gone.returncode == 1 and "no user 'bob'" in gone.stderr


def test_the_auth_secret_is_made_once_kept_private_and_the_environment_wins(tmp_path):
    folder = tmp_path / "data"
    made = auth_secret(folder, env={})
    assert len(made) >= 48 and auth_secret(folder, env={}) == made, "kept across starts"
    assert stat.S_IMODE((folder / "auth-secret").stat().st_mode) == 0o600
    assert auth_secret(folder, env={"CHAINLIT_AUTH_SECRET": "given"}) == "given"
    assert data_dir(env={}) == Path("data")
    assert data_dir(env={"VCHAT_DATA_DIR": "/srv/chat"}) == Path("/srv/chat")


async def test_the_first_admin_comes_from_the_environment_or_is_generated_once(engine):
    await migrate(engine)
    accounts = Accounts(engine)
    with pytest.raises(ValueError, match="both"):
        await first_admin(accounts, env={"VCHAT_ADMIN_USER": "root"})
    name, password = await first_admin(accounts, env={})
    assert name == "admin" and len(password) >= 16
    assert (await accounts.verify("admin", password)).role == "admin"
    assert await first_admin(accounts, env={}) is None, "accounts exist: nothing made"
    await accounts.remove("admin")
    given = {"VCHAT_ADMIN_USER": "root", "VCHAT_ADMIN_PASSWORD": "a long given secret"}
    assert await first_admin(accounts, env=given) == ("root", None)
    assert (await accounts.verify("root", "a long given secret")).role == "admin"


CRAFTED = "x') OR (SELECT COUNT(*) FROM accounts) > 0 --"


async def hostile_round(layer) -> None:
    """Another account's ids and crafted text through every method of the data layer:
    nothing of alice's is read, changed or deleted by mallory's calls, and every statement
    run is one of store/queries.py's fixed texts, no value pasted in (issue 26). Shared
    with tests/test_postgres.py."""
    import uuid

    from chainlit.types import Feedback, Pagination, ThreadFilter
    from chainlit.user import User
    from sqlalchemy import event

    from store import queries
    from store.schema import StoreError

    init_http_context()
    alice = await layer.create_user(User(identifier="alice", metadata={"session": "s-1"}))
    mallory = await layer.create_user(User(identifier="mallory", metadata={}))
    assert alice.metadata == {}, "a login's session id is never stored with the user"
    run = []
    event.listen(layer.engine.sync_engine, "before_execute",
                 lambda conn, clause, *rest: run.append(getattr(clause, "text", str(clause))))
    theirs, mine = str(uuid.uuid4()), CRAFTED
    await layer.update_thread(theirs, name="Alice's chat", user_id=alice.id)
    said = Message(content="alice's secret: heliotrope", type="user_message")
    said.thread_id = theirs
    await layer.create_step(said.to_dict())
    fid = await layer.upsert_feedback(Feedback(forId=said.id, value=1), owner="alice")
    await layer.update_thread(mine, name="Mallory's", user_id=mallory.id, tags=[CRAFTED])
    forged = Message(content="overwritten", type="user_message")
    forged.thread_id, forged.id = mine, said.id  # alice's message's id, in mallory's chat
    with pytest.raises(StoreError, match="another chat"):
        await layer.create_step(forged.to_dict())
    await layer.delete_step(said.id, thread_id=mine)
    await layer.update_thread(theirs, name="pwned", user_id=mallory.id)
    assert await layer.upsert_feedback(Feedback(forId=said.id, value=0), owner="mallory") \
        is None
    assert await layer.upsert_feedback(Feedback(forId=said.id, value=0, id=fid),
                                       owner="mallory") is None
    assert await layer.delete_feedback(fid, owner="mallory") is False
    for words in (CRAFTED, "heliotrope", "%", "_"):
        found = await layer.list_threads(Pagination(first=20),
                                         ThreadFilter(userId=mallory.id, search=words))
        assert theirs not in [t["id"] for t in found.data], words
    listed = await layer.list_threads(Pagination(first=20, cursor="' OR 1=1 --"),
                                      ThreadFilter(userId=mallory.id))
    assert [t["id"] for t in listed.data] == [mine]
    assert await layer.get_thread_author(CRAFTED) == "", "not a chat id: no such chat"
    assert await layer.get_thread(str(uuid.uuid4())) is None
    stored = await layer.get_thread(theirs)
    assert stored["userIdentifier"] == "alice", "the owner never changes"
    assert [(s["id"], s["output"]) for s in stored["steps"]] == [(said.id, said.content)]
    assert stored["steps"][0]["feedback"]["value"] == 1
    assert (await layer.get_thread(mine))["tags"] == [CRAFTED], "stored as data"
    await layer.delete_thread(mine)
    assert run and set(run) <= queries.ALL, set(run) - queries.ALL
    assert not any(CRAFTED in sql or "heliotrope" in sql for sql in run)


async def test_hostile_values_reach_no_statements_text_and_no_other_account(layer):
    await hostile_round(layer)


async def one_feedback_per_step(layer) -> None:
    """Regression (issue 52): ratings of one reply at once without a feedback id each made
    a row, and the chat read back held the reply once per row. Nine at once, with no id,
    another step's feedback id or an unknown one, make one row for the step, changed in
    place, and leave the other step's feedback as it was. Shared with
    tests/test_postgres.py (where the nine race on connections of their own)."""
    import uuid

    from chainlit.types import Feedback
    from chainlit.user import User

    init_http_context()
    alice = await layer.create_user(User(identifier="alice", metadata={}))
    thread = str(uuid.uuid4())
    await layer.update_thread(thread, name="Rated", user_id=alice.id)
    asked = Message(content="A question.", type="user_message")
    said = Message(content="A reply.", type="assistant_message")
    for message in (asked, said):
        message.thread_id = thread
        await layer.create_step(message.to_dict())
    other = await layer.upsert_feedback(Feedback(forId=asked.id, value=1, comment="kept"),
                                        owner="alice")
    given = [None, other, str(uuid.uuid4())]
    rated = await asyncio.gather(*[layer.upsert_feedback(
        Feedback(forId=said.id, value=0, comment=f"try {n}", id=given[n % 3]),
        owner="alice") for n in range(9)])
    assert len(set(rated)) == 1 and other not in rated, rated
    assert await layer.upsert_feedback(Feedback(forId=said.id, value=1, comment="final"),
                                       owner="alice") == rated[0]
    steps = (await layer.get_thread(thread))["steps"]
    assert len(steps) == 2, "each step once"
    assert {s["id"]: s["feedback"] for s in steps} == {
        asked.id: {"id": other, "forId": asked.id, "value": 1, "comment": "kept"},
        said.id: {"id": rated[0], "forId": said.id, "value": 1, "comment": "final"}}
    async with layer.engine.connect() as conn:
        assert (await conn.execute(text("SELECT COUNT(*) FROM feedbacks"))).scalar() == 2


async def test_one_feedback_per_step_however_many_ratings_come_at_once(layer):
    await one_feedback_per_step(layer)


async def feedback_duplicates_go_at_migration_7(engine) -> None:
    """The duplicate feedbacks that concurrent first ratings made before migration 7 are
    dropped by it, one kept per step, and no second one can be written after. Shared with
    tests/test_postgres.py."""
    from sqlalchemy.exc import IntegrityError

    await migrate(engine)
    async with engine.begin() as conn:  # back to version 6, with duplicates
        for sql in ('DROP INDEX threads_by_owner',  # version 11's
                    'DROP TABLE shares',  # version 10's
                    'DROP TABLE api_responses',  # version 9's
                    'DROP TABLE documents',  # version 8's
                    'DROP INDEX feedbacks_one_per_step',
                    'ALTER TABLE usage DROP COLUMN "pending"',
                    'UPDATE schema_version SET version = 6',
                    """INSERT INTO threads ("id") VALUES ('t')"""):
            await conn.execute(text(sql))
        for n, step in enumerate(["s1"] * 5 + ["s2"]):
            await conn.execute(text(
                'INSERT INTO feedbacks ("id", "forId", "threadId", "value") '
                "VALUES (:id, :step, 't', 0)"), {"id": f"f{n}", "step": step})
    assert await migrate(engine) == (6, SCHEMA_VERSION)
    async with engine.connect() as conn:
        kept = (await conn.execute(text(
            'SELECT "forId", "id" FROM feedbacks ORDER BY "forId"'))).all()
    assert [tuple(row) for row in kept] == [("s1", "f4"), ("s2", "f5")]
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text('INSERT INTO feedbacks ("id", "forId", "threadId", '
                                    """"value") VALUES ('f6', 's1', 't', 1)"""))


async def test_feedback_duplicates_go_at_migration_7(engine):
    await feedback_duplicates_go_at_migration_7(engine)


async def test_usage_rows_are_written_together_and_kept_while_the_database_refuses(engine):
    """store/usage.py keeps finished turns' rows and writes them in one transaction a
    second; a failed write keeps them for the next one (nothing counted twice or lost)."""
    from store.usage import Spent, Usage

    await migrate(engine)
    usage = Usage(engine)
    for n in range(3):
        usage.record(Spent("ann", "Latency-first", "chat", 10 + n, 5, stopped=n == 2))

    async def rows() -> int:
        async with engine.connect() as conn:
            return (await conn.execute(text("SELECT COUNT(*) FROM usage"))).scalar_one()

    assert await rows() == 0  # not yet: within FLUSH_S
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE usage RENAME TO usage_away"))
    with pytest.raises(Exception):
        await usage.flush()
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE usage_away RENAME TO usage"))
    usage.record(Spent(None, "Throughput-first", "api", 7, 3, stopped=False))
    await usage.settle()
    assert await rows() == 4
    (line_ann, line_api) = sorted(await usage.report(), key=lambda line: line.profile)
    assert (line_ann.turns, line_ann.prompt_tokens, line_ann.reply_tokens, line_ann.stopped) == \
        (3, 33, 15, 1)
    assert (line_api.identifier, line_api.turns) == (None, 1)
