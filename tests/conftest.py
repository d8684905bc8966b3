"""Shared fixtures: one set of real engines on the real embedded model per test session.

Engines are small and quick to start here: eager mode (no torch.compile), a 1 GiB KV cache
split between the presets, and a 2,048-token context.
"""

import os

os.environ.setdefault("VCHAT_ENFORCE_EAGER", "1")
os.environ.setdefault("VCHAT_KV_CACHE_GIB", "1")
os.environ.setdefault("VCHAT_MAX_MODEL_LEN", "2048")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from engine import Engines, load_config  # noqa: E402
from tools.chainlit_client import serving  # noqa: E402

API_KEY = "operator-key-for-the-api-tests-0123456789"  # `api_app`'s VCHAT_API_KEY
STAND_IN_RATE = 2000  # tokens/s per stream of `fast_stand_in`: 2 tokens every 1 ms step


def pytest_runtest_logreport(report):
    """With VCHAT_FAILURE_LOG set, each failure's report goes to that file as it happens,
    not at the end of the session: a run on the GPU machine may be cut off by its time
    limit before pytest's summary (scripts/gpu_run.sh)."""
    path = os.environ.get("VCHAT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


SHARED_FIXTURES = ("api_app", "engines", "fast_stand_in")  # the session's, below


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks
def pytest_collection_modifyitems(items):
    """Groups for `make test`'s workers (pytest-xdist, `--dist loadgroup`): a file runs on
    one worker, so its module's server starts once; files that use the same session server
    or engines run on the same worker, which starts it once; the browser tests (one
    package's app) stay together. Without `-n` the marks change nothing."""
    groups: dict[str, str] = {}  # a file or shared fixture -> the group it joined

    def group_of(key: str) -> str:
        while groups.get(key, key) != key:
            key = groups[key]
        return key

    def file_of(item) -> str:
        path = item.nodeid.split("::")[0]
        return "tests/e2e" if path.startswith("tests/e2e/") else path

    for item in items:
        keys = [file_of(item), *(n for n in SHARED_FIXTURES if n in item.fixturenames)]
        first = group_of(keys[0])
        for key in keys[1:]:
            groups[group_of(key)] = first
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(file_of(item))))


def pytest_addoption(parser):
    parser.addoption("--soak-turns", type=int, default=160,
                     help="turns in the soak test (tests/test_app.py; `make soak` runs 1,000)")


@pytest.fixture(scope="session")
def soak_turns(request) -> int:
    return request.config.getoption("--soak-turns")


@pytest.fixture(scope="session")
def config():
    return load_config()


@pytest.fixture(scope="session")
async def engines(config):
    """Both presets' engines, started once for the whole session."""
    pool = Engines(config)
    await pool.start()
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
async def fast_stand_in():
    """A `chainlit run app.py` server on the labelled stand-in engine (no model), far faster
    than any CPU model, replies running to max_tokens: the UI layer's tests and the app
    path's bench share it."""
    async with serving({"VCHAT_ENGINE": "stand-in",
                        "VCHAT_STANDIN_TOKENS_PER_S": str(STAND_IN_RATE),
                        "VCHAT_BENCH_IGNORE_EOS": "1"}, timeout=120) as srv:
        yield srv


@pytest.fixture(scope="session")
async def api_app():
    """The app on the real engines with the operator's API key and its log as an operator's
    collector reads it (JSON lines): the API's test files and the chat's (tests/test_api_*.py,
    tests/test_app.py, run one after another) share it."""
    async with serving({"VCHAT_API_KEY": API_KEY, "VCHAT_LOG_FORMAT": "json"}) as srv:
        yield srv
