"""MessageStore: the facade over the commit log, consume queues and index, and the services that
dispatch, flush, allocate and clean them (see docs/store.md for the design, threads and locks).
Thread-safe and synchronous; store/ never imports remoting, broker, client, asyncio or socket. A
MessageStore starts once; to reopen a directory create a new one. Each service keeps a reference to
this facade.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from collections.abc import Callable, Iterator

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.message import (
    BLANK_MAGIC,
    MAX_PROPERTIES_LENGTH,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    PROPERTY_WAIT_STORE_MSG_OK,
    SCHEDULE_TOPIC,
    MessageExt,
    MessageFormatError,
    decode_record,
    pack_host,
    tags_code,
    validate_topic,
)
from chronomq.store.allocate import ALLOCATE_AHEAD, AllocateMappedFileService
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.clean import CleanCommitLogService
from chronomq.store.commitlog import BLANK_HEAD, I64, PATCH, CommitLog, encode, splice
from chronomq.store.consumequeue import ConsumeQueue
from chronomq.store.flush import FlushCommitLogService, FlushConsumeQueueService, GroupCommitService
from chronomq.store.index import IndexService
from chronomq.store.mapped import MappedFile
from chronomq.store.recovery import StoreRecovery
from chronomq.store.reput import ArrivalListener, ReputMessageService
from chronomq.store.types import AppendResult, CQUnit, GetResult, GetStatus, PutResult, PutStatus

DEFAULT_MAX_BYTES = 256 * 1024
_POS_STORETIMESTAMP = 56


class MessageStore:
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
        self._pending: list[tuple] = []  # dispatch requests; the dispatcher swaps the list
        self._cur_seg = None
        self._last_ts = 0
        self._topic_cache: dict[str, bytes] = {}
        self._tag_cache: dict[str, int] = {}
        self._host_cache: dict[tuple[str, int], bytes] = {}

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

        self._running = False
        self._started = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clean_lock = threading.Lock()
        self.disk_usage_ratio: Callable[[], float] = self._cleaner.disk_usage_ratio
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
        for name, fn in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        """Stop accepting puts, dispatch and flush everything, write the checkpoint, remove the abort file."""
        if not self._running:
            return
        self._stop_threads()
        with self._dispatch_lock:
            self._reput.dispatch_pending()  # anything left after the dispatcher stopped
        self._flusher.do_flush()
        with self._clean_lock:
            self._cq_flusher.flush_queues_and_checkpoint()
        self._flusher.fail_requests()
        end = self._cl.wrote
        Checkpoint(self._flusher.flushed, self._reput.dispatched, end, self.clock.now_ms()).save(
            self._checkpoint_path)
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

    @property
    def _cl_flushed(self) -> int:
        """The commit-log offset known durable (tests)."""
        return self._flusher.flushed

    # ================================================================================= consume queues
    def _get_queue(self, topic: str, qid: int, create: bool) -> ConsumeQueue | None:
        key = (topic, qid)
        cq = self._queues.get(key)
        if cq is None and create:
            with self._queues_lock:
                cq = self._queues.get(key)
                if cq is None:
                    cq = ConsumeQueue(self._cq_root, topic, qid, self.config.mappedFileSizeConsumeQueue)
                    self._queues[key] = cq
        return cq

    # ================================================================================= dispatch
    def set_dispatch_hook(self, fn: Callable[[], None] | None) -> None:
        """Dispatch on the caller's side: after a put queues dispatch requests, ``fn()`` is called (on
        the putting thread, outside every store lock) instead of waking the dispatcher thread, and it
        must arrange for ``dispatch_now()`` to run soon (the broker: later in the same event-loop turn).
        The dispatcher thread stays as the fallback: it retries a failed batch and serves
        ``wait_dispatched``. None restores the thread-only mode."""
        self._reput.hook = fn

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
        """fn(topic, queue_id, max_offset, store_timestamp), called from the dispatcher thread after the
        consume-queue entries of a batch are written (once per queue per batch, with the new max offset)."""
        self._reput.listeners.append(fn)

    def wait_dispatched(self, commit_log_offset: int, timeout_s: float) -> bool:
        """Block until every record starting at or before ``commit_log_offset`` has its queue entry (or
        everything written so far is dispatched). Returns False on timeout."""
        return self._reput.wait_dispatched(commit_log_offset, timeout_s)

    # ================================================================================= clean
    def set_min_offset_guard(self, fn: Callable[[], int | None]) -> None:
        self._cleaner.guard = fn

    def run_clean_once(self, force: bool = False) -> int:
        """Delete expired commit-log segments (older than fileReservedTime) when the hour is one of
        deleteWhen or ``force``; when disk use passes diskMaxUsedSpaceRatio delete the oldest segments
        regardless of age. Never the segment being written, never one holding data at or beyond the
        min-offset guard. Then drop consume-queue and index files wholly below the oldest commit-log
        offset. Returns the number of commit-log segments deleted."""
        return self._cleaner.run_once(force)

    # ================================================================================= put
    def _fail(self, status: PutStatus, error: str) -> PutResult:
        return PutResult(status, None, error)

    def _topic_bytes(self, topic: str) -> bytes | PutResult:
        """A topic not in the cache yet: checked (a refusal as a PutResult), encoded and cached."""
        err = validate_topic(topic) if isinstance(topic, str) else "the topic is not a string"
        if err is not None:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, err)
        topic_b = topic.encode()
        if len(self._topic_cache) > 100_000:
            self._topic_cache.clear()
        self._topic_cache[topic] = topic_b
        return topic_b

    def _prepare(self, msg: MessageExt) -> tuple | PutResult:
        """Validate and encode one message (outside any lock). Returns the pieces the locked section needs
        or a PutResult describing why nothing will be written."""
        topic = msg.topic
        topic_b = self._topic_cache.get(topic)
        if topic_b is None:
            topic_b = self._topic_bytes(topic)
            if isinstance(topic_b, PutResult):
                return topic_b
        body = msg.body
        if body.__class__ is not bytes and not isinstance(body, bytearray | memoryview):
            return self._fail(PutStatus.MESSAGE_ILLEGAL, "the message body is not bytes")
        if len(body) > self._max_body:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              f"the message body is {len(body)} bytes, more than maxMessageSize="
                              f"{self._max_body}")
        qid = msg.queue_id
        if qid < 0 or qid > 0x7FFFFFFF:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, f"queue id {qid} out of range")
        props = msg.properties
        fields = self._property_fields(props)
        if isinstance(fields, PutResult):
            return fields
        props_b, tags, keys_l, uniq = fields
        host = msg.born_host
        born_b = self._host_cache.get(host)
        if born_b is None:
            try:
                born_b = pack_host(host)
            except (TypeError, ValueError, struct.error) as e:
                return self._fail(PutStatus.MESSAGE_ILLEGAL, f"bad born host {host!r}: {e}")
            if len(self._host_cache) > 10_000:
                self._host_cache.clear()
            self._host_cache[host] = born_b
        try:
            buf = encode(msg, topic_b, props_b, self._store_host_b, born_b)
        except (struct.error, TypeError, ValueError) as e:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, f"cannot encode the message: {e}")
        if len(buf) > self._seg_size - 8:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              f"the record ({len(buf)} bytes) does not fit a commit-log segment "
                              f"({self._seg_size} bytes)")
        if topic == SCHEDULE_TOPIC:
            levels = self._delay_levels
            try:
                level = int(props.get(PROPERTY_DELAY_TIME_LEVEL, "1")) if props else 1
            except ValueError:
                level = 1
            level = min(max(level, 1), len(levels))
            delay = levels[level - 1]
            tc = 0
        else:
            delay = None
            if tags:
                tc = self._tag_cache.get(tags)
                if tc is None:
                    tc = tags_code(tags)
                    if len(self._tag_cache) > 100_000:
                        self._tag_cache.clear()
                    self._tag_cache[tags] = tc
            else:
                tc = 0
        return buf, topic, qid, tc, delay, keys_l, uniq

    def _prepare_checked(self, msg: MessageExt) -> tuple | PutResult:
        try:
            return self._prepare(msg)
        except (TypeError, ValueError, AttributeError, OverflowError, struct.error) as e:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, f"malformed message: {e}")

    def _reserve(self, size: int) -> tuple[MappedFile, int, int] | PutResult:
        """Under the commit-log lock: the segment, commit-log offset and in-segment position where
        ``size`` bytes go (rolling to a new segment and allocating disk as needed), or a failed
        PutResult. A record never spans two segments."""
        if not self._running:
            return self._fail(PutStatus.SERVICE_NOT_AVAILABLE, "the message store is not running")
        seg = self._cur_seg
        wrote = self._cl.wrote
        r = wrote - seg.start if seg is not None else 0
        if seg is None or r + size + 8 > self._seg_size:
            try:
                seg = self._roll(seg, r)
            except OSError as e:
                return self._fail(PutStatus.SERVICE_NOT_AVAILABLE, f"cannot create a commit-log segment: {e}")
            wrote = seg.start
            r = 0
        if r + size + ALLOCATE_AHEAD // 2 > seg.allocated:
            if not self._alloc_wake.is_set():
                self._alloc_wake.set()
            if r + size > seg.allocated:  # the writer outran the allocator thread
                try:
                    seg.allocate(r + size)
                except OSError as e:
                    return self._fail(PutStatus.SERVICE_NOT_AVAILABLE,
                                      f"cannot allocate commit-log space: {e}")
        return seg, wrote, r


    def _property_fields(self, props: dict[str, str]
                         ) -> tuple[bytes, str | None, list[str] | None, str | None] | PutResult:
        """The stored properties text (checked: names non-empty, no separators inside, size limit) and
        what the dispatcher indexes (tags, KEYS words, UNIQ_KEY); a refusal as a PutResult."""
        if not props:
            return b"", None, None, None
        n = len(props)
        text = "\x02".join(map("\x01".join, props.items()))
        if text.count("\x01") != n or text.count("\x02") != n - 1 or "" in props:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              "a property has an empty name or contains a 0x01/0x02 separator")
        props_b = (text + "\x02").encode()
        if len(props_b) > MAX_PROPERTIES_LENGTH:
            return self._fail(PutStatus.PROPERTIES_SIZE_EXCEEDED,
                              f"the properties are {len(props_b)} bytes, more than {MAX_PROPERTIES_LENGTH}")
        keys = props.get(PROPERTY_KEYS)
        keys_l = [k for k in keys.split(" ") if k] if keys else None
        return props_b, props.get(PROPERTY_TAGS), keys_l, props.get(PROPERTY_UNIQ_KEY)

    def put_message(self, msg: MessageExt) -> PutResult:
        try:
            prep = self._prepare(msg)
        except (TypeError, ValueError, AttributeError, OverflowError, struct.error) as e:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, f"malformed message: {e}")
        if prep.__class__ is PutResult:
            return prep  # type: ignore[return-value]
        buf, topic, qid, tc, delay, keys_l, uniq = prep  # type: ignore[misc]
        size = len(buf)
        qkey = (topic, qid)
        cl = self._cl
        with cl.lock:
            reserved = self._reserve(size)
            if reserved.__class__ is PutResult:
                return reserved  # type: ignore[return-value]
            seg, wrote, r = reserved  # type: ignore[misc]
            ts = self.clock.now_ms()
            if ts < self._last_ts:
                ts = self._last_ts
            else:
                self._last_ts = ts
            qt = self._queue_table
            qoff = qt.get(qkey, 0)
            qt[qkey] = qoff + 1
            mm = seg.mm
            mm[r : r + size] = buf
            PATCH.pack_into(mm, r + 20, qoff, wrote)
            I64.pack_into(mm, r + _POS_STORETIMESTAMP, ts)
            seg.written = r + size
            cl.wrote = wrote + size
            self._pending.append((wrote, size, topic, qid, qoff, tc if delay is None else ts + delay, ts,
                                  keys_l, uniq))
        self._signal_dispatch()
        msg.queue_offset = qoff
        msg.commit_log_offset = wrote
        msg.store_timestamp = ts
        msg.store_host = self.store_host
        msg.store_size = size
        fut = None
        if self._sync and (not msg.properties or msg.properties.get(PROPERTY_WAIT_STORE_MSG_OK) != "false"):
            fut = self._request_flush(wrote + size)
        return PutResult(PutStatus.PUT_OK, AppendResult(wrote, size, f"{self._msg_id_prefix}{wrote:016X}",
                                                        qoff, ts), None, fut)

    def put_messages(self, msgs: list[MessageExt]) -> PutResult:
        """A batch for one topic and queue: contiguous queue offsets, written back to back in one segment."""
        if not msgs:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, "an empty batch")
        preps = []
        for m in msgs:
            prep = self._prepare_checked(m)
            if prep.__class__ is PutResult:
                return prep  # type: ignore[return-value]
            preps.append(prep)
        topic, qid = preps[0][1], preps[0][2]
        if any(p[1] != topic or p[2] != qid for p in preps):
            return self._fail(PutStatus.MESSAGE_ILLEGAL, "a batch must be for one topic and one queue")
        total = sum(len(p[0]) for p in preps)
        placed = self._append_run(topic, qid, [(p[0], p[3], p[4], p[5], p[6]) for p in preps], total)
        if placed.__class__ is PutResult:
            return placed  # type: ignore[return-value]
        first_phys, first_q, ts = placed  # type: ignore[misc]
        off = first_phys
        host = self.store_host
        for i, m in enumerate(msgs):
            size = len(preps[i][0])
            m.queue_offset = first_q + i
            m.commit_log_offset = off
            m.store_size = size
            m.store_timestamp = ts
            m.store_host = host
            off += size
        return self._batch_result(first_phys, first_q, ts, [len(p[0]) for p in preps], total)

    def _append_run(self, topic: str, qid: int, entries: list[tuple], total: int
                    ) -> tuple[int, int, int] | PutResult:
        """Append encoded records (rec, tagsCode, delay or None, KEYS words, UNIQ_KEY) of one queue
        contiguously in one segment, with consecutive queue offsets, and queue their dispatch requests.
        Returns (first physical offset, first queue offset, store time) or a refusal."""
        if total > self._seg_size - 8:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              f"the batch ({total} bytes) does not fit a commit-log segment")
        qkey = (topic, qid)
        cl = self._cl
        with cl.lock:
            pending = self._pending  # only under the lock: the dispatcher swaps the list
            reserved = self._reserve(total)
            if reserved.__class__ is PutResult:
                return reserved  # type: ignore[return-value]
            seg, wrote, r = reserved  # type: ignore[misc]
            ts = max(self.clock.now_ms(), self._last_ts)
            self._last_ts = ts
            first_q = qoff = self._queue_table.get(qkey, 0)
            self._queue_table[qkey] = first_q + len(entries)
            first_phys = wrote
            mm = seg.mm
            patch = PATCH.pack_into
            i64 = I64.pack_into
            for rec, tc, delay, keys_l, uniq in entries:
                size = len(rec)
                mm[r : r + size] = rec
                patch(mm, r + 20, qoff, wrote)
                i64(mm, r + _POS_STORETIMESTAMP, ts)
                pending.append((wrote, size, topic, qid, qoff, tc if delay is None else ts + delay, ts,
                                keys_l, uniq))
                qoff += 1
                r += size
                wrote += size
            seg.written = r
            cl.wrote = wrote
        self._signal_dispatch()
        return first_phys, first_q, ts

    def _batch_result(self, first_phys: int, first_q: int, ts: int, sizes: list[int], total: int
                      ) -> PutResult:
        prefix = self._msg_id_prefix
        ids = []
        off = first_phys
        for size in sizes:
            ids.append(f"{prefix}{off:016X}")
            off += size
        fut = self._request_flush(first_phys + total) if self._sync else None
        return PutResult(PutStatus.PUT_OK,
                         AppendResult(first_phys, total, ",".join(ids), first_q, ts, len(sizes)), None, fut)

    def put_records(self, topic: str, queue_id: int,
                    records: list[tuple[bytes | bytearray | memoryview, int, int, dict[str, str]]]
                    ) -> PutResult:
        """put_messages for records the caller holds as stored bytes (a parked delayed message): each
        entry (buf, pos, size, properties) is the V1 record of ``size`` bytes at ``buf[pos:]`` and the
        properties its copy gets. The copy goes to ``topic``/``queue_id``; flag, sysFlag, born time and
        host, reconsume times and body are taken from the bytes without decoding the message (see
        commitlog.splice), so the record is byte for byte the one put_messages would store for the
        decoded message with those fields. Same checks, guarantees and result as put_messages
        (contiguous queue offsets, one segment, tagsCode / delay, index keys, SYNC_FLUSH future); the
        entries' properties dicts are not modified. A malformed record refuses the batch with
        MESSAGE_ILLEGAL."""
        if not records:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, "an empty batch")
        topic_b = self._topic_cache.get(topic)
        if topic_b is None:
            topic_b = self._topic_bytes(topic)
            if isinstance(topic_b, PutResult):
                return topic_b
        if queue_id.__class__ is not int or queue_id < 0 or queue_id > 0x7FFFFFFF:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, f"queue id {queue_id!r} out of range")
        schedule = topic == SCHEDULE_TOPIC
        levels = self._delay_levels
        tag_cache = self._tag_cache
        max_body = self._max_body
        store_host_b = self._store_host_b
        preps = []
        total = 0
        for buf, pos, size, props in records:
            fields = self._property_fields(props)
            if isinstance(fields, PutResult):
                return fields
            props_b, tags, keys_l, uniq = fields
            try:
                rec, body_len = splice(buf, pos, size, topic_b, queue_id, props_b, store_host_b)
            except (ValueError, TypeError, struct.error) as e:
                return self._fail(PutStatus.MESSAGE_ILLEGAL, f"not a stored record: {e}")
            if body_len > max_body:
                return self._fail(PutStatus.MESSAGE_ILLEGAL,
                                  f"the message body is {body_len} bytes, more than maxMessageSize="
                                  f"{max_body}")
            if schedule:
                try:
                    level = int(props.get(PROPERTY_DELAY_TIME_LEVEL, "1")) if props else 1
                except ValueError:
                    level = 1
                delay = levels[min(max(level, 1), len(levels)) - 1]
                tc = 0
            else:
                delay = None
                if tags:
                    tc = tag_cache.get(tags)
                    if tc is None:
                        tc = tags_code(tags)
                        if len(tag_cache) > 100_000:
                            tag_cache.clear()
                        tag_cache[tags] = tc
                else:
                    tc = 0
            total += len(rec)
            preps.append((rec, tc, delay, keys_l, uniq))
        placed = self._append_run(topic, queue_id, preps, total)
        if placed.__class__ is PutResult:
            return placed  # type: ignore[return-value]
        first_phys, first_q, ts = placed  # type: ignore[misc]
        return self._batch_result(first_phys, first_q, ts, [len(p[0]) for p in preps], total)

    def put_message_and_wait(self, msg: MessageExt) -> PutResult:
        res = self.put_message(msg)
        if res.flushed is not None:
            try:
                ok = res.flushed.result(timeout=self.config.syncFlushTimeout / 1000.0)
            except concurrent.futures.TimeoutError:
                ok = False
                try:
                    res.flushed.set_result(False)
                except concurrent.futures.InvalidStateError:
                    ok = res.flushed.result()
            if not ok:
                res.status = PutStatus.FLUSH_DISK_TIMEOUT
                res.error = "the commit log was not flushed within syncFlushTimeout"
        return res

    def _roll(self, seg, r: int):
        """Under the commit-log lock: fill the rest of ``seg`` with a blank record, open the next one."""
        cl = self._cl
        if seg is None:
            start = cl.wrote
        else:
            rest = self._seg_size - r
            if rest >= 8:
                BLANK_HEAD.pack_into(seg.mm, r, rest, BLANK_MAGIC)
            seg.written = self._seg_size
            start = seg.end
        existing = cl.segment_for(start)
        new = existing if existing is not None else cl.new_segment(start)
        cl.wrote = start
        self._cur_seg = new
        return new

    # ================================================================================= reads
    def get_message(self, topic: str, queue_id: int, offset: int, max_msgs: int,
                    max_bytes: int = DEFAULT_MAX_BYTES, tag_filter: Callable[[int], bool] | None = None
                    ) -> GetResult:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
        lo, hi = cq.min_offset, cq.max_offset
        if hi == 0:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
        if offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        if offset == hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, offset, lo, hi)
        if offset > hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, 0 if lo == 0 else hi, lo, hi)
        max_msgs = max(1, max_msgs)
        scan = max_msgs if tag_filter is None else max(max_msgs, 800)
        units = cq.units(offset, scan)
        cl = self._cl
        min_phys = cl.min_offset
        out: list[bytes] = []
        nbytes = 0
        next_off = offset
        removed = filtered = 0
        for phys, size, tc in units:
            if size <= 0:
                next_off += 1
                continue
            if phys < min_phys:
                removed += 1
                next_off += 1
                continue
            if tag_filter is not None and not tag_filter(tc):
                filtered += 1
                next_off += 1
                continue
            if out and nbytes + size > max_bytes:
                break
            data = cl.read(phys, size)
            if data is None:
                removed += 1
                next_off += 1
                continue
            out.append(data)
            nbytes += size
            next_off += 1
            if len(out) >= max_msgs:
                break
        if out:
            status = GetStatus.FOUND
        elif removed and not filtered:
            status = GetStatus.MESSAGE_WAS_REMOVING
        elif filtered:
            status = GetStatus.NO_MATCHED_MESSAGE
        else:
            status = GetStatus.OFFSET_FOUND_NULL
        return GetResult(status, next_off, lo, hi, out)

    def read_record(self, commit_log_offset: int) -> bytes | None:
        if commit_log_offset < self._cl.min_offset:
            return None
        return self._cl.record_at(commit_log_offset)

    def look_message_by_offset(self, commit_log_offset: int) -> MessageExt | None:
        data = self.read_record(commit_log_offset)
        if data is None:
            return None
        try:
            return decode_record(data)
        except MessageFormatError:
            return None

    def get_cq_units(self, topic: str, queue_id: int, offset: int, max_count: int) -> list[CQUnit]:
        cq = self._queues.get((topic, queue_id))
        if cq is None or max_count <= 0:
            return []
        return cq.cq_units(offset, max_count)

    def get_max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        return cq.max_offset if cq is not None else 0

    def get_min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        return cq.min_offset if cq is not None else 0

    def get_offset_in_queue_by_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return 0
        return cq.offset_by_time(timestamp_ms, self._store_time_of)

    def _store_time_of(self, phys: int) -> int | None:
        if phys < self._cl.min_offset:
            return None
        return self._cl.store_time_at(phys)

    def get_earliest_message_time(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return -1
        for phys, size, _ in cq.units(cq.min_offset, 16):
            if size > 0:
                t = self._store_time_of(phys)
                if t is not None:
                    return t
        return -1

    def query_message(self, topic: str, key: str, max_num: int, begin_ts: int, end_ts: int
                      ) -> list[MessageExt]:
        """Messages of ``topic`` whose KEYS contain ``key`` or whose UNIQ_KEY is ``key``, stored within
        [begin_ts, end_ts]; at most ``max_num``, the newest ones, returned in commit-log order."""
        if max_num <= 0 or not key:
            return []
        cands = self._index.query(topic, key, max_num * 2 + 16, begin_ts, end_ts)
        out: dict[int, MessageExt] = {}
        for phys in sorted(set(cands), reverse=True):
            if len(out) >= max_num:
                break
            m = self.look_message_by_offset(phys)
            if m is None or m.topic != topic or not (begin_ts <= m.store_timestamp <= end_ts):
                continue
            if m.uniq_key == key or key in m.keys:
                out[phys] = m
        return [out[p] for p in sorted(out)]

    def iter_messages(self, from_commit_log_offset: int) -> Iterator[MessageExt]:
        for _, data in self._cl.iter_records(from_commit_log_offset):
            try:
                yield decode_record(data)
            except MessageFormatError:
                return

    @property
    def max_phy_offset(self) -> int:
        return self._cl.wrote

    @property
    def min_phy_offset(self) -> int:
        return self._cl.min_offset

    @property
    def dispatched_offset(self) -> int:
        return self._reput.dispatched

    def topics(self) -> list[str]:
        return sorted({t for t, _ in list(self._queues)})

    def queue_ids(self, topic: str) -> list[int]:
        return sorted(q for t, q in list(self._queues) if t == topic)
