"""What the differential compat tests share: names, bodies and the comparison of observations.

A differential test runs one scenario per broker (chronomq and the reference RocketMQ, at the same time:
each waits on its own broker and client process) through the same official client and compares the
observations: ``assert_same`` holds every broker's to chronomq's.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

B = TypeVar("B")


def uniq(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def text(rec: dict[str, Any]) -> str:
    """A delivery record's body as text."""
    return base64.b64decode(rec["body"]).decode(errors="replace")


def assert_same(observed: dict[str, dict[str, Any]], what: str) -> None:
    """Every broker's observation equals chronomq's (the first) — the differential assertion."""
    names = list(observed)
    base = observed[names[0]]
    for name in names[1:]:
        assert observed[name] == base, (f"{what}: chronomq observed\n  {base}\n{name} observed\n"
                                        f"  {observed[name]}")


def each(brokers: Mapping[str, B], scenario: Callable[[str, B], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``scenario(name, broker)`` on every broker at once, the observations in the brokers' order (a
    scenario's topics and groups are its own, so the runs do not meet)."""
    with ThreadPoolExecutor(max_workers=len(brokers)) as pool:
        futures = {name: pool.submit(scenario, name, broker) for name, broker in brokers.items()}
        observed = {name: future.result() for name, future in futures.items()}
    for name, obs in observed.items():
        print(f"{name} observed: {obs}")  # shown when the test fails
    return observed
