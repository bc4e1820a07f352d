"""TimerStore: the synchronous, thread-safe core of the timer (on-disk format: docs/timer.md).

The asyncio delivery loop lives in ``service.py``; everything here can also be driven by hand
(``poll`` / ``deliver``), which is what the virtual-clock tests do. The store's hot path is its own: the
schedule path and durability (flush, checkpoint) are here, the delivery window is its base class
(window.py), and both share the state declared in state.py. The cold paths are parts the store holds and
delegates to: cancel and reschedule (cancel.py), queries and counts (query.py), retention
(retention.py), opening, recovery and closing (recovery.py).

Schedule rules: validate and encode outside the lock, then under it write the message bytes, the key hash
entries, the index entries and the wheel heads, in that order (recovery relies on it), and hand entries
for slots already in memory to the window; validation is all-or-nothing before anything is written; a
failed write marks what it wrote FAILED and raises TimerUnavailable. Flush rules: the lock is held only
to take a snapshot (swap the done logs, collect the fds, build the checkpoint); the fsyncs and the mark
writes run outside it; a checkpoint never overwrites a newer one (``_ckpt_lock``).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from chronomq.clock import Clock
from chronomq.message import (
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageFormatError,
    create_offset_msg_id,
    validate_topic,
)
from chronomq.store.atomicfile import write_atomic
from chronomq.store.threads import as_background

from ..histogram import Histogram
from .append import _encode_record, pack_index_entries, pack_timer_records
from .cancel import Cancellation
from .query import Queries
from .records import (  # the layouts, for tests and tools that read the files
    _I32,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    FAILED,
    IDX,
    IDX_SIZE,
    OFF_STATE,
    PENDING,
    TIMER_OFFSET_FLAG,
    Item,
    _new,
    _pack_index,
    _pos_of,
    _unpack_index,
    unpack_header,
)
from .recovery import Recovery
from .retention import Retention
from .types import (
    OpResult,
    PendingInfo,
    QueryPage,
    ScheduleResult,
    TimerConfig,
    TimerError,
    TimerRefused,
    TimerUnavailable,
)
from .window import WindowPath

__all__ = [
    "DATA_HDR", "DATA_HDR_SIZE", "DATA_MAGIC", "IDX", "IDX_SIZE", "PENDING", "TIMER_OFFSET_FLAG", "Item",
    "TimerStore", "_pack_index", "_pos_of", "_unpack_index",
]


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:  # closed meanwhile (retention deleted the file): nothing left to sync
        pass


_APPLY_SLICE = 1024  # applied marks dropped from memory per hold of the lock
_FSYNC_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="timer-fsync",
                                                    initializer=as_background)


class TimerStore(WindowPath):
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
        self.on_done: Callable[[list[str]], None] | None = None  # completions, for a journal
        self.wakeup: Callable[[int], None] | None = None  # called with a deliver time that may be earlier
        # the message store's end (commit-log offset): a checkpoint records it, so that after a crash the
        # copies delivered since can be found there (recover_delivered)
        self.store_end: Callable[[], int] | None = None
        # makes the message store's records durable (MessageStore.sync_commit_log): a checkpoint calls it
        # before its delivery marks reach the disk, so no mark is ever durable ahead of its copy
        self.store_sync: Callable[[], object] | None = None
        self.scan_from: int | None = None  # after a crash: where those copies start, until recovered
        self._opened = False
        self._id_prefix: str | None = None
        # the cold paths
        self._recovery = Recovery(self)
        self._cancels = Cancellation(self)
        self._queries = Queries(self)
        self._retention = Retention(self)

    # --- opening, recovery, closing (recovery.py) --------------------------------------------------------
    def open(self) -> None:
        self._recovery.open()

    def close(self) -> None:
        """Flush everything and write a clean checkpoint."""
        self._recovery.close()

    def abandon(self) -> None:
        """Drop the store without flushing (tests: a simulated process crash)."""
        self._recovery.abandon()

    def recover_delivered(self, copies: Iterable[tuple[str, int]]) -> int:
        """After a crash: mark delivered the pending records whose copies (UNIQ_KEY, TIMER_DELIVER_MS) the
        message store holds from ``scan_from`` on; returns how many (Recovery.recover_delivered)."""
        return self._recovery.recover_delivered(copies)

    # --- cancel and reschedule (cancel.py) ---------------------------------------------------------------
    def cancel(self, ident: str, by_key: bool = False) -> list[OpResult]:
        """Cancel every pending message with this id (UNIQ_KEY or timer offset msgId) or key."""
        return self._cancels.cancel(ident, by_key)

    def reschedule(self, ident: str, deliver_ms: int, by_key: bool = False) -> list[OpResult]:
        """Move every pending message with this id or key to ``deliver_ms``."""
        return self._cancels.reschedule(ident, deliver_ms, by_key)

    def mark_done(self, uniq: str) -> int:
        """A slave's copy of a completion its master journaled (Cancellation.mark_done)."""
        return self._cancels.mark_done(uniq)

    def is_parked(self, uniq: str, origin: int) -> bool:
        """Whether the record parked from the journal record at commit-log offset ``origin`` is here."""
        return self._cancels.is_parked(uniq, origin)

    # --- queries (query.py) ------------------------------------------------------------------------------
    def query(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None, limit: int = 100,
              cursor: str | None = None) -> QueryPage:
        """Pending messages ordered by deliver time, filtered, one page at a time (Queries.query)."""
        return self._queries.query(topic, key, tag, start_ms, end_ms, limit, cursor)

    def count(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None) -> int:
        """Number of pending messages matching; by topic alone (or nothing) from counters, else a scan."""
        return self._queries.count(topic, key, tag, start_ms, end_ms)

    def records_of(self, uniq_key: str) -> list[PendingInfo]:
        """Every record whose UNIQ_KEY is ``uniq_key``, whatever its state, oldest first."""
        return self._queries.records_of(uniq_key)

    def offset_id_prefix(self) -> str:
        """The 16 hex chars (this broker's host) that every timer handle starts with."""
        prefix = self._id_prefix
        if prefix is None:
            prefix = self._id_prefix = create_offset_msg_id(self.store_host, 0)[:16]
        return prefix

    def offset_msg_id(self, pos: int) -> str:
        return f"{self.offset_id_prefix()}{TIMER_OFFSET_FLAG | pos:016X}"

    # --- retention (retention.py) ------------------------------------------------------------------------
    def reclaim_candidates(self) -> set[int]:
        """The data segments before the active one in which enough records completed since retention last
        scanned them (an eighth of a segment, by the mean size of the records appended since the open, 1
        KiB before the first) that a scan is worth it: their completed runs get reclaimed."""
        with self.lock:
            mean = self.appended_bytes // self.appended_records if self.appended_records else 1024
            need = max(1, self.data_seg // 8 // max(1, mean))
            active = self.data.seg_start(self.data_end)
            return {start for start, n in self.done_since_scan.items() if n >= need and start < active}

    def run_retention(self, now: int | None = None) -> dict[str, int]:
        """Delete what no pending message needs; returns counts of what was deleted. Scans without the
        lock: call it from a worker thread (Retention.run)."""
        return self._retention.run(now)

    # --- the schedule path -------------------------------------------------------------------------------
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
                import uuid  # not at module level: it imports platform, about 2 ms of every start

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
                h = unpack_header(hdr) if len(hdr) == DATA_HDR_SIZE else None
                if h is None or h.magic != DATA_MAGIC:
                    pos = self.data.seg_start(pos) + self.data_seg
                    continue
                if h.state == PENDING:
                    self.data.patch(pos + OFF_STATE, _I32.pack(FAILED))
                    self.pending[h.topic_id] -= 1
                pos += h.size
        except OSError:
            pass

    def _append(self, encoded: list[tuple[MessageExt, int, bytearray]], now: int, origin: int = -1
                ) -> list[ScheduleResult]:
        # 1. message bytes  2. key hash entries  3. index entries (with chain links)  4. wheel heads.
        # A crash between steps leaves unreachable bytes that recovery trims (docs/timer.md).
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
        self.appended_bytes += sum(size for _p, size, _d, _t in placed)
        self.appended_records += len(placed)
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
        for slot, entry in items:
            item = _new(Item, entry)  # the compiled kernel builds a plain tuple
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

    # --- durability: fsync, the delivery marks into their records, the checkpoint ------------------------
    def _fds_to_sync(self) -> list[int]:
        return (self.data.take_dirty_fds() + self.index.take_dirty_fds() + self.hash.all_fds()
                + self.wheel.all_fds())

    @staticmethod
    def _fsync_all(fds: list[int]) -> None:
        if len(fds) > 1:
            list(_FSYNC_POOL.map(_fsync, fds))
        elif fds:
            _fsync(fds[0])

    def sync_files(self) -> None:
        """fsync the data and index logs (what SYNC_FLUSH needs before acknowledging a schedule). The
        wheel and the key hash wait for the periodic flush: after a crash recovery re-links the wheel
        and re-adds the keys from the index entries past the checkpoint. The fsyncs run outside the
        lock, so deliveries and schedules go on meanwhile."""
        with self.lock:
            fds = self.data.take_dirty_fds() + self.index.take_dirty_fds()
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
        if marks and self.store_sync is not None:
            self.store_sync()  # the copies of these deliveries first (they were put before their marks)
        marks.sort()
        per_seg: dict[int, int] = {}  # the marks written below, by segment (counted once, not locked)
        seg = self.data_seg
        for pos, _m in marks:
            start = pos - pos % seg
            per_seg[start] = per_seg.get(start, 0) + 1
        counts = snap["done_since_scan"]  # they count in the checkpoint written after them
        for start, n in per_seg.items():
            counts[str(start)] = counts.get(str(start), 0) + n
        for pos, m in marks:  # records of delivered messages never change again
            self.data.write_existing(pos + OFF_STATE, m[3])
        self._fsync_all(fds + self.data.fds_for([pos for pos, _ in marks]))
        self._store_checkpoint(snap)
        # In slices, taking the lock for each: the delivery loop needs it too, and at 10,000 deliveries
        # a second one hold over every mark kept the loop waiting for milliseconds.
        for i in range(0, len(marks), _APPLY_SLICE):
            with self.lock:
                for pos, m in marks[i:i + _APPLY_SLICE]:
                    if self._marks.get(pos) is m:
                        del self._marks[pos]
        with self.lock:
            for start, n in per_seg.items():
                self._count_done(start, n)
        try:
            os.ftruncate(full_fd, 0)  # its marks are in the records now, and fsynced
        except OSError:
            return
        with self.lock:  # from here retention may reclaim these records (retention.scan_records_py)
            self.persisted_done_seq = max(self.persisted_done_seq, snap["done_seq"])

    def _write_checkpoint(self, clean: bool) -> None:
        self._store_checkpoint(self._checkpoint_dict(clean))

    def _checkpoint_dict(self, clean: bool) -> dict[str, Any]:
        self.open_ranges = [r for r in self.open_ranges if r[2] > self.watermark]
        self._ckpt_seq += 1
        self.snapshot_index_end = self.index_end
        return {
            "seq": self._ckpt_seq,
            "open_ranges": [list(r) for r in self.open_ranges],
            "version": 1,
            "clean": clean,
            "watermark": self.watermark,
            "index_end": self.index_end,
            "data_end": self.data_end,
            "hash_extent": list(self.hash.extent()),  # synced with everything else before this is written
            "done_seq": self.done_seq,
            "pending": {str(k): v for k, v in self.pending.items() if v},
            "idx_seg_max": {str(k): v for k, v in self.idx_seg_max.items()},
            "done_since_scan": {str(k): v for k, v in self.done_since_scan.items() if v > 0},
            "slot_ms": self.slot_ms,
            "data_segment_bytes": self.data_seg,
            "index_segment_entries": self.idx_seg_entries,
            "written_ms": self.clock.now_ms(),
            # every delivery after this snapshot puts its copy at or past this offset (puts and marks
            # happen under the lock); while a crash's copies are not recovered yet, theirs is kept
            "store_end": self._store_end_mark(),
        }

    def _store_end_mark(self) -> int | None:
        end = self.store_end() if self.store_end is not None else None
        if self.scan_from is not None:
            return self.scan_from if end is None else min(end, self.scan_from)
        return end

    def _store_checkpoint(self, snap: dict[str, Any]) -> None:
        with self._ckpt_lock:
            if snap["seq"] <= self._ckpt_written:
                return  # a newer snapshot is already on disk
            write_atomic(self.root / "checkpoint.json", json.dumps(snap).encode(), backup=True)
            self._ckpt_written = snap["seq"]
            self.persisted_watermark = max(self.persisted_watermark, snap["watermark"])

    # --- summaries ---------------------------------------------------------------------------------------
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
