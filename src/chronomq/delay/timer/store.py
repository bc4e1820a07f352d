"""TimerStore: the synchronous, thread-safe core of the timer (on-disk format: docs/timer.md).

The asyncio delivery loop lives in ``service.py``; everything here can also be driven by hand
(``poll`` / ``deliver``), which is what the virtual-clock tests do.
"""

from __future__ import annotations

import bisect
import heapq
import json
import logging
import os
import struct
import threading
import uuid
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from chronomq.clock import Clock
from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_KEYS,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageFormatError,
    create_offset_msg_id,
    decode_offset_msg_id,
    decode_record,
    encode_record,
    validate_topic,
)
from chronomq.store.atomicfile import write_atomic
from chronomq.store.types import PutResult

from ..delivery import PutRaw, StorePuts, decode_to_put, put_groups, record_to_put
from ..histogram import Histogram
from .files import HashIndex, SegmentedFile, Wheel
from .props import TIMER_PROPERTIES
from .types import (
    OpResult,
    Outcome,
    PendingInfo,
    QueryPage,
    ScheduleResult,
    TimerConfig,
    TimerError,
    TimerRefused,
)

log = logging.getLogger(__name__)

# --- data record: a 64-byte header + the message in the stored V1 record layout ---------------------------
DATA_MAGIC = 0x54494D52  # "TIMR"
DATA_HDR = struct.Struct("<iiiiqqqqqii")
DATA_HDR_SIZE = DATA_HDR.size  # 64
OFF_STATE = 8
OFF_GEN = 12
OFF_DELIVER = 16
OFF_DONE = 24  # done_ms, created_ms, origin, done_seq: rewritten together
_DONE_BLOCK = struct.Struct("<qqqq")
_STATE_BLOCK = struct.Struct("<iiqqqqq")  # state, gen, deliver, done_ms, created, origin, done_seq
_DONE_ENTRY = struct.Struct("<q48s")  # done.log: data position + the state block to write there
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")

PENDING, DELIVERED, CANCELLED, MOVED, FAILED = 0, 1, 2, 3, 4

# --- index entry: one per schedule or reschedule ----------------------------------------------------------
IDX = struct.Struct("<qqqqiiii")  # deliver_ms, data_pos, prev+1, slot, gen, topic_id, size, crc
IDX_SIZE = IDX.size  # 48
_IDX_BODY = struct.Struct("<qqqqiii")

TIMER_OFFSET_FLAG = 1 << 62  # marks an offset msgId that names a timer data position
_SEQ_JUMP = 1 << 40  # done_seq numbers of a run after a crash start this far above the checkpoint's

Item = tuple[int, int, int, int, int, int]  # deliver_ms, index entry, data pos, gen, topic id, size
# batch index, message to put (or put_records entry: buffer, position, size, properties), header, item
_Taken = tuple[int, Any, tuple[int, ...], Item]


def _pack_index(deliver: int, pos: int, prev: int, slot: int, gen: int, topic: int, size: int) -> bytes:
    body = _IDX_BODY.pack(deliver, pos, prev, slot, gen, topic, size)
    return body + _I32.pack(zlib.crc32(body) - (1 << 31))


def _unpack_index(raw: bytes) -> tuple[int, int, int, int, int, int, int] | None:
    if len(raw) < IDX_SIZE:
        return None
    *body, crc = IDX.unpack(raw)
    if zlib.crc32(raw[: IDX_SIZE - 4]) - (1 << 31) != crc:
        return None
    return tuple(body)  # type: ignore[return-value]


class _Slot:
    """One slot's entries in memory: the chain read from disk (sorted) plus late arrivals (a heap)."""

    __slots__ = ("cursor", "d", "g", "head", "i", "inflight", "late", "p", "ready", "s", "slot", "started",
                 "t", "walk")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.started = False
        self.ready = False
        self.walk = 0
        self.head = 0
        self.d = array("q")
        self.i = array("q")
        self.p = array("q")
        self.g = array("i")
        self.t = array("i")
        self.s = array("i")
        self.cursor = 0
        self.late: list[Item] = []
        self.inflight = 0

    def start(self, head: int) -> None:
        self.started = True
        self.head = head
        self.walk = head

    def step(self, index: SegmentedFile, budget: int) -> None:
        d, i, p, g, t, s = self.d, self.i, self.p, self.g, self.t, self.s
        cur = self.walk
        # A chain written by one schedule_batch runs through adjacent entries: after a link to the
        # entry just before, read the next up-to-256 entries (same index segment) in one pread.
        blk = b""
        blk_lo = blk_n = 0
        seg_entries = index.segment_size // IDX_SIZE
        adjacent = False
        while cur and budget > 0:
            budget -= 1
            e_no = cur - 1
            rel = e_no - blk_lo
            if 0 <= rel < blk_n:
                raw = blk[rel * IDX_SIZE : (rel + 1) * IDX_SIZE]
            elif adjacent:
                blk_lo = max(e_no - 255, e_no - e_no % seg_entries)
                blk = index.read(blk_lo * IDX_SIZE, (e_no - blk_lo + 1) * IDX_SIZE)
                blk_n = len(blk) // IDX_SIZE
                rel = e_no - blk_lo
                raw = blk[rel * IDX_SIZE : (rel + 1) * IDX_SIZE]
            else:
                raw = index.read(e_no * IDX_SIZE, IDX_SIZE)
            e = _unpack_index(raw)
            if e is None or e[3] != self.slot or e[2] >= cur:
                log.error("timer index chain of slot %d broken at entry %d; rest of the chain skipped",
                          self.slot, cur - 1)
                cur = 0
                break
            d.append(e[0])
            i.append(cur - 1)
            p.append(e[1])
            g.append(e[4])
            t.append(e[5])
            s.append(e[6])
            adjacent = e[2] == cur - 1
            cur = e[2]
        self.walk = cur
        if cur == 0:
            n = len(d)
            # The chain runs newest first: reversed, entry numbers ascend, and a stable sort by deliver
            # time then orders by (deliver time, entry number) with plain int keys (no tuples).
            for arr in (d, i, p, g, t, s):
                arr.reverse()
            order = sorted(range(n), key=d.__getitem__)
            self.d = array("q", (d[k] for k in order))
            self.i = array("q", (i[k] for k in order))
            self.p = array("q", (p[k] for k in order))
            self.g = array("i", (g[k] for k in order))
            self.t = array("i", (t[k] for k in order))
            self.s = array("i", (s[k] for k in order))
            self.ready = True

    def peek(self) -> tuple[int, int] | None:
        a = (self.d[self.cursor], self.i[self.cursor]) if self.cursor < len(self.d) else None
        b = (self.late[0][0], self.late[0][1]) if self.late else None
        if a is None:
            return b
        if b is None:
            return a
        return min(a, b)

    def pop(self) -> Item:
        c = self.cursor
        if self.late and (c >= len(self.d) or (self.late[0][0], self.late[0][1]) < (self.d[c], self.i[c])):
            return heapq.heappop(self.late)
        self.cursor = c + 1
        return (self.d[c], self.i[c], self.p[c], self.g[c], self.t[c], self.s[c])

    def exhausted(self) -> bool:
        return self.cursor >= len(self.d) and not self.late

    def entries(self) -> int:
        return len(self.d) - self.cursor + len(self.late)


class TimerStore:
    def __init__(self, root: str | Path, clock: Clock, config: TimerConfig | None = None,
                 store_host: tuple[str, int] = ("127.0.0.1", 10911)) -> None:
        self.root = Path(root)
        self.clock = clock
        self.cfg = config or TimerConfig()
        self.cfg.validate()
        self.store_host = store_host
        self.lock = threading.RLock()
        self._ckpt_lock = threading.Lock()
        self._ckpt_seq = 0
        self._ckpt_written = 0
        self.wakeup: Callable[[int], None] | None = None  # called with a deliver time that may be earlier
        self._opened = False
        self._id_prefix: str | None = None
        self.scan_chunk = 4 << 20  # bytes per read when retention scans a data segment

    # ============================================================================ open / recovery / close
    def open(self) -> None:
        with self.lock:
            self._open()

    def _open(self) -> None:
        cfg = self.cfg
        self.root.mkdir(parents=True, exist_ok=True)
        self.slot_ms = cfg.slot_ms
        ckpt_path = self.root / "checkpoint.json"
        abort_path = self.root / "abort"
        ckpt: dict[str, Any] | None = None
        if ckpt_path.exists():
            try:
                ckpt = json.loads(ckpt_path.read_text())
            except (OSError, ValueError) as e:
                raise TimerError(f"timer checkpoint {ckpt_path} is unreadable: {e}") from e
        fresh = ckpt is None
        clean = ckpt is not None and not abort_path.exists()
        if ckpt is None:
            ckpt = {"watermark": self.clock.now_ms() // cfg.slot_ms - 1, "index_end": 0, "data_end": 0,
                    "done_seq": 0, "pending": {}, "idx_seg_max": {}, "slot_ms": cfg.slot_ms,
                    "data_segment_bytes": cfg.data_segment_bytes,
                    "index_segment_entries": cfg.index_segment_entries}
        # Geometry of existing files wins over the configuration (it is baked into the files).
        self.data_seg = int(ckpt.get("data_segment_bytes", cfg.data_segment_bytes))
        self.idx_seg_entries = int(ckpt.get("index_segment_entries", cfg.index_segment_entries))
        old_slot_ms = int(ckpt.get("slot_ms", cfg.slot_ms))

        self.topics: dict[str, int] = {}
        tpath = self.root / "topics.json"
        if tpath.exists():
            self.topics = json.loads(tpath.read_text())
        self.topic_names = {v: k for k, v in self.topics.items()}
        self.data = SegmentedFile(self.root / "data", self.data_seg)
        self.index = SegmentedFile(self.root / "index", self.idx_seg_entries * IDX_SIZE)
        self.wheel = Wheel(self.root / "wheel", cfg.slot_ms)
        self.hash = HashIndex(self.root / "hash", cfg.hash_buckets, cfg.hash_generation_entries)

        self._ckpt_seq = self._ckpt_written = int(ckpt.get("seq", 0))
        self.watermark = int(ckpt["watermark"])
        if old_slot_ms != cfg.slot_ms:
            self.watermark = (self.watermark + 1) * old_slot_ms // cfg.slot_ms - 1
        self.persisted_watermark = self.watermark
        self.pending: Counter[int] = Counter({int(k): v for k, v in ckpt.get("pending", {}).items()})
        self.idx_seg_max: dict[int, int] = {int(k): v for k, v in ckpt.get("idx_seg_max", {}).items()}
        recovered_seq = int(ckpt.get("done_seq", 0))
        self.done_seq = recovered_seq + (1 if clean else _SEQ_JUMP)
        # Sequence ranges of completions that happened after a checkpoint and before a crash: their
        # records are subtracted from the pending counters when their slots are walked again. A range
        # stays open (and persisted) until the watermark passes every slot that crashed run touched.
        self.open_ranges: list[list[int]] = [list(r) for r in ckpt.get("open_ranges", [])]
        if not clean and not fresh:
            frontier = (self.clock.now_ms() + cfg.preload_ms) // cfg.slot_ms + 1
            self.open_ranges.append([recovered_seq, self.done_seq, frontier])
        self.recovered_clean = clean or fresh

        ck_index_end = int(ckpt["index_end"])
        ck_data_end = int(ckpt["data_end"])
        file_idx_end = self.index.file_end() // IDX_SIZE
        if clean:
            self.index_end = ck_index_end
            self.data_end = ck_data_end
            if file_idx_end > ck_index_end or self.data.file_end() > ck_data_end:
                clean = False  # files longer than the checkpoint says: treat as a crash
        if not clean:
            self._recover_tail(min(ck_index_end, file_idx_end), ck_data_end)
        if old_slot_ms != cfg.slot_ms or (not clean and self.wheel.max_value() > self.index_end):
            self._rebuild_wheel()

        self.cur: _Slot | None = None
        self.nxt: _Slot | None = None
        self.scan_empty_from: int | None = None
        self.hist: dict[int, Histogram] = {}
        self.delivered = 0
        self.cancelled = 0
        self.rescheduled = 0
        self.failed = 0
        self.put_retries = 0
        self.early = 0
        self.stale_skipped = 0
        self.data_recheck: dict[int, int] = {}
        # Deliveries are recorded in memory (an overlay on the record headers) and appended to
        # done.log once per batch; the flush thread later writes them into the records and truncates
        # the log. Marking each record in place at delivery cost an ext4 journal transaction per
        # message (dirtying a clean page), 50-100 us under I/O contention.
        self._marks: dict[int, tuple[int, int, int, bytes]] = {}  # pos -> state, done_ms, seq, block
        self._mark_buf = bytearray()
        # Two logs: the flush swaps them, applies the full one and empties it.
        self._done_fds = [os.open(self.root / f"done.{k}.log", os.O_RDWR | os.O_CREAT, 0o644) for k in (0, 1)]
        self._done_fd = self._done_fds[0]
        self._apply_done_log()
        self.dirty = True
        abort_path.write_bytes(b"")
        self._opened = True
        self._write_checkpoint(clean=False)

    def _recover_tail(self, tail_start: int, ck_data_end: int) -> None:
        """After a crash: validate index entries written since the checkpoint, cut torn tails, re-link
        entries the wheel missed, recount schedules, and drop message bytes no entry names."""
        idx = tail_start
        data_end = ck_data_end
        file_end_idx = self.index.file_end() // IDX_SIZE
        data_file_end = self.data.file_end()
        relinked = 0
        while idx < file_end_idx:
            e = _unpack_index(self.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                break
            _deliver, pos, prev, slot, gen, topic, size = e
            if pos + size > data_file_end or prev > idx:
                break
            hdr = self.data.read(pos, DATA_HDR_SIZE)
            if len(hdr) < DATA_HDR_SIZE or DATA_HDR.unpack(hdr)[0] != DATA_MAGIC:
                break
            head = self.wheel.get(slot)
            if head < idx + 1:
                if head != prev:
                    log.warning("timer wheel slot %d inconsistent after crash; rebuilding", slot)
                self.wheel.set(slot, idx + 1)
                relinked += 1
            if gen == 0:
                self.pending[topic] += 1
            seg = idx // self.idx_seg_entries
            self.idx_seg_max[seg] = max(self.idx_seg_max.get(seg, slot), slot)
            data_end = max(data_end, pos + size)
            idx += 1
        self.index_end = idx
        self.index.truncate(idx * IDX_SIZE)
        self.data_end = data_end
        self.data.truncate(data_end)
        if relinked:
            log.info("timer recovery re-linked %d index entries", relinked)

    def _rebuild_wheel(self) -> None:
        """Rebuild every slot chain from the retained index entries (slot size changed, or damage)."""
        log.warning("timer: rebuilding the time wheel from the index")
        self.wheel.clear()
        floor = self.watermark + 1
        heads: dict[int, int] = {}
        seg_max: dict[int, int] = {}
        start = self.index.min_pos // IDX_SIZE
        buf = bytearray()
        for idx in range(start, self.index_end):
            e = _unpack_index(self.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                continue
            deliver, pos, _prev, _slot, gen, topic, size = e
            slot = max(deliver // self.slot_ms, floor)
            prev = heads.get(slot, 0)
            buf = bytearray(_pack_index(deliver, pos, prev, slot, gen, topic, size))
            self.index.write(idx * IDX_SIZE, buf)
            heads[slot] = idx + 1
            seg = idx // self.idx_seg_entries
            seg_max[seg] = max(seg_max.get(seg, slot), slot)
        for slot, head in heads.items():
            self.wheel.set(slot, head)
        self.idx_seg_max = seg_max

    def _apply_done_log(self) -> None:
        """At open: write every mark of both done logs into its record (idempotent: a delivered
        record never changes again), then empty the logs."""
        n = 0
        sizes = [os.fstat(fd).st_size for fd in self._done_fds]
        for fd, size in zip(self._done_fds, sizes, strict=True):
            raw = os.pread(fd, size, 0) if size else b""
            for off in range(0, len(raw) - len(raw) % _DONE_ENTRY.size, _DONE_ENTRY.size):
                pos, block = _DONE_ENTRY.unpack_from(raw, off)
                if self.data.min_pos <= pos < self.data_end and \
                        self.data.write_existing(pos + OFF_STATE, block):
                    n += 1
        if any(sizes):
            self.data.sync()
            for fd in self._done_fds:
                os.ftruncate(fd, 0)
                os.fsync(fd)
            log.info("timer: applied %d delivery marks from the done logs", n)
        self._done_end = 0

    def _commit_marks(self) -> None:
        """Append the marks of the last batch to done.log (one pwrite): from here a process crash
        no longer loses them."""
        if self._mark_buf:
            os.pwrite(self._done_fd, self._mark_buf, self._done_end)
            self._done_end += len(self._mark_buf)
            self._mark_buf = bytearray()

    def _overlay(self, pos: int, h: tuple[int, ...]) -> tuple[int, ...]:
        m = self._marks.get(pos)
        if m is None:
            return h
        return (h[0], h[1], m[0], h[3], h[4], m[1], h[6], h[7], m[2], h[9], h[10])

    def close(self) -> None:
        """Flush everything and write a clean checkpoint."""
        with self.lock:
            if not self._opened:
                return
            # Whatever was taken into memory but not delivered stays pending on disk; make sure the
            # watermark never passes a slot still held in memory.
            self.flush(clean=True)
            for fd in self._done_fds:
                os.close(fd)
            self.data.close()
            self.index.close()
            self.wheel.close()
            self.hash.close()
            (self.root / "abort").unlink(missing_ok=True)
            self._opened = False

    def abandon(self) -> None:
        """Drop the store without flushing (tests: a simulated process crash)."""
        with self.lock:
            for fd in self._done_fds:
                os.close(fd)
            self.data.close()
            self.index.close()
            self.wheel.close()
            self.hash.close()
            self._opened = False

    def _fds_to_sync(self) -> list[int]:
        return (self.data.take_dirty_fds() + self.index.take_dirty_fds() + self.hash.all_fds()
                + self.wheel.all_fds())

    @staticmethod
    def _fsync_all(fds: list[int]) -> None:
        for fd in fds:
            try:
                os.fsync(fd)
            except OSError:  # closed meanwhile (retention deleted the file): nothing left to sync
                pass

    def sync_files(self) -> None:
        """fsync the logs (what SYNC_FLUSH needs before acknowledging a schedule). The fsyncs run
        outside the lock, so deliveries and schedules go on meanwhile."""
        with self.lock:
            fds = self._fds_to_sync()
        self._fsync_all(fds)

    def flush(self, clean: bool = False) -> None:
        """fsync everything written so far, then write a checkpoint describing exactly that state.
        Safe to call from a worker thread while the loop keeps delivering."""
        with self.lock:
            self._commit_marks()
            marks = list(self._marks.items())
            full_fd = self._done_fd  # everything in ``marks`` is in this log (or an older, applied one)
            self._done_fd = self._done_fds[1] if full_fd == self._done_fds[0] else self._done_fds[0]
            self._done_end = 0
            fds = self._fds_to_sync()
            snap = self._checkpoint_dict(clean)
            self.dirty = False
        marks.sort()
        for pos, m in marks:  # records of delivered messages never change again
            self.data.write_existing(pos + OFF_STATE, m[3])
        self._fsync_all(fds + self.data.fds_for([pos for pos, _ in marks]))
        self._store_checkpoint(snap)
        with self.lock:
            for pos, m in marks:
                if self._marks.get(pos) is m:
                    del self._marks[pos]
        try:
            os.ftruncate(full_fd, 0)  # its marks are in the records now, and fsynced
        except OSError:
            pass

    def _write_checkpoint(self, clean: bool) -> None:
        self._store_checkpoint(self._checkpoint_dict(clean))

    def _checkpoint_dict(self, clean: bool) -> dict[str, Any]:
        self.open_ranges = [r for r in self.open_ranges if r[2] > self.watermark]
        self._ckpt_seq += 1
        return {
            "seq": self._ckpt_seq,
            "open_ranges": [list(r) for r in self.open_ranges],
            "version": 1,
            "clean": clean,
            "watermark": self.watermark,
            "index_end": self.index_end,
            "data_end": self.data_end,
            "done_seq": self.done_seq,
            "pending": {str(k): v for k, v in self.pending.items() if v},
            "idx_seg_max": {str(k): v for k, v in self.idx_seg_max.items()},
            "slot_ms": self.slot_ms,
            "data_segment_bytes": self.data_seg,
            "index_segment_entries": self.idx_seg_entries,
            "written_ms": self.clock.now_ms(),
        }

    def _store_checkpoint(self, snap: dict[str, Any]) -> None:
        with self._ckpt_lock:
            if snap["seq"] <= self._ckpt_written:
                return  # a newer snapshot is already on disk
            write_atomic(self.root / "checkpoint.json", json.dumps(snap).encode())
            self._ckpt_written = snap["seq"]
            self.persisted_watermark = max(self.persisted_watermark, snap["watermark"])

    # ====================================================================================== scheduling
    def _topic_id(self, topic: str) -> int:
        tid = self.topics.get(topic)
        if tid is None:
            tid = len(self.topics) + 1
            self.topics[topic] = tid
            self.topic_names[tid] = topic
            write_atomic(self.root / "topics.json", json.dumps(self.topics).encode())
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

    def schedule_batch(self, items: Iterable[tuple[MessageExt, int]]) -> list[ScheduleResult]:
        """Park messages until their deliver times. Each message is stored as given (its real topic
        and queue id); UNIQ_KEY is generated when missing. All-or-nothing validation: raises TimerError
        (TimerRefused beyond the maximum delay) before anything is written."""
        items = list(items)
        now = self.clock.now_ms()
        encoded: list[tuple[MessageExt, int, bytearray]] = []
        for msg, deliver_ms in items:
            if not isinstance(deliver_ms, int) or deliver_ms < 0:
                raise TimerError(f"deliver time {deliver_ms!r} is not a non-negative integer (epoch ms)")
            self.check_deliver_ms(deliver_ms, now)
            reason = validate_topic(msg.topic)
            if reason:
                raise TimerError(reason)
            if not msg.properties.get(PROPERTY_UNIQ_KEY):
                msg.properties[PROPERTY_UNIQ_KEY] = uuid.uuid4().hex.upper()
            msg.properties[PROPERTY_TIMER_DELIVER_MS] = str(deliver_ms)
            try:
                rec = encode_record(msg)
            except MessageFormatError as e:
                raise TimerError(f"message cannot be stored: {e}") from e
            if DATA_HDR_SIZE + len(rec) > self.data_seg:
                raise TimerError(f"message of {len(rec)} bytes is larger than a timer data segment")
            encoded.append((msg, deliver_ms, rec))
        with self.lock:
            self._require_open()
            start_pos = self.data_end
            try:
                return self._append(encoded, now)
            except OSError as e:  # disk full, I/O error: nothing was acknowledged
                self._abandon_records(start_pos)
                raise TimerError(f"the timer store could not write: {e.strerror or e}") from e

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

    def _require_open(self) -> None:
        if not self._opened:
            raise TimerError("the timer store is not open")

    def _floor_slot(self) -> int:
        return self.cur.slot if self.cur is not None else self.watermark + 1

    def _append(self, encoded: list[tuple[MessageExt, int, bytearray]], now: int) -> list[ScheduleResult]:
        # 1. message bytes  2. key hash entries  3. index entries (with chain links)  4. wheel heads.
        # A crash between steps leaves unreachable bytes that recovery trims; see the module docs.
        results: list[ScheduleResult] = []
        hash_items: list[tuple[int, int]] = []
        crc32 = zlib.crc32
        hdr_pack = DATA_HDR.pack
        topics = self.topics
        seg_size = self.data_seg
        chunk = bytearray()
        chunk_pos = self.data_end
        pos = self.data_end
        placed: list[tuple[int, int, int, int]] = []  # pos, size, deliver, topic id
        for msg, deliver_ms, rec in encoded:
            size = DATA_HDR_SIZE + len(rec)
            if seg_size - pos % seg_size < size:
                if chunk:
                    self.data.write(chunk_pos, chunk)
                    chunk = bytearray()
                pos = pos - pos % seg_size + seg_size
                chunk_pos = pos
            tid = topics.get(msg.topic) or self._topic_id(msg.topic)
            chunk += hdr_pack(DATA_MAGIC, size, PENDING, 0, deliver_ms, 0, now, -1, 0,
                              crc32(rec) - (1 << 31), tid)
            chunk += rec
            placed.append((pos, size, deliver_ms, tid))
            props = msg.properties
            uniq = props[PROPERTY_UNIQ_KEY]
            hash_items.append((crc32(("u:" + uniq).encode()) & 0x7FFFFFFF, pos))
            keys = props.get(PROPERTY_KEYS)
            if keys:
                for k in keys.split(" "):
                    if k:
                        hash_items.append((crc32(("k:" + k).encode()) & 0x7FFFFFFF, pos))
            results.append(ScheduleResult(uniq, self.offset_msg_id(pos), deliver_ms, pos))
            pos += size
        if chunk:
            self.data.write(chunk_pos, chunk)
        self.data_end = pos
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
        heads: dict[int, int] = {}
        start_idx = self.index_end
        idx = start_idx
        buf = bytearray()
        items: list[tuple[int, Item]] = []
        cur, nxt = self.cur, self.nxt
        hot = nxt.slot if nxt is not None else (cur.slot if cur is not None else -1)
        slot_ms = self.slot_ms
        wget = self.wheel.get
        body_pack = _IDX_BODY.pack
        i32 = _I32.pack
        crc32 = zlib.crc32
        per_seg = self.idx_seg_entries
        seg_max = self.idx_seg_max
        min_deliver = None
        for deliver, pos, gen, tid, size in links:
            slot = deliver // slot_ms
            if slot < floor:
                slot = floor
            prev = heads.get(slot)
            if prev is None:
                prev = wget(slot)
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

    # =========================================================================== cancel / reschedule
    def offset_msg_id(self, pos: int) -> str:
        prefix = self._id_prefix
        if prefix is None:
            prefix = self._id_prefix = create_offset_msg_id(self.store_host, 0)[:16]
        return f"{prefix}{TIMER_OFFSET_FLAG | pos:016X}"

    def _read_record(self, pos: int) -> tuple[tuple[int, ...], bytes] | None:
        hdr = self.data.read(pos, DATA_HDR_SIZE)
        if len(hdr) < DATA_HDR_SIZE:
            return None
        h = DATA_HDR.unpack(hdr)
        if h[0] != DATA_MAGIC or h[1] < DATA_HDR_SIZE:
            return None
        raw = self.data.read(pos, h[1])
        if len(raw) < h[1]:
            return None
        return self._overlay(pos, h), raw

    def _find(self, ident: str, by_key: bool) -> list[tuple[int, tuple[int, ...], MessageExt]]:
        """Records named by ``ident``: a key (by_key), or an id that is a UNIQ_KEY or one of this
        store's own handles (offset_msg_id). A UNIQ_KEY has the same 32-hex shape as a handle, so the
        id is read as a handle only when its host part is this broker's, and the key index (verified
        against the record's UNIQ_KEY) is consulted in every case."""
        found: dict[int, bool] = {}  # position -> needs verification against the record
        if not by_key and len(ident) == 32 and self.offset_msg_id(0)[:16] == ident[:16].upper():
            try:
                _, off = decode_offset_msg_id(ident)
            except ValueError:
                off = -1
            if off >= 0 and off & TIMER_OFFSET_FLAG:
                found[off & ~TIMER_OFFSET_FLAG] = False  # a handle names the record itself
        for pos in self.hash.lookup(("k:" if by_key else "u:") + ident):
            found.setdefault(pos, True)
        out = []
        for pos in sorted(found):
            if pos < self.data.min_pos or pos >= self.data_end:
                continue
            r = self._read_record(pos)
            if r is None:
                continue
            h, raw = r
            try:
                msg = decode_record(raw, DATA_HDR_SIZE, read_body=False)
            except MessageFormatError:
                continue
            if found[pos] and (ident not in msg.keys if by_key else msg.uniq_key != ident):
                continue
            out.append((pos, h, msg))
        return out

    def _write_done(self, pos: int, h: tuple[int, ...], state: int, now: int) -> int:
        # One pwrite of state..done_seq (a process crash cannot split a pwrite).
        self.done_seq += 1
        self.data.patch(pos + OFF_STATE, _STATE_BLOCK.pack(state, h[3], h[4], now, h[6], h[7], self.done_seq))
        return self.done_seq

    def cancel(self, ident: str, by_key: bool = False) -> list[OpResult]:
        """Cancel every pending message with this id (UNIQ_KEY or timer offset msgId) or key."""
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            found = self._find(ident, by_key)
            if not found:
                return [OpResult(Outcome.UNKNOWN, ident)]
            out = []
            changed = False
            for pos, h, msg in found:
                uid = msg.uniq_key or ident
                state = h[2]
                if state == PENDING:
                    self._write_done(pos, h, CANCELLED, now)
                    self.pending[h[10]] -= 1
                    self.cancelled += 1
                    changed = True
                    out.append(OpResult(Outcome.CANCELLED, uid, h[4], msg.topic))
                elif state == DELIVERED:
                    out.append(OpResult(Outcome.ALREADY_DELIVERED, uid, h[5], msg.topic))
                elif state == FAILED:
                    out.append(OpResult(Outcome.FAILED, uid, h[5], msg.topic))
                elif state == CANCELLED:
                    out.append(OpResult(Outcome.ALREADY_CANCELLED, uid, h[5], msg.topic))
            if changed:
                self._write_checkpoint(clean=False)  # the pending counts must not resurrect it
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    def reschedule(self, ident: str, deliver_ms: int, by_key: bool = False) -> list[OpResult]:
        """Move every pending message with this id or key to ``deliver_ms``."""
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            if not isinstance(deliver_ms, int) or deliver_ms < 0:
                raise TimerError(f"deliver time {deliver_ms!r} is not a non-negative integer (epoch ms)")
            self.check_deliver_ms(deliver_ms, now)
            found = self._find(ident, by_key)
            out = []
            for pos, h, msg in found:
                uid = msg.uniq_key or ident
                state = h[2]
                if state == PENDING:
                    gen = h[3] + 1
                    self._add_index_entries([(deliver_ms, pos, gen, h[10], h[1])], self._floor_slot())
                    # The new entry is live once the record carries its generation.
                    self.data.patch(pos + OFF_GEN, _I32.pack(gen))
                    self.data.patch(pos + OFF_DELIVER, _I64.pack(deliver_ms))
                    self.rescheduled += 1
                    self.dirty = True
                    out.append(OpResult(Outcome.RESCHEDULED, uid, deliver_ms, msg.topic))
                elif state == DELIVERED:
                    out.append(OpResult(Outcome.ALREADY_DELIVERED, uid, h[5], msg.topic))
                elif state == FAILED:
                    out.append(OpResult(Outcome.FAILED, uid, h[5], msg.topic))
                elif state == CANCELLED:
                    out.append(OpResult(Outcome.ALREADY_CANCELLED, uid, h[5], msg.topic))
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    # ================================================================================ the delivery window
    def poll(self, now: int, max_items: int | None = None) -> tuple[list[Item], int | None]:
        """Due items (taken: the caller must ``deliver`` each), or none and the time to call again
        (None: nothing pending at all; a new schedule calls ``wakeup``)."""
        n = max_items or self.cfg.deliver_batch
        with self.lock:
            self._commit_marks()
            self._advance_window(now)
            cur = self.cur
            if cur is not None:
                out: list[Item] = []
                if not cur.late:  # the common case: a slice of the sorted chain, no per-item peek/pop
                    c = cur.cursor
                    end = min(bisect.bisect_right(cur.d, now, lo=c), c + n)
                    if end > c:
                        out = list(zip(cur.d[c:end], cur.i[c:end], cur.p[c:end], cur.g[c:end], cur.t[c:end],
                                       cur.s[c:end], strict=True))
                        cur.cursor = end
                while len(out) < n:
                    head = cur.peek()
                    if head is None or head[0] > now:
                        break
                    out.append(cur.pop())
                if out:
                    cur.inflight += len(out)
                    return out, None
            return [], self._wake_ms(now)

    def _advance_window(self, now: int) -> None:
        for _ in range(8):
            cur = self.cur
            if cur is not None and cur.exhausted() and cur.inflight == 0:
                self.watermark = max(self.watermark, cur.slot)
                self.cur = None
                self.dirty = True
                continue
            if cur is None and self.nxt is not None and self.nxt.ready and \
                    now >= self.nxt.slot * self.slot_ms - self.cfg.promote_ms:
                self.cur, self.nxt = self.nxt, None
                continue
            if self.nxt is None:
                frm = (cur.slot if cur is not None else self.watermark) + 1
                if self.scan_empty_from is None or frm < self.scan_empty_from:
                    s = self.wheel.next_nonempty(frm)
                    if s is None:
                        self.scan_empty_from = frm
                    else:
                        self.nxt = _Slot(s)
            nxt = self.nxt
            if nxt is not None and not nxt.ready and now >= nxt.slot * self.slot_ms - self.cfg.preload_ms:
                if not nxt.started:
                    nxt.start(self.wheel.get(nxt.slot))
                nxt.step(self.index, self.cfg.preload_step)
                if nxt.ready and self.cur is None:
                    continue
            break

    def _wake_ms(self, now: int) -> int | None:
        cands = []
        if self.cur is not None:
            head = self.cur.peek()
            if head is not None:
                cands.append(head[0])
            elif self.cur.inflight == 0:
                cands.append(now)
        nxt = self.nxt
        if nxt is not None and not nxt.ready:
            t = nxt.slot * self.slot_ms - self.cfg.preload_ms
            cands.append(now if (nxt.started or now >= t) else t)
        elif nxt is not None and self.cur is None:
            cands.append(max(now, nxt.slot * self.slot_ms - self.cfg.promote_ms))
        return min(cands) if cands else None

    def deliver(self, item: Item, put: Callable[[MessageExt], PutResult], now: int | None = None) -> str:
        """Deliver one taken item through ``put`` (the MessageStore's put_message). Returns 'delivered',
        'skipped' (cancelled, rescheduled, already delivered), 'failed' (the store refused it for good)
        or 'retry' (the store could not take it now; the item is back in the window)."""
        return self.deliver_many([item], put, None, now)[0]

    def deliver_many(self, items: list[Item], put: Callable[[MessageExt], PutResult],
                     put_many: Callable[[list[MessageExt]], PutResult] | None = None,
                     now: int | None = None, put_raw: PutRaw | None = None) -> list[str]:
        """Deliver taken items (a ``poll``'s batch) under one lock hold; one outcome per item, as for
        ``deliver``. The records are read in few large reads (a batch's records are mostly adjacent on
        disk), then go through the delivery path shared with the level service
        (chronomq.delay.delivery.put_groups): one put per real topic and queue, to ``put_raw`` (the
        MessageStore's put_records: the stored bytes re-put with the edited properties) when given, else
        ``put_many`` (put_messages), else ``put`` one by one. A group refused for good is isolated
        message by message. After a transient failure the items not stored go back to the window
        ('retry'). An item is marked delivered only once the store has accepted it; an exception leaves
        every item without an outcome pending in the window."""
        n = len(items)
        out: list[str] = [""] * n
        with self.lock:
            now = self.clock.now_ms() if now is None else now
            try:
                groups = self._prepare_batch(items, now, out, put_raw is not None)
                put_groups(groups, StorePuts(put, put_many, put_raw),
                           lambda g, _r: self._mark_delivered(g, out),
                           lambda g, r: self._refused(g, r, out), lambda g, _r: self._busy(g, out))
            finally:
                cur = self.cur
                for k in range(n):
                    if not out[k]:
                        out[k] = "retry"
                    if out[k] == "retry" and cur is not None:
                        heapq.heappush(cur.late, items[k])
                if cur is not None:
                    cur.inflight -= n
        return out

    def _prepare_batch(self, items: list[Item], now: int, out: list[str], as_records: bool = False
                       ) -> dict[tuple[str, int], list[_Taken]]:
        """Read and check the records of ``items`` and turn the live ones into the messages to put (with
        ``as_records``: the (buffer, position, size, properties) entries of put_records), grouped by real
        (topic, queue) in ``items`` order. Outcomes of the others go into ``out``."""
        data = self.data
        seg = self.data_seg
        n = len(items)
        for it in items:
            if it[0] > now:
                self.early += 1  # never happens: poll only hands out due items
                raise AssertionError(f"timer item due at {it[0]} handed out at {now}")
        # 1. read: one pread per run of nearby records (same segment, gaps < 64 KiB, up to 1 MiB)
        bufs: list[tuple[bytes, int]] = [(b"", 0)] * n
        order = sorted(range(n), key=lambda k: items[k][2])
        min_pos = data.min_pos
        j = 0
        while j < n:
            k = order[j]
            lo = items[k][2]
            if lo < min_pos:
                j += 1
                continue
            hi = lo + items[k][5]
            seg_lo = lo - lo % seg
            e = j + 1
            while e < n:
                p2 = items[order[e]][2]
                end2 = p2 + items[order[e]][5]
                if p2 - p2 % seg != seg_lo or p2 - hi > 65536 or end2 - lo > (1 << 20):
                    break
                if end2 > hi:
                    hi = end2
                e += 1
            raw = data.read(lo, hi - lo)
            for q in range(j, e):
                kk = order[q]
                bufs[kk] = (raw, items[kk][2] - lo)
            j = e
        # 2. check and decode, in deliver order
        groups: dict[tuple[str, int], list[_Taken]] = {}
        unpack_from = DATA_HDR.unpack_from
        marks = self._marks
        store_host = self.store_host
        strip = (*TIMER_PROPERTIES, PROPERTY_DELAY_TIME_LEVEL)
        decode = decode_to_put
        parse = record_to_put
        raw_mode = as_records
        for k in range(n):
            item = items[k]
            deliver_ms, _idx, pos, gen, tid, size = item
            raw, off = bufs[k]
            if size < DATA_HDR_SIZE or off + size > len(raw):
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            h = unpack_from(raw, off)
            if h[0] != DATA_MAGIC or h[1] != size:
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            if marks:
                h = self._overlay(pos, h)
            if h[3] != gen:
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            if h[2] != PENDING:
                if h[2] in (DELIVERED, FAILED) and self.open_ranges and \
                        any(lo < h[8] < hi for lo, hi, _ in self.open_ranges):
                    # Completed after the last checkpoint, before a crash: subtract it now, and give
                    # it a sequence number of this run so it is never subtracted twice.
                    self.pending[tid] -= 1
                    self.done_seq += 1
                    self.data.patch(pos + OFF_DONE, _DONE_BLOCK.pack(h[5], h[6], h[7], self.done_seq))
                    self.dirty = True
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            try:
                if raw_mode:
                    topic, qid, props = parse(raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE)
                    m: Any = (raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE, props)
                else:
                    m = decode(raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE, store_host)
                    topic, qid, props = m.topic, m.queue_id, m.properties
            except MessageFormatError as e:
                log.error("timer record at %d is corrupt (%s); marked failed", pos, e)
                self._write_done(pos, h, FAILED, now)
                self.pending[tid] -= 1
                self.failed += 1
                out[k] = "failed"
                continue
            for key in strip:
                props.pop(key, None)
            props[PROPERTY_TIMER_DELIVER_MS] = str(deliver_ms)
            g = groups.get((topic, qid))
            if g is None:
                groups[(topic, qid)] = [(k, m, h, item)]
            else:
                g.append((k, m, h, item))
        return groups

    def _refused(self, taken: _Taken, res: PutResult, out: list[str]) -> None:
        """The store refused one message for good: it is marked FAILED and never delivered."""
        k, m, h, item = taken
        uniq = m[3].get(PROPERTY_UNIQ_KEY) if isinstance(m, tuple) else m.uniq_key
        log.error("timer: store refused message %s for good: %s", uniq, res.error)
        self._write_done(item[2], h, FAILED, self.clock.now_ms())
        self.pending[item[4]] -= 1
        self.failed += 1
        out[k] = "failed"

    def _busy(self, group: list[_Taken], out: list[str]) -> None:
        self.put_retries += len(group)
        for g in group:
            out[g[0]] = "retry"

    def _mark_delivered(self, group: list[_Taken], out: list[str]) -> None:
        t = self.clock.now_ms()
        marks = self._marks
        buf = self._mark_buf
        pending = self.pending
        pack = _STATE_BLOCK.pack
        i64 = _I64.pack
        lates: dict[tuple[int, int], int] = {}
        seq = self.done_seq
        for k, _m, h, item in group:
            pos, tid = item[2], item[4]
            seq += 1
            block = pack(DELIVERED, h[3], h[4], t, h[6], h[7], seq)
            marks[pos] = (DELIVERED, t, seq, block)
            buf += i64(pos)
            buf += block
            pending[tid] -= 1
            created = h[6]
            d = item[0]
            lk = (tid, t - (d if d > created else created))  # past when scheduled: not lateness
            lates[lk] = lates.get(lk, 0) + 1
            out[k] = "delivered"
        hists = self.hist
        for (tid, late), c in lates.items():  # a burst shares few distinct values
            hist = hists.get(tid)
            if hist is None:
                hist = hists[tid] = Histogram()
            hist.record(late, c)
        self.done_seq = seq
        self.delivered += len(group)
        self.dirty = True

    # ============================================================================== query and counting
    def _info(self, pos: int, h: tuple[int, ...], m: MessageExt) -> PendingInfo:
        return PendingInfo(msg_id=m.uniq_key or "", offset_msg_id=self.offset_msg_id(pos), topic=m.topic,
                           queue_id=m.queue_id, tags=m.tags, keys=m.keys, deliver_ms=h[4], created_ms=h[6],
                           body_size=len(m.body))

    def query(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None, limit: int = 100,
              cursor: str | None = None) -> QueryPage:
        """Pending messages ordered by deliver time, filtered, one page at a time. ``key`` matches a
        KEYS word or the UNIQ_KEY. A page examines at most max_query_scan entries; ``next_cursor`` is
        set whenever there may be more (pages can be short or empty then)."""
        if limit <= 0:
            raise TimerError("limit must be positive")
        with self.lock:
            self._require_open()

            def keep(h: tuple[int, ...], m: MessageExt) -> bool:
                return ((topic is None or m.topic == topic) and (tag is None or m.tags == tag)
                        and (start_ms is None or h[4] >= start_ms) and (end_ms is None or h[4] <= end_ms))

            if key is not None:
                return self._query_key(key, keep, limit, cursor)
            return self._query_time(keep, start_ms, end_ms, limit, cursor)

    def _query_key(self, key: str, keep: Callable[..., bool], limit: int, cursor: str | None) -> QueryPage:
        seen: dict[int, tuple[tuple[int, ...], MessageExt]] = {}
        for pos, h, m in self._find(key, True) + self._find(key, False):
            if h[2] == PENDING and keep(h, m):
                seen[pos] = (h, m)
        rows = sorted(seen.items(), key=lambda kv: (kv[1][0][4], kv[0]))
        after = None
        if cursor:
            try:
                a, b = cursor.lstrip("k").split(":")
                after = (int(a), int(b))
            except ValueError:
                raise TimerError(f"bad query cursor {cursor!r}") from None
        page = QueryPage(scanned=len(rows))
        for pos, (h, m) in rows:
            if after is not None and (h[4], pos) <= after:
                continue
            if len(page.items) == limit:
                last = page.items[-1]
                page.next_cursor = f"k{last.deliver_ms}:{_pos_of(last.offset_msg_id)}"
                break
            page.items.append(self._info(pos, h, m))
        return page

    def _query_time(self, keep: Callable[..., bool], start_ms: int | None, end_ms: int | None, limit: int,
                    cursor: str | None) -> QueryPage:
        floor = self._floor_slot()
        s_from = max(self.watermark + 1, (start_ms // self.slot_ms) if start_ms is not None else 0)
        after_slot, after = -1, (-1, -1)
        if cursor:
            try:
                a, b, c = cursor.lstrip("s").split(":")
                after_slot, after = int(a), (int(b), int(c))
            except ValueError:
                raise TimerError(f"bad query cursor {cursor!r}") from None
            s_from = max(s_from, after_slot)
        end_slot = None if end_ms is None else max(end_ms // self.slot_ms, floor)
        page = QueryPage()
        while True:
            s = self.wheel.next_nonempty(s_from)
            if s is None or (end_slot is not None and s > end_slot):
                return page
            w = _Slot(s)
            w.start(self.wheel.get(s))
            while not w.ready:
                w.step(self.index, 1 << 30)
            last = (-1, -1)
            for k in range(len(w.d)):
                d, idx = w.d[k], w.i[k]
                if s == after_slot and (d, idx) <= after:
                    continue
                if len(page.items) == limit or page.scanned >= self.cfg.max_query_scan:
                    page.next_cursor = f"s{s}:{last[0]}:{last[1]}"
                    return page
                page.scanned += 1
                last = (d, idx)
                pos, gen = w.p[k], w.g[k]
                r = self._read_record(pos) if pos >= self.data.min_pos else None
                if r is None:
                    continue
                h, raw = r
                if h[3] != gen or h[2] != PENDING:
                    continue
                try:
                    m = decode_record(raw, DATA_HDR_SIZE)
                except MessageFormatError:
                    continue
                if keep(h, m):
                    page.items.append(self._info(pos, h, m))
            s_from = s + 1

    def count(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None) -> int:
        """Number of pending messages matching; by topic alone (or nothing) from counters, else a scan."""
        if key is None and tag is None and start_ms is None and end_ms is None:
            with self.lock:
                if topic is None:
                    return max(0, sum(self.pending.values()))
                tid = self.topics.get(topic)
                return max(0, self.pending.get(tid, 0)) if tid else 0
        total = 0
        cursor = None
        while True:
            page = self.query(topic, key, tag, start_ms, end_ms, limit=10_000, cursor=cursor)
            total += len(page.items)
            if page.next_cursor is None:
                return total
            cursor = page.next_cursor

    # =========================================================================== retention and metrics
    def run_retention(self, now: int | None = None) -> dict[str, int]:
        """Delete what no pending message needs: processed wheel days and index segments (by the
        persisted watermark), data segments holding no pending record, hash generations naming only
        deleted data. Returns counts of what was deleted. The data segments are scanned without the
        lock (a scan reads a whole 64 MiB segment: seconds for a backlog of them), so deliveries and
        schedules go on meanwhile; call it from a worker thread."""
        with self.lock:
            now = self.clock.now_ms() if now is None else now
            wm = self.persisted_watermark
            if self.cur is not None:
                wm = min(wm, self.cur.slot - 1)
            deleted = {"index_segments": 0, "data_segments": 0, "wheel_files": 0}
            active_idx_seg = self.index_end // self.idx_seg_entries
            for seg, mx in sorted(self.idx_seg_max.items()):
                if seg < active_idx_seg and mx <= wm:
                    self.index.delete_segment(seg * self.idx_seg_entries * IDX_SIZE)
                    del self.idx_seg_max[seg]
                    deleted["index_segments"] += 1
            before = self.wheel.files
            self.wheel.delete_through(wm)
            deleted["wheel_files"] = before - self.wheel.files
            active = self.data.seg_start(self.data_end)
            todo = [start for start in self.data.starts
                    if start < active and self.data_recheck.get(start, 0) <= now]
        # Unlocked: a segment before the active one is never appended to, and a record's state only
        # leaves PENDING (delivered, cancelled, failed; a reschedule keeps it pending). A scan racing a
        # state change can only see a record as still pending, which keeps its segment a while longer.
        found = {start: self._scan_data_segment(start) for start in todo}
        with self.lock:
            for start, max_pending in found.items():
                if start not in self.data.starts:
                    continue
                if max_pending is None:
                    self.data.delete_segment(start)
                    self.data_recheck.pop(start, None)
                    deleted["data_segments"] += 1
                else:
                    self.data_recheck[start] = max_pending
            self.hash.drop_below(min(self.data.min_pos, self.data_end) if self.data.starts else self.data_end)
            return deleted

    def _scan_data_segment(self, start: int) -> int | None:
        """The latest deliver time of a pending record in the segment, or None if there is none (read in
        large chunks: one pread per record header made a backlog's first retention pass take seconds)."""
        end = start + self.data_seg
        best = None
        marks = self._marks
        pos = start
        buf = b""
        buf_at = start
        chunks = self.data.iter_chunks(start, self.scan_chunk)
        while pos + DATA_HDR_SIZE <= end:
            while pos + DATA_HDR_SIZE > buf_at + len(buf):  # the header is (partly) beyond this chunk
                nxt = next(chunks, None)
                if nxt is None:
                    return best
                at, data = nxt
                keep = buf[pos - buf_at:] if pos < buf_at + len(buf) else b""
                if at + len(data) <= pos:
                    buf, buf_at = b"", at + len(data)  # a whole chunk inside one record's body
                    continue
                buf = keep + data if keep else data[max(0, pos - at):]
                buf_at = pos
            h = DATA_HDR.unpack_from(buf, pos - buf_at)
            if h[0] != DATA_MAGIC or h[1] < DATA_HDR_SIZE:
                break
            if h[2] == PENDING and pos not in marks:
                best = h[4] if best is None else max(best, h[4])
            pos += h[1]
        return best

    def due_undelivered(self, now: int) -> dict[str, int]:
        """Per topic: messages whose deliver time has passed and that are still in memory waiting."""
        with self.lock:
            c: Counter[int] = Counter()
            for w in (self.cur,):
                if w is None:
                    continue
                k = bisect.bisect_right(w.d, now, lo=w.cursor)
                c.update(w.t[w.cursor : k])
                c.update(it[4] for it in w.late if it[0] <= now)
            return {self.topic_name(t): n for t, n in c.items() if n}

    def stats(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock.now_ms()
            head = self.cur.peek() if self.cur is not None else None
            return {
                "pending": max(0, sum(self.pending.values())),
                "pending_by_topic": {self.topic_name(t): n for t, n in self.pending.items() if n > 0},
                "due_undelivered": self.due_undelivered(now),
                "delivered": self.delivered,
                "cancelled": self.cancelled,
                "rescheduled": self.rescheduled,
                "failed": self.failed,
                "put_retries": self.put_retries,
                "early_deliveries": self.early,
                "stale_entries_skipped": self.stale_skipped,
                "next_due_ms": head[0] if head else None,
                "watermark_ms": (self.watermark + 1) * self.slot_ms,
                "lateness_ms": Histogram.merged(self.hist.values()).summary(),
                "lateness_ms_by_topic": {self.topic_name(t): h.summary() for t, h in self.hist.items()},
                "max_delay_ms": self.cfg.max_delay_ms,
                "slot_ms": self.slot_ms,
                "disk_bytes": self.disk_bytes(),
                "recovered_clean": self.recovered_clean,
            }

    def disk_bytes(self) -> dict[str, int]:
        d = {"data": self.data.disk_bytes(), "index": self.index.disk_bytes(),
             "wheel": self.wheel.disk_bytes(), "hash": self.hash.disk_bytes()}
        d["total"] = sum(d.values())
        return d

    def footprint(self) -> dict[str, int]:
        """Sizes of every in-memory structure (what must not grow with the number pending)."""
        with self.lock:
            return {
                "window_entries": sum(w.entries() for w in (self.cur, self.nxt) if w is not None),
                "unapplied_marks": len(self._marks),  # deliveries since the last flush
                "topics": len(self.topics),
                "pending_counters": len(self.pending),
                "index_segments_tracked": len(self.idx_seg_max),
                "data_segments_tracked": len(self.data_recheck) + len(self.data.starts),
                "wheel_files": self.wheel.files,
                "hash_generations": len(self.hash.gens),
                "histogram_buckets": sum(h.buckets for h in self.hist.values()),
            }


def _pos_of(offset_msg_id: str) -> int:
    return decode_offset_msg_id(offset_msg_id)[1] & ~TIMER_OFFSET_FLAG
