"""Retention for TimerStore (``Retention``, which the store holds and delegates to): delete processed wheel
days and index segments (by the persisted watermark), data segments holding no pending record, and hash
generations naming only deleted data; reclaim the runs of completed records inside a segment that still
holds pending ones. Rules: the data segments are scanned without the lock (only ever to keep bytes
longer than needed); the deletions run under the store's lock; a record is reclaimed only once its
completion is in a checkpoint and no crash recovery may still read it (``scan_records_py``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from chronomq.store import faults
from chronomq.store.speedups import Buffer, kernels, pure_twin

from .records import DATA_HDR, DATA_HDR_SIZE, DATA_MAGIC, IDX_SIZE, PENDING

RECLAIM_MIN = 64 << 10  # a run of completed records shorter than this is left in place
YIELD_EVERY = 512  # records a scan parses between two releases of the GIL (the event loop's turn)


class _Scan(NamedTuple):
    """What a scan of one data segment found."""

    max_pending: int | None  # the latest deliver time of a pending record (None: none is pending)
    runs: list[tuple[int, int]]  # [first, end) runs of reclaimable records, RECLAIM_MIN or longer
    waiting: int  # completed records not reclaimable yet (their completion is not in a checkpoint)

if TYPE_CHECKING:
    from .store import TimerStore


class Retention:
    def __init__(self, store: TimerStore) -> None:
        self.store = store
        self.scan_chunk = 4 << 20  # bytes per read when a data segment is scanned
        self._scan_buf: bytearray | None = None  # the scan's buffer, kept (see scan_data_segment)
        self._scan_lock = threading.Lock()

    def run(self, now: int | None = None) -> dict[str, int]:
        """Delete what no pending message needs: processed wheel days and index segments (by the
        persisted watermark), data segments holding no pending record, hash generations naming only
        deleted data. Returns counts of what was deleted. The data segments are scanned without the
        lock (a scan reads a whole 64 MiB segment: seconds for a backlog of them), so deliveries and
        schedules go on meanwhile; call it from a worker thread."""
        s = self.store
        with s.lock:
            now = s.clock.now_ms() if now is None else now
            wm = s.persisted_watermark
            if s.cur is not None:
                wm = min(wm, s.cur.slot - 1)
            deleted = {"index_segments": 0, "data_segments": 0, "wheel_files": 0}
            active_idx_seg = s.index_end // s.idx_seg_entries
            for seg, mx in sorted(s.idx_seg_max.items()):
                if seg < active_idx_seg and mx <= wm:
                    s.index.delete_segment(seg * s.idx_seg_entries * IDX_SIZE)
                    del s.idx_seg_max[seg]
                    deleted["index_segments"] += 1
            before = s.wheel.files
            s.wheel.delete_through(wm)
            deleted["wheel_files"] = before - s.wheel.files
            faults.point("timer.retention")
            active = s.data.seg_start(s.data_end)
            reclaim = s.reclaim_candidates()
            todo = [start for start in s.data.starts
                    if start < active and (s.data_recheck.get(start, 0) <= now or start in reclaim)]
            counted = {start: s.done_since_scan.get(start, 0) for start in todo}
            done_seq, open_ranges = s.persisted_done_seq, [(lo, hi) for lo, hi, _ in s.open_ranges]
        # Unlocked: a segment before the active one is never appended to, and a record's state only
        # leaves PENDING (delivered, cancelled, failed; a reschedule keeps it pending). A scan racing a
        # state change can only see a record as still pending, which keeps its segment a while longer.
        found = {start: self.scan_data_segment(start, done_seq, open_ranges) for start in todo}
        reclaimed = 0
        for start, scan in found.items():
            if scan.max_pending is not None and start in s.data.starts:
                reclaimed += s.data.reclaim(scan.runs)  # recorded and synced before the punch
        with s.lock:
            for start, scan in found.items():
                if start not in s.data.starts:
                    s.done_since_scan.pop(start, None)
                    continue
                s.done_since_scan[start] = s.done_since_scan.get(start, 0) - counted[start] + scan.waiting
                if scan.max_pending is None:
                    s.data.delete_segment(start)
                    s.data_recheck.pop(start, None)
                    s.done_since_scan.pop(start, None)
                    deleted["data_segments"] += 1
                else:
                    s.data_recheck[start] = scan.max_pending
            s.hash.drop_below(min(s.data.min_pos, s.data_end) if s.data.starts else s.data_end)
            deleted["reclaimed_bytes"] = reclaimed
            return deleted

    def scan_data_segment(self, start: int, done_seq: int = -1,
                          open_ranges: list[tuple[int, int]] | None = None) -> _Scan:
        """The latest deliver time of a pending record in the segment at ``start`` (None if there is
        none), the runs of records ``reclaimable`` under ``done_seq`` and ``open_ranges`` (a run that
        continues a reclaimed range starts where that range does), and how many completed records are not
        reclaimable yet. Reclaimed ranges are stepped over. Read in chunks of ``scan_chunk`` bytes into
        one buffer kept for the store's life (why: docs/timer.md, Retention); the headers are walked by
        ``scan_records`` between the reclaimed ranges. It runs in a worker thread and lets go of the GIL
        every YIELD_EVERY records, so the event loop, woken meanwhile, waits for it a fraction of a
        millisecond, not the interpreter's 5 ms switch interval."""
        s = self.store
        end = start + s.data_seg
        marks = s._marks
        ranges = open_ranges or []
        hole_at, next_hole = s.data.hole_end, s.data.next_hole
        runs: list[tuple[int, int]] = []
        st: list[Any] = [None, -1, -1, 0]  # best, run's first, where its new part begins, waiting
        parsed, next_yield = 0, YIELD_EVERY
        chunk = max(self.scan_chunk, DATA_HDR_SIZE)
        with self._scan_lock:
            if self._scan_buf is None or len(self._scan_buf) != chunk + DATA_HDR_SIZE:
                self._scan_buf = bytearray(chunk + DATA_HDR_SIZE)
            buf = self._scan_buf
            view = memoryview(buf)
            fd = s.data.open_reader(start)
            if fd is None:
                return _Scan(None, [], 0)
            try:
                pos = start
                buf_at, have = start, 0  # buf[0:have] holds the segment's bytes from position buf_at
                while pos + DATA_HDR_SIZE <= end:
                    hole_end = hole_at(pos)
                    if hole_end is not None:  # reclaimed: completed records only
                        _close_run(st, pos, RECLAIM_MIN, runs)
                        st[1], st[2], pos = pos, hole_end, hole_end
                        continue
                    if pos + DATA_HDR_SIZE > buf_at + have:  # the header is not (wholly) in the buffer
                        keep = buf_at + have - pos if pos < buf_at + have else 0
                        if keep:
                            buf[:keep] = buf[pos - buf_at:pos - buf_at + keep]
                        want = min(chunk, end - pos - keep)
                        got = os.preadv(fd, [view[keep:keep + want]], pos + keep - start) if want > 0 else 0
                        buf_at, have = pos, keep + got
                        if pos + DATA_HDR_SIZE > buf_at + have:
                            break  # the segment's written end
                    stop = next_hole(pos)
                    pos, n, ended = scan_records(buf, buf_at, have, pos, end if stop is None else stop,
                                                 next_yield - parsed, marks, done_seq, ranges, RECLAIM_MIN,
                                                 st, runs)
                    if ended:
                        break
                    parsed += n
                    if parsed >= next_yield:
                        time.sleep(0)  # releases the GIL
                        next_yield = parsed + YIELD_EVERY
                _close_run(st, pos, RECLAIM_MIN, runs)
            finally:
                view.release()
                os.close(fd)
        return _Scan(st[0], runs, st[3])


def _close_run(st: list[Any], at: int, min_run: int, runs: list[tuple[int, int]]) -> None:
    """End the run in ``st`` (if any) at ``at``: kept in ``runs`` when its new part is ``min_run`` long."""
    if st[1] >= 0 and at - st[2] >= min_run:
        runs.append((st[1], at))
    st[1] = -1


@pure_twin("scan_records")
def scan_records_py(buf: Buffer, buf_at: int, have: int, pos: int, stop: int, limit: int,
                    marks: dict[int, Any], done_seq: int, open_ranges: list[tuple[int, int]], min_run: int,
                    st: list[Any], runs: list[tuple[int, int]]) -> tuple[int, int, bool]:
    """Walk the data records from ``pos`` (a record's start; ``buf[0:have]`` holds the bytes from position
    ``buf_at`` on) while their header lies in the buffer, before ``stop``, at most ``limit`` of them. ``st``
    is updated in place: [0] the latest deliver time of a PENDING record not in ``marks`` (None: none
    yet), [1] the first position of the current run of reclaimable records (-1: none), [2] where the
    run's new part began, [3] completed records not reclaimable. A run that ends goes into ``runs`` when
    its new part is ``min_run`` bytes or longer. Returns (the next position, records walked, whether a
    header was not a record's: the written end).

    Reclaimable: a completed record whose completion is in a checkpoint (``done_seq`` at most the
    checkpoint's: its mark is in the record and synced, and the done logs' replay at open skips
    reclaimed ranges), and not one whose completion a crash's recovery still has to count when its slot
    comes round (``done_seq`` inside one of ``open_ranges``)."""
    n = 0
    unpack = DATA_HDR.unpack_from
    while n < limit and pos < stop and pos + DATA_HDR_SIZE <= buf_at + have:
        magic, size, state, _g, deliver, _d, _c, _o, seq, _crc, _t = unpack(buf, pos - buf_at)
        if magic != DATA_MAGIC or size < DATA_HDR_SIZE:
            return pos, n, True
        if state == PENDING:
            if pos not in marks and (st[0] is None or deliver > st[0]):
                st[0] = deliver
            ok = False
        else:
            ok = seq <= done_seq and not any(lo < seq < hi for lo, hi in open_ranges)
        if ok:
            if st[1] < 0:
                st[1] = st[2] = pos
        else:
            if state != PENDING:
                st[3] += 1
            if st[1] >= 0 and pos - st[2] >= min_run:
                runs.append((st[1], pos))
            st[1] = -1
        pos += size
        n += 1
    return pos, n, False


scan_records = kernels.scan_records
