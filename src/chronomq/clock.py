"""Clocks. Logic never reads the wall clock directly: it asks the clock it was given.

``SystemClock`` is the real one. ``VirtualClock`` only moves when a test tells it to, so an hour of
delays can be fast-forwarded in milliseconds. Both offer:

- ``now_ms()``: epoch milliseconds (store timestamps, deliver times);
- ``monotonic()``: seconds, for measuring intervals;
- ``async sleep_until_ms(ms, precise=False)`` / ``async sleep(seconds)``: for asyncio services (schedule
  service, long polling deadlines, housekeeping); ``precise``: wake at the deadline itself, not up to a
  millisecond after it (the delivery loops);
- ``wait_until_ms(event, ms)``: for thread services (the store's flush and clean threads): block until
  the clock reaches ``ms`` or ``event`` is set; returns True when the event was set.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Protocol

# The event loop's poll takes whole milliseconds and rounds a timeout up: a precise sleeper sleeps on
# the loop until _PRECISE_S before its deadline, has the waker thread (_Waker) wake it _SPIN_S before
# it (a thread's hand-over to the loop takes tens of microseconds), and yields turn by turn for the rest.
_PRECISE_S = 0.002
_SPIN_S = 0.00015


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Waker:
    """One daemon thread that wakes precise sleepers at their deadline (``time.time()`` seconds). A timed
    wait on a condition ends within tens of microseconds of its time and holds no GIL while it waits;
    spinning on the event loop for the last millisecond instead kept a CPU busy (and the GIL from the
    store's threads) whenever deadlines came every millisecond."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """A fresh state (also in a forked child, where the parent's thread does not exist)."""
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, at: float, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._seq), loop, fut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="clock-waker", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        _tight_timer_slack()
        cond, heap = self._cond, self._heap
        while True:
            try:
                with cond:
                    while not heap or heap[0][0] > time.time():
                        cond.wait(max(0.0, heap[0][0] - time.time()) if heap else None)
                    now = time.time()
                    due = []
                    while heap and heap[0][0] <= now:
                        due.append(heapq.heappop(heap))
                for _at, _n, loop, fut in due:
                    try:
                        loop.call_soon_threadsafe(_wake, fut)
                    except RuntimeError:  # its loop is closed: nobody waits any more
                        pass
            except Exception:  # never let the thread die: a sleeper's loop timer is its backstop anyway
                logging.getLogger(__name__).exception("clock waker")


_WAKER = _Waker()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WAKER._reset)


def _tight_timer_slack() -> None:
    """Let the kernel end this thread's timed waits within a microsecond (Linux coalesces them by 50 us
    by default); nothing happens elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
    except Exception:  # not Linux, no prctl: the default slack only costs a little precision
        pass


class Clock(Protocol):
    def now_ms(self) -> int: ...

    def monotonic(self) -> float: ...

    async def sleep_until_ms(self, deadline_ms: int, precise: bool = False) -> None: ...

    async def sleep(self, seconds: float) -> None: ...

    def wait_until_ms(self, event: threading.Event, deadline_ms: int) -> bool: ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep_until_ms(self, deadline_ms: int, precise: bool = False) -> None:
        # Sub-millisecond arithmetic (not the floored now_ms); at most 1 s per asyncio sleep (a monotonic
        # timer), so a step of the wall clock (NTP) moves the wake-up with it instead of making it hours
        # late. The loop's poll still rounds each timeout up to a whole ms: ``precise`` sleeps until
        # _PRECISE_S before the deadline, lets the waker thread wake it just before, and yields turn by
        # turn for the last _SPIN_S, waking within microseconds of the deadline.
        margin = _PRECISE_S if precise else 0.0
        at = deadline_ms / 1000.0
        while True:
            delay = at - time.time()
            if delay <= 0:
                return
            if precise and delay <= _SPIN_S:
                await asyncio.sleep(0)
                continue
            if delay <= margin:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                backstop = loop.call_later(delay + 0.002, _wake, fut)  # should the waker ever fail
                _WAKER.add(at - _SPIN_S, loop, fut)
                try:
                    await fut
                finally:
                    backstop.cancel()
                continue
            await asyncio.sleep(min(delay - margin, 1.0))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def wait_until_ms(self, event: threading.Event, deadline_ms: int) -> bool:
        delay = (deadline_ms - self.now_ms()) / 1000.0
        if delay <= 0:
            return event.is_set()
        return event.wait(delay)


class VirtualClock:
    """A clock that moves only when ``advance``/``advance_to``/``set`` is called.

    Async sleepers are futures resolved on their own event loop (thread-safe); thread sleepers wait on a
    condition. ``advance`` fires waiters in deadline order, stepping the time to each deadline, so a
    service woken at T sees now_ms() == T. Use ``await clock.advance(ms)`` from async tests (it yields to
    the loop between steps so woken tasks run), or ``clock.advance_sync(ms)`` from plain threads.
    """

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._mono = 0.0
        self._lock = threading.Condition()
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []

    def now_ms(self) -> int:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    async def sleep_until_ms(self, deadline_ms: int, precise: bool = False) -> None:
        if deadline_ms <= self._now:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            heapq.heappush(self._heap, (deadline_ms, next(self._seq), fut))
        await fut

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until_ms(self._now + max(0, round(seconds * 1000)))

    def wait_until_ms(self, event: threading.Event, deadline_ms: int) -> bool:
        # Thread sleepers poll the event on a short real interval and the virtual time on every
        # notification; a virtual clock never blocks a thread for long in real time.
        while True:
            if event.is_set():
                return True
            with self._lock:
                if self._now >= deadline_ms:
                    return event.is_set()
                self._lock.wait(0.01)

    def pending_deadlines(self) -> list[int]:
        with self._lock:
            return sorted(d for d, _, f in self._heap if not f.done())

    def _pop_due(self, until_ms: int) -> tuple[int, asyncio.Future[None]] | None:
        with self._lock:
            while self._heap and self._heap[0][0] <= until_ms:
                deadline, _, fut = heapq.heappop(self._heap)
                if not fut.done():
                    return deadline, fut
            return None

    def _set_now(self, ms: int) -> None:
        with self._lock:
            if ms > self._now:
                self._mono += (ms - self._now) / 1000.0
                self._now = ms
            self._lock.notify_all()

    @staticmethod
    def _wake(fut: asyncio.Future[None]) -> None:
        loop = fut.get_loop()

        def _set() -> None:
            if not fut.done():
                fut.set_result(None)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _set()
        else:
            loop.call_soon_threadsafe(_set)

    async def advance_to(self, target_ms: int, settle_rounds: int = 20) -> None:
        """Move time forward to ``target_ms``, waking every sleeper in deadline order and letting the
        loop run woken tasks (``settle_rounds`` yields) after each step."""
        while True:
            item = self._pop_due(target_ms)
            if item is None:
                break
            deadline, fut = item
            self._set_now(deadline)
            self._wake(fut)
            for _ in range(settle_rounds):
                await asyncio.sleep(0)
        self._set_now(target_ms)
        for _ in range(settle_rounds):
            await asyncio.sleep(0)

    async def advance(self, ms: int, settle_rounds: int = 20) -> None:
        await self.advance_to(self._now + ms, settle_rounds)

    def advance_sync(self, ms: int) -> None:
        """Advance from a thread that is not running the sleepers' loop."""
        target = self._now + ms
        while True:
            item = self._pop_due(target)
            if item is None:
                break
            deadline, fut = item
            self._set_now(deadline)
            self._wake(fut)
        self._set_now(target)

    def set(self, ms: int) -> None:
        """Jump to ``ms`` without stepping through deadlines one by one (sleepers due are woken)."""
        self.advance_sync(ms - self._now) if ms > self._now else None
