"""How the broker's background threads are scheduled: flush, allocate, dispatch, clean, the timer's
fsync threads, and the file work the event loop hands off (for the duration of each call).

On Linux they run under SCHED_BATCH: the same share of the CPU as any thread, but waking one never
preempts the thread running on that CPU, which on a busy broker is the event loop in the middle of a
delivery (docs/latency.md, "background threads"). Elsewhere, or where the kernel refuses, nothing
changes. The switch is process-wide (the broker key ``backgroundThreadsBatch``) and is read when a
thread starts (for handed-off work: at each call); threads already running keep their policy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_batch = True


def set_background_batch(on: bool) -> None:
    """Whether background threads started from now on take SCHED_BATCH."""
    global _batch
    _batch = on


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
    """``fn(*args)`` under SCHED_BATCH for the call's duration, in whatever thread runs it (the event
    loop's default executor: chronomq.delay.background.in_background), its policy restored after: the
    executor's threads serve others too, and keep the policy they had."""
    policy = getattr(os, "SCHED_BATCH", None)
    if not _batch or policy is None:
        return fn(*args)
    try:
        before, param = os.sched_getscheduler(0), os.sched_getparam(0)
    except OSError:
        return fn(*args)
    changed = before != policy and as_background()
    try:
        return fn(*args)
    finally:
        if changed:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, before, param)
