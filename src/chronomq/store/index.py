"""IndexFile: a hash index from "topic#key" (each KEYS word and the UNIQ_KEY) to commit-log offsets.

RocketMQ's layout: a 40-byte header (begin/end store timestamp, begin/end physical offset, used slots,
entry count), ``maxHashSlotNum`` 4-byte slots holding the newest entry number of their chain, then
``maxIndexNum`` 20-byte entries (key hash int32, physical offset int64, seconds since the file's begin
timestamp int32, previous entry in the chain int32). Entry 0 is unused so 0 means "none". Files are
named by a 20-digit sequence number (physical offsets can repeat after recovery truncates the log); a
full file is followed by a new one. The first file of an empty index is FIRST_FILE_SHRINK times smaller
(slots and entries alike); a file's geometry is read from its size when it is opened again.

Lookups return candidate offsets only: the caller reads each record and checks its topic, keys and
store time (hash collisions, and entries left by a crash past the recovered end, are filtered there).
"""

from __future__ import annotations

import array
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterable

from chronomq.store.mapped import MappedFile, data_pages, pwrite_all
from chronomq.store.speedups import Buffer, kernels, pure_twin
from chronomq.store.types import DispatchRequest

HEADER = struct.Struct(">qqqqii")
HEADER_SIZE = 40
ENTRY = struct.Struct(">iqii")
ENTRY_SIZE = 20
I32 = struct.Struct(">i")
SLOT_PAGE_BITS = 12
SLOT_PAGE = 1 << SLOT_PAGE_BITS  # write-back granularity of an in-memory slot table
RUN_PAGES = 64  # at most this many pages are copied out at once while the writer waits
# IndexFile.view: (mapping, descriptor, slot table in memory or None, slot count, entries' start, entry
# count, begin time)
IndexView = tuple[Buffer, int, bytearray | None, int, int, int, int]


def _pread_table(fd: int, n: int) -> bytearray:
    """The slot table of a file, read into memory with one copy (its holes read as zeros)."""
    table = bytearray(n)
    view, done = memoryview(table), 0
    while done < n:
        got = os.preadv(fd, [view[done:]], HEADER_SIZE + done)
        if got <= 0:
            break  # past the file's end: zeros
        done += got
    return table


def _write_table(fd: int, table: bytearray) -> None:
    """Write a whole slot table back: the pages that hold a slot, and the pages of the file's table that
    have disk blocks (they may hold old slots); pages that are holes and stay zero are left holes."""
    backed = data_pages(fd, HEADER_SIZE + len(table), SLOT_PAGE)
    view = memoryview(table)
    zero = bytes(SLOT_PAGE)
    for first in range(0, len(table), SLOT_PAGE):
        page = view[first:first + SLOT_PAGE]
        at = HEADER_SIZE + first
        had_blocks = at // SLOT_PAGE in backed or (at + len(page) - 1) // SLOT_PAGE in backed
        if had_blocks or page != zero[:len(page)]:
            pwrite_all(fd, page, at)


# A store's first index file has FIRST_FILE_SHRINK times fewer slots than configured, so that a store
# holding few keys does not give its slot table's every page a disk block: 60,000 keys touch every page of
# 5,000,000 slots, 20 MiB. It takes at most one entry a slot: its chains are one entry long on average when
# it is full, where a configured file's are index_num / slot_num (4 by default), and a key query walks
# them (a de-duplicated send asks for every key it stores). The files after it have the configured size.
# Not when that would leave fewer than FIRST_FILE_MIN_SLOTS slots. A first file written by an earlier
# version has FIRST_FILE_SHRINK times fewer entries than configured; it is read back as it is.
FIRST_FILE_SHRINK = 16
FIRST_FILE_MIN_SLOTS = 4096


def first_file_geometry(slot_num: int, index_num: int) -> tuple[int, int]:
    """(slots, entries) of a store's first index file under the configured counts."""
    slots = slot_num // FIRST_FILE_SHRINK
    entries = min(index_num // FIRST_FILE_SHRINK, slots)
    return (slots, entries) if slots >= FIRST_FILE_MIN_SLOTS and entries >= 2 else (slot_num, index_num)


def file_geometry(size: int, slot_num: int, index_num: int) -> tuple[int, int]:
    """(slots, entries) of an index file of ``size`` bytes under the configured counts: a small first
    file's when its size is one (this version's or an earlier one's), else the configured (a new file,
    or one of another size)."""
    slots, entries = first_file_geometry(slot_num, index_num)
    if (slots, entries) != (slot_num, index_num):
        for n in (entries, index_num // FIRST_FILE_SHRINK):
            if size == HEADER_SIZE + slots * 4 + n * ENTRY_SIZE:
                return slots, n
    return slot_num, index_num


def key_hash(key: str) -> int:
    """Must match the hash index_entries computes inline."""
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


class IndexFile:
    """One index file. While it takes entries (``hold_slots``) its slot table lives in process memory and
    is written back by ``write_back``: a store into a mapped page that a flush has just written to disk
    faults (the kernel write-protects clean shared pages), and random slot writes would take that fault
    on nearly every entry. Entries and the header are written through the mapping (sequential)."""

    def __init__(self, path: str, slot_num: int, index_num: int) -> None:
        self.slot_num = slot_num
        self.index_num = index_num
        self.size = HEADER_SIZE + slot_num * 4 + index_num * ENTRY_SIZE
        self.mf = MappedFile(path, int(os.path.basename(path)), self.size)
        self.mm = self.mf.mm
        self.entries_at = HEADER_SIZE + slot_num * 4
        # the header's page is stored through the mapping; the slot table only ever with pwrite (which
        # reports a full disk as ENOSPC) and read with pread, so it stays a hole until a page is written:
        # a new file costs no 20 MB of zeros, on disk or in time
        self.mf.allocate(HEADER_SIZE, chunk=SLOT_PAGE)
        self.mf.skip_allocation(self.entries_at)
        self.dirty = False
        self.slots: bytearray | None = None  # the slot table in memory while the file takes entries
        self.dirty_pages: set[int] = set()  # SLOT_PAGE-sized pages of ``slots`` not yet written back
        (self.begin_ts, self.end_ts, self.begin_phy, self.end_phy, self.slots_used,
         self.count) = HEADER.unpack_from(self.mm, 0)
        # a count out of range, or none at all (a file is made for its first entry), is a torn header
        self.header_intact = 0 < self.count <= index_num
        if self.count <= 0 or self.count > index_num:
            self.count = 1
            self.begin_ts = self.end_ts = 0
            self.begin_phy = self.end_phy = -1

    @property
    def full(self) -> bool:
        return self.count >= self.index_num

    def hold_slots(self) -> bytearray:
        """The slot table in memory (read from the file the first time)."""
        if self.slots is None:
            if self.count <= 1:
                self.slots = bytearray(self.slot_num * 4)  # a new file: all zeros
            else:
                self.slots = _pread_table(self.mf.fd, self.slot_num * 4)
        return self.slots

    def write_header(self) -> None:
        HEADER.pack_into(self.mm, 0, self.begin_ts, self.end_ts, self.begin_phy, self.end_phy,
                         self.slots_used, self.count)
        self.dirty = True

    def take_dirty_runs(self) -> list[tuple[int, int]]:
        """[first, end) page runs of the slot table changed since the last call, at most RUN_PAGES long.
        The caller holds the service's write lock."""
        pages = self.dirty_pages
        if self.slots is None or not pages:
            return []
        self.dirty_pages = set()
        runs: list[tuple[int, int]] = []
        start = prev = -2
        for p in sorted(pages):
            if p != prev + 1 or p - start >= RUN_PAGES:
                if start >= 0:
                    runs.append((start, prev + 1))
                start = p
            prev = p
        runs.append((start, prev + 1))
        return runs

    def copy_run(self, first: int, end: int) -> bytes:
        """The caller holds the service's write lock (a batch is never half copied)."""
        slots = self.slots
        return b"" if slots is None else bytes(slots[first * SLOT_PAGE:end * SLOT_PAGE])

    def truncate_entries(self, last: int, last_ts: int) -> None:
        """Keep entries 1..``last`` only (recovery, before any writer): the chains and the slot table
        are rebuilt from them, so no chain leads to a dropped entry."""
        slots = bytearray(self.slot_num * 4)
        phys = -1
        for n in range(1, last + 1):
            epos = self.entries_at + n * ENTRY_SIZE
            h, phys, tdiff, _ = ENTRY.unpack_from(self.mm, epos)
            slot = (h % self.slot_num) * 4
            ENTRY.pack_into(self.mm, epos, h, phys, tdiff, I32.unpack_from(slots, slot)[0])
            I32.pack_into(slots, slot, n)
        _write_table(self.mf.fd, slots)
        self.slots = None
        self.dirty_pages = set()
        self.count = last + 1
        self.slots_used = self.slot_num - array.array("i", slots).count(0)
        if last == 0:
            self.begin_ts = self.end_ts = 0
            self.begin_phy = self.end_phy = -1
        else:
            self.end_phy, self.end_ts = phys, last_ts
        self.header_intact = True
        self.write_header()

    def view(self) -> IndexView:
        """What ``index_query`` reads of this file: its mapping, its descriptor, its slot table in memory
        (None: the file's own table, read with pread), slot count, where entries begin, entry count and
        begin time."""
        return self.mm, self.mf.fd, self.slots, self.slot_num, self.entries_at, self.count, self.begin_ts


@pure_twin("index_query")
def index_query_py(topic: str, keys: list[str], files: list[IndexView], limit: int, begin_ts: int,
                   end_ts: int) -> dict[str, list[int]]:
    """The candidate offsets of each of ``keys`` (of ``topic``) stored within [begin_ts, end_ts] in
    ``files`` (IndexFile.view, newest first): key -> offsets, newest file first and newest first within a
    file, at most ``limit``, for the keys that have any. A key's chain is walked from its slot (a slot
    table in memory, else read with pread: a load from a hole in a mapping can fault) newest to oldest,
    stopping at the first entry older than the window, a link that does not lead back, an entry past the
    mapping or after ``count`` steps. A file whose mapping or descriptor is closed (deleted meanwhile) is
    passed over. ValueError when a slot table is shorter than its slot count."""
    for _, _, slots, slot_num, _, _, _ in files:
        if slot_num <= 0 or (slots is not None and len(slots) < slot_num * 4):
            raise ValueError("the slot table is shorter than slot_num slots")
    out: dict[str, list[int]] = {}
    crc32, prefix = zlib.crc32, topic + "#"
    unpack_slot, unpack_entry, pread = I32.unpack_from, ENTRY.unpack_from, os.pread
    for key in keys:
        h = crc32((prefix + key).encode()) & 0x7FFFFFFF  # key_hash
        found: list[int] = []
        for mm, fd, slots, slot_num, entries_at, count, f_begin in files:
            if len(found) >= limit:
                break
            pos = (h % slot_num) * 4
            if slots is not None:
                n = unpack_slot(slots, pos)[0]
            else:
                try:
                    raw = pread(fd, 4, HEADER_SIZE + pos)
                except OSError:
                    continue
                n = I32.unpack(raw)[0] if len(raw) == 4 else 0
            if not 0 < n < count:
                continue
            try:
                size = len(mm)
            except ValueError:
                continue  # the mapping is closed
            lo_s = (begin_ts - f_begin) // 1000 - 1
            hi_s = (end_ts - f_begin) // 1000 + 1
            seen = 0
            while 0 < n < count and len(found) < limit and seen < count:
                epos = entries_at + n * ENTRY_SIZE
                if epos < 0 or epos + ENTRY_SIZE > size:
                    break
                eh, phys, tdiff, prev = unpack_entry(mm, epos)
                seen += 1
                if tdiff < lo_s:
                    break  # chains run newest to oldest
                if eh == h and tdiff <= hi_s:
                    found.append(phys)
                if prev >= n:
                    break
                n = prev
        if found:
            out[key] = found
    return out


index_query = kernels.index_query


@pure_twin("index_entries")
def index_entries_py(mm: mmap.mmap | bytearray, entries_at: int, allocated: int, slots: bytearray,
                     slot_num: int, n: int, index_num: int, begin_ts: int, items: list[DispatchRequest],
                     i: int, w: int, dirty: set[int]) -> tuple[int, int, int, int, int, int, int, int]:
    """Write the index entries of ``items`` (each one's UNIQ_KEY, then each KEYS word) from item ``i``'s
    word ``w`` on into one file: entries numbered from ``n`` on into ``mm`` (the file's mapping, entries
    from byte ``entries_at``, ``allocated`` bytes of it backed by disk), their chains' heads into ``slots``
    (the file's ``slot_num`` slots in memory; each slot page written goes into ``dirty``). The file's first
    entry (``n == 1``) sets its begin time. Stops when every word is written, when the file holds
    ``index_num`` entries, or when the next entry would lie past ``allocated``. Returns (n, slots newly
    used, i, w, begin_ts, begin_phy, phys, ts): the next entry number; the next word to write (``i ==
    len(items)`` when all are); the file's begin time and offset when its first entry was written here
    (begin_phy -1 otherwise); the offset and store time of the last entry written (-1, 0 when none)."""
    crc32 = zlib.crc32
    unpack_slot, pack_slot, pack_entry = I32.unpack_from, I32.pack_into, ENTRY.pack_into
    mark = dirty.add
    used, begin_phy, phys, ts = 0, -1, -1, 0
    count = len(items)
    while i < count:
        req = items[i]
        uniq, keys = req.uniq_key, req.keys
        words = ([uniq] if uniq else []) + (keys or [])
        e_phys, e_ts = req.phys, req.store_timestamp
        topic = req.topic
        while w < len(words):
            epos = entries_at + n * ENTRY_SIZE
            if n >= index_num or epos + ENTRY_SIZE > allocated:
                return n, used, i, w, begin_ts, begin_phy, phys, ts
            if n == 1:
                begin_ts, begin_phy = e_ts, e_phys
            h = crc32(f"{topic}#{words[w]}".encode()) & 0x7FFFFFFF  # key_hash
            slot_pos = (h % slot_num) * 4
            prev = unpack_slot(slots, slot_pos)[0]
            if prev <= 0 or prev >= n:
                prev = 0
                used += 1
            tdiff = (e_ts - begin_ts) // 1000
            if tdiff < 0 or tdiff > 0x7FFFFFFF:
                tdiff = 0 if tdiff < 0 else 0x7FFFFFFF
            pack_entry(mm, epos, h, e_phys, tdiff, prev)
            pack_slot(slots, slot_pos, n)
            mark(slot_pos >> SLOT_PAGE_BITS)
            n, w, phys, ts = n + 1, w + 1, e_phys, e_ts
        i, w = i + 1, 0
    return n, used, i, w, begin_ts, begin_phy, phys, ts


index_entries = kernels.index_entries


class IndexService:
    """All index files; the dispatcher's backlog writer puts entries (on the broker's loop, the dispatcher
    thread, or a key query's thread first), any thread queries, the flush thread writes the slot tables
    back and syncs."""

    def __init__(self, directory: str, slot_num: int, index_num: int) -> None:
        self.dir = directory
        self.slot_num = max(1, slot_num)
        self.index_num = max(2, index_num)
        self.files: list[IndexFile] = []
        self.lock = threading.Lock()  # guards the files list
        self._write_lock = threading.Lock()  # one writer batch or one slot copy-out at a time
        os.makedirs(directory, exist_ok=True)

    def load(self) -> None:
        for n in sorted(x for x in os.listdir(self.dir) if x.isdigit() and len(x) == 20):
            path = os.path.join(self.dir, n)
            slots, entries = file_geometry(os.stat(path).st_size, self.slot_num, self.index_num)
            self.files.append(IndexFile(path, slots, entries))

    def _active(self) -> IndexFile:
        if not self.files or self.files[-1].full:
            if self.files:
                self.files[-1].write_header()
                seq = int(os.path.basename(self.files[-1].mf.path)) + 1
                slots, entries = self.slot_num, self.index_num
            else:  # the store's first file: the small geometry, when there is one
                seq = 0
                slots, entries = first_file_geometry(self.slot_num, self.index_num)
            f = IndexFile(os.path.join(self.dir, f"{seq:020d}"), slots, entries)
            with self.lock:
                self.files = [*self.files, f]
        return self.files[-1]

    def put_batch(self, items: list[DispatchRequest]) -> None:
        """The index entries (UNIQ_KEY, then each KEYS word) of the dispatcher's requests; those without
        keys are skipped. The per-entry work is inlined (hot path of the dispatcher: one entry per
        message with a UNIQ_KEY)."""
        first = next((i for i, req in enumerate(items) if req.keys or req.uniq_key), -1)
        if first < 0:
            return  # nothing to index
        if first:
            items = items[first:]
        with self._write_lock:
            self._put_locked(items)

    def _put_locked(self, items: list[DispatchRequest]) -> None:
        f = self._active()
        i = w = 0
        while True:
            n, used, i, w, begin_ts, begin_phy, phys, ts = index_entries(
                f.mm, f.entries_at, f.mf.allocated, f.hold_slots(), f.slot_num, f.count, f.index_num,
                f.begin_ts, items, i, w, f.dirty_pages)
            if begin_phy >= 0:
                f.begin_ts, f.begin_phy = begin_ts, begin_phy
            f.count = n
            f.slots_used += used
            if phys >= 0:
                f.end_ts, f.end_phy = ts, phys
            if i >= len(items):
                break
            if n >= f.index_num:
                f = self._active()  # roll to a new file (the full one's header written)
            else:
                f.mf.allocate(f.entries_at + (n + 1) * ENTRY_SIZE)
        f.write_header()

    def query(self, topic: str, key: str, limit: int, begin_ts: int, end_ts: int) -> list[int]:
        return self.query_many(topic, (key,), limit, begin_ts, end_ts).get(key, [])

    def query_many(self, topic: str, keys: Iterable[str], limit: int, begin_ts: int, end_ts: int
                   ) -> dict[str, list[int]]:
        """``query`` for several keys of one topic, the files chosen once: key -> candidate offsets (newest
        file first), for the keys that have any."""
        files = [f.view() for f in reversed(self.files)
                 if not (f.count <= 1 or f.end_ts < begin_ts or f.begin_ts > end_ts)]
        if not files:
            return {}
        return index_query(topic, keys if isinstance(keys, list) else list(keys), files, limit, begin_ts,
                           end_ts)

    def write_back(self) -> list[IndexFile]:
        """Write every changed slot-table page to its file (not synced), one run at a time so a writer
        never waits long; a full file then gives up its in-memory table. Returns the files to sync.
        Entries are written before the slots that point to them, so a table written back while
        entries keep coming only points to entries that exist."""
        with self.lock:
            files = list(self.files)
        out = []
        for f in files:
            with self._write_lock:
                runs = f.take_dirty_runs()
            for i, (first, end) in enumerate(runs):
                with self._write_lock:
                    data = f.copy_run(first, end)
                try:
                    pwrite_all(f.mf.fd, data, HEADER_SIZE + first * SLOT_PAGE)
                except (OSError, ValueError):  # the pages not written go back; the next flush retries
                    with self._write_lock:
                        for a, b in runs[i:]:
                            f.dirty_pages.update(range(a, b))
                    break
                f.dirty = True
            if f.full and f is not files[-1] and not f.dirty_pages:
                f.slots = None  # lookups read the file's own table from now on
            if f.dirty:
                out.append(f)
        return out

    def flush(self) -> None:
        for f in self.write_back():
            if f.dirty and not f.mf.closed:
                f.dirty = False
                try:
                    f.mf.sync()
                except (OSError, ValueError):
                    f.dirty = True

    def clean_below(self, min_phys: int) -> int:
        deleted = 0
        with self.lock:
            while len(self.files) > 1 and self.files[0].end_phy < min_phys:
                self.files[0].mf.destroy()
                self.files = self.files[1:]
                deleted += 1
        return deleted

    def close(self) -> None:
        self.write_back()
        for f in self.files:
            if not f.mf.closed:
                f.write_header()
            f.mf.close()
