"""The put path of MessageStore (a base class of it, sharing its state): validate and encode outside
any lock; under the commit-log lock only assign the queue offset, physical offset and store time (never
going backwards), copy the record into the mapped segment, patch those fields in place and queue the
dispatch request; then signal the dispatcher and, under SYNC_FLUSH, ask for a group commit. Rules: a
record never spans two segments; nothing per message is added inside the lock; a refusal is raised as
``_Refused`` where it is found and answered as its PutResult by the public methods, so a caller never
sees an exception for a refused put.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import struct
import sys
import threading
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, TypeVar

from chronomq.levels import parked_delay_ms, queue_tags_code
from chronomq.message import (
    BLANK_MAGIC,
    MAGIC_V1,
    MAX_PROPERTIES_LENGTH,
    PROPERTY_DEDUP,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    PROPERTY_WAIT_STORE_MSG_OK,
    RECORD_FIXED_SIZE,
    SCHEDULE_TOPIC,
    MessageExt,
    pack_host,
    tags_code,
    validate_topic,
)
from chronomq.store import faults
from chronomq.store.allocate import ALLOCATE_AHEAD, AllocateMappedFileService
from chronomq.store.commitlog import (
    BLANK_HEAD,
    H16,
    HEAD,
    HOST_MASK,
    I64,
    PATCH,
    TOPIC_LEN,
    CommitLog,
    encode,
)
from chronomq.store.mapped import MappedFile, pwrite_all
from chronomq.store.speedups import crc32, kernels, pure_twin
from chronomq.store.types import AppendResult, DispatchRequest, EncodedRecord, PutResult, PutStatus

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.config import BrokerConfig
    from chronomq.store.consumequeue import ConsumeQueue

_POS_STORETIMESTAMP = 56
# Where a run of records goes to its segment: encoded into a scratch buffer and written with pwrite when
# it holds at least PWRITE_MIN bytes and starts within FLUSHED_ZONE of what the last flush wrote back,
# else copied into the mapping. A flush write-protects the mapped pages it cleans, and the mapping holds
# the pages ahead of the write position in large folios, so the next stores into that folio fault once
# per 4 KiB page, several µs each. A pwrite never faults, but each call goes through the file system's
# write path, updating the file's mtime (a journal handle) whenever the clock has moved on, and copies once
# more: worth it for a run of pages, not for a record (docs/store.md).
PWRITE_MIN = 4096
FLUSHED_ZONE = 2 * 1024 * 1024
SCRATCH_MAX = 4 * 1024 * 1024  # the scratch buffer kept between runs; a larger run gets one of its own
# The put path's records are built from a tuple of their fields with tuple.__new__: a C call, where
# calling a NamedTuple class runs its Python-level __new__ (about 150 ns more per record).
_new = tuple.__new__

K = TypeVar("K")
V = TypeVar("V")
PropertyFields = tuple[bytes, str | None, list[str] | None, str | None]
StoredRecord = tuple[bytes | bytearray | memoryview, int, int, dict[str, str]]  # see put_records


_LITTLE = sys.byteorder == "little"


def batch_msg_ids(prefix: str, first: int, sizes: list[int]) -> str:
    """The offset message ids, comma-joined, of records of ``sizes`` bytes written back to back from
    ``first``: ``prefix`` (the store host's hex) and each record's offset as 16 hex digits. One hex
    conversion of the offsets' big-endian bytes, no string per record."""
    offsets = array("Q", accumulate(sizes[:-1], initial=first))
    if _LITTLE:
        offsets.byteswap()
    return prefix + offsets.tobytes().hex(",", 8).upper().replace(",", "," + prefix)


@pure_twin("property_fields")
def property_fields_py(props: dict[str, str]) -> PropertyFields | int:
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


@pure_twin("append_run")
def append_run_py(mm: mmap.mmap | bytearray, r: int, wrote: int, qoff: int, ts: int,
                  entries: list[EncodedRecord], topic: str, qid: int, pending: list[DispatchRequest]
                  ) -> tuple[int, int, int]:
    """Copy encoded records into ``mm`` from byte ``r`` on (the commit log at offset ``wrote``), patching
    each one's queue offset (from ``qoff`` on), physical offset and store time ``ts``, and append its
    dispatch request to ``pending``. The caller has reserved the room (ValueError otherwise). Returns
    the next (r, wrote, qoff)."""
    patch = PATCH.pack_into
    i64 = I64.pack_into
    n = len(mm)
    for e in entries:
        rec = e.record
        size = len(rec)
        if r < 0 or r + (size if size > 64 else 64) > n:
            raise ValueError("a record does not fit the mapped segment")
        mm[r : r + size] = rec
        patch(mm, r + 20, qoff, wrote)
        i64(mm, r + _POS_STORETIMESTAMP, ts)
        tags = queue_tags_code(e.tags_hash, e.delay_ms, ts)
        pending.append(_new(DispatchRequest, (wrote, size, topic, qid, qoff, tags, ts, e.keys, e.uniq_key)))
        qoff += 1
        r += size
        wrote += size
    return r, wrote, qoff


_ITEM_HEAD = struct.Struct(">iiiii")  # a batch item's total, magic, crc, flag, body length
_ITEM_HEAD_SIZE = 20
_I16 = struct.Struct(">h")
_NAME_TAGS, _NAME_KEYS = PROPERTY_TAGS.encode(), PROPERTY_KEYS.encode()
_NAME_UNIQ, _NAME_DEDUP = PROPERTY_UNIQ_KEY.encode(), PROPERTY_DEDUP.encode()
# A batch as put_encoded takes it: the entries, each item's UNIQ_KEY when it asks for de-duplication
# (None when no item asks) and the items' body bytes.
EncodedBatch = tuple[list[EncodedRecord], list[str | None] | None, int]


@pure_twin("batch_records")
def batch_records_py(data: bytes | bytearray | memoryview, topic_b: bytes, queue_id: int, sys_flag: int,
                     born_ts: int, born_host_b: bytes, store_host_b: bytes, reconsume: int, stamps_b: bytes,
                     special: tuple[bytes, ...], max_body: int, max_record: int, tag_cache: dict[str, int]
                     ) -> EncodedBatch | None:
    """A SEND_BATCH_MESSAGE body (TOTALSIZE | MAGIC | BODYCRC | FLAG | BODYLEN | BODY | PROPLEN(int16) |
    PROPS, repeated) straight to the records ``encode`` would build for its items, in one pass: each
    item's properties text is stored as it came, closed by 0x02, followed by ``stamps_b`` (the broker's
    stamped properties, encoded). None when an item is anything but the plain case, for the general
    path to decide (it stores or refuses exactly as before): a malformed or empty body, a body over
    ``max_body``, properties that are not UTF-8 or not well formed (an empty item or name, a value with
    0x01, a name twice), a name in ``special`` (what admission, the timer or the stamps act on),
    properties over MAX_PROPERTIES_LENGTH, a record over ``max_record``. ``tag_cache[tags]`` is a TAGS
    text's hash. Returns (entries, the UNIQ_KEY of each item asking for de-duplication or None, None
    when no item asks; body bytes)."""
    n = len(data)
    if not n:
        return None
    entries: list[EncodedRecord] = []
    asks: list[str | None] = []
    asked = False
    bodies = 0
    sys_flag &= HOST_MASK
    tlen = TOPIC_LEN[len(topic_b)]
    pos = 0
    while pos < n:
        if n - pos < _ITEM_HEAD_SIZE + 2:
            return None
        total, _magic, _crc, flag, blen = _ITEM_HEAD.unpack_from(data, pos)
        if total < _ITEM_HEAD_SIZE + 2 or pos + total > n or blen < 0 or blen > total - _ITEM_HEAD_SIZE - 2 \
                or blen > max_body:
            return None
        p = pos + _ITEM_HEAD_SIZE
        body = bytes(data[p : p + blen])
        p += blen
        (plen,) = _I16.unpack_from(data, p)
        p += 2
        if plen < 0 or p + plen != pos + total:
            return None
        raw = bytes(data[p : p + plen])
        pos += total
        try:
            raw.decode()
        except UnicodeDecodeError:
            return None
        pieces = raw.split(b"\x02")
        if pieces[-1] == b"":
            pieces.pop()
        else:
            raw += b"\x02"
        names: set[bytes] = set()
        tags = keys = uniq = dedup = None
        for piece in pieces:
            i = piece.find(b"\x01")
            if i <= 0 or piece.find(b"\x01", i + 1) >= 0:
                return None
            name = piece[:i]
            if name in names or name in special:
                return None
            names.add(name)
            if name == _NAME_TAGS:
                tags = piece[i + 1 :].decode()
            elif name == _NAME_KEYS:
                keys = piece[i + 1 :].decode()
            elif name == _NAME_UNIQ:
                uniq = piece[i + 1 :].decode()
            elif name == _NAME_DEDUP:
                dedup = piece[i + 1 :]
        props_b = raw + stamps_b
        if len(props_b) > MAX_PROPERTIES_LENGTH:
            return None
        size = RECORD_FIXED_SIZE + blen + len(topic_b) + len(props_b)
        if size > max_record:
            return None
        head = HEAD.pack(size, MAGIC_V1, crc32(body) & 0x7FFFFFFF, queue_id, flag, 0, 0, sys_flag, born_ts,
                         born_host_b, 0, store_host_b, reconsume, 0, blen)
        rec = b"".join((head, body, tlen, topic_b, H16.pack(len(props_b)), props_b))
        keys_l = [k for k in keys.split(" ") if k] if keys else None
        entries.append(_new(EncodedRecord, (rec, tag_cache[tags] if tags else 0, None, keys_l, uniq)))
        ask = uniq if dedup == b"true" and uniq else None
        asked = asked or ask is not None
        asks.append(ask)
        bodies += blen
    return entries, asks if asked else None, bodies


class _Cache(dict[K, V]):
    """A dict that makes a missing value with ``make`` (which may raise) and holds at most ``limit``
    entries (then it starts again empty)."""

    def __init__(self, make: Callable[[K], V], limit: int) -> None:
        super().__init__()
        self._make = make
        self._limit = limit

    def __missing__(self, key: K) -> V:
        value = self._make(key)
        if len(self) > self._limit:
            self.clear()
        self[key] = value
        return value


def _topic_bytes(topic: str) -> bytes:
    """A topic's name encoded, once it is checked (_Refused when it is not a topic's)."""
    err = validate_topic(topic) if isinstance(topic, str) else "the topic is not a string"
    if err is not None:
        raise _Refused(PutStatus.MESSAGE_ILLEGAL, err)
    return topic.encode()


def _host_bytes(host: tuple[str, int]) -> bytes:
    """A born host packed as the record holds it (_Refused when it cannot be)."""
    try:
        return pack_host(host)
    except (TypeError, ValueError, struct.error) as e:
        raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"bad born host {host!r}: {e}") from None


class _Refused(Exception):
    """A put refused (nothing was written), raised where the refusal is found; the public methods answer
    with ``result``."""

    def __init__(self, status: PutStatus, error: str) -> None:
        super().__init__(error)
        self.result = PutResult(status, None, error)


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
    _pending: list[DispatchRequest]
    _cur_seg: MappedFile | None
    _last_ts: int
    _topic_cache: _Cache[str, bytes]
    _tag_cache: _Cache[str, int]
    _host_cache: _Cache[tuple[str, int], bytes]
    _alloc_wake: threading.Event
    _scratch: bytearray
    _allocator: AllocateMappedFileService
    _queues: dict[tuple[str, int], ConsumeQueue]
    _signal_dispatch: Callable[[], None]
    _request_flush: Callable[[int], concurrent.futures.Future[bool]]

    def _init_caches(self) -> None:
        """The put path's caches: a topic's bytes (checked once), a tags text's hash, a born host packed;
        and the scratch buffer runs are encoded into before their pwrite."""
        self._scratch = bytearray(64 * 1024)
        self._topic_cache = _Cache(_topic_bytes, 100_000)
        self._tag_cache = _Cache(tags_code, 100_000)
        self._host_cache = _Cache(_host_bytes, 10_000)

    def _prepare(self, msg: MessageExt) -> EncodedRecord:
        """Validate and encode one message (outside any lock); _Refused when nothing will be written, a
        message whose fields are of the wrong kind refused as malformed."""
        try:
            topic = msg.topic
            topic_b = self._topic_cache[topic]
            body = msg.body
            if body.__class__ is not bytes and not isinstance(body, bytearray | memoryview):
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, "the message body is not bytes")
            if len(body) > self._max_body:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"the message body is {len(body)} bytes, more "
                                                          f"than maxMessageSize={self._max_body}")
            qid = msg.queue_id
            if qid < 0 or qid > 0x7FFFFFFF:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"queue id {qid} out of range")
            props = msg.properties
            props_b, tags, keys, uniq = self._property_fields(props)
            born_b = self._host_cache[msg.born_host]
            try:
                buf = encode(msg, topic_b, props_b, self._store_host_b, born_b)
            except (struct.error, TypeError, ValueError) as e:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"cannot encode the message: {e}") from None
            if len(buf) > self._seg_size - 8:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"the record ({len(buf)} bytes) does not fit a "
                                                          f"commit-log segment ({self._seg_size} bytes)")
            delay = parked_delay_ms(topic, props, self._delay_levels)
            tags_hash = self._tag_cache[tags] if tags and delay is None else 0
            return _new(EncodedRecord, (buf, tags_hash, delay, keys, uniq))
        except (TypeError, ValueError, AttributeError, OverflowError, struct.error) as e:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"malformed message: {e}") from None

    def _reserve(self, size: int, delivery: bool = False) -> tuple[MappedFile, int, int]:
        """Under the commit-log lock: the segment, commit-log offset and in-segment position where
        ``size`` bytes go (rolling to a new segment and allocating disk as needed); _Refused when they
        cannot be had. A record never spans two segments. While the disk is full (``disk_full``) only a
        ``delivery`` (a parked delayed message coming due) may go on, as far as space allows. The
        bytes are allocated (zeros written) before they are returned, whichever way they are then
        written: the allocator thread zeros past ``allocated`` without the commit-log lock, so a write
        there would race with its zeros."""
        if not self._running:
            raise _Refused(PutStatus.SERVICE_NOT_AVAILABLE, "the message store is not running")
        if self.disk_full is not None and not delivery:
            raise _Refused(PutStatus.SERVICE_NOT_AVAILABLE, self.disk_full)
        seg = self._cur_seg
        wrote = self._cl.wrote
        r = wrote - seg.start if seg is not None else 0
        if seg is None or r + size + 8 > self._seg_size:
            try:
                seg = self._roll(seg, r)
            except OSError as e:
                raise _Refused(PutStatus.SERVICE_NOT_AVAILABLE,
                               f"cannot create a commit-log segment: {e}") from None
            wrote = seg.start
            r = 0
        if r + size + ALLOCATE_AHEAD // 2 > seg.allocated:
            if not self._alloc_wake.is_set():
                self._alloc_wake.set()
            if r + size > seg.allocated:  # the writer outran the allocator thread
                try:
                    seg.allocate(r + size)
                except OSError as e:
                    raise _Refused(PutStatus.SERVICE_NOT_AVAILABLE,
                                   f"cannot allocate commit-log space: {e}") from None
        return seg, wrote, r

    def _property_fields(self, props: dict[str, str]) -> PropertyFields:
        """The property_fields kernel, with its refusal raised as _Refused."""
        fields = kernels.property_fields(props)
        if not isinstance(fields, int):
            return fields
        if fields == 0:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL,
                           "a property has an empty name or contains a 0x01/0x02 separator")
        raise _Refused(PutStatus.PROPERTIES_SIZE_EXCEEDED,
                       f"the properties are {fields} bytes, more than {MAX_PROPERTIES_LENGTH}")

    def put_message(self, msg: MessageExt) -> PutResult:
        try:
            entry = self._prepare(msg)
            size = len(entry.record)
            wrote, qoff, ts = self._append_run(msg.topic, msg.queue_id, [entry], size)
        except _Refused as refused:
            return refused.result
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
            return PutResult(PutStatus.MESSAGE_ILLEGAL, None, "an empty batch")
        try:
            entries = [self._prepare(m) for m in msgs]
            topic, qid = msgs[0].topic, msgs[0].queue_id
            if any(m.topic != topic or m.queue_id != qid for m in msgs):
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, "a batch must be for one topic and one queue")
            sizes = [len(e.record) for e in entries]
            total = sum(sizes)
            first_phys, first_q, ts = self._append_run(topic, qid, entries, total)
        except _Refused as refused:
            return refused.result
        off = first_phys
        host = self.store_host
        for i, m in enumerate(msgs):
            size = sizes[i]
            m.queue_offset = first_q + i
            m.commit_log_offset = off
            m.store_size = size
            m.store_timestamp = ts
            m.store_host = host
            off += size
        return self._batch_result(first_phys, first_q, ts, sizes, total)

    def encode_batch(self, topic: str, queue_id: int, body: bytes | bytearray | memoryview, sys_flag: int,
                     born_ts: int, born_host: tuple[str, int], reconsume: int, stamps_b: bytes,
                     special: tuple[bytes, ...]) -> EncodedBatch | None:
        """A send's batch body encoded for ``put_encoded`` in one pass (the batch_records kernel: the
        records ``put_messages`` would write for its items, the items' properties followed by
        ``stamps_b``), or None when the batch is not the plain case and must go the general way
        (decoded into messages, ``put_messages``), which stores or refuses it as it always did."""
        if topic == SCHEDULE_TOPIC or queue_id.__class__ is not int or not 0 <= queue_id <= 0x7FFFFFFF \
                or not -0x80000000 <= sys_flag <= 0x7FFFFFFF or not -0x80000000 <= reconsume <= 0x7FFFFFFF \
                or not -(1 << 63) <= born_ts < (1 << 63):
            return None
        try:
            topic_b = self._topic_cache[topic]
            born_b = self._host_cache[born_host]
        except _Refused:
            return None
        return kernels.batch_records(body, topic_b, queue_id, sys_flag, born_ts, born_b, self._store_host_b,
                                     reconsume, stamps_b, special, self._max_body, self._seg_size - 8,
                                     self._tag_cache)

    def put_encoded(self, topic: str, queue_id: int, entries: list[EncodedRecord]) -> PutResult:
        """put_messages for the entries of ``encode_batch`` (all of them or any subset, in order): the
        same append, result and refusals."""
        if not entries:
            return PutResult(PutStatus.MESSAGE_ILLEGAL, None, "an empty batch")
        try:
            sizes = [len(e.record) for e in entries]
            total = sum(sizes)
            first_phys, first_q, ts = self._append_run(topic, queue_id, entries, total)
        except _Refused as refused:
            return refused.result
        return self._batch_result(first_phys, first_q, ts, sizes, total)

    def _append_run(self, topic: str, qid: int, entries: list[EncodedRecord], total: int,
                    delivery: bool = False) -> tuple[int, int, int]:
        """Append encoded records of one queue contiguously in one segment, with consecutive queue offsets,
        and queue their dispatch requests. Returns (first physical offset, first queue offset, store
        time); _Refused when they cannot go in. ``delivery``: see _reserve."""
        if total > self._seg_size - 8:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"the batch ({total} bytes) does not fit a commit-log "
                                                      "segment")
        qkey = (topic, qid)
        cl = self._cl
        with cl.lock:
            seg, wrote, r = self._reserve(total, delivery)
            ts = max(self.clock.now_ms(), self._last_ts)
            first_q = self._queue_table.get(qkey, 0)
            if total >= PWRITE_MIN and r < seg.flushed + FLUSHED_ZONE:
                reqs = self._pwrite_run(seg, r, wrote, first_q, ts, entries, topic, qid, total)
                self._pending.extend(reqs)  # only under the lock: the dispatcher swaps the list
                r += total
            else:
                pending = self._pending  # only under the lock: the dispatcher swaps the list
                r, _, _ = kernels.append_run(seg.mm, r, wrote, first_q, ts, entries, topic, qid, pending)
            self._last_ts = ts
            self._queue_table[qkey] = first_q + len(entries)
            seg.written = r
            cl.wrote = wrote + total
        self._signal_dispatch()
        return wrote, first_q, ts

    def _pwrite_run(self, seg: MappedFile, r: int, wrote: int, qoff: int, ts: int,
                    entries: list[EncodedRecord], topic: str, qid: int, total: int) -> list[DispatchRequest]:
        """Under the commit-log lock: ``append_run`` into a scratch buffer, written to the segment's file
        at ``r`` with pwrite; returns the run's dispatch requests. Nothing of the store's state changes
        before the write succeeded (_Refused otherwise)."""
        buf = self._scratch
        if len(buf) < total + 64:  # append_run wants room for a record's fixed fields past its end
            buf = bytearray(total + 64)
            if len(buf) <= SCRATCH_MAX:
                self._scratch = buf
        reqs: list[DispatchRequest] = []
        kernels.append_run(buf, 0, wrote, qoff, ts, entries, topic, qid, reqs)
        with memoryview(buf) as view:
            try:
                pwrite_all(seg.fd, view[:total], r)
            except OSError as e:
                raise _Refused(PutStatus.SERVICE_NOT_AVAILABLE, f"cannot write the commit log: {e}") from None
        return reqs

    def _batch_result(self, first_phys: int, first_q: int, ts: int, sizes: list[int], total: int,
                      with_ids: bool = True, flush: bool = True) -> PutResult:
        ids = batch_msg_ids(self._msg_id_prefix, first_phys, sizes) if with_ids and sizes else ""
        fut = self._request_flush(first_phys + total) if self._sync and flush else None
        result = AppendResult(first_phys, total, ids, first_q, ts, len(sizes))
        return PutResult(PutStatus.PUT_OK, result, None, fut)

    def put_records(self, topic: str, queue_id: int, records: list[StoredRecord]) -> PutResult:
        """put_messages for records the caller holds as stored bytes (a parked delayed message): each
        entry (buf, pos, size, properties) is the V1 record of ``size`` bytes at ``buf[pos:]`` and the
        properties its copy gets. The copy goes to ``topic``/``queue_id``; flag, sysFlag, born time and
        host, reconsume times and body are taken from the bytes without decoding the message (see
        commitlog.splice_py), so the record is byte for byte the one put_messages would store for the
        decoded message with those fields. Same checks, guarantees and result as put_messages
        (contiguous queue offsets, one segment, tagsCode / delay, index keys, SYNC_FLUSH future); the
        entries' properties dicts are not modified. A malformed record refuses the batch with
        MESSAGE_ILLEGAL. Being the delivery path's put, it is not refused for ``disk_full`` (_reserve).
        It is ``prepare_records`` then ``put_prepared``."""
        try:
            return self._put_prepared(topic, queue_id, self._prepare_records(topic, queue_id, records), True)
        except _Refused as refused:
            return refused.result

    def prepare_records(self, topic: str, queue_id: int, records: list[StoredRecord]
                        ) -> list[EncodedRecord] | PutResult:
        """The first half of put_records, which touches no store state: each record's copy encoded for
        ``topic``/``queue_id`` (an entry for ``put_prepared``), or the refusal of the batch. The timer
        prepares the messages about to fall due this way, so that at their moment only the append is
        left."""
        try:
            entries = self._prepare_records(topic, queue_id, records)
        except _Refused as refused:
            return refused.result
        if (topic, queue_id) not in self._queues:  # its first records: the queue's file made meanwhile
            self._allocator.prepare_queue(topic, queue_id)
        return entries

    def _prepare_records(self, topic: str, queue_id: int, records: list[StoredRecord]) -> list[EncodedRecord]:
        if not records:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL, "an empty batch")
        topic_b = self._topic_cache[topic]
        if queue_id.__class__ is not int or queue_id < 0 or queue_id > 0x7FFFFFFF:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"queue id {queue_id!r} out of range")
        max_body = self._max_body
        store_host_b = self._store_host_b
        levels = self._delay_levels
        tag_cache = self._tag_cache
        splice = kernels.splice
        entries = []
        for buf, pos, size, props in records:
            props_b, tags, keys, uniq = self._property_fields(props)
            try:
                rec, body_len = splice(buf, pos, size, topic_b, queue_id, props_b, store_host_b)
            except (ValueError, TypeError, struct.error) as e:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"not a stored record: {e}") from None
            if body_len > max_body:
                raise _Refused(PutStatus.MESSAGE_ILLEGAL, f"the message body is {body_len} bytes, more than "
                                                          f"maxMessageSize={max_body}")
            delay = parked_delay_ms(topic, props, levels)
            tags_hash = tag_cache[tags] if tags and delay is None else 0
            entries.append(_new(EncodedRecord, (rec, tags_hash, delay, keys, uniq)))
        return entries

    def put_prepared(self, topic: str, queue_id: int, entries: list[EncodedRecord], with_ids: bool = True,
                     flush: bool = True) -> PutResult:
        """The second half of put_records: append entries that ``prepare_records`` made for this
        ``topic``/``queue_id`` (any subset of them, in any grouping). ``with_ids=False``: the result
        carries no message ids (the timer's deliveries need none). ``flush=False``: under SYNC_FLUSH
        the put asks for no fdatasync of its own (``flushed`` is None); the group commit's next round
        covers it, and a caller that must order its own durable state after it calls
        ``sync_commit_log`` first (the timer's checkpoint does)."""
        try:
            return self._put_prepared(topic, queue_id, entries, with_ids, flush)
        except _Refused as refused:
            return refused.result

    def _put_prepared(self, topic: str, queue_id: int, entries: list[EncodedRecord], with_ids: bool,
                      flush: bool = True) -> PutResult:
        if not entries:
            raise _Refused(PutStatus.MESSAGE_ILLEGAL, "an empty batch")
        sizes = [len(e.record) for e in entries]
        total = sum(sizes)
        first_phys, first_q, ts = self._append_run(topic, queue_id, entries, total, True)
        return self._batch_result(first_phys, first_q, ts, sizes, total, with_ids, flush)

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

    def _roll(self, seg: MappedFile | None, r: int) -> MappedFile:
        """Under the commit-log lock: fill the rest of ``seg`` (from ``r``) with a blank record and open the
        next segment (the first one when ``seg`` is None)."""
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
