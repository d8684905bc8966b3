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


def pytest_runtest_logreport(report):
    """With VCHAT_FAILURE_LOG set, each failure's report goes to that file as it happens,
    not at the end of the session: a run on the GPU machine may be cut off by its time
    limit before pytest's summary (scripts/gpu_run.sh)."""
    path = os.environ.get("VCHAT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


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
