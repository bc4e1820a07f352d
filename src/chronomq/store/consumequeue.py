"""Consume queues: per (topic, queueId), 20-byte units (commit-log offset int64, size int32, tagsCode
int64) in segment files of ``mappedFileSizeConsumeQueue`` bytes named by the 20-digit byte offset of
their first unit (RocketMQ's layout). Logical queue offset = unit index. A unit with size 0 marks the end.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable

from chronomq.store.mapped import MappedFile, segment_files
from chronomq.store.types import CQUnit

log = logging.getLogger("chronomq.store")

UNIT = struct.Struct(">qiq")
UNIT_SIZE = 20
# a queue file gets disk blocks ahead of its writes, 16 KiB (819 units) first, then as much again as it has,
# up to 256 KiB (13,107 units) at a time: a queue that takes few messages holds little disk
CQ_FIRST_CHUNK = 16 * 1024
CQ_ALLOC_CHUNK = 256 * 1024


class ConsumeQueue:
    def __init__(self, root: str, topic: str, queue_id: int, file_size: int) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.dir = os.path.join(root, topic, str(queue_id))
        self.file_size = file_size
        self.units_per_file = file_size // UNIT_SIZE
        self.files: list[MappedFile] = []
        self.max_offset = 0  # next logical offset to write
        self.min_offset = 0  # first logical offset still readable
        self.lock = threading.Lock()
        self.dirty = False

    # --- files --------------------------------------------------------------------------------------
    def load(self) -> None:
        if not os.path.isdir(self.dir):
            return
        for path, start in segment_files(self.dir, self.file_size, "consume-queue file",
                                         "mappedFileSizeConsumeQueue"):
            if self.files and start != self.files[-1].end:
                break
            self.files.append(MappedFile(path, start, self.file_size))
            if self.files[-1].was_short:
                log.warning("consume queue %s/%d: file %s is shorter than mappedFileSizeConsumeQueue (cut); "
                            "its missing entries are rebuilt from the commit log", self.topic, self.queue_id,
                            path)
        if not self.files:
            return
        # The first used unit: normally the first of the file; a queue rebuilt from the middle of the log
        # (cleaned prefix, lost queue files) starts later, after zero units.
        # Read with pread, not through the mapping: on a full tmpfs, touching a hole of a mapped file
        # needs a new page and faults (SIGBUS); pread returns zeros for it.
        first = self.files[0]
        lead = 0
        if UNIT.unpack(os.pread(first.fd, UNIT_SIZE, 0))[1] == 0:
            head = os.pread(first.fd, first.file_size, 0)
            lead = (len(head) - len(head.lstrip(b"\0"))) // UNIT_SIZE
            if lead >= self.units_per_file:
                lead = 0  # no unit at all: an empty queue
        self.min_offset = first.start // UNIT_SIZE + lead
        # The end: the first unit of size 0 after the start (units are contiguous: binary search).
        last = self.files[-1]
        lo = lead if last is first else 0
        hi = self.units_per_file
        while lo < hi:
            mid = (lo + hi) // 2
            if UNIT.unpack(os.pread(last.fd, UNIT_SIZE, mid * UNIT_SIZE))[1] > 0:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.units_per_file and os.pread(last.fd, UNIT_SIZE, lo * UNIT_SIZE) != bytes(UNIT_SIZE):
            log.warning("consume queue %s/%d: file %s holds torn bytes after its last entry (position %d); "
                        "zeroed", self.topic, self.queue_id, last.path, lo * UNIT_SIZE)
            last.zero_tail(lo * UNIT_SIZE)
        last.written = last.flushed = lo * UNIT_SIZE
        for f in self.files[:-1]:
            f.written = f.flushed = f.file_size
        self.max_offset = last.start // UNIT_SIZE + lo
        if self.max_offset < self.min_offset:
            self.min_offset = self.max_offset

    def _file_for(self, offset: int) -> MappedFile | None:
        files = self.files
        if not files:
            return None
        i = offset // self.units_per_file - files[0].start // self.file_size
        if 0 <= i < len(files):
            return files[i]
        return None

    def _ensure_dir(self) -> None:
        os.makedirs(self.dir, exist_ok=True)

    def _drop_files(self) -> None:
        for f in self.files:
            f.destroy()
        self.files = []

    def prepare_first_file(self) -> bool:
        """Create the first file of a queue that has none and has never taken a unit (its first unit is
        at offset 0), with its first disk blocks, ahead of that unit: the writer then finds it made.
        Returns whether it made one. Any thread; OSError (a full disk) propagates."""
        with self.lock:
            if self.files or self.max_offset or self.min_offset:
                return False
            self._ensure_dir()
            f = MappedFile(os.path.join(self.dir, f"{0:020d}"), 0, self.file_size)
            try:
                f.allocate(min(CQ_FIRST_CHUNK, self.file_size), CQ_FIRST_CHUNK)
            except OSError:
                f.destroy()
                raise
            self.files.append(f)
            return True

    # --- writes (dispatcher thread) -----------------------------------------------------------------
    def append_units(self, first_offset: int, packed: bytes | bytearray, count: int) -> None:
        """Write ``count`` packed units whose first logical offset is ``first_offset``. Units already
        present (re-dispatch after recovery) are skipped; a gap is filled with empty units."""
        with self.lock:
            if first_offset < self.max_offset:
                skip = self.max_offset - first_offset
                if skip >= count:
                    return
                packed = packed[skip * UNIT_SIZE :]
                count -= skip
                first_offset = self.max_offset
            elif first_offset > self.max_offset:
                if self.max_offset == self.min_offset:  # empty: the queue starts here
                    if not self.max_offset and self.files and self._file_for(first_offset) is None:
                        self._drop_files()  # made ahead for offset 0 (prepare_first_file), never used
                    self.min_offset = self.max_offset = first_offset
                else:
                    self._write(self.max_offset, bytes((first_offset - self.max_offset) * UNIT_SIZE))
            self._write(first_offset, packed)
            self.dirty = True

    def _write(self, offset: int, data: bytes | bytearray) -> None:
        pos = 0
        n = len(data)
        while pos < n:
            f = self._file_for(offset)
            if f is None:
                self._ensure_dir()
                start = (offset // self.units_per_file) * self.file_size
                f = MappedFile(os.path.join(self.dir, f"{start:020d}"), start, self.file_size)
                if not self.files:
                    self.min_offset = max(self.min_offset, start // UNIT_SIZE)
                self.files.append(f)
            r = offset * UNIT_SIZE - f.start
            chunk = min(n - pos, f.file_size - r)
            if r + chunk > f.allocated:  # OSError (disk full) propagates: dispatch retries
                f.allocate(r + chunk, min(CQ_ALLOC_CHUNK, max(CQ_FIRST_CHUNK, f.allocated)))
            f.mm[r : r + chunk] = data[pos : pos + chunk]
            f.written = r + chunk
            pos += chunk
            offset += chunk // UNIT_SIZE
        self.max_offset = offset

    def first_at_or_after(self, phys: int, lo: int | None = None) -> int:
        """The first logical offset (from ``lo``, default the min offset) whose unit's commit-log offset
        is >= ``phys`` (max offset if none)."""
        lo, hi = self.min_offset if lo is None else lo, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            u = self._unit(mid)
            if u is not None and u[0] < phys:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def truncate_from_phys(self, phys: int) -> None:
        """Drop every unit whose commit-log offset is >= ``phys`` (recovery)."""
        with self.lock:
            self.truncate_from(self.first_at_or_after(phys))

    def truncate_from(self, lo: int) -> None:
        """Drop every unit from logical offset ``lo`` on (recovery; the caller holds the lock)."""
        if lo >= self.max_offset:
            return
        # zero [lo, max): whole files after the one holding lo go away
        keep = []
        for f in self.files:
            first = f.start // UNIT_SIZE
            if first >= lo and first > self.min_offset:
                f.destroy()
                continue
            keep.append(f)
            if first <= lo < first + self.units_per_file:
                f.zero_tail((lo - first) * UNIT_SIZE)
        self.files = keep
        self.max_offset = lo
        if not self.files:
            self.min_offset = lo

    def flush(self) -> None:
        if not self.dirty:
            return
        self.dirty = False
        for f in list(self.files):
            if f.flushed < f.written:
                f.flush()

    # --- reads --------------------------------------------------------------------------------------
    def _unit(self, offset: int) -> tuple[int, int, int] | None:
        f = self._file_for(offset)
        if f is None:
            return None
        try:
            return UNIT.unpack_from(f.mm, offset * UNIT_SIZE - f.start)
        except ValueError:
            return None

    def units(self, offset: int, max_count: int) -> list[tuple[int, int, int]]:
        """Raw (phys, size, tagsCode) units from ``offset`` (clamped to [min, max))."""
        return list(UNIT.iter_unpack(self.raw_units(offset, max_count)))

    def raw_units(self, offset: int, max_count: int) -> bytes:
        """The units from ``offset`` (clamped to [min, max)) as stored, UNIT_SIZE bytes each; up to the
        first that cannot be read (a file cleaned meanwhile)."""
        parts: list[bytes] = []
        offset = max(offset, self.min_offset)
        end = min(self.max_offset, offset + max_count)
        while offset < end:
            f = self._file_for(offset)
            if f is None:
                break
            r = offset * UNIT_SIZE - f.start
            n = min(end - offset, (f.file_size - r) // UNIT_SIZE)
            try:
                part = f.mm[r : r + n * UNIT_SIZE]
            except ValueError:
                break
            if len(part) != n * UNIT_SIZE:  # a file shorter than its size: up to its whole units
                parts.append(part[: len(part) - len(part) % UNIT_SIZE])
                break
            parts.append(part)
            offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def cq_units(self, offset: int, max_count: int) -> list[CQUnit]:
        start = max(offset, self.min_offset)
        return [CQUnit(start + i, p, s, t) for i, (p, s, t) in enumerate(self.units(start, max_count))]

    def offset_by_time(self, ts: int, store_time: Callable[[int], int | None]) -> int:
        """The first logical offset whose message's store time is >= ``ts`` (max offset if none)."""
        lo, hi = self.min_offset, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            u = self._unit(mid)
            t = store_time(u[0]) if u is not None else None
            if t is None or t < ts:  # message gone: treat it as older than anything asked for
                lo = mid + 1
            else:
                hi = mid
        return lo

    # --- cleaning -----------------------------------------------------------------------------------
    def clean_below(self, min_phys: int) -> int:
        """Drop whole files whose every unit points below ``min_phys`` (never the last file) and move the
        min offset to the first unit at or above it. Returns the number of files deleted."""
        deleted = 0
        with self.lock:
            while len(self.files) > 1:
                f = self.files[0]
                last = UNIT.unpack_from(f.mm, f.file_size - UNIT_SIZE)
                if last[1] > 0 and last[0] < min_phys:
                    f.destroy()
                    self.files = self.files[1:]
                    deleted += 1
                else:
                    break
            if self.files:
                first = self.files[0].start // UNIT_SIZE
                self.min_offset = self.first_at_or_after(min_phys, max(first, self.min_offset))
        return deleted

    def close(self) -> None:
        for f in self.files:
            f.close()
