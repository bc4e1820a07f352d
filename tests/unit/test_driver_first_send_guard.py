"""The official C++-based client's drivers retry its first-send race (tests/compat/drivers/_common.py
``FirstSendGuard``): only before the first success, only the race's failures ("No route info", or a batch
send's textless failure that came back at once), at most ``limit`` times, each retry counted."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[1] / "compat" / "drivers" / "_common.py"
_spec = importlib.util.spec_from_file_location("compat_driver_common", _PATH)
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


class ProducerSendSyncFailed(Exception):  # the wrapper's exception type, by name
    pass


def failing(errors: list[BaseException]) -> tuple[Callable[[], str], list[int]]:
    """A send that raises ``errors`` in turn, then succeeds; and the list of its calls."""
    calls: list[int] = []

    def send() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    return send, calls


def guard(**kw: Any) -> Any:
    return common.FirstSendGuard(pause_s=0.0, **kw)


def test_the_race_is_retried_until_the_first_success() -> None:
    g = guard()
    send, calls = failing([RuntimeError("msg: No route info of this topic: T"), ProducerSendSyncFailed("")])
    assert g.call(send) == "ok" and len(calls) == 3 and g.retries == 2 and g.succeeded


def test_a_failure_after_the_first_success_is_never_retried() -> None:
    g = guard()
    assert g.call(lambda: "ok") == "ok"
    send, calls = failing([RuntimeError("No route info of this topic: T")])
    with pytest.raises(RuntimeError):
        g.call(send)
    assert len(calls) == 1 and g.retries == 0


@pytest.mark.parametrize("error", [ProducerSendSyncFailed("the broker refused it"), ValueError(""),
                                   RuntimeError("send timeout")])
def test_other_failures_are_not_retried(error: BaseException) -> None:
    g = guard()
    send, calls = failing([error])
    with pytest.raises(type(error)):
        g.call(send)
    assert len(calls) == 1 and g.retries == 0


def test_a_textless_failure_that_took_its_time_is_not_the_race() -> None:
    g = guard(fast_s=0.0)  # every failure counts as slow: a timeout, which may have reached the broker
    send, calls = failing([ProducerSendSyncFailed("")])
    with pytest.raises(ProducerSendSyncFailed):
        g.call(send)
    assert len(calls) == 1 and g.retries == 0


def test_retries_are_bounded() -> None:
    g = guard(limit=2)
    send, calls = failing([ProducerSendSyncFailed("")] * 5)
    with pytest.raises(ProducerSendSyncFailed):
        g.call(send)
    assert len(calls) == 3 and g.retries == 2
