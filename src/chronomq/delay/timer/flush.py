"""Durability of TimerStore (a base class of it, sharing its state): fsync the files, write the
delivery marks into their records, and the checkpoint. Rules: the lock is held only to take a snapshot
(swap the done logs, collect the fds, build the checkpoint); the fsyncs and the mark writes run outside
it; a checkpoint never overwrites a newer one (``_ckpt_lock``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Any

from chronomq.store.atomicfile import write_atomic

from .records import OFF_STATE
from .state import TimerState


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:  # closed meanwhile (retention deleted the file): nothing left to sync
        pass


_APPLY_SLICE = 1024  # applied marks dropped from memory per hold of the lock
_FSYNC_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="timer-fsync")


class FlushPath(TimerState):
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
        marks.sort()
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
            "hash_extent": list(self.hash.extent()),  # synced with everything else before this is written
            "done_seq": self.done_seq,
            "pending": {str(k): v for k, v in self.pending.items() if v},
            "idx_seg_max": {str(k): v for k, v in self.idx_seg_max.items()},
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
