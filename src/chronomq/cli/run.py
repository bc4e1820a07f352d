"""What every long-running ``chronomq`` command shares: the event loop it runs on (``choose_loop``), the
line saying which loop and kernels run (``runtime_line``), the garbage collector off while it starts
(``collector_paused``) and running until SIGTERM or SIGINT (``run_until_signal``: start, print the ready
line, wait, stop)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator

log = logging.getLogger("chronomq")

_collector_paused = False  # by collector_paused, until the start is done


def choose_loop() -> str:
    """Install uvloop's event loop policy when available (CHRONOMQ_LOOP=asyncio turns it off; a missing
    uvloop falls back to asyncio). uvloop is the default because it roughly doubles the transport's
    request rate and costs nothing elsewhere (docs/latency.md, "The event loop")."""
    if os.environ.get("CHRONOMQ_LOOP", "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a broker starts: its imports and its recovery after a crash
    allocate objects by the hundred thousand and make no cyclic garbage, and the passes they trigger
    were 5-15 ms of a restart. ``run_until_signal`` turns it back on once started (after freezing what
    the start made); leaving the block turns it back on in any case (unless it was off before)."""
    global _collector_paused
    was = gc.isenabled()
    gc.disable()
    _collector_paused = was
    try:
        yield
    finally:
        _collector_paused = False
        if was:
            gc.enable()


def kernels_text() -> str:
    """Which hot-path kernels this install runs (compiled or pure Python, and why)."""
    from chronomq.store.speedups import describe

    return describe()


def runtime_line(loop_name: str) -> str:
    """The start's INFO line on what runs: the event loop and the kernels; an optional part that is
    absent is named with how to get it."""
    loop = loop_name
    if loop_name != "uvloop":
        forced = os.environ.get("CHRONOMQ_LOOP", "").lower() == "asyncio"
        loop += " (CHRONOMQ_LOOP=asyncio)" if forced else " (uvloop is faster: pip install 'chronomq[fast]')"
    kernels = kernels_text()
    if kernels.endswith("(not built)"):
        kernels += "; pip builds the compiled ones where a C compiler and Python's headers are installed"
    return f"event loop: {loop}; hot-path kernels: {kernels}"


async def run_until_signal(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]], ready_line: Callable[[], str]
) -> None:
    loop = asyncio.get_running_loop()
    stop_event = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop_event.set)
    try:
        await start()
    except BaseException:
        with contextlib.suppress(Exception):
            await stop()
        raise
    # What starting made (modules, configuration, recovered state) lives as long as the process: moved
    # out of the collector's reach, a full collection no longer walks it (10 ms pauses of the loop).
    gc.freeze()
    if _collector_paused:
        gc.enable()
    sys.stdout.write(ready_line() + "\n")
    sys.stdout.flush()
    await stop_event.wait()
    log.info("shutting down")
    await stop()
