"""Long polling (RocketMQ's PullRequestHoldService): a PULL with the suspend flag and nothing to return
waits until a message lands in its queue or its suspend timeout passes.

Wake-ups come from the store's arrival listener, not from a sleep loop. When the store dispatches on the
event loop (the broker's mode) the listener resolves the waiters whose offset is now below the queue's
max at once; from another thread (the store's dispatcher thread) it records the (topic, queue) and
schedules one drain on the loop (coalesced: at most one call_soon_threadsafe outstanding).
A waiter re-checks the max offset right after registering, so an arrival between the first read and the
registration is never missed. Timeouts are measured on the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
from collections.abc import Callable

from chronomq.clock import Clock

Key = tuple[str, int]


class PullHoldService:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[bool]]]] = {}
        self._lock = threading.Lock()
        self._arrived: dict[Key, int] = {}
        self._scheduled = False
        self.wakeups = 0
        self.timeouts = 0
        self._deadlines: list[tuple[int, int, asyncio.Future[bool]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.Future[None] | None = None
        self._rearm: asyncio.Future[None] | None = None
        self._armed_ms = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the running loop (called on it)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()

    # --- the store's arrival listener: on the loop, or on the store's dispatcher thread ---------------------
    def on_arrival(self, topic: str, queue_id: int, max_offset: int, store_timestamp: int) -> None:
        key = (topic, queue_id)
        if key not in self._waiters or self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self.notify(topic, queue_id, max_offset)
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
        """Wait until the queue's max offset exceeds ``offset`` (True) or the deadline passes (False).

        No task per held pull: the future is resolved either by ``notify`` or by the one timer task of
        the service, which sleeps (on the injected clock) until the earliest deadline."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        key = (topic, queue_id)
        fut: asyncio.Future[bool] = loop.create_future()
        entry = (offset, fut)
        self._waiters.setdefault(key, []).append(entry)
        try:
            if current_max() > offset:
                return True
            self._add_deadline(deadline_ms, fut)
            result = await fut
            if not result:
                self.timeouts += 1
            return result
        finally:
            ws = self._waiters.get(key)
            if ws is not None:
                with contextlib.suppress(ValueError):
                    ws.remove(entry)
                if not ws:
                    del self._waiters[key]

    # --- the shared deadline timer ------------------------------------------------------------------------
    def _add_deadline(self, deadline_ms: int, fut: asyncio.Future[bool]) -> None:
        heap = self._deadlines
        if len(heap) > 4096 and len(heap) > 4 * self.held:
            # most entries belong to pulls already answered by an arrival: drop them (bounded memory)
            heap[:] = [e for e in heap if not e[2].done()]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline_ms, next(self._seq), fut))
        if self._timer is None or self._timer.done():
            self._timer = asyncio.ensure_future(self._timer_loop())
        elif deadline_ms < self._armed_ms and self._rearm is not None and not self._rearm.done():
            self._rearm.set_result(None)  # an earlier deadline than the one the timer sleeps for

    async def _timer_loop(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._deadlines
        while heap:
            now = self.clock.now_ms()
            while heap and (heap[0][0] <= now or heap[0][2].done()):
                _, _, fut = heapq.heappop(heap)
                if not fut.done():
                    fut.set_result(False)
            if not heap:
                break
            self._armed_ms = heap[0][0]
            self._rearm = loop.create_future()
            sleeper = asyncio.ensure_future(self.clock.sleep_until_ms(self._armed_ms))
            try:
                await asyncio.wait((sleeper, self._rearm), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not sleeper.done():
                    sleeper.cancel()
        self._armed_ms = 0

    def wake_all(self) -> None:
        """Answer every held pull now (shutdown)."""
        for waiters in list(self._waiters.values()):
            for _, fut in waiters:
                if not fut.done():
                    fut.set_result(False)
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()

    @property
    def held(self) -> int:
        return sum(len(w) for w in self._waiters.values())
