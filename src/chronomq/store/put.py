"""The put path of MessageStore (a base class of it, sharing its state): validate and encode outside
any lock; under the commit-log lock only assign the queue offset, physical offset and store time (never
going backwards), copy the record into the mapped segment, patch those fields in place and queue the
dispatch request; then signal the dispatcher and, under SYNC_FLUSH, ask for a group commit. Rules: a
record never spans two segments; a refusal is a PutResult, never an exception; nothing per message is
added inside the lock.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

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
    pack_host,
    tags_code,
    validate_topic,
)
from chronomq.store import faults
from chronomq.store.allocate import ALLOCATE_AHEAD
from chronomq.store.commitlog import BLANK_HEAD, I64, PATCH, CommitLog, encode, splice
from chronomq.store.mapped import MappedFile
from chronomq.store.speedups import native
from chronomq.store.types import AppendResult, PutResult, PutStatus

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.config import BrokerConfig

_POS_STORETIMESTAMP = 56



def property_fields(props: dict[str, str]
                    ) -> tuple[bytes, str | None, list[str] | None, str | None] | int:
    """The stored properties text of a message's properties and what the dispatcher indexes (TAGS, the
    KEYS words, UNIQ_KEY), or the refusal as an int: 0 when a name is empty or a name or value holds a
    0x01/0x02 separator, else the encoded size, which is over MAX_PROPERTIES_LENGTH. A non-str name or
    value raises TypeError; text that cannot be UTF-8 raises UnicodeEncodeError."""
    if not props:
        return b"", None, None, None
    n = len(props)
    text = "\x02".join(map("\x01".join, props.items()))
    if text.count("\x01") != n or text.count("\x02") != n - 1 or "" in props:
        return 0
    props_b = (text + "\x02").encode()
    if len(props_b) > MAX_PROPERTIES_LENGTH:
        return len(props_b)
    keys = props.get(PROPERTY_KEYS)
    keys_l = [k for k in keys.split(" ") if k] if keys else None
    return props_b, props.get(PROPERTY_TAGS), keys_l, props.get(PROPERTY_UNIQ_KEY)


def append_run(mm: mmap.mmap, r: int, wrote: int, qoff: int, ts: int, entries: list[tuple], topic: str,
               qid: int, pending: list[tuple]) -> tuple[int, int, int]:
    """Copy encoded records (rec, tagsCode, delay or None, KEYS words, UNIQ_KEY) into ``mm`` from byte
    ``r`` on (the commit log at offset ``wrote``), patching each one's queue offset (from ``qoff`` on),
    physical offset and store time ``ts``, and append its dispatch request to ``pending``. The caller
    has reserved the room (ValueError otherwise). Returns the next (r, wrote, qoff)."""
    patch = PATCH.pack_into
    i64 = I64.pack_into
    n = len(mm)
    for rec, tc, delay, keys_l, uniq in entries:
        size = len(rec)
        if r < 0 or r + (size if size > 64 else 64) > n:
            raise ValueError("a record does not fit the mapped segment")
        mm[r : r + size] = rec
        patch(mm, r + 20, qoff, wrote)
        i64(mm, r + _POS_STORETIMESTAMP, ts)
        pending.append((wrote, size, topic, qid, qoff, tc if delay is None else ts + delay, ts, keys_l, uniq))
        qoff += 1
        r += size
        wrote += size
    return r, wrote, qoff


property_fields_py = property_fields
append_run_py = append_run
if native is not None:
    property_fields = native.property_fields
    append_run = native.append_run


class PutPath:
    # the facade's state this path uses; guarded by self._cl.lock: _queue_table, _pending, _cur_seg,
    # _last_ts, and _running's change to False
    config: BrokerConfig
    clock: Clock
    store_host: tuple[str, int]
    _cl: CommitLog
    _seg_size: int
    _max_body: int
    _delay_levels: list[int]
    _sync: bool
    _store_host_b: bytes
    _msg_id_prefix: str
    _running: bool
    disk_full: str | None
    _queue_table: dict[tuple[str, int], int]
    _pending: list[tuple]
    _cur_seg: MappedFile | None
    _last_ts: int
    _topic_cache: dict[str, bytes]
    _tag_cache: dict[str, int]
    _host_cache: dict[tuple[str, int], bytes]
    _alloc_wake: threading.Event
    _signal_dispatch: Callable[[], None]
    _request_flush: Callable[[int], concurrent.futures.Future[bool]]

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

    def _reserve(self, size: int, delivery: bool = False) -> tuple[MappedFile, int, int] | PutResult:
        """Under the commit-log lock: the segment, commit-log offset and in-segment position where
        ``size`` bytes go (rolling to a new segment and allocating disk as needed), or a failed
        PutResult. A record never spans two segments. While the disk is full (``disk_full``) only a
        ``delivery`` (a parked delayed message coming due) may go on, as far as space allows."""
        if not self._running:
            return self._fail(PutStatus.SERVICE_NOT_AVAILABLE, "the message store is not running")
        if self.disk_full is not None and not delivery:
            return self._fail(PutStatus.SERVICE_NOT_AVAILABLE, self.disk_full)
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
        """property_fields, with a refusal as a PutResult."""
        fields = property_fields(props)
        if fields.__class__ is not int:
            return fields  # type: ignore[return-value]
        if fields == 0:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              "a property has an empty name or contains a 0x01/0x02 separator")
        return self._fail(PutStatus.PROPERTIES_SIZE_EXCEEDED,
                          f"the properties are {fields} bytes, more than {MAX_PROPERTIES_LENGTH}")

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

    def _append_run(self, topic: str, qid: int, entries: list[tuple], total: int, delivery: bool = False
                    ) -> tuple[int, int, int] | PutResult:
        """Append encoded records (rec, tagsCode, delay or None, KEYS words, UNIQ_KEY) of one queue
        contiguously in one segment, with consecutive queue offsets, and queue their dispatch requests.
        Returns (first physical offset, first queue offset, store time) or a refusal. ``delivery``: see
        _reserve."""
        if total > self._seg_size - 8:
            return self._fail(PutStatus.MESSAGE_ILLEGAL,
                              f"the batch ({total} bytes) does not fit a commit-log segment")
        qkey = (topic, qid)
        cl = self._cl
        with cl.lock:
            pending = self._pending  # only under the lock: the dispatcher swaps the list
            reserved = self._reserve(total, delivery)
            if reserved.__class__ is PutResult:
                return reserved  # type: ignore[return-value]
            seg, wrote, r = reserved  # type: ignore[misc]
            ts = max(self.clock.now_ms(), self._last_ts)
            self._last_ts = ts
            first_q = self._queue_table.get(qkey, 0)
            self._queue_table[qkey] = first_q + len(entries)
            first_phys = wrote
            r, wrote, _ = append_run(seg.mm, r, wrote, first_q, ts, entries, topic, qid, pending)
            seg.written = r
            cl.wrote = wrote
        self._signal_dispatch()
        return first_phys, first_q, ts

    def _batch_result(self, first_phys: int, first_q: int, ts: int, sizes: list[int], total: int,
                      with_ids: bool = True) -> PutResult:
        ids = []
        if with_ids:
            prefix = self._msg_id_prefix
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
        MESSAGE_ILLEGAL. Being the delivery path's put, it is not refused for ``disk_full`` (_reserve).
        It is ``prepare_records`` then ``put_prepared``."""
        preps = self.prepare_records(topic, queue_id, records)
        if preps.__class__ is PutResult:
            return preps  # type: ignore[return-value]
        return self.put_prepared(topic, queue_id, preps)  # type: ignore[arg-type]

    def prepare_records(self, topic: str, queue_id: int,
                        records: list[tuple[bytes | bytearray | memoryview, int, int, dict[str, str]]]
                        ) -> list[tuple] | PutResult:
        """The first half of put_records, which touches no store state: each record's copy encoded for
        ``topic``/``queue_id`` (an opaque entry for ``put_prepared``), or the refusal of the batch. The
        timer prepares the messages about to fall due this way, so that at their moment only the append
        is left."""
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
            preps.append((rec, tc, delay, keys_l, uniq))
        return preps

    def put_prepared(self, topic: str, queue_id: int, entries: list[tuple], with_ids: bool = True
                     ) -> PutResult:
        """The second half of put_records: append entries that ``prepare_records`` made for this
        ``topic``/``queue_id`` (any subset of them, in any grouping). ``with_ids=False``: the result
        carries no message ids (the timer's deliveries need none)."""
        if not entries:
            return self._fail(PutStatus.MESSAGE_ILLEGAL, "an empty batch")
        sizes = [len(p[0]) for p in entries]
        total = sum(sizes)
        placed = self._append_run(topic, queue_id, entries, total, True)
        if placed.__class__ is PutResult:
            return placed  # type: ignore[return-value]
        first_phys, first_q, ts = placed  # type: ignore[misc]
        return self._batch_result(first_phys, first_q, ts, sizes, total, with_ids)

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
                if r + 8 > seg.allocated:
                    seg.allocate(r + 8)  # a store into an unallocated page of a full disk is a SIGBUS
                BLANK_HEAD.pack_into(seg.mm, r, rest, BLANK_MAGIC)
            seg.written = self._seg_size
            start = seg.end
        existing = cl.segment_for(start)
        new = existing if existing is not None else cl.new_segment(start)
        faults.point("commitlog.roll")
        cl.wrote = start
        self._cur_seg = new
        return new
