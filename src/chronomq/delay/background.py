"""Blocking file work the delay services and the broker hand off from the event loop (the timer's flushes,
fsync rounds and retention scans, the level offsets' save): run on the loop's default executor as
background work, which never preempts the loop (chronomq.store.threads), and awaited on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from chronomq.store.threads import call_as_background

T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` on the running loop's default executor, under SCHED_BATCH while it runs; awaitable."""
    return asyncio.get_running_loop().run_in_executor(None, call_as_background, fn, args)
