"""ReputMessageService: the dispatcher. Takes the put path's dispatch requests in commit-log order, in
batches, writes consume-queue units and index entries, advances ``dispatched``, then calls the arrival
listeners once per queue per batch. Rules: one dispatcher at a time (``lock``, so batches stay in
order); a failed batch is put back in front and retried (re-dispatch is idempotent); listeners run
outside every store lock. With a dispatch hook set, the putting thread calls the hook instead of waking
the thread, and the hook arranges for ``dispatch_now`` to run soon. With ``index_later`` set, the index
entries of a batch are written after the consume-queue units' readers are answered: the batch waits in
a backlog, in order, which a key query, the checkpoint (``recover_point``) and shutdown take into account.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from chronomq.levels import stored_tags_code
from chronomq.message import MessageExt
from chronomq.store.consumequeue import UNIT, ConsumeQueue
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import DispatchRequest

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")

ArrivalListener = Callable[[str, int, int, int], None]


def request_of(off: int, m: MessageExt, levels: list[int]) -> DispatchRequest:
    """The dispatch request of the record at ``off`` read back from the log (recovery, a slave's replica),
    as the put path builds it (its tagsCode by chronomq.levels)."""
    ts = m.store_timestamp
    tags = stored_tags_code(m.topic, m.properties, levels, ts)
    return DispatchRequest(off, m.store_size, m.topic, m.queue_id, m.queue_offset, tags, ts, m.keys or None,
                           m.uniq_key)


@pure_twin("queue_runs")
def queue_runs_py(batch: list[DispatchRequest]) -> list[tuple[str, int, int, bytes, int, int]]:
    """The consume-queue units of ``batch`` (requests in commit-log order), queue by queue in the order the
    queues first appear: for each run of consecutive queue offsets of one queue, (topic, queue id, its first
    offset, its units packed, their count, the store time of its last request)."""
    by_queue: dict[tuple[str, int], list[DispatchRequest]] = {}
    for req in batch:
        key = (req.topic, req.queue_id)
        lst = by_queue.get(key)
        if lst is None:
            by_queue[key] = [req]
        else:
            lst.append(req)
    pack = UNIT.pack
    runs = []
    for (topic, qid), reqs in by_queue.items():
        start = 0
        for i in range(1, len(reqs) + 1):
            if i == len(reqs) or reqs[i].queue_offset != reqs[i - 1].queue_offset + 1:
                run = reqs[start:i]
                runs.append((topic, qid, run[0].queue_offset,
                             b"".join([pack(r.phys, r.size, r.tags_code) for r in run]), len(run),
                             run[-1].store_timestamp))
                start = i
    return runs


# the compiled kernel when built (chronomq.store.speedups chooses); queue_runs_py is its twin
queue_runs = kernels.queue_runs


# The longest a dispatched batch's key index entries wait while a burst is being handed over
# (ReputMessageService.index_busy): a burst of 10,000 timed messages is handed over in about 70 ms here,
# and a longer one has its entries written in parts this large (about 30,000 entries, 20 ms of the loop).
INDEX_MAX_WAIT_S = 0.2


class ReputMessageService:
    def __init__(self, store: MessageStore) -> None:
        self._store = store
        self.dispatched = 0  # every record below this commit-log offset has its queue entry
        self.cv = threading.Condition()  # notified when ``dispatched`` moves
        self.wake = threading.Event()
        self.lock = threading.Lock()  # one dispatcher at a time: batches go in commit-log order
        self.hook: Callable[[], None] | None = None
        self.listeners: list[ArrivalListener] = []
        # index_later(fn): run fn soon on the dispatching side, after the answers of this turn's arrivals
        self.index_later: Callable[[Callable[[], None]], None] | None = None
        # index_busy(): True while a burst is being handed over (the timer's deliveries); the deferred
        # entries then wait for its end, at most INDEX_MAX_WAIT_S after the oldest of them was dispatched
        self.index_busy: Callable[[], bool] | None = None
        self._index_since = 0.0  # the store clock's monotonic time the oldest waiting batch was dispatched
        self._index_lock = threading.Lock()  # the backlog and _indexing_from
        self._index_writer = threading.Lock()  # one backlog writer at a time: batches stay in order
        self._index_backlog: list[list[DispatchRequest]] = []
        self._indexing_from: int | None = None  # the first offset of batches taken but not yet indexed
        self._index_scheduled = False
        self._index_retry = False  # a backlog write failed: the dispatcher thread retries it

    def signal(self) -> None:
        """After a put queued dispatch requests (on the putting thread, outside every store lock)."""
        hook = self.hook
        if hook is not None:
            try:
                hook()
                return
            except RuntimeError:  # the hook's loop is closed (shutdown): the thread takes over
                self.hook = None
        if not self.wake.is_set():
            self.wake.set()

    def dispatch_now(self) -> None:
        """Dispatch every queued request on this thread. If the dispatcher thread is busy, it takes
        them after its current batch; a failed batch is left to the thread's retry."""
        if not self.lock.acquire(blocking=False):
            self.wake.set()
            return
        try:
            ok = self.dispatch_pending()
        finally:
            self.lock.release()
        if not ok:
            self.wake.set()

    def run(self) -> None:
        """Thread chronomq-store-dispatch."""
        stop = self._store._stop
        while True:
            self.wake.wait(0.05)
            self.wake.clear()
            stopping = stop.is_set()
            with self.lock:
                ok = self.dispatch_pending()
            if self._index_retry or stopping:  # else the index_later jobs write the backlog
                ok = self.index_pending() and ok
            if not ok and not stopping:
                stop.wait(0.1)  # failed (disk full?): the batch was put back; retry shortly
            if stopping:
                return

    def dispatch_pending(self) -> bool:
        """Take and dispatch the queued requests; the caller holds ``lock``."""
        store = self._store
        with store._cl.lock:
            batch = store._pending
            store._pending = []
        if not batch:
            return True
        try:
            self.dispatch(batch)
            return True
        except Exception:
            # Re-dispatch is idempotent (queue units already written are skipped; index duplicates are
            # filtered by queries), so put the whole batch back in front and try again later.
            log.exception("dispatch failed; will retry")
            with store._cl.lock:
                store._pending[:0] = batch
            return False

    def dispatch(self, batch: list[DispatchRequest]) -> None:
        """Build consume-queue units and index entries for requests in commit-log order."""
        store = self._store
        # per queue, in the order the queues first appear: its queue and the store time of its last unit
        ends: dict[tuple[str, int], tuple[ConsumeQueue, int]] = {}
        for topic, qid, first, packed, count, ts in queue_runs(batch):
            cq = store._queue_for_dispatch(topic, qid)
            cq.append_units(first, packed, count)
            ends[(topic, qid)] = (cq, ts)
        arrivals = [(topic, qid, cq.max_offset, ts) for (topic, qid), (cq, ts) in ends.items()]
        if store._index_enabled:
            later = self.index_later
            if later is None:
                store._index.put_batch(batch)  # a failure propagates: the whole batch is retried
            else:
                with self._index_lock:
                    if not self._index_backlog:
                        self._index_since = store.clock.monotonic()
                    self._index_backlog.append(batch)
                    schedule = not self._index_scheduled
                    self._index_scheduled = True
                if schedule:
                    try:
                        later(self._index_soon)
                    except RuntimeError:  # the deferral's loop is closed (shutdown): write it here
                        self._index_soon()
        last = batch[-1]
        with self.cv:
            self.dispatched = last.phys + last.size
            self.cv.notify_all()
        for listener in list(self.listeners):
            for a in arrivals:
                try:
                    listener(*a)
                except Exception:
                    log.exception("arrival listener failed")

    def _index_soon(self) -> None:
        busy, later = self.index_busy, self.index_later
        if busy is not None and later is not None and busy():
            with self._index_lock:
                wait = bool(self._index_backlog) and (
                    self._store.clock.monotonic() - self._index_since < INDEX_MAX_WAIT_S)
            if wait:  # the entries go in after the burst: its answers first (the job stays scheduled)
                try:
                    later(self._index_soon)
                    return
                except RuntimeError:  # the deferral's loop is closed (shutdown): write them here
                    pass
        with self._index_lock:
            self._index_scheduled = False
        if not self.index_pending():
            self.wake.set()  # the dispatcher thread retries

    def index_pending(self) -> bool:
        """Write the index entries of the batches in the backlog, in order. On a failure the batches
        not written go back in front (re-indexing is idempotent for queries) and False is returned."""
        with self._index_writer:
            with self._index_lock:
                batches, self._index_backlog = self._index_backlog, []
                if not batches:
                    return True
                self._indexing_from = batches[0][0].phys  # recover_point stays below them meanwhile
            done = 0
            try:
                for batch in batches:
                    self._store._index.put_batch(batch)
                    done += 1
            except Exception:
                log.exception("index dispatch failed; will retry")
                with self._index_lock:
                    self._index_backlog[:0] = batches[done:]
                    self._indexing_from = None
                self._index_retry = True
                return False
            with self._index_lock:
                self._indexing_from = None
            self._index_retry = False
        return True

    def recover_point(self) -> int:
        """The commit-log offset below which every record has its queue units and index entries."""
        point = self.dispatched
        with self._index_lock:
            if self._indexing_from is not None:
                point = min(point, self._indexing_from)
            if self._index_backlog:
                point = min(point, self._index_backlog[0][0].phys)
        return point

    def wait_dispatched(self, commit_log_offset: int, timeout_s: float) -> bool:
        """Block until every record starting at or before ``commit_log_offset`` has its queue entry (or
        everything written so far is dispatched). Returns False on timeout."""
        cl = self._store._cl
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                d = self.dispatched
                if d > commit_log_offset or d >= cl.wrote:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.wake.set()
                self.cv.wait(min(left, 0.05))
