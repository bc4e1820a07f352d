"""Fixtures for the official-client compatibility suite: a fresh chronomq per test on free ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess, official_python


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
