"""Blocking file work the delay services and the broker hand off from the event loop (the timer's flushes,
fsync rounds and retention scans, the level offsets' save): run in the store's background pool, whose
threads never preempt the loop (chronomq.store.threads), and awaited on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from chronomq.store.threads import background_pool, call_as_background

T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in the background pool; awaitable from the running loop."""
    return asyncio.get_running_loop().run_in_executor(background_pool(), call_as_background, fn, args)
