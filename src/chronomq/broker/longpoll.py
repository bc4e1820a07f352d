"""Long polling (RocketMQ's PullRequestHoldService): a PULL with the suspend flag and nothing to return
waits until a message lands in its queue or its suspend timeout passes.

Wake-ups come from the store's arrival listener (the reput thread), not from a sleep loop: the listener
records the (topic, queue) and schedules one drain on the event loop (coalesced: at most one
call_soon_threadsafe outstanding), which resolves the waiters whose offset is now below the queue's max.
A waiter re-checks the max offset right after registering, so an arrival between the first read and the
registration is never missed. Timeouts are measured on the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from chronomq.clock import Clock

Key = tuple[str, int]


class PullHoldService:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[bool]]]] = {}
        self._lock = threading.Lock()
        self._arrived: dict[Key, int] = {}
        self._scheduled = False
        self.wakeups = 0
        self.timeouts = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # --- called from the store's dispatcher thread ---------------------------------------------------------
    def on_arrival(self, topic: str, queue_id: int, max_offset: int, store_timestamp: int) -> None:
        key = (topic, queue_id)
        if key not in self._waiters or self._loop is None:
            return
        with self._lock:
            if max_offset > self._arrived.get(key, -1):
                self._arrived[key] = max_offset
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # loop closed during shutdown
            pass

    # --- on the event loop ----------------------------------------------------------------------------------
    def _drain(self) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, {}
            self._scheduled = False
        for key, max_offset in arrived.items():
            self.notify(key[0], key[1], max_offset)

    def notify(self, topic: str, queue_id: int, max_offset: int) -> None:
        waiters = self._waiters.get((topic, queue_id))
        if not waiters:
            return
        for offset, fut in waiters:
            if offset < max_offset and not fut.done():
                fut.set_result(True)
                self.wakeups += 1

    async def wait(
        self, topic: str, queue_id: int, offset: int, deadline_ms: int, current_max: Callable[[], int]
    ) -> bool:
        """Wait until the queue's max offset exceeds ``offset`` (True) or the deadline passes (False)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        key = (topic, queue_id)
        fut: asyncio.Future[bool] = loop.create_future()
        entry = (offset, fut)
        self._waiters.setdefault(key, []).append(entry)
        sleeper: asyncio.Task[None] | None = None
        try:
            if current_max() > offset:
                return True
            sleeper = asyncio.ensure_future(self.clock.sleep_until_ms(deadline_ms))
            await asyncio.wait((fut, sleeper), return_when=asyncio.FIRST_COMPLETED)
            if fut.done() and not fut.cancelled():
                return fut.result()
            self.timeouts += 1
            return False
        finally:
            if sleeper is not None and not sleeper.done():
                sleeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sleeper
            ws = self._waiters.get(key)
            if ws is not None:
                with contextlib.suppress(ValueError):
                    ws.remove(entry)
                if not ws:
                    del self._waiters[key]

    def wake_all(self) -> None:
        """Answer every held pull now (shutdown)."""
        for waiters in list(self._waiters.values()):
            for _, fut in waiters:
                if not fut.done():
                    fut.set_result(False)

    @property
    def held(self) -> int:
        return sum(len(w) for w in self._waiters.values())
