"""The schedule path of TimerStore (a base class of it, sharing its state): validate and encode
outside the lock, then under ``self.lock`` write the message bytes, the key hash entries, the index
entries and the wheel heads, in that order (recovery relies on it), and hand entries for slots already
in memory to the window. Rules: validation is all-or-nothing before anything is written; a failed
write marks what it wrote FAILED and raises TimerUnavailable.
"""

from __future__ import annotations

import heapq
import json
import uuid
import zlib
from collections.abc import Callable, Iterable

from chronomq.message import (
    PROPERTY_KEYS,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageFormatError,
    encode_record,
    validate_topic,
)
from chronomq.store.atomicfile import write_atomic
from chronomq.store.speedups import native

from .files import add_key_items
from .records import (
    _I32,
    _IDX_BODY,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    FAILED,
    IDX_SIZE,
    OFF_STATE,
    PENDING,
    TIMER_OFFSET_FLAG,
    Item,
)
from .state import TimerState
from .types import ScheduleResult, TimerError, TimerRefused, TimerUnavailable

# the compiled encoder when it is built (chronomq.store.speedups); message.encode_record is its reference
_encode_record = native.encode_record if native is not None else encode_record


class AppendPath(TimerState):
    def _topic_id(self, topic: str) -> int:
        tid = self.topics.get(topic)
        if tid is None:
            tid = len(self.topics) + 1
            # on disk before any record names it: a failed write (disk full) leaves no id in use
            write_atomic(self.root / "topics.json", json.dumps({**self.topics, topic: tid}).encode(),
                         backup=True)
            self.topics[topic] = tid
            self.topic_names[tid] = topic
        return tid

    def topic_name(self, tid: int) -> str:
        return self.topic_names.get(tid, f"#{tid}")

    def check_deliver_ms(self, deliver_ms: int, now_ms: int | None = None) -> None:
        now = self.clock.now_ms() if now_ms is None else now_ms
        if deliver_ms - now > self.cfg.max_delay_ms:
            raise TimerRefused(
                f"deliver time {deliver_ms} is {(deliver_ms - now) / 86_400_000:.2f} days ahead; the maximum "
                f"delay is {self.cfg.max_delay_ms / 86_400_000:g} days (timerMaxDelaySec="
                f"{self.cfg.max_delay_ms // 1000})")

    def schedule(self, msg: MessageExt, deliver_ms: int) -> ScheduleResult:
        return self.schedule_batch([(msg, deliver_ms)])[0]

    def schedule_batch(self, items: Iterable[tuple[MessageExt, int]], origin: int = -1
                       ) -> list[ScheduleResult]:
        """Park messages until their deliver times. Each message is stored as given (its real topic
        and queue id); UNIQ_KEY is generated when missing. All-or-nothing validation: raises TimerError
        (TimerRefused beyond the maximum delay) before anything is written. ``origin`` goes into each
        record's header: -1, or on a slave the commit-log offset of the journal record it came from."""
        items = list(items)
        now = self.clock.now_ms()
        encoded: list[tuple[MessageExt, int, bytearray]] = []
        valid_topic = None
        latest = now + self.cfg.max_delay_ms
        for msg, deliver_ms in items:
            if not isinstance(deliver_ms, int) or deliver_ms < 0:
                raise TimerError(f"deliver time {deliver_ms!r} is not a non-negative integer (epoch ms)")
            if deliver_ms > latest:
                self.check_deliver_ms(deliver_ms, now)  # raises TimerRefused
            if msg.topic is not valid_topic:  # a batch has one topic: checked once
                reason = validate_topic(msg.topic)
                if reason:
                    raise TimerError(reason)
                valid_topic = msg.topic
            if not msg.properties.get(PROPERTY_UNIQ_KEY):
                msg.properties[PROPERTY_UNIQ_KEY] = uuid.uuid4().hex.upper()
            msg.properties[PROPERTY_TIMER_DELIVER_MS] = str(deliver_ms)
            try:
                rec = _encode_record(msg)
            except MessageFormatError as e:
                raise TimerError(f"message cannot be stored: {e}") from e
            if DATA_HDR_SIZE + len(rec) > self.data_seg:
                raise TimerError(f"message of {len(rec)} bytes is larger than a timer data segment")
            encoded.append((msg, deliver_ms, rec))
        with self.lock:
            self._require_open()
            start_pos = self.data_end
            try:
                return self._append(encoded, now, origin)
            except OSError as e:  # disk full, I/O error: nothing was acknowledged
                self._abandon_records(start_pos)
                raise TimerUnavailable(f"the timer store could not write: {e.strerror or e}") from e

    def _abandon_records(self, start_pos: int) -> None:
        """After a failed append: mark records written from ``start_pos`` on that no index entry
        names as FAILED, so they never pin their segment (best effort: the disk may be failing)."""
        pos = start_pos
        try:
            while pos < self.data_end:
                hdr = self.data.read(pos, DATA_HDR_SIZE)
                if len(hdr) < DATA_HDR_SIZE or DATA_HDR.unpack(hdr)[0] != DATA_MAGIC:
                    pos = self.data.seg_start(pos) + self.data_seg
                    continue
                h = DATA_HDR.unpack(hdr)
                if h[2] == PENDING:
                    self.data.patch(pos + OFF_STATE, _I32.pack(FAILED))
                    self.pending[h[10]] -= 1
                pos += h[1]
        except OSError:
            pass

    def _append(self, encoded: list[tuple[MessageExt, int, bytearray]], now: int, origin: int = -1
                ) -> list[ScheduleResult]:
        # 1. message bytes  2. key hash entries  3. index entries (with chain links)  4. wheel heads.
        # A crash between steps leaves unreachable bytes that recovery trims; see the module docs.
        topics = self.topics
        # new topics numbered in the order they first appear (the same on every replica)
        tids = {t: topics.get(t) or self._topic_id(t)
                for t in dict.fromkeys(msg.topic for msg, _d, _r in encoded)}
        placed: list[tuple[int, int, int, int]] = []  # pos, size, deliver, topic id
        hash_items: list[tuple[int, int]] = []
        results: list[ScheduleResult] = []
        writes, end = pack_timer_records(encoded, tids, now, origin, self.data_end, self.data_seg, placed,
                                         hash_items, results, ScheduleResult, self.offset_id_prefix())
        for chunk_pos, chunk in writes:
            self.data.write(chunk_pos, chunk)
        self.data_end = end
        for (_p, _size, _deliver, tid) in placed:
            self.pending[tid] += 1
        self.hash.add_many(hash_items)
        floor = self._floor_slot()
        links = [(deliver, p, 0, tid, size) for (p, size, deliver, tid) in placed]
        self._add_index_entries(links, floor)
        self.dirty = True
        return results

    def _add_index_entries(self, links: list[tuple[int, int, int, int, int]], floor: int) -> None:
        """links: (deliver_ms, data pos, gen, topic id, size). Writes the entries, then moves the wheel
        heads, then hands entries for slots already in memory to the window."""
        start_idx = self.index_end
        cur, nxt = self.cur, self.nxt
        hot = nxt.slot if nxt is not None else (cur.slot if cur is not None else -1)
        buf, heads, items, min_deliver = pack_index_entries(links, floor, self.slot_ms, start_idx,
                                                            self.idx_seg_entries, self.idx_seg_max, hot,
                                                            self.wheel.get)
        idx = start_idx + len(links)
        self.wheel.reserve(heads)  # a full disk fails here, before the index entries are written
        # write, split at index segment boundaries
        off = 0
        i = start_idx
        while off < len(buf):
            room_entries = self.idx_seg_entries - i % self.idx_seg_entries
            n = min(room_entries, (len(buf) - off) // IDX_SIZE)
            self.index.write(i * IDX_SIZE, memoryview(buf)[off : off + n * IDX_SIZE])
            off += n * IDX_SIZE
            i += n
        self.index_end = idx
        for slot, head in heads.items():
            self.wheel.set(slot, head)
        for slot, item in items:
            if cur is not None and slot == cur.slot:
                heapq.heappush(cur.late, item)
            elif nxt is not None and slot == nxt.slot:
                if nxt.started:
                    heapq.heappush(nxt.late, item)
            elif nxt is not None and slot < nxt.slot:
                self.nxt = nxt = None  # a nearer slot appeared: find it again
        self.scan_empty_from = None
        if min_deliver is not None and self.wakeup is not None:
            self.wakeup(min_deliver)


def pack_timer_records_py(encoded: list[tuple[MessageExt, int, bytearray]], tids: dict[str, int], now: int,
                          origin: int, pos: int, seg_size: int, placed: list[tuple[int, int, int, int]],
                          hash_items: list[tuple[int, int]], results: list[ScheduleResult],
                          result_cls: type[ScheduleResult], id_prefix: str
                          ) -> tuple[list[tuple[int, bytearray]], int]:
    """The data log bytes of ``encoded`` [(message, deliver_ms, encoded record)] from position ``pos``:
    a PENDING header and the record each, no record across a segment boundary. Appends (position,
    size, deliver_ms, topic id) to ``placed``, the key hash entries to ``hash_items`` and a
    ``result_cls`` per message to ``results``; returns the writes [(position, bytes)] and the end."""
    writes: list[tuple[int, bytearray]] = []
    crc32 = zlib.crc32
    hdr_pack = DATA_HDR.pack
    chunk = bytearray()
    chunk_pos = pos
    for msg, deliver_ms, rec in encoded:
        size = DATA_HDR_SIZE + len(rec)
        if seg_size - pos % seg_size < size:
            if chunk:
                writes.append((chunk_pos, chunk))
                chunk = bytearray()
            pos = pos - pos % seg_size + seg_size
            chunk_pos = pos
        tid = tids[msg.topic]
        chunk += hdr_pack(DATA_MAGIC, size, PENDING, 0, deliver_ms, 0, now, origin, 0, crc32(rec) - (1 << 31),
                          tid)
        chunk += rec
        placed.append((pos, size, deliver_ms, tid))
        props = msg.properties
        uniq = props[PROPERTY_UNIQ_KEY]
        add_key_items(hash_items, uniq, props.get(PROPERTY_KEYS), pos)
        results.append(result_cls(uniq, f"{id_prefix}{TIMER_OFFSET_FLAG | pos:016X}", deliver_ms, pos))
        pos += size
    if chunk:
        writes.append((chunk_pos, chunk))
    return writes, pos


def pack_index_entries_py(links: list[tuple[int, int, int, int, int]], floor: int, slot_ms: int,
                          start_idx: int, per_seg: int, seg_max: dict[int, int], hot: int,
                          wheel_get: Callable[[int], int]
                          ) -> tuple[bytearray, dict[int, int], list[tuple[int, Item]], int | None]:
    """The index entries of ``links`` [(deliver_ms, data pos, gen, topic id, size)] numbered from
    ``start_idx``, each linked to the previous head of its slot (from ``wheel_get`` or an earlier link
    of the run; a slot below ``floor`` is ``floor``). Raises ``seg_max`` (the highest slot of each index
    segment of ``per_seg`` entries) where needed. Returns the bytes, the new slot heads (entry + 1),
    the (slot, item) of slots up to ``hot`` (already in memory) and the earliest deliver time."""
    heads: dict[int, int] = {}
    buf = bytearray()
    items: list[tuple[int, Item]] = []
    body_pack = _IDX_BODY.pack
    i32 = _I32.pack
    crc32 = zlib.crc32
    min_deliver = None
    idx = start_idx
    for deliver, pos, gen, tid, size in links:
        slot = deliver // slot_ms
        if slot < floor:
            slot = floor
        prev = heads.get(slot)
        if prev is None:
            prev = wheel_get(slot)
        body = body_pack(deliver, pos, prev, slot, gen, tid, size)
        buf += body
        buf += i32(crc32(body) - (1 << 31))
        heads[slot] = idx + 1
        seg = idx // per_seg
        m = seg_max.get(seg)
        if m is None or slot > m:
            seg_max[seg] = slot
        if slot <= hot:
            items.append((slot, (deliver, idx, pos, gen, tid, size)))
        if min_deliver is None or deliver < min_deliver:
            min_deliver = deliver
        idx += 1
    return buf, heads, items, min_deliver


# the compiled kernels when built (chronomq.store.speedups); the functions above are their reference
pack_timer_records = native.pack_timer_records if native is not None else pack_timer_records_py
pack_index_entries = native.pack_index_entries if native is not None else pack_index_entries_py
