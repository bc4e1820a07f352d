"""How the broker's background threads are scheduled: flush, allocate, dispatch, clean, and the pool
that runs the timer's fsyncs and flushes.

On Linux they run under SCHED_BATCH: the same share of the CPU as any thread, but waking one never
preempts the thread running on that CPU, which on a busy broker is the event loop in the middle of a
delivery (docs/latency.md, "background threads"). Elsewhere, or where the kernel refuses, nothing
changes. The switch is process-wide (the broker key ``backgroundThreadsBatch``) and is read when a
thread starts (the pool's: at each call); threads already running keep their policy.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_batch = True
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def set_background_batch(on: bool) -> None:
    """Whether background threads started from now on take SCHED_BATCH."""
    global _batch
    _batch = on


def background_batch() -> bool:
    return _batch


def as_background() -> bool:
    """Called first thing in a background thread: SCHED_BATCH for the calling thread if the switch is on
    and the platform has it. Returns whether the thread now runs under it."""
    policy = getattr(os, "SCHED_BATCH", None)
    if not _batch or policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # a sandbox refusing the call: the default policy only costs some preemptions
        return False
    return True


def background_target(fn: Callable[[], object]) -> Callable[[], None]:
    """A thread target that runs ``fn`` as a background thread."""

    def run() -> None:
        as_background()
        fn()

    return run


def call_as_background(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """``fn(*args)`` as a background thread: what ``background_pool`` runs (the event loop's side,
    awaiting it, is chronomq.delay.background.in_background)."""
    as_background()  # per call: a pool thread started while the switch was off takes it once it is on
    return fn(*args)


def background_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool for blocking file work done for an event loop (fsync, flush, retention scans;
    run through ``call_as_background``). Threads start as work comes. Eight: a broker hands off at most
    four kinds at once (a flush, a retention scan of seconds, a timer fsync round, the level offsets'
    save), so two brokers in one process (tests, an embedded master and slave) never queue a flush behind
    a scan."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="chronomq-bg")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there; a new pool starts on first use."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
