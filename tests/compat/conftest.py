"""Fixtures for the official-client compatibility suite: a fresh chronomq per test on free ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess, CompatUnavailable, official_python, stop_driver_servers
from tests.compat.reference import (
    REFERENCE_POM,
    ROCKETMQ4,
    ROCKETMQ5,
    Release,
    RocketMQProcess,
    maven_classpath,
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture
def official_client() -> str:
    """The compat venv's python (the test is skipped, with the reason, if the client cannot run here)."""
    return official_python()


@pytest.fixture
def chronomq_factory(request: pytest.FixtureRequest, tmp_path: Path
                     ) -> Iterator[Callable[..., ChronomqProcess]]:
    """Start chronomq processes with config overrides; all are stopped after the test (their log tail
    is printed when the test failed)."""
    procs: list[ChronomqProcess] = []

    def make(overrides: dict[str, str] | None = None, name: str = "data", start: bool = True
             ) -> ChronomqProcess:
        p = ChronomqProcess(tmp_path / name, overrides)
        procs.append(p)
        if start:
            p.start()
        return p

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for p in procs:
        if failed:
            print(f"--- chronomq log {p.log_path} (tail) ---\n{p.log_tail(6000)}")
        try:
            p.stop(timeout=30)
        except RuntimeError as e:
            print(f"chronomq teardown: {e}")


@pytest.fixture
def chronomq_server(official_client: str, chronomq_factory: Callable[..., ChronomqProcess]
                    ) -> ChronomqProcess:
    """A fresh chronomq (default config) in tmp_path, with the official client available."""
    return chronomq_factory()


# --- the reference Apache RocketMQ (tests/compat/reference.py), started once per run --------------------
# Both brokers of a differential test run the same short delay-level table, so that the 18 levels and the
# retry ladder (level 3 + reconsume times) can be watched within seconds.
FAST_DELAY_LEVELS = "1s 2s 3s 1s 2s 1s 2s 1s 2s 1s 2s 1s 2s 1s 2s 1s 2s 3s"
# Undecided transactions are checked back after 2 s, in rounds 1 s apart, on both; the reference's first
# checks can miss a 5.x producer while its proxy has not yet told the broker about it, so neither gives up
# after the default 15.
DIFFERENTIAL_CONF = {"messageDelayLevel": FAST_DELAY_LEVELS, "transactionTimeOut": "2000",
                     "transactionCheckInterval": "1000", "transactionCheckMax": "100"}
# The reference 5.x broker's timer wheel (100 ms precision) is a 166 MB mapped file, forced to disk every
# timerFlushIntervalMs (1 s by default): two thirds of the idle broker's CPU (its TimerFlushService thread,
# 4.3 CPU-s a minute, for as long as the compat tests run). Every 10 s here: no delivery waits on that flush,
# and no test crashes the reference broker. (bench/compare keeps RocketMQ's default.)
REFERENCE_TIMER_CONF = {"timerFlushIntervalMs": "10000"}


def _reference(tmp_path_factory: pytest.TempPathFactory, release: Release) -> Iterator[RocketMQProcess]:
    try:
        maven_classpath(REFERENCE_POM, release.profile)
    except CompatUnavailable as e:
        pytest.skip(str(e))
    errors = []
    # started afresh on new ports when the proxy exits because the broker has not registered its cluster
    # yet, or when a port chosen free was taken before the JVM bound it
    for _ in range(3):
        conf = {**DIFFERENTIAL_CONF, **(REFERENCE_TIMER_CONF if release.has_timer else {})}
        proc = RocketMQProcess(tmp_path_factory.mktemp(release.name), release, conf, proxy=release.has_proxy)
        try:
            proc.start()
            break
        except RuntimeError as e:
            errors.append(str(e))
            if "failed on cluster" not in str(e) and "Address already in use" not in str(e):
                break
    if not proc.children:
        pytest.fail(f"the reference {release.name} did not start: {errors[-1]}")
    yield proc
    proc.discard()  # its store goes with the run's tmp dir


# Package scope: started once for the modules that take them (tests/conftest.py keeps those on one xdist
# worker, one after the other) and killed when that worker's run leaves tests/compat, not at the end of the
# whole run: idle, the five JVMs still take about 10 CPU-seconds a minute from the other tests.
@pytest.fixture(scope="package")
def rocketmq5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocketMQProcess]:
    """Apache RocketMQ 5.3.x (name server + broker, timer wheel on, and the proxy for gRPC clients)."""
    yield from _reference(tmp_path_factory, ROCKETMQ5)


@pytest.fixture(scope="package")
def rocketmq4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocketMQProcess]:
    """Apache RocketMQ 4.9.x (name server + broker)."""
    yield from _reference(tmp_path_factory, ROCKETMQ4)


@pytest.fixture(scope="package", autouse=True)
def _java_driver_servers() -> Iterator[None]:
    """The official Java clients' serve-mode JVMs (one per client kind, started on first use) go when a
    worker's run leaves tests/compat, like the reference brokers, not at the end of the whole run."""
    yield
    stop_driver_servers()


@pytest.fixture
def chronomq_differential(chronomq_factory: Callable[..., ChronomqProcess]) -> ChronomqProcess:
    """A fresh chronomq with the same delay-level table as the reference brokers."""
    return chronomq_factory(dict(DIFFERENTIAL_CONF))
