"""Retention of TimerStore (a base class of it, sharing its state): delete processed wheel days and
index segments (by the persisted watermark), data segments holding no pending record, and hash
generations naming only deleted data. Rules: the data segments are scanned without the lock (only
ever to keep a segment longer than needed); the deletions run under ``self.lock``.
"""

from __future__ import annotations

import os

from chronomq.store import faults

from .records import DATA_HDR, DATA_HDR_SIZE, DATA_MAGIC, IDX_SIZE, PENDING
from .state import TimerState


class Retention(TimerState):
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
            faults.point("timer.retention")
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
        """The latest deliver time of a pending record in the segment, or None if there is none. Read in
        large chunks (one pread per record header made a backlog's first retention pass take seconds)
        into one buffer kept for the store's life: fresh multi-MiB buffers in worker threads stayed
        with glibc's per-thread arenas, and the broker's heap grew by 16 MiB at each segment scanned."""
        end = start + self.data_seg
        best = None
        marks = self._marks
        chunk = max(self.scan_chunk, DATA_HDR_SIZE)
        with self._scan_lock:
            if self._scan_buf is None or len(self._scan_buf) != chunk + DATA_HDR_SIZE:
                self._scan_buf = bytearray(chunk + DATA_HDR_SIZE)
            buf = self._scan_buf
            view = memoryview(buf)
            fd = self.data.open_reader(start)
            if fd is None:
                return None
            try:
                pos = start
                buf_at, have = start, 0  # buf[0:have] holds the segment's bytes from position buf_at
                while pos + DATA_HDR_SIZE <= end:
                    if pos + DATA_HDR_SIZE > buf_at + have:  # the header is not (wholly) in the buffer
                        keep = buf_at + have - pos if pos < buf_at + have else 0
                        if keep:
                            buf[:keep] = buf[pos - buf_at:pos - buf_at + keep]
                        want = min(chunk, end - pos - keep)
                        got = os.preadv(fd, [view[keep:keep + want]], pos + keep - start) if want > 0 else 0
                        buf_at, have = pos, keep + got
                        if pos + DATA_HDR_SIZE > buf_at + have:
                            break  # the segment's written end
                    h = DATA_HDR.unpack_from(buf, pos - buf_at)
                    if h[0] != DATA_MAGIC or h[1] < DATA_HDR_SIZE:
                        break
                    if h[2] == PENDING and pos not in marks:
                        best = h[4] if best is None else max(best, h[4])
                    pos += h[1]
            finally:
                view.release()
                os.close(fd)
        return best
