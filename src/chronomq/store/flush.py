"""Flush services. ``FlushCommitLogService`` (ASYNC_FLUSH, RocketMQ's FlushRealTimeService) fdatasyncs
the commit log every flushIntervalCommitLog ms of clock time and owns the flushed offset;
``GroupCommitService`` (SYNC_FLUSH) resolves each put's Future after one shared fdatasync, with a
watchdog that resolves it False after syncFlushTimeout of real time; ``FlushConsumeQueueService``
flushes queues and index, then writes the checkpoint (under the store's clean lock). Rules: a
checkpoint never claims more than was flushed; no service holds the commit-log lock while syncing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from chronomq.store.checkpoint import Checkpoint
from chronomq.store.periodic import run_every

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")


class FlushRequest(NamedTuple):
    """A SYNC_FLUSH put waiting for the commit log to be durable up to ``end``."""

    end: int
    future: concurrent.futures.Future[bool]
    asked_at: float  # time.monotonic() when asked: the watchdog's start


FLUSH_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


class FlushTimes:
    """How long the commit log's flushes take: counts per bucket (ms, FLUSH_BUCKETS_MS), total and sum."""

    def __init__(self) -> None:
        self.counts = [0] * (len(FLUSH_BUCKETS_MS) + 1)
        self.count = 0
        self.total_ms = 0.0

    def observe(self, ms: float) -> None:
        i = 0
        while i < len(FLUSH_BUCKETS_MS) and ms > FLUSH_BUCKETS_MS[i]:
            i += 1
        self.counts[i] += 1
        self.count += 1
        self.total_ms += ms

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip(FLUSH_BUCKETS_MS, self.counts, strict=False):
            running += n
            out.append((bound, running))
        return out


class FlushCommitLogService:
    """ASYNC_FLUSH: a periodic fdatasync of the commit log. ``flushed`` is the commit-log offset known
    durable. Puts never wait on it (``request`` is GroupCommitService's)."""

    def __init__(self, store: MessageStore) -> None:
        self._store = store
        self.flushed = 0
        self.times = FlushTimes()

    def do_flush(self) -> int:
        clock = self._store.clock
        t0 = clock.monotonic()
        flushed = self._store._cl.flush()
        if flushed > self.flushed:
            self.times.observe((clock.monotonic() - t0) * 1000)  # only flushes that wrote something
            self.flushed = flushed
        return self.flushed

    def run(self) -> None:
        """Thread chronomq-store-flush under ASYNC_FLUSH."""
        run_every(self._store, self._store.config.flushIntervalCommitLog, self.do_flush, "commit-log flush")

    def wakeup(self) -> None:
        """At stop: nothing waits on a condition here (run waits on the store's stop event)."""

    def fail_requests(self) -> None:
        """At stop: no put waits on an ASYNC_FLUSH flush."""


class GroupCommitService(FlushCommitLogService):
    """SYNC_FLUSH: each put's Future from ``request`` is resolved by ``run`` (thread
    chronomq-store-flush) after one fdatasync shared with every request pending at that moment, or
    False by ``watchdog`` (thread chronomq-store-flush-watchdog) after syncFlushTimeout."""

    def __init__(self, store: MessageStore) -> None:
        super().__init__(store)
        self.cv = threading.Condition()
        self.requests: list[FlushRequest] = []

    def request(self, end: int) -> concurrent.futures.Future[bool]:
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
        asked_at = time.monotonic()
        with self.cv:
            if self.flushed >= end:
                fut.set_result(True)
                return fut
            self.requests.append(FlushRequest(end, fut, asked_at))
            self.cv.notify()
        return fut

    def run(self) -> None:
        cv = self.cv
        stop = self._store._stop
        interval = self._store.config.flushIntervalCommitLog / 1000.0
        last_batch = 0
        while True:
            with cv:
                while not self.requests and not stop.is_set():
                    if not cv.wait(timeout=interval):
                        break  # periodic flush for puts that did not ask to wait
            # Group commit: while requests keep arriving (writers just released by the previous flush
            # are putting their next message), give them a moment to join this flush. Bounded, and
            # skipped when the last flush served a single request (one writer: no one else to wait for).
            n = len(self.requests)
            for _ in range(8 if last_batch > 1 else 0):
                if n == 0:
                    break
                time.sleep(0.0002)
                m = len(self.requests)
                if m == n:
                    break
                n = m
            with cv:
                reqs = self.requests
                self.requests = []
            last_batch = len(reqs)
            if stop.is_set() and not reqs:
                return
            try:
                flushed = self.do_flush()
            except (OSError, ValueError) as e:
                log.error("commit-log flush failed: %s", e)
                _resolve_all(reqs, False)
                continue
            late = []
            for req in reqs:
                fut = req.future
                if fut.done():
                    continue  # the watchdog already reported a timeout
                if req.end <= flushed:
                    try:
                        fut.set_result(True)
                    except concurrent.futures.InvalidStateError:
                        pass
                else:
                    late.append(req)
            if late:
                with cv:
                    self.requests[:0] = late

    def watchdog(self) -> None:
        """Resolve SYNC_FLUSH futures to False once syncFlushTimeout (real time: it bounds a disk wait)
        has passed without their flush, even while an fdatasync hangs. The data may still become
        durable later, as with RocketMQ's FLUSH_DISK_TIMEOUT."""
        timeout = self._store.config.syncFlushTimeout / 1000.0
        stop = self._store._stop
        while not stop.wait(min(0.1, timeout / 4)):
            now = time.monotonic()
            with self.cv:
                reqs = list(self.requests)
            for req in reqs:
                fut = req.future
                if now - req.asked_at > timeout and not fut.done():
                    try:
                        fut.set_result(False)
                    except concurrent.futures.InvalidStateError:
                        pass

    def wakeup(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def fail_requests(self) -> None:
        """At stop: flush once more and resolve every pending request by whether it is now durable."""
        with self.cv:
            reqs = self.requests
            self.requests = []
        if reqs:
            try:
                flushed = self.do_flush()
            except (OSError, ValueError):
                flushed = -1
            for req in reqs:
                try:
                    req.future.set_result(req.end <= flushed)
                except concurrent.futures.InvalidStateError:
                    pass


def _resolve_all(reqs: list[FlushRequest], ok: bool) -> None:
    for req in reqs:
        try:
            req.future.set_result(ok)
        except concurrent.futures.InvalidStateError:
            pass


class FlushConsumeQueueService:
    """Flush consume queues and index, then write the checkpoint (flushed commit log, recover-from = the
    offset below which queue units and index entries are all written, never past the flushed one).
    ``run`` is thread chronomq-store-flush-cq."""

    def __init__(self, store: MessageStore) -> None:
        self._store = store

    def flush_queues_and_checkpoint(self) -> None:
        """The caller holds the store's ``_clean_lock``."""
        store = self._store
        recover_from = store._reput.recover_point()
        with store._queues_lock:
            queues = list(store._queues.values())
        for cq in queues:
            try:
                cq.flush()
            except ValueError:
                pass
        store._index.flush()
        flushed = store._flusher.flushed
        Checkpoint(flushed, min(recover_from, flushed), 0, store.clock.now_ms()).save(store._checkpoint_path)

    def run(self) -> None:
        store = self._store

        def flush() -> None:
            with store._clean_lock:
                self.flush_queues_and_checkpoint()

        run_every(store, store.config.flushIntervalConsumeQueue, flush, "consume-queue flush")
