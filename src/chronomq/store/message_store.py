"""MessageStore: the facade over the commit log, consume queues and index, and the services that
dispatch, flush, allocate and clean them (see docs/store.md for the design, threads and locks).
Thread-safe and synchronous; store/ never imports remoting, broker, client, asyncio or socket. A
MessageStore starts once; to reopen a directory create a new one. The put path is in put.py, reads in
reads.py (base classes sharing this object's state); each service keeps a reference to this facade.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.message import pack_host
from chronomq.store.allocate import AllocateMappedFileService
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.clean import CleanCommitLogService
from chronomq.store.commitlog import CommitLog
from chronomq.store.consumequeue import ConsumeQueue
from chronomq.store.flush import FlushCommitLogService, FlushConsumeQueueService, GroupCommitService
from chronomq.store.index import IndexService
from chronomq.store.put import PutPath
from chronomq.store.reads import ReadPath
from chronomq.store.recovery import StoreRecovery
from chronomq.store.replica import ReplicaAppend
from chronomq.store.reput import ArrivalListener, ReputMessageService
from chronomq.store.threads import background_target, set_background_batch
from chronomq.store.types import DispatchRequest

log = logging.getLogger("chronomq.store")


class MessageStore(PutPath, ReadPath):
    def __init__(self, config: BrokerConfig, clock: Clock, store_host: tuple[str, int] = ("127.0.0.1", 10911)
                 ) -> None:
        self.config = config
        self.clock = clock
        self.store_host = store_host
        self.root = os.path.abspath(config.storePathRootDir)
        self._store_host_b = pack_host(store_host)
        self._msg_id_prefix = self._store_host_b.hex().upper()
        self._seg_size = config.mappedFileSizeCommitLog
        self._cl = CommitLog(os.path.join(self.root, "commitlog"), self._seg_size)
        self._cq_root = os.path.join(self.root, "consumequeue")
        self._queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._queues_lock = threading.Lock()
        self._index = IndexService(os.path.join(self.root, "index"), config.maxHashSlotNum,
                                   config.maxIndexNum)
        self._index_enabled = config.messageIndexEnable
        self._delay_levels = config.delay_levels_ms
        self._sync = config.sync_flush
        self._max_body = config.maxMessageSize
        self._checkpoint_path = os.path.join(self.root, "checkpoint")
        self._abort_path = os.path.join(self.root, "abort")

        # put side (guarded by self._cl.lock)
        self._queue_table: dict[tuple[str, int], int] = {}
        self._pending: list[DispatchRequest] = []  # the dispatcher swaps the list
        self._cur_seg = None
        self._last_ts = 0
        self._init_caches()

        # services; the put path calls the ones it needs per message through handles bound once here
        self._reput = ReputMessageService(self)
        self._wake = self._reput.wake
        self._dispatch_lock = self._reput.lock
        self._signal_dispatch = self._reput.signal
        self._allocator = AllocateMappedFileService(self)
        self._alloc_wake = self._allocator.wake
        self._flusher = GroupCommitService(self) if self._sync else FlushCommitLogService(self)
        if isinstance(self._flusher, GroupCommitService):
            self._request_flush = self._flusher.request  # SYNC_FLUSH only: no ASYNC_FLUSH put waits
        self._cq_flusher = FlushConsumeQueueService(self)
        self._cleaner = CleanCommitLogService(self)
        self._replica = ReplicaAppend(self)

        self._running = False
        self._started = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clean_lock = threading.Lock()
        self.disk_usage_ratio: Callable[[], float] = self._cleaner.disk_usage_ratio
        # why sends are refused for want of disk (the clean service sets and clears it), or None
        self.disk_full: str | None = None
        self.recovered_abnormally = False

    # ================================================================================= lifecycle
    def start(self) -> None:
        if self._running or self._started:
            raise RuntimeError("a MessageStore starts once; create a new one to reopen the directory")
        self._started = True
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self._cq_root, exist_ok=True)
        abnormal = os.path.exists(self._abort_path)
        StoreRecovery(self).recover(abnormal)
        with open(self._abort_path, "wb") as f:
            f.write(b"chronomq store running\n")
            f.flush()
            os.fsync(f.fileno())
        self._running = True
        self._stop.clear()
        targets = [("chronomq-store-dispatch", self._reput.run),
                   ("chronomq-store-allocate", self._allocator.run),
                   ("chronomq-store-flush-cq", self._cq_flusher.run),
                   ("chronomq-store-clean", self._cleaner.run),
                   ("chronomq-store-flush", self._flusher.run)]
        if isinstance(self._flusher, GroupCommitService):
            targets.append(("chronomq-store-flush-watchdog", self._flusher.watchdog))
        set_background_batch(self.config.backgroundThreadsBatch)
        for name, fn in targets:
            t = threading.Thread(target=background_target(fn), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        """Stop accepting puts, dispatch and flush everything, write the checkpoint, remove the abort file."""
        if not self._running:
            return
        self._stop_threads()
        with self._dispatch_lock:
            self._reput.dispatch_pending()  # anything left after the dispatcher stopped
        self._reput.index_pending()
        try:
            self._flusher.do_flush()
            with self._clean_lock:
                self._cq_flusher.flush_queues_and_checkpoint()
            self._flusher.fail_requests()
            end = self._cl.wrote
            Checkpoint(self._flusher.flushed, self._reput.recover_point(), end, self.clock.now_ms()).save(
                self._checkpoint_path)
        except OSError as e:  # a full disk: the abort file stays, the next start verifies as after a crash
            log.error("store shutdown: cannot flush or write the checkpoint (%s); the next start recovers "
                      "as after a crash", e)
            try:
                self._flusher.fail_requests()
            except OSError:
                pass
            self._close_files()
            return
        self._close_files()
        try:
            os.unlink(self._abort_path)
        except FileNotFoundError:
            pass

    def _stop_threads(self) -> None:
        """Refuse further puts, then wake and join the service threads."""
        with self._cl.lock:
            self._running = False
        self._stop.set()
        self._wake.set()
        self._alloc_wake.set()
        self._flusher.wakeup()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    def _halt(self) -> None:
        """Tests: stop threads and close files without a clean shutdown (as if the process died after
        the last write; the abort file stays, the checkpoint is whatever was written last)."""
        self._stop_threads()
        self._flusher.fail_requests()
        self._close_files()

    def _close_files(self) -> None:
        self._cl.close()
        with self._queues_lock:
            for cq in self._queues.values():
                cq.close()
        self._index.close()

    def flush(self) -> None:
        """Flush the commit log, then queues and index, then write the checkpoint. A no-op unless running."""
        if not self._running:
            return
        self._flusher.do_flush()
        with self._clean_lock:
            self._cq_flusher.flush_queues_and_checkpoint()

    def sync_commit_log(self) -> int:
        """fdatasync the commit log up to everything written so far, whatever the flush mode, and return
        the offset now durable: for a caller whose own durable state must never get ahead of the
        records it put (the timer's checkpoint, before its delivery marks). Not running (stopped: its
        shutdown flushed everything): the offset last known durable."""
        if not self._running:
            return self._flusher.flushed
        return self._flusher.do_flush()

    @property
    def _cl_flushed(self) -> int:
        """The commit-log offset known durable (tests)."""
        return self._flusher.flushed

    # ================================================================================= consume queues
    def _queue_for_dispatch(self, topic: str, qid: int) -> ConsumeQueue:
        """The consume queue of ``topic``/``qid``, created when it is the first record's."""
        key = (topic, qid)
        cq = self._queues.get(key)
        if cq is None:
            with self._queues_lock:
                cq = self._queues.get(key)
                if cq is None:
                    cq = ConsumeQueue(self._cq_root, topic, qid, self.config.mappedFileSizeConsumeQueue)
                    self._queues[key] = cq
        return cq

    def prepare_queue(self, topic: str, qid: int) -> bool:
        """Create the consume queue of ``topic``/``qid`` and its first file ahead of its first record,
        when nothing was ever put to it (its first unit then goes at offset 0): the first dispatch to it
        then finds the file made. Returns whether a file was made. Any thread (the allocator's)."""
        key = (topic, qid)
        cq = self._queues.get(key)
        if cq is not None and cq.files:
            return False
        with self._cl.lock:
            if self._queue_table.get(key, 0):
                return False  # records were put to it: its first unit's place is known elsewhere
        return self._queue_for_dispatch(topic, qid).prepare_first_file()

    # ================================================================================= dispatch
    def append_replicated(self, offset: int, data: bytes | memoryview) -> int:
        """A slave's write of commit-log bytes received from its master (replica.py). Returns the new
        write position; raises ReplicaError."""
        return self._replica.append(offset, data)

    def end_replication(self) -> int:
        """A slave becoming a master: drop the tail of a record that never arrived whole (replica.py);
        returns the bytes dropped."""
        return self._replica.end()

    def replication_chunk(self, offset: int, max_bytes: int) -> bytes:
        """A master's read of commit-log bytes for a slave (replica.py); raises ReplicaError."""
        return self._replica.chunk(offset, max_bytes)

    def set_dispatch_hook(self, fn: Callable[[], None] | None) -> None:
        """Dispatch on the caller's side: after a put queues dispatch requests, ``fn()`` is called (on
        the putting thread, outside every store lock) instead of waking the dispatcher thread, and it
        must arrange for ``dispatch_now()`` to run soon (the broker: later in the same event-loop turn).
        The dispatcher thread stays as the fallback: it retries a failed batch and serves
        ``wait_dispatched``. None restores the thread-only mode."""
        self._reput.hook = fn

    def set_index_later(self, fn: Callable[[Callable[[], None]], None] | None,
                        busy: Callable[[], bool] | None = None) -> None:
        """Write the key index entries of a dispatched batch later: ``fn(job)`` must run ``job()`` soon
        (the broker: on its loop, after the answers to the pulls the batch woke). While ``busy()`` says a
        burst is being handed over, the job defers itself again through ``fn``, for at most
        reput.INDEX_MAX_WAIT_S after the oldest waiting batch. Key queries, the checkpoint and shutdown
        see the entries not yet written. None: written with the batch (what waits is written first, so
        the index keeps commit-log order)."""
        if fn is None:
            self._reput.index_pending()
        self._reput.index_busy = busy
        self._reput.index_later = fn
        if fn is None:
            self._reput.index_pending()

    @property
    def _dispatch_hook(self) -> Callable[[], None] | None:
        return self._reput.hook

    @_dispatch_hook.setter
    def _dispatch_hook(self, fn: Callable[[], None] | None) -> None:
        self._reput.hook = fn

    def dispatch_now(self) -> None:
        """Dispatch every queued request on this thread. If the dispatcher thread is busy, it takes
        them after its current batch; a failed batch is left to the thread's retry."""
        self._reput.dispatch_now()

    def add_arrival_listener(self, fn: ArrivalListener) -> None:
        """fn(topic, queue_id, max_offset, store_timestamp), called by whoever dispatches (the dispatch
        hook's thread, the broker's event loop, or the dispatcher thread) after the consume-queue entries
        of a batch are written (once per queue per batch, with the new max offset): it must work on any."""
        self._reput.listeners.append(fn)

    def wait_dispatched(self, commit_log_offset: int, timeout_s: float) -> bool:
        """Block until every record starting at or before ``commit_log_offset`` has its queue entry (or
        everything written so far is dispatched). Returns False on timeout."""
        return self._reput.wait_dispatched(commit_log_offset, timeout_s)

    # ================================================================================= clean
    def set_min_offset_guard(self, fn: Callable[[], int | None]) -> None:
        self._cleaner.guard = fn

    def check_disk(self) -> str | None:
        """Read the disk use now and update ``disk_full`` (as the clean service does every
        cleanResourceInterval); returns it."""
        self._cleaner.check_disk(self.disk_usage_ratio())
        return self.disk_full

    def run_clean_once(self, force: bool = False) -> int:
        """Delete expired commit-log segments (older than fileReservedTime) when the hour is one of
        deleteWhen, disk use is past diskMaxUsedSpaceRatio, or ``force``; past diskSpaceCleanForciblyRatio
        (with cleanFileForciblyEnable) delete the oldest segments regardless of age. Never the segment
        being written, never one holding data at or beyond the min-offset guard. Then drop consume-queue
        and index files wholly below the oldest commit-log offset. Returns the number of commit-log
        segments deleted."""
        return self._cleaner.run_once(force)
