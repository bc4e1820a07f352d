"""Shared test helpers: free loopback ports, polling with a deadline (tests never sleep for a condition)."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.ports import free_port

# Property tests are judged by their examples, not their speed: a loaded CI machine (or the pure-Python
# pass) must not fail one on hypothesis's 200 ms deadline or its too-slow health check.
settings.register_profile("chronomq", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("chronomq")


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01,
             message: str = "condition") -> object:
    """Poll ``predicate`` until it returns a truthy value or the deadline passes (then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


async def async_wait_for(predicate: Callable[[], object | Awaitable[object]], timeout: float = 10.0,
                         interval: float = 0.01, message: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)



def queue_messages(store: Any, topic: str) -> list[Any]:
    """Every message of ``topic`` in a MessageStore's consume queues, decoded, queue by queue."""
    from chronomq.message import decode_record

    out = []
    for qid in store.queue_ids(topic):
        res = store.get_message(topic, qid, 0, 100_000, max_bytes=1 << 30)
        out += [decode_record(raw) for raw in res.messages]
    return out

@pytest.fixture
def port() -> int:
    return free_port()




# Under pytest-xdist with `--dist loadscope` (see the Makefile's PYTEST_XDIST) the tests that share a
# fixture wider than a function stay on one worker, so that it is set up once: every module is a scope of
# its own (its module-scoped servers), and so are three sets of modules that share a costly session fixture:
# those of tests/spark that take the local Spark session (a JVM), tests/web (its cluster and console), and
# those of tests/compat that take a reference Apache RocketMQ (three or four JVMs, started once).
# Ports are free ones chosen at run time and files live under each test's tmp_path, so scopes do not disturb
# one another; a venv or driver built on first use is built under a file lock (tests/compat/harness.py).
# (xdist's own xdist_group marks no longer reach its scheduler under pytest 9, which does not let a plugin
# rename a test's node id, so the scopes are chosen here.)
_TAKES_SPARK = re.compile(r"def test_\w+\([^)]*\bspark\b")
_TAKES_REFERENCE = re.compile(r"def \w+\([^)]*\brocketmq[45]\b")
_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def xdist_scope_of_module(path: str) -> str:
    if path.startswith("tests/web/"):
        return "tests/web"
    for folder, takes, scope in (("tests/compat/", _TAKES_REFERENCE, "tests/compat (reference RocketMQ)"),
                                 ("tests/spark/", _TAKES_SPARK, "tests/spark (Spark session)")):
        if path.startswith(folder):
            try:
                if takes.search((_ROOT / path).read_text()):
                    return scope
            except OSError:
                pass
    return path


def xdist_scope_of(nodeid: str) -> str:
    return xdist_scope_of_module(nodeid.split("::", 1)[0])


_FIRST = ("tests/compat (reference RocketMQ)", "tests/spark/", "tests/compat/", "tests/integration/")


def _rank(nodeid: str) -> int:
    scope = xdist_scope_of(nodeid)
    return next((i for i, start in enumerate(_FIRST) if scope.startswith(start)), len(_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers, the longest scopes first: those on the reference RocketMQ, then Spark's (a
    standalone cluster, spark-submit runs, the Spark session), then the other compat and integration
    modules, then the quick ones; otherwise a long scope starting last leaves the other workers idle at the
    end. xdist schedules scopes in the order its workers collected them (--no-loadscope-reorder, the
    Makefile's PYTEST_XDIST, keeps it); on a worker xdist has set the dist option to "no", so the sort is
    made on every worker, the same on each."""
    if getattr(config, "workerinput", None) is not None:
        items.sort(key=lambda item: _rank(item.nodeid))  # stable: else as collected


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope_of(nodeid)

    return SharedFixtureScheduling(config, log)
