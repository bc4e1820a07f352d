"""The timer store's files: segmented positional-I/O logs, the time wheel and the key hash index.

Everything here is synchronous and single-writer (the TimerStore lock serialises callers). Logs use
``os.pwrite``/``os.pread`` rather than mmap so the broker's resident memory does not grow with the data
written; only the small wheel files and the hash bucket tables are memory-mapped.
"""

from __future__ import annotations

import array
import bisect
import errno
import mmap
import operator
import os
import struct
import sys
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from chronomq.store.mapped import BackedPages
from chronomq.store.speedups import kernels, pure_twin

_Q = struct.Struct("<q")
_ZERO_CHUNK = bytes(4096)
_HOLE = struct.Struct("<qqi")  # a reclaimed range of a data segment: [first, end) positions, crc32 of both
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_PAGE = 4096
_libc: Any = None  # ctypes.CDLL, loaded at the first punch (ctypes costs a start 1.2 ms)


def punch_hole(fd: int, off: int, length: int) -> bool:
    """Give back the disk blocks of [off, off + length) of a file (they read as zeros afterwards), keeping
    its size. False when the file system or platform cannot (nothing changed then)."""
    global _libc
    if length <= 0 or not sys.platform.startswith("linux"):
        return False
    import ctypes

    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, _PUNCH, off, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def _heads_of(raw: bytes) -> array.array[int]:
    """Little-endian 8-byte bucket heads as an array of ints."""
    heads = array.array("q", raw)
    if sys.byteorder == "big":
        heads.byteswap()
    return heads


def _seg_name(start: int) -> str:
    return f"{start:020d}"


class SegmentedFile:
    """A logical byte space split into fixed-size files named by their 20-digit start position.
    One write never crosses a segment boundary (``write`` refuses it). Ranges of a segment may be
    reclaimed (``reclaim``): their pages become holes, and the ranges are listed in ``<start>.holes``
    (entries appended and synced before the punch) so that a walk of the segment steps over them."""

    def __init__(self, directory: Path, segment_size: int) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_size = segment_size
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._patches = 0
        self.changes = 0  # in-place overwrites so far (state, generation, deliver time): never reset
        self._dirty: set[int] = set()
        self.starts: list[int] = sorted(
            int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and len(p.name) == 20
        )
        # reclaimed ranges per segment: first -> end, and the firsts sorted (``in_hole``, ``next_hole``)
        self.holes: dict[int, dict[int, int]] = {}
        self._hole_firsts: dict[int, list[int]] = {}
        for start in self.starts:
            self._load_holes(start)

    # --- layout -------------------------------------------------------------------------------------
    def seg_start(self, pos: int) -> int:
        return pos - pos % self.segment_size

    @property
    def min_pos(self) -> int:
        return self.starts[0] if self.starts else 0

    def file_end(self) -> int:
        """The logical position just past the last byte present on disk."""
        if not self.starts:
            return 0
        last = self.starts[-1]
        return last + os.fstat(self._fd(last)).st_size

    def _fd(self, start: int, create: bool = False) -> int:
        fd = self._fds.get(start)
        if fd is None:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            fd = os.open(self.dir / _seg_name(start), flags, 0o644)
            self._fds[start] = fd
            if create and (not self.starts or self.starts[-1] < start):
                self.starts.append(start)
            elif create and start not in self.starts:
                self.starts.append(start)
                self.starts.sort()
        return fd

    # --- reclaimed ranges -------------------------------------------------------------------------------
    def _holes_path(self, start: int) -> Path:
        return self.dir / f"{_seg_name(start)}.holes"

    def _load_holes(self, start: int) -> None:
        try:
            raw = self._holes_path(start).read_bytes()
        except FileNotFoundError:
            return
        ranges: dict[int, int] = {}
        for off in range(0, len(raw) - len(raw) % _HOLE.size, _HOLE.size):
            first, end, crc = _HOLE.unpack_from(raw, off)
            if (zlib.crc32(raw[off:off + 16]) - (1 << 31) != crc
                    or not start <= first < end <= start + self.segment_size):
                break  # a torn last entry (its punch never ran)
            ranges[first] = end  # a later entry for the same first extends it
        if ranges:
            self.holes[start] = ranges
            self._hole_firsts[start] = sorted(ranges)

    def hole_end(self, pos: int) -> int | None:
        """The end of the reclaimed range that begins at ``pos``, or None."""
        ranges = self.holes.get(self.seg_start(pos))
        return None if ranges is None else ranges.get(pos)

    def next_hole(self, pos: int) -> int | None:
        """The first position of the next reclaimed range after ``pos`` in its segment, or None."""
        start = self.seg_start(pos)
        firsts = self._hole_firsts.get(start)
        if not firsts:
            return None
        i = bisect.bisect_right(firsts, pos)
        return firsts[i] if i < len(firsts) else None

    def in_hole(self, pos: int) -> bool:
        """Whether ``pos`` lies in a reclaimed range."""
        start = self.seg_start(pos)
        firsts = self._hole_firsts.get(start)
        if not firsts:
            return False
        i = bisect.bisect_right(firsts, pos) - 1
        return i >= 0 and pos < self.holes[start][firsts[i]]

    def reclaim(self, ranges: list[tuple[int, int]]) -> int:
        """Reclaim the [first, end) ranges, all in one segment (nothing there is read again; a ``first``
        may begin a range already reclaimed, which then grows): the ranges are recorded and synced (one
        write and one fsync for them all), then the whole pages inside each are punched. Returns the
        bytes punched (0 where the file system cannot punch: the ranges are recorded all the same).
        OSError from the record or a punch (nothing half done that a walk could misread: a recorded range
        is only ever skipped)."""
        if not ranges:
            return 0
        start = self.seg_start(ranges[0][0])
        if not all(start <= first < end <= start + self.segment_size for first, end in ranges):
            raise ValueError("the reclaimed ranges lie within one segment")
        entries = b"".join(_HOLE.pack(first, end, zlib.crc32(_HOLE.pack(first, end, 0)[:16]) - (1 << 31))
                           for first, end in ranges)
        fd = os.open(self._holes_path(start), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, entries)
            os.fsync(fd)
        finally:
            os.close(fd)
        known = self.holes.setdefault(start, {})
        firsts = self._hole_firsts.setdefault(start, [])
        for first, end in ranges:
            listed = first in known
            known[first] = end  # before ``first`` is listed: a reader that finds it listed finds its end
            if not listed:
                bisect.insort(firsts, first)
        # a descriptor of its own: this runs in retention's thread, and the writer's table is not shared
        fd = os.open(self.dir / _seg_name(start), os.O_WRONLY)
        punched = 0
        try:
            for first, end in ranges:
                lo = -(-(first - start) // _PAGE) * _PAGE
                hi = (end - start) // _PAGE * _PAGE
                if hi > lo and punch_hole(fd, lo, hi - lo):
                    punched += hi - lo
        finally:
            os.close(fd)
        return punched

    # --- I/O -------------------------------------------------------------------------------------------
    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        start = self.seg_start(pos)
        if pos - start + len(data) > self.segment_size:
            raise ValueError("write crosses a segment boundary")
        fd = self._fd(start, create=True)
        os.pwrite(fd, data, pos - start)
        self._dirty.add(start)

    def write_existing(self, pos: int, data: bytes) -> bool:
        """pwrite into a segment only if it still exists (never re-creates a deleted one). Safe from
        a worker thread: a segment deleted meanwhile just makes this a no-op."""
        start = self.seg_start(pos)
        fd = self._fds.get(start)
        try:
            if fd is None:
                if start not in self.starts:
                    return False
                fd = self._fd(start)
            os.pwrite(fd, data, pos - start)
            return True
        except (OSError, ValueError):
            return False

    def fds_for(self, positions: list[int]) -> list[int]:
        starts = {self.seg_start(p) for p in positions}
        return [fd for s, fd in list(self._fds.items()) if s in starts]

    def patch(self, pos: int, data: bytes) -> None:
        """Overwrite a few bytes in place, through a shared mapping (a pwrite would update the file's
        mtime, a journal transaction, at every call: docs/timer.md). The mapped pages are dropped from
        the page tables every 64 patches so they never accumulate in the process's resident set."""
        self.changes += 1
        start = self.seg_start(pos)
        off = pos - start
        mm = self._maps.get(start)
        if mm is None or off + len(data) > len(mm):
            fd = self._fd(start)
            size = os.fstat(fd).st_size
            if off + len(data) > size:
                os.pwrite(fd, data, off)
                self._dirty.add(start)
                return
            if mm is not None:
                mm.close()
            mm = self._maps[start] = mmap.mmap(fd, size)
        mm[off : off + len(data)] = data
        self._dirty.add(start)
        self._patches += 1
        if self._patches >= 64:
            # A write fault can map a whole large folio (up to MBs of the file); dropping the page
            # table entries (the dirty data stays in the page cache) keeps RSS flat, for < 1 us a patch.
            for m in self._maps.values():
                m.madvise(mmap.MADV_DONTNEED)
            self._patches = 0

    def release_maps(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()
        self._patches = 0

    def read(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (fewer at the end of a file; empty when the segment is gone)."""
        start = self.seg_start(pos)
        if start not in self._fds and start not in self.starts:
            return b""
        try:
            fd = self._fd(start)
        except FileNotFoundError:
            return b""
        return os.pread(fd, min(n, self.segment_size - (pos - start)), pos - start)

    def open_reader(self, start: int) -> int | None:
        """A read-only descriptor of its own on the segment at ``start`` (safe from a thread other than
        the writer's), to be closed by the caller; None if the segment is gone."""
        try:
            return os.open(self.dir / _seg_name(start), os.O_RDONLY)
        except FileNotFoundError:
            return None

    def truncate(self, end: int) -> None:
        """Drop everything at or beyond logical position ``end``."""
        self.release_maps()
        for start in list(self.starts):
            if start >= end:
                self.delete_segment(start)
            elif start + self.segment_size > end:
                os.ftruncate(self._fd(start), end - start)
                self._dirty.add(start)

    def delete_segment(self, start: int) -> None:
        mm = self._maps.pop(start, None)
        if mm is not None:
            mm.close()
        fd = self._fds.pop(start, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(start)
        try:
            (self.dir / _seg_name(start)).unlink()
        except FileNotFoundError:
            pass
        self._holes_path(start).unlink(missing_ok=True)
        self.holes.pop(start, None)
        self._hole_firsts.pop(start, None)
        if start in self.starts:
            self.starts.remove(start)

    def take_dirty_fds(self) -> list[int]:
        """File descriptors written since the last call (fsync them outside any lock; pages changed
        through a shared mapping are in the page cache, so an fsync of the file covers them)."""
        fds = [self._fds[s] for s in self._dirty if s in self._fds]
        self._dirty.clear()
        return fds

    def sync(self) -> None:
        for mm in self._maps.values():
            mm.flush()
        for start in list(self._dirty):
            fd = self._fds.get(start)
            if fd is not None:
                os.fsync(fd)
        self._dirty.clear()

    def disk_bytes(self) -> int:
        total = 0
        for start in self.starts:
            try:
                total += os.fstat(self._fd(start)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        self.release_maps()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class Wheel:
    """Absolute time wheel: one small file per day of slots (``slot_ms`` each). A slot holds the index
    entry number + 1 of the newest entry linked into it (0 = empty); entries chain backwards through
    their ``prev`` field. Files for days that are fully processed are deleted."""

    def __init__(self, directory: Path, slot_ms: int) -> None:
        if 86_400_000 % slot_ms:
            raise ValueError(f"timer slot size {slot_ms} ms must divide a day (86,400,000 ms)")
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.slot_ms = slot_ms
        self.per_file = 86_400_000 // slot_ms
        self.file_bytes = self.per_file * 8
        self._maps: dict[int, mmap.mmap] = {}
        self._fds: dict[int, int] = {}
        self._backing: dict[int, BackedPages] = {}
        self.cut: list[str] = []  # files found shorter or longer than a day of slots (torn)
        for p in self.dir.iterdir():
            if p.name.isdigit():
                self._open(int(p.name), create=False)

    def _open(self, fno: int, create: bool) -> mmap.mmap | None:
        mm = self._maps.get(fno)
        if mm is not None:
            return mm
        path = self.dir / f"{fno:08d}"
        if not create and not path.exists():
            return None
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size != self.file_bytes:
            if not create:
                self.cut.append(path.name)
            os.ftruncate(fd, self.file_bytes)
        mm = mmap.mmap(fd, self.file_bytes)
        self._maps[fno] = mm
        self._fds[fno] = fd
        self._backing[fno] = BackedPages(fd, self.file_bytes)
        return mm

    def reserve(self, slots: Iterable[int]) -> None:
        """Give disk blocks to the wheel pages of ``slots`` before they are set (a full disk raises
        OSError here, never a SIGBUS in ``set``)."""
        per = self.per_file
        for slot in slots:
            fno = slot // per
            if self._open(fno, create=True) is not None:
                self._backing[fno].ensure(((slot % per) * 8,))

    def get(self, slot: int) -> int:
        fno = slot // self.per_file
        mm = self._maps.get(fno)  # every existing file is mapped at open
        off = (slot % self.per_file) * 8
        if mm is None or not self._backing[fno].has(off):
            return 0  # a hole: read through the mapping it could be a SIGBUS on a full tmpfs
        return _Q.unpack_from(mm, off)[0]

    def set(self, slot: int, value: int) -> None:
        fno = slot // self.per_file
        mm = self._maps.get(fno) or self._open(fno, create=True)
        assert mm is not None
        off = (slot % self.per_file) * 8
        self._backing[fno].ensure((off,))
        _Q.pack_into(mm, off, value)

    def next_nonempty(self, from_slot: int) -> int | None:
        """The first slot >= from_slot with a chain, or None."""
        first_file = from_slot // self.per_file
        for fno in sorted(f for f in self._maps if f >= first_file):
            mm = self._maps[fno]
            backed = self._backing[fno].backed
            off = max(0, from_slot - fno * self.per_file) * 8
            end = self.file_bytes
            while off < end:
                # Aligned 4 KiB chunks (pages) compared against zeros run at C speed; holes are zeros.
                chunk_end = min(end, (off // 4096 + 1) * 4096)
                if off // 4096 not in backed:
                    off = chunk_end
                    continue
                chunk = mm[off:chunk_end]
                if chunk != _ZERO_CHUNK[: len(chunk)]:
                    stripped = chunk.lstrip(b"\0")
                    first_byte = off + len(chunk) - len(stripped)
                    return fno * self.per_file + first_byte // 8
                off = chunk_end
        return None

    def delete_through(self, slot: int) -> None:
        """Delete files whose every slot is <= ``slot``."""
        for fno in [f for f in self._maps if (f + 1) * self.per_file - 1 <= slot]:
            self._maps.pop(fno).close()
            self._backing.pop(fno, None)
            os.close(self._fds.pop(fno))
            (self.dir / f"{fno:08d}").unlink(missing_ok=True)

    def max_value(self) -> int:
        best = 0
        page = BackedPages.PAGE
        for fno, mm in self._maps.items():
            for p in self._backing[fno].backed:  # holes are zeros
                n = min(page, self.file_bytes - p * page) // 8
                best = max(best, *struct.unpack_from(f"<{n}q", mm, p * page))
        return best

    def clear(self) -> None:
        for fno in list(self._maps):
            self._maps.pop(fno).close()
            self._backing.pop(fno, None)
            os.close(self._fds.pop(fno))
            (self.dir / f"{fno:08d}").unlink(missing_ok=True)

    @property
    def files(self) -> int:
        return len(self._maps)

    def sync(self) -> None:
        for mm in self._maps.values():
            mm.flush()

    def all_fds(self) -> list[int]:
        return list(self._fds.values())

    def disk_bytes(self) -> int:
        return sum(os.fstat(fd).st_blocks * 512 for fd in self._fds.values())

    def close(self) -> None:
        for fno in list(self._maps):
            self._maps.pop(fno).close()
            self._backing.pop(fno, None)
            os.close(self._fds.pop(fno))


# --- key hash index -------------------------------------------------------------------------------------
HASH_ENTRY = struct.Struct("<iqq")  # key hash, data position, prev entry number + 1 (0 = none)
HASH_ENTRY_SIZE = HASH_ENTRY.size  # 20


def key_hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def add_key_items(out: list[tuple[int, int]], uniq: str, keys: str | None, pos: int) -> None:
    """The hash entries of the record at ``pos``: its UNIQ_KEY ("u:") and each of its KEYS ("k:")."""
    crc32 = zlib.crc32
    out.append((crc32(("u:" + uniq).encode()) & 0x7FFFFFFF, pos))
    if keys:
        for k in keys.split(" "):
            if k:
                out.append((crc32(("k:" + k).encode()) & 0x7FFFFFFF, pos))


@pure_twin("pack_hash_entries")
def pack_hash_entries_py(items: list[tuple[int, int]], count: int, buckets: int, bmap: mmap.mmap,
                         backed: set[int]) -> tuple[bytearray, dict[int, int], int]:
    """The entries of ``items`` [(key hash, data position)] numbered from ``count`` + 1, each linked to
    the previous head of its bucket (in ``bmap``, 8 bytes a bucket; a page not in ``backed`` is a hole
    and reads as zero, or an earlier item of the run). Returns the bytes, the new heads (byte offset
    in ``bmap`` -> entry number + 1) and the highest position (-1 for none)."""
    buf = bytearray()
    n = count
    heads: dict[int, int] = {}
    page = BackedPages.PAGE
    pack = HASH_ENTRY.pack
    max_pos = -1
    for h, pos in items:
        b = (h % buckets) * 8
        prev = heads.get(b)
        if prev is None:
            prev = _Q.unpack_from(bmap, b)[0] if b // page in backed else 0
        buf += pack(h, pos, prev)
        n += 1
        heads[b] = n
        if pos > max_pos:
            max_pos = pos
    return buf, heads, max_pos


class _HashGeneration:
    def __init__(self, directory: Path, gen: int, buckets: int, capacity: int) -> None:
        self.gen = gen
        self.bucket_path = directory / f"{gen:08d}.buckets"
        self.entry_path = directory / f"{gen:08d}.entries"
        self._bfd = os.open(self.bucket_path, os.O_RDWR | os.O_CREAT, 0o644)
        size = os.fstat(self._bfd).st_size
        if size and not size % 8 and size // 8 != buckets:
            # the table on disk wins (a small first generation, or one made with another setting); its
            # entries in proportion, as HashIndex sizes a small first generation
            capacity = max(1, capacity * (size // 8) // buckets)
            buckets = size // 8
        elif size != buckets * 8:
            os.ftruncate(self._bfd, buckets * 8)
        self.buckets = buckets
        self.capacity = capacity
        self.bmap = mmap.mmap(self._bfd, buckets * 8)
        self._backing = BackedPages(self._bfd, buckets * 8)
        self.efd = os.open(self.entry_path, os.O_RDWR | os.O_CREAT, 0o644)
        size = os.fstat(self.efd).st_size
        if size % HASH_ENTRY_SIZE:  # a torn tail entry after a crash
            size -= size % HASH_ENTRY_SIZE
            os.ftruncate(self.efd, size)
        self.count = size // HASH_ENTRY_SIZE
        self.max_pos = -1
        if self.count:
            _, self.max_pos, _ = HASH_ENTRY.unpack(os.pread(self.efd, HASH_ENTRY_SIZE,
                                                            (self.count - 1) * HASH_ENTRY_SIZE))

    def add_many(self, items: list[tuple[int, int]]) -> None:
        # Entries are written first and the bucket heads moved after, so a crash in between leaves
        # the old chains intact (the new entries are just unreachable).
        buf, heads, max_pos = pack_hash_entries(items, self.count, self.buckets, self.bmap,
                                                self._backing.backed)
        self._backing.ensure(heads)  # a full disk fails here, before anything is written
        os.pwrite(self.efd, buf, self.count * HASH_ENTRY_SIZE)
        self.count += len(items)
        self.max_pos = max(self.max_pos, max_pos)
        for b, head in heads.items():
            _Q.pack_into(self.bmap, b, head)

    def cut_back(self, count: int) -> int:
        """After a crash: keep the first ``count`` entries (what the last flush synced along with the
        bucket table) and drop the rest, whichever of them reached the disk. A head naming a dropped
        entry means the bucket table moved on after the flush: such heads are moved back along the
        dropped entries' links (read before the cut), or, when those cannot be followed, every head is
        recomputed from the entries kept. Returns how many heads changed."""
        count = max(0, min(count, self.count))
        dropped = b""
        if count < self.count:
            dropped = os.pread(self.efd, (self.count - count) * HASH_ENTRY_SIZE, count * HASH_ENTRY_SIZE)
            os.ftruncate(self.efd, count * HASH_ENTRY_SIZE)
            self.count = count
        self.max_pos = -1
        if count:
            _, self.max_pos, _ = HASH_ENTRY.unpack(os.pread(self.efd, HASH_ENTRY_SIZE,
                                                            (count - 1) * HASH_ENTRY_SIZE))
        if not self._names_dropped(count):
            return 0
        fixed = self._unwind_heads(count, dropped)
        return self.rebuild_buckets() if fixed is None else fixed

    def _names_dropped(self, count: int) -> bool:
        """Does a head name an entry past ``count``? (a page at a time, at C speed)"""
        return any(max(heads, default=0) > count for _base, heads in self._stored_pages())

    def _unwind_heads(self, count: int, dropped: bytes) -> int | None:
        """Move the heads that name a dropped entry back along the dropped entries' own links (each entry
        names the head its bucket had before it) to the first kept entry, or none: what the table held
        at ``count`` entries. Only the buckets of the dropped entries are visited. None, with the table
        as it was, when a link cannot be followed (an entry that did not reach the disk, or one of another
        bucket) or a head outside those buckets names a dropped entry: the caller then rebuilds every
        head from the entries. Returns how many heads changed."""
        entries = list(HASH_ENTRY.iter_unpack(dropped))
        buckets = self.buckets
        backing = self._backing
        back: dict[int, tuple[int, int]] = {}  # bucket byte -> (head, head moved back)
        for b in {(h % buckets) * 8 for h, _pos, _prev in entries}:
            if not backing.has(b):
                continue  # a hole: no head, nothing to move back
            head = cur = _Q.unpack_from(self.bmap, b)[0]
            while cur > count:
                k = cur - count - 1
                if k >= len(entries):
                    return None
                h, pos, prev = entries[k]
                if (h == pos == prev == 0) or pos < 0 or prev >= cur or (h % buckets) * 8 != b:
                    return None
                cur = prev
            if cur != head:
                back[b] = (head, cur)
        for b, (_head, moved) in back.items():
            _Q.pack_into(self.bmap, b, moved)
        if self._names_dropped(count):
            for b, (head, _moved) in back.items():
                _Q.pack_into(self.bmap, b, head)
            return None
        return len(back)

    def _stored_pages(self) -> Iterator[tuple[int, array.array[int]]]:
        """(first byte, heads) of every page of the bucket table with a disk block (the others are holes,
        zero), the heads as an array: a crash's checks run at C speed over the whole table."""
        page = BackedPages.PAGE
        end = self.buckets * 8
        for p in sorted(self._backing.backed):
            base = p * page
            if base < end:
                yield base, _heads_of(self.bmap[base:min(base + page, end)])

    def rebuild_buckets(self) -> int:
        """Recompute every bucket head from the entry file. Returns how many heads changed. The table is
        compared and rewritten a page at a time (arrays, C speed): a crash's recovery costs the entries
        read, not a Python step per bucket."""
        heads: dict[int, int] = {}
        buckets = self.buckets
        chunk = 1 << 16
        for first in range(0, self.count, chunk):
            n = min(chunk, self.count - first)
            raw = os.pread(self.efd, n * HASH_ENTRY_SIZE, first * HASH_ENTRY_SIZE)
            heads.update({(h % buckets) * 8: first + i + 1
                          for i, (h, _pos, _prev) in enumerate(HASH_ENTRY.iter_unpack(raw))})
        page, end = BackedPages.PAGE, buckets * 8
        by_page: dict[int, list[tuple[int, int]]] = {}
        for b, head in heads.items():
            by_page.setdefault(b // page, []).append((b, head))
        backed = self._backing.backed
        changed = 0
        rewrite: list[tuple[int, array.array[int]]] = []
        for p in sorted(backed | by_page.keys()):
            base = p * page
            if base >= end:
                continue
            size = min(page, end - base)
            new = _heads_of(bytes(size))
            for b, head in by_page.get(p, ()):
                new[(b - base) // 8] = head
            stored = _heads_of(self.bmap[base:base + size]) if p in backed else _heads_of(bytes(size))
            if new != stored:  # heads moved on, or name entries lost with the rest of the file
                changed += sum(map(operator.ne, new, stored))
                rewrite.append((base, new))
        self._backing.ensure(base for base, _new in rewrite)
        for base, new in rewrite:
            if sys.byteorder == "big":
                new.byteswap()
            self.bmap[base:base + len(new) * 8] = new.tobytes()
        return changed

    def _head(self, b: int) -> int:
        """The bucket head at byte ``b`` (0 in a hole, which is not read: see BackedPages)."""
        return _Q.unpack_from(self.bmap, b)[0] if self._backing.has(b) else 0

    def lookup(self, h: int) -> list[int]:
        out = []
        cur = self._head((h % self.buckets) * 8)
        steps = 0
        while cur and steps < self.count + 1:
            steps += 1
            idx = cur - 1
            if not 0 <= idx < self.count:  # a damaged head or link names no entry
                break
            eh, pos, prev = HASH_ENTRY.unpack(os.pread(self.efd, HASH_ENTRY_SIZE, idx * HASH_ENTRY_SIZE))
            if eh == h:
                out.append(pos)
            if prev >= cur:  # never loop on a corrupt chain
                break
            cur = prev
        return out

    def sync(self) -> None:
        self.bmap.flush()
        os.fsync(self.efd)

    def disk_bytes(self) -> int:
        return os.fstat(self._bfd).st_blocks * 512 + os.fstat(self.efd).st_blocks * 512

    def close(self, delete: bool = False) -> None:
        self.bmap.close()
        os.close(self._bfd)
        os.close(self.efd)
        if delete:
            self.bucket_path.unlink(missing_ok=True)
            self.entry_path.unlink(missing_ok=True)


# A new key hash starts with a first generation FIRST_GENERATION_SHRINK times smaller than the configured
# one (buckets and entries alike, so its chains are as long when it is full), so that a store holding few
# keys has a small bucket table on disk (the configured 2^20 buckets are 8 MiB once keys touch every page)
# and a crash's recovery checks a small table; the generations after it have the configured size. Not
# when that would leave fewer than FIRST_GENERATION_MIN_BUCKETS buckets.
FIRST_GENERATION_SHRINK = 16
FIRST_GENERATION_MIN_BUCKETS = 4096


class HashIndex:
    """Key -> data positions, in generations (each: a bucket table + an append-only entry file). The
    newest generation takes writes; a generation is dropped once every position it names is gone. The
    first generation of a new hash is smaller (FIRST_GENERATION_SHRINK); each generation's table size is
    its file's."""

    def __init__(self, directory: Path, buckets: int, capacity: int) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.buckets = buckets
        self.capacity = capacity
        gens = sorted(int(p.name.split(".")[0]) for p in self.dir.glob("*.entries"))
        self.gens = [_HashGeneration(self.dir, g, buckets, capacity) for g in gens]
        if not self.gens:
            small = buckets // FIRST_GENERATION_SHRINK
            if small >= FIRST_GENERATION_MIN_BUCKETS:
                first = _HashGeneration(self.dir, 0, small, max(1, capacity // FIRST_GENERATION_SHRINK))
            else:
                first = _HashGeneration(self.dir, 0, buckets, capacity)
            self.gens.append(first)

    def add_many(self, items: list[tuple[int, int]]) -> None:
        while items:
            cur = self.gens[-1]
            if cur.count >= cur.capacity:
                cur.sync()
                cur = _HashGeneration(self.dir, cur.gen + 1, self.buckets, self.capacity)
                self.gens.append(cur)
            take = cur.capacity - cur.count
            cur.add_many(items[:take])
            items = items[take:]

    def lookup(self, text: str) -> list[int]:
        h = key_hash(text)
        out: list[int] = []
        for g in reversed(self.gens):
            out.extend(g.lookup(h))
        return out

    def extent(self) -> tuple[int, int]:
        """(generation, entries) of the generation taking writes: what a checkpoint records."""
        g = self.gens[-1]
        return g.gen, g.count

    def cut_back(self, gen: int, count: int) -> int:
        """After a crash: back to ``extent()`` as a checkpoint recorded it (generations started since are
        deleted; older ones were synced when they filled up). Returns how many bucket heads changed."""
        while len(self.gens) > 1 and self.gens[-1].gen > gen:
            self.gens.pop().close(delete=True)
        g = self.gens[-1]
        return g.cut_back(count if g.gen == gen else g.count)

    def drop_below(self, min_pos: int) -> None:
        while len(self.gens) > 1 and self.gens[0].max_pos < min_pos:
            self.gens.pop(0).close(delete=True)

    def sync(self) -> None:
        for g in self.gens:
            g.sync()

    def all_fds(self) -> list[int]:
        return [fd for g in self.gens for fd in (g._bfd, g.efd)]

    def disk_bytes(self) -> int:
        return sum(g.disk_bytes() for g in self.gens)

    def close(self) -> None:
        for g in self.gens:
            g.close()


# the compiled kernel when built (chronomq.store.speedups chooses); pack_hash_entries_py is its twin
pack_hash_entries = kernels.pack_hash_entries
