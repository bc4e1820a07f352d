"""MessageStore: the facade over the commit log, consume queues, index, flush, dispatch, clean and
recovery (design, threads and locks: docs/store.md). Thread-safe and synchronous; store/ never imports
remoting, broker, client, asyncio or socket. A MessageStore starts once; to reopen a directory create
a new one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import struct
import threading
import time
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
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.commitlog import (
    BLANK_HEAD,
    I64,
    PATCH,
    CommitLog,
    check_record,
    encode,
    splice,
)
from chronomq.store.consumequeue import UNIT, ConsumeQueue
from chronomq.store.index import IndexService
from chronomq.store.mapped import MappedFile
from chronomq.store.types import AppendResult, CQUnit, GetResult, GetStatus, PutResult, PutStatus

log = logging.getLogger("chronomq.store")

DEFAULT_MAX_BYTES = 256 * 1024
# The allocator thread keeps this much of the active commit-log segment written with zeros ahead of the
# write position (see store.mapped: a put must not be the one to allocate a page's disk block).
ALLOCATE_AHEAD = 16 * 1024 * 1024
_POS_STORETIMESTAMP = 56
ArrivalListener = Callable[[str, int, int, int], None]


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
        self._pending: list[tuple] = []
        self._cur_seg = None
        self._last_ts = 0
        self._topic_cache: dict[str, bytes] = {}
        self._tag_cache: dict[str, int] = {}
        self._host_cache: dict[tuple[str, int], bytes] = {}

        # dispatch side
        self._dispatched = 0
        self._dispatch_cv = threading.Condition()
        self._wake = threading.Event()
        self._dispatch_lock = threading.Lock()  # one dispatcher at a time: batches go in commit-log order
        self._dispatch_hook: Callable[[], None] | None = None
        self._listeners: list[ArrivalListener] = []
        self._guard: Callable[[], int | None] | None = None

        self._alloc_wake = threading.Event()

        # flush side
        self._flush_cv = threading.Condition()
        self._flush_requests: list[tuple[int, concurrent.futures.Future[bool]]] = []
        self._cl_flushed = 0

        self._running = False
        self._started = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clean_lock = threading.Lock()
        self.disk_usage_ratio: Callable[[], float] = self._disk_usage_ratio
        self.recovered_abnormally = False

    # ================================================================================= lifecycle
    def start(self) -> None:
        if self._running or self._started:
            raise RuntimeError("a MessageStore starts once; create a new one to reopen the directory")
        self._started = True
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self._cq_root, exist_ok=True)
        abnormal = os.path.exists(self._abort_path)
        self._recover(abnormal)
        with open(self._abort_path, "wb") as f:
            f.write(b"chronomq store running\n")
            f.flush()
            os.fsync(f.fileno())
        self._running = True
        self._stop.clear()
        targets = [("chronomq-store-dispatch", self._dispatch_loop),
                   ("chronomq-store-allocate", self._allocate_loop),
                   ("chronomq-store-flush-cq", self._flush_cq_loop),
                   ("chronomq-store-clean", self._clean_loop)]
        targets.append(("chronomq-store-flush", self._group_commit_loop if self._sync else self._flush_loop))
        if self._sync:
            targets.append(("chronomq-store-flush-watchdog", self._flush_watchdog))
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
            self._dispatch_pending()  # anything left after the dispatcher stopped
        self._do_flush()
        with self._clean_lock:
            self._flush_queues_and_checkpoint()
        self._fail_flush_requests()
        end = self._cl.wrote
        Checkpoint(self._cl_flushed, self._dispatched, end, self.clock.now_ms()).save(self._checkpoint_path)
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
        with self._flush_cv:
            self._flush_cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    def _halt(self) -> None:
        """Tests: stop threads and close files without a clean shutdown (as if the process died after
        the last write; the abort file stays, the checkpoint is whatever was written last)."""
        self._stop_threads()
        self._fail_flush_requests()
        self._close_files()

    def _close_files(self) -> None:
        self._cl.close()
        with self._queues_lock:
            for cq in self._queues.values():
                cq.close()
        self._index.close()

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

    def _allocate_loop(self) -> None:
        """RocketMQ's AllocateMappedFileService, reduced to what matters here: keep ALLOCATE_AHEAD bytes of
        the active segment allocated (zeros written) ahead of the writer, a chunk at a time so a put that
        needs space itself never waits long for the lock."""
        while not self._stop.is_set():
            self._alloc_wake.wait(0.5)
            self._alloc_wake.clear()
            seg = self._cur_seg
            if seg is None or self._stop.is_set():
                continue
            target = min(self._cl.wrote - seg.start + ALLOCATE_AHEAD, seg.file_size)
            try:
                while seg.allocated < target and not seg.closed and not self._stop.is_set():
                    seg.allocate(seg.allocated + 1)
            except (OSError, ValueError) as e:  # the put that needs the space reports it (disk full)
                log.warning("commit-log allocation ahead of the writer failed: %s", e)
                self._stop.wait(1.0)

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

    # ================================================================================= flush
    def _request_flush(self, end: int) -> concurrent.futures.Future[bool]:
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
        fut._chronomq_t = time.monotonic()  # type: ignore[attr-defined]
        with self._flush_cv:
            if self._cl_flushed >= end:
                fut.set_result(True)
                return fut
            self._flush_requests.append((end, fut))
            self._flush_cv.notify()
        return fut

    def _group_commit_loop(self) -> None:
        cv = self._flush_cv
        interval = self.config.flushIntervalCommitLog / 1000.0
        last_batch = 0
        while True:
            with cv:
                while not self._flush_requests and not self._stop.is_set():
                    if not cv.wait(timeout=interval):
                        break  # periodic flush for puts that did not ask to wait
            # Group commit: while requests keep arriving (writers just released by the previous flush
            # are putting their next message), give them a moment to join this flush. Bounded, and
            # skipped when the last flush served a single request (one writer: no one else to wait for).
            n = len(self._flush_requests)
            for _ in range(8 if last_batch > 1 else 0):
                if n == 0:
                    break
                time.sleep(0.0002)
                m = len(self._flush_requests)
                if m == n:
                    break
                n = m
            with cv:
                reqs = self._flush_requests
                self._flush_requests = []
            last_batch = len(reqs)
            if self._stop.is_set() and not reqs:
                return
            try:
                flushed = self._do_flush()
            except (OSError, ValueError) as e:
                log.error("commit-log flush failed: %s", e)
                for _, fut in reqs:
                    try:
                        fut.set_result(False)
                    except concurrent.futures.InvalidStateError:
                        pass
                continue
            late = []
            for end, fut in reqs:
                if fut.done():
                    continue  # the watchdog already reported a timeout
                if end <= flushed:
                    try:
                        fut.set_result(True)
                    except concurrent.futures.InvalidStateError:
                        pass
                else:
                    late.append((end, fut))
            if late:
                with cv:
                    self._flush_requests[:0] = late

    def _flush_watchdog(self) -> None:
        """Resolve SYNC_FLUSH futures to False once syncFlushTimeout (real time: it bounds a disk wait)
        has passed without their flush, even while an fdatasync hangs. The data may still become
        durable later, as with RocketMQ's FLUSH_DISK_TIMEOUT."""
        timeout = self.config.syncFlushTimeout / 1000.0
        while not self._stop.wait(min(0.1, timeout / 4)):
            now = time.monotonic()
            with self._flush_cv:
                reqs = list(self._flush_requests)
            for _, fut in reqs:
                started = getattr(fut, "_chronomq_t", now)
                if now - started > timeout and not fut.done():
                    try:
                        fut.set_result(False)
                    except concurrent.futures.InvalidStateError:
                        pass

    def _do_flush(self) -> int:
        flushed = self._cl.flush()
        if flushed > self._cl_flushed:
            self._cl_flushed = flushed
        return self._cl_flushed

    def _fail_flush_requests(self) -> None:
        with self._flush_cv:
            reqs = self._flush_requests
            self._flush_requests = []
        if reqs:
            try:
                flushed = self._do_flush()
            except (OSError, ValueError):
                flushed = -1
            for end, fut in reqs:
                try:
                    fut.set_result(end <= flushed)
                except concurrent.futures.InvalidStateError:
                    pass

    def _flush_loop(self) -> None:
        interval = self.config.flushIntervalCommitLog
        while not self._stop.is_set():
            if self.clock.wait_until_ms(self._stop, self.clock.now_ms() + interval):
                break
            try:
                self._do_flush()
            except (OSError, ValueError) as e:
                log.error("commit-log flush failed: %s", e)

    def flush(self) -> None:
        """Flush the commit log, then queues and index, then write the checkpoint. A no-op unless running."""
        if not self._running:
            return
        self._do_flush()
        with self._clean_lock:
            self._flush_queues_and_checkpoint()

    def _flush_queues_and_checkpoint(self) -> None:
        dispatched = self._dispatched
        with self._queues_lock:
            queues = list(self._queues.values())
        for cq in queues:
            try:
                cq.flush()
            except ValueError:
                pass
        self._index.flush()
        flushed = self._cl_flushed
        Checkpoint(flushed, min(dispatched, flushed), 0, self.clock.now_ms()).save(self._checkpoint_path)

    def _flush_cq_loop(self) -> None:
        interval = self.config.flushIntervalConsumeQueue
        while not self._stop.is_set():
            if self.clock.wait_until_ms(self._stop, self.clock.now_ms() + interval):
                break
            try:
                with self._clean_lock:
                    self._flush_queues_and_checkpoint()
            except (OSError, ValueError) as e:
                log.error("consume-queue flush failed: %s", e)

    # ================================================================================= dispatch
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

    def set_dispatch_hook(self, fn: Callable[[], None] | None) -> None:
        """Dispatch on the caller's side: after a put queues dispatch requests, ``fn()`` is called (on
        the putting thread, outside every store lock) instead of waking the dispatcher thread, and it
        must arrange for ``dispatch_now()`` to run soon (the broker: later in the same event-loop turn).
        The dispatcher thread stays as the fallback: it retries a failed batch and serves
        ``wait_dispatched``. None restores the thread-only mode."""
        self._dispatch_hook = fn

    def _signal_dispatch(self) -> None:
        hook = self._dispatch_hook
        if hook is not None:
            try:
                hook()
                return
            except RuntimeError:  # the hook's loop is closed (shutdown): the thread takes over
                self._dispatch_hook = None
        if not self._wake.is_set():
            self._wake.set()

    def dispatch_now(self) -> None:
        """Dispatch every queued request on this thread. If the dispatcher thread is busy, it takes
        them after its current batch; a failed batch is left to the thread's retry."""
        if not self._dispatch_lock.acquire(blocking=False):
            self._wake.set()
            return
        try:
            ok = self._dispatch_pending()
        finally:
            self._dispatch_lock.release()
        if not ok:
            self._wake.set()

    def _dispatch_loop(self) -> None:
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            stopping = self._stop.is_set()
            with self._dispatch_lock:
                ok = self._dispatch_pending()
            if not ok and not stopping:
                self._stop.wait(0.1)  # failed (disk full?): the batch was put back; retry shortly
            if stopping:
                return

    def _dispatch_pending(self) -> bool:
        """Take and dispatch the queued requests; the caller holds ``_dispatch_lock``."""
        with self._cl.lock:
            batch = self._pending
            self._pending = []
        if not batch:
            return True
        try:
            self._dispatch(batch)
            return True
        except Exception:
            # Re-dispatch is idempotent (queue units already written are skipped; index duplicates are
            # filtered by queries), so put the whole batch back in front and try again later.
            log.exception("dispatch failed; will retry")
            with self._cl.lock:
                self._pending[:0] = batch
            return False

    def _dispatch(self, batch: list[tuple]) -> None:
        """Build consume-queue units and index entries for requests in commit-log order."""
        by_queue: dict[tuple[str, int], list[tuple]] = {}
        for item in batch:
            key = (item[2], item[3])
            lst = by_queue.get(key)
            if lst is None:
                by_queue[key] = [item]
            else:
                lst.append(item)
        pack = UNIT.pack
        arrivals = []
        for (topic, qid), items in by_queue.items():
            cq = self._get_queue(topic, qid, True)
            # queue offsets of one queue are contiguous in commit-log order; split where they are not
            start = 0
            for i in range(1, len(items) + 1):
                if i == len(items) or items[i][4] != items[i - 1][4] + 1:
                    run = items[start:i]
                    cq.append_units(run[0][4], b"".join([pack(it[0], it[1], it[5]) for it in run]), len(run))
                    start = i
            last = items[-1]
            arrivals.append((topic, qid, cq.max_offset, last[6]))
        if self._index_enabled:
            self._index.put_batch(batch)  # a failure propagates: the whole batch is retried
        last = batch[-1]
        with self._dispatch_cv:
            self._dispatched = last[0] + last[1]
            self._dispatch_cv.notify_all()
        for listener in list(self._listeners):
            for a in arrivals:
                try:
                    listener(*a)
                except Exception:
                    log.exception("arrival listener failed")

    def add_arrival_listener(self, fn: ArrivalListener) -> None:
        """fn(topic, queue_id, max_offset, store_timestamp), called from the dispatcher thread after the
        consume-queue entries of a batch are written (once per queue per batch, with the new max offset)."""
        self._listeners.append(fn)

    def set_min_offset_guard(self, fn: Callable[[], int | None]) -> None:
        self._guard = fn

    def wait_dispatched(self, commit_log_offset: int, timeout_s: float) -> bool:
        """Block until every record starting at or before ``commit_log_offset`` has its queue entry (or
        everything written so far is dispatched). Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._dispatch_cv:
            while True:
                d = self._dispatched
                if d > commit_log_offset or d >= self._cl.wrote:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()
                self._dispatch_cv.wait(min(left, 0.05))

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
        return self._dispatched

    def topics(self) -> list[str]:
        return sorted({t for t, _ in list(self._queues)})

    def queue_ids(self, topic: str) -> list[int]:
        return sorted(q for t, q in list(self._queues) if t == topic)

    # ================================================================================= clean
    def _disk_usage_ratio(self) -> float:
        """Like df's Use%: used / (used + available to unprivileged users)."""
        st = os.statvfs(self.root)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        usable = used + st.f_bavail * st.f_frsize
        return 0.0 if usable <= 0 else used / usable

    def _clean_loop(self) -> None:
        interval = self.config.cleanResourceInterval
        while not self._stop.is_set():
            if self.clock.wait_until_ms(self._stop, self.clock.now_ms() + interval):
                break
            try:
                self.run_clean_once()
            except (OSError, ValueError) as e:
                log.error("clean failed: %s", e)

    def run_clean_once(self, force: bool = False) -> int:
        """Delete expired commit-log segments (older than fileReservedTime) when the hour is one of
        deleteWhen or ``force``; when disk use passes diskMaxUsedSpaceRatio delete the oldest segments
        regardless of age. Never the segment being written, never one holding data at or beyond the
        min-offset guard. Then drop consume-queue and index files wholly below the oldest commit-log
        offset. Returns the number of commit-log segments deleted."""
        with self._clean_lock:
            now = self.clock.now_ms()
            hour = time.localtime(now / 1000).tm_hour
            hours = {int(h) for h in self.config.deleteWhen.split(";") if h.strip().isdigit()}
            try:
                ratio = self.disk_usage_ratio()
            except OSError:
                ratio = 0.0
            disk_full = ratio * 100 >= self.config.diskMaxUsedSpaceRatio
            if not (force or disk_full or hour in hours):
                return 0
            reserved_ms = self.config.fileReservedTime * 3_600_000
            guard = None
            if self._guard is not None:
                try:
                    guard = self._guard()
                except Exception:
                    log.exception("min offset guard failed; not cleaning")
                    return 0
            deleted = 0
            cl = self._cl
            while True:
                segs = cl.segments
                if len(segs) < 2:
                    break
                seg, nxt = segs[0], segs[1]
                if nxt.start >= cl.wrote:
                    break  # seg is the one being written
                if seg.end > self._dispatched:
                    break  # its queue entries are not built yet: they would point into a deleted file
                if not disk_full:
                    newest = cl.store_time_at(nxt.start)  # >= every store time inside seg
                    if newest is None or newest + reserved_ms > now:
                        break
                if guard is not None and seg.end > guard:
                    log.info("clean: keeping commit-log segment %020d and later: undelivered delayed "
                             "messages from offset %d are still needed", seg.start, guard)
                    break
                with cl.seg_lock:
                    cl.segments = cl.segments[1:]
                seg.destroy()
                deleted += 1
                log.info("clean: deleted commit-log segment %020d (%s)", seg.start,
                         "disk use %.0f%%" % (ratio * 100) if disk_full else "expired")
            min_phys = cl.min_offset
            with self._queues_lock:
                queues = list(self._queues.values())
            for cq in queues:
                cq.clean_below(min_phys)
            self._index.clean_below(min_phys)
            return deleted

    # ================================================================================= recovery
    def _recover(self, abnormal: bool) -> None:
        cl = self._cl
        cl.load()
        ckpt = Checkpoint.load(self._checkpoint_path)
        self._load_queues()
        self._index.load()
        self.recovered_abnormally = abnormal or ckpt is None
        if not cl.segments:
            cl.wrote = 0
            self._cur_seg = None
            self._finish_recovery(0, 0)
            return
        if any(seg.was_short for seg in cl.segments):
            log.warning("recovery: a commit-log segment is shorter than mappedFileSizeCommitLog; verifying")
            abnormal = True
            self.recovered_abnormally = True
        if ckpt is not None and not abnormal and ckpt.commit_log_end:
            # clean shutdown: the end is known; confirm nothing valid follows it
            start = ckpt.commit_log_end
            check_crc = False
        else:
            start = ckpt.recover_from if ckpt is not None else cl.segments[0].start
            check_crc = self.config.checkCRCOnRecover
        start = max(start, cl.segments[0].start)
        seg = cl.segment_for(start)
        if seg is None:  # the checkpoint points past the files we have: verify the last one fully
            seg = cl.segments[-1]
            start = seg.start
        if abnormal or ckpt is None or not ckpt.commit_log_end:
            start = seg.start  # re-verify from the start of the segment holding the checkpoint
        end = self._scan_end(start, check_crc)
        self._truncate_log(end)
        dispatch_from = min(ckpt.recover_from if ckpt is not None else 0, end)
        dispatch_from = max(dispatch_from, cl.min_offset)
        if not abnormal and ckpt is not None and ckpt.commit_log_end and end == ckpt.commit_log_end:
            dispatch_from = min(max(ckpt.recover_from, cl.min_offset), end)
        self._finish_recovery(dispatch_from, end)

    def _scan_end(self, start: int, check_crc: bool) -> int:
        """Walk valid records from ``start`` (a record boundary); return the offset where they stop."""
        cl = self._cl
        off = start
        while True:
            seg = cl.segment_for(off)
            if seg is None:
                return off
            r = off - seg.start
            n = check_record(seg.mm, r, seg.start, seg.file_size, check_crc)
            if n > 0:
                off += n
            elif n == -1:
                off = seg.end
            else:
                if n == -2:
                    log.warning("recovery: invalid or torn record at commit-log offset %d; the log is "
                                "truncated there", off)
                return off

    def _truncate_log(self, end: int) -> None:
        cl = self._cl
        keep = []
        for seg in cl.segments:
            if seg.start > end or (seg.start == end and seg is not cl.segments[0]):
                log.warning("recovery: removing commit-log segment %020d past the recovered end", seg.start)
                seg.destroy()
                continue
            keep.append(seg)
        cl.segments = keep
        for seg in keep:
            seg.written = seg.flushed = seg.file_size
        cl.wrote = end
        if keep:
            last = keep[-1]
            r = end - last.start
            if r < last.file_size:
                last.zero_tail(r)
                last.written = last.flushed = r
            self._cur_seg = last
        else:
            self._cur_seg = None

    def _load_queues(self) -> None:
        if not os.path.isdir(self._cq_root):
            return
        for topic in os.listdir(self._cq_root):
            tdir = os.path.join(self._cq_root, topic)
            if not os.path.isdir(tdir) or validate_topic(topic) is not None:
                continue
            for q in os.listdir(tdir):
                if not q.isdigit():
                    continue
                cq = ConsumeQueue(self._cq_root, topic, int(q), self.config.mappedFileSizeConsumeQueue)
                cq.load()
                if not cq.files:
                    shutil.rmtree(os.path.join(tdir, q), ignore_errors=True)
                    continue
                self._queues[(topic, int(q))] = cq

    def _finish_recovery(self, dispatch_from: int, end: int) -> None:
        """Cut queue entries at or beyond ``dispatch_from``, then rebuild them from the log up to ``end``,
        checking each record's queue offset against its queue (a mismatch ends the log there)."""
        cl = self._cl
        for cq in self._queues.values():
            cq.truncate_from_phys(dispatch_from)
            cq.clean_below(cl.min_offset)
        qt = {k: cq.max_offset for k, cq in self._queues.items()}
        levels = self._delay_levels
        batch: list[tuple] = []
        last_ts = 0
        off = dispatch_from
        for off, data in cl.iter_records(dispatch_from):
            if off >= end:
                break
            try:
                m = decode_record(data)
            except MessageFormatError:
                end = off
                break
            key = (m.topic, m.queue_id)
            expect = qt.get(key)
            if expect is None and key not in self._queues:
                if m.queue_offset > 0 and dispatch_from > cl.min_offset:
                    # Queue files lost (its earlier entries are not in any file): rebuild every queue
                    # from the oldest commit-log offset instead of only the tail.
                    log.warning("recovery: queue %s/%d has no files but the log has its offset %d; "
                                "rebuilding all queues from the start of the log", m.topic, m.queue_id,
                                m.queue_offset)
                    self._finish_recovery(cl.min_offset, end)
                    return
                expect = m.queue_offset  # the queue starts here (its older data was cleaned)
            if m.queue_offset != expect:
                log.warning("recovery: record at %d has queue offset %d, expected %d; the log is truncated "
                            "there", off, m.queue_offset, expect)
                end = off
                break
            qt[key] = expect + 1
            if m.topic == SCHEDULE_TOPIC:
                level = min(max(m.delay_level, 1), len(levels))
                tc = m.store_timestamp + levels[level - 1]
            else:
                tc = tags_code(m.tags)
            keys = m.keys or None
            batch.append((off, m.store_size, m.topic, m.queue_id, m.queue_offset, tc, m.store_timestamp,
                          keys, m.uniq_key))
            last_ts = max(last_ts, m.store_timestamp)
            if len(batch) >= 4096:
                self._dispatch(batch)
                batch = []
        if batch:
            self._dispatch(batch)
        if end < cl.wrote:
            self._truncate_log(end)
            for cq in self._queues.values():
                cq.truncate_from_phys(end)
            qt = {k: cq.max_offset for k, cq in self._queues.items()}
        self._queue_table = qt
        self._dispatched = cl.wrote
        self._cl_flushed = cl.wrote
        if last_ts == 0 and cl.wrote > cl.min_offset:
            last_ts = self._last_store_time()
        if last_ts > self.clock.now_ms() + 86_400_000:
            log.warning("recovery: the newest store time is more than a day ahead of the clock; ignoring it")
            last_ts = 0
        self._last_ts = last_ts
        for seg in cl.segments:
            seg.flush()
        with self._queues_lock:
            for cq in self._queues.values():
                cq.dirty = True
                cq.flush()
        self._index.flush()
        Checkpoint(cl.wrote, cl.wrote, 0, self.clock.now_ms()).save(self._checkpoint_path)

    def _last_store_time(self) -> int:
        best = 0
        for cq in self._queues.values():
            if cq.max_offset > cq.min_offset:
                u = cq.units(cq.max_offset - 1, 1)
                if u:
                    t = self._store_time_of(u[0][0])
                    if t is not None:
                        best = max(best, t)
        return best
