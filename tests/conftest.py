"""Shared test helpers: free loopback ports, polling with a deadline (tests never sleep for a condition)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# Property tests are judged by their examples, not their speed: a loaded CI machine (or the pure-Python
# pass) must not fail one on hypothesis's 200 ms deadline or its too-slow health check.
settings.register_profile("chronomq", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("chronomq")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
