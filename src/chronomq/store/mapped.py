"""A fixed-size file mapped into memory: the building block of commit-log, consume-queue and index files.

Writes are memory copies into the shared mapping (the page cache); ``flush`` makes them durable with
fdatasync on the file descriptor. On Linux msync(MS_SYNC) is the same vfs_fsync_range, but CPython's
mmap.flush holds the GIL for the whole disk wait (1-4 ms here), stalling every other thread, while
os.fdatasync releases it: writers keep appending during a group commit.

A file found shorter than its nominal size (truncated by a crash or by hand) is extended with
zeros on open, so every file of a kind has the same size and a zero TOTALSIZE marks its end.

Disk blocks are given ahead of the writer (``allocate``) by writing zeros, not with fallocate: a first
store into a mapped page with no written block (a hole, or fallocate's unwritten extent) allocates or
converts it inside the page fault, and on ext4 that fault waits for any journal commit another thread's
fsync has started: 15-20 ms here, with the GIL held. A page that holds written zeros takes the store in
microseconds, and a full disk shows up as ENOSPC from the pwrite instead of a SIGBUS at the store.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterable

ALLOC_CHUNK = 4 * 1024 * 1024
_ZEROS = memoryview(bytes(1024 * 1024))


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, off: int) -> None:
    """Write all of ``data`` at ``off`` with pwrite. OSError as pwrite raises it (ENOSPC), and EIO for a
    call that writes nothing (a regular file never does this; never loop on it)."""
    with memoryview(data) as view:
        done, total = 0, len(view)
        while done < total:
            n = os.pwrite(fd, view[done:], off + done)
            if n <= 0:
                raise OSError(errno.EIO, "pwrite wrote nothing")
            done += n


class StoreConfigError(RuntimeError):
    """The files on disk were written with a configuration that differs from the current one."""


class MappedFile:
    __slots__ = ("_alloc_lock", "_lock", "allocated", "blank_from", "closed", "fd", "file_size", "flushed",
                 "mm", "path", "start", "was_short", "written")

    def __init__(self, path: str, start: int, file_size: int) -> None:
        self.path = path
        self.start = start  # logical/physical offset of the first byte
        self.file_size = file_size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        size = os.fstat(self.fd).st_size
        self.was_short = 0 < size < file_size
        if size != file_size:
            os.ftruncate(self.fd, file_size)
        self.mm = mmap.mmap(self.fd, file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.written = 0  # bytes written (relative), maintained by the owner
        self.flushed = 0  # bytes known durable (relative)
        self.closed = False
        self.allocated = 0  # bytes known to have disk blocks (see allocate)
        # bytes from here on were never written (a new file): allocate may write zeros over them
        self.blank_from = 0 if size == 0 else file_size
        self._lock = threading.Lock()
        self._alloc_lock = threading.Lock()

    @property
    def end(self) -> int:
        return self.start + self.file_size

    def allocate(self, upto: int, chunk: int = ALLOC_CHUNK) -> None:
        """Make sure disk blocks exist below ``upto`` (relative), in ``chunk`` steps. Bytes from
        ``blank_from`` on get zeros written through the page cache (see the module docstring); bytes
        before it may hold data and get posix_fallocate, which never changes content. Thread-safe: a
        background allocator and the writer may both call it. OSError (ENOSPC) propagates."""
        if upto <= self.allocated:
            return
        with self._alloc_lock:
            start = self.allocated
            if upto <= start or self.closed:
                return
            end = min(self.file_size, -(-upto // chunk) * chunk)
            zero_at = min(max(start, self.blank_from), end)
            if zero_at > start:
                os.posix_fallocate(self.fd, start, zero_at - start)
            off = zero_at
            try:
                while off < end:
                    n = os.pwrite(self.fd, _ZEROS[: min(len(_ZEROS), end - off)], off)
                    if n <= 0:  # a regular file never does this; never loop on it
                        raise OSError(errno.EIO, "pwrite wrote nothing")
                    off += n
            except OSError:
                # a nearly full disk: keep what was written (the chunk is larger than what is asked
                # for), so a put that fits the space there is still succeeds
                self.allocated = max(self.allocated, off)
                if upto > off:
                    raise
                return
            self.allocated = end

    def skip_allocation(self, upto: int) -> None:
        """Bytes below ``upto`` (relative) are never stored through the mapping (the owner writes them
        with pwrite, which reports a full disk as ENOSPC, and reads them with pread): ``allocate`` gives
        blocks from there on only, and leaves the rest holes."""
        with self._alloc_lock:
            self.allocated = max(self.allocated, min(upto, self.file_size))

    def flush(self, upto: int | None = None) -> int:
        """Make [flushed, upto) durable (relative; default: everything written) with one fdatasync of the
        file. Returns the new flushed mark."""
        with self._lock:
            target = self.written if upto is None else min(upto, self.written)
            if target > self.flushed and not self.closed:
                os.fdatasync(self.fd)
                self.flushed = target
            return self.flushed

    def sync(self) -> None:
        """fdatasync regardless of the written marks (files written at random places: the index)."""
        with self._lock:
            if not self.closed:
                os.fdatasync(self.fd)

    def zero_tail(self, pos: int) -> None:
        """Make every byte from ``pos`` (relative) to the end zero, cheaply (truncate + extend)."""
        with self._lock:
            self.mm.close()
            os.ftruncate(self.fd, pos)
            os.ftruncate(self.fd, self.file_size)
            self.mm = mmap.mmap(self.fd, self.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.written = min(self.written, pos)
            self.flushed = min(self.flushed, pos)
            self.allocated = min(self.allocated, pos)
            self.blank_from = min(self.blank_from, pos)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.mm.close()
            except BufferError:
                pass  # a reader still holds a view; the mapping goes when it is released
            os.close(self.fd)

    def destroy(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class BackedPages:
    """The pages of a file with holes (one extended with ftruncate) that have disk blocks, for 8-byte
    fields read and written through a shared mapping. A store into a hole must allocate the block inside
    the page fault, and on tmpfs even a load does; on a full disk that fault is a SIGBUS, which kills the
    process. So: ``ensure`` fallocates a page (content kept) before its first store, raising OSError
    (ENOSPC) instead, and a field in a page that is not ``backed`` is a hole, zero without being read.
    The backed pages of an existing file are found with SEEK_DATA at open."""

    __slots__ = ("backed", "fd", "size")
    PAGE = 4096

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.backed: set[int] = data_pages(fd, size, self.PAGE)

    def has(self, off: int) -> bool:
        """Whether the byte at ``off`` is in a page with a disk block (else it reads as zero)."""
        return off // self.PAGE in self.backed

    def ensure(self, offsets: Iterable[int]) -> None:
        """Make sure the pages holding the 8-byte fields at ``offsets`` have disk blocks; raises
        OSError (ENOSPC) before any of them is written."""
        backed = self.backed
        for off in offsets:
            page = off // self.PAGE
            if page not in backed:
                # never past the file's size: fallocate would extend the file (a wheel file a day of
                # slots long that is not a whole number of pages would then read as torn at the next open)
                start = page * self.PAGE
                os.posix_fallocate(self.fd, start, min(self.PAGE, self.size - start))
                backed.add(page)


def data_pages(fd: int, size: int, page: int) -> set[int]:
    """The pages of the first ``size`` bytes of ``fd`` that hold data (SEEK_DATA / SEEK_HOLE); all of
    them where the file system cannot tell."""
    out: set[int] = set()
    off = 0
    try:
        while off < size:
            start = os.lseek(fd, off, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.update(range(start // page, -(-end // page)))
            off = end
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: no data from ``off`` on
            return set(range(-(-size // page)))
    return out


def first_hole(fd: int, size: int) -> int:
    """The offset of the first hole (a range never written or allocated) in a file of ``size``, or
    ``size`` when it has none."""
    try:
        return min(size, os.lseek(fd, 0, os.SEEK_HOLE))
    except OSError:  # a file system without SEEK_HOLE: no hole is known
        return size


def segment_files(directory: str, file_size: int, what: str, key: str) -> list[tuple[str, int]]:
    """The segment files of ``directory`` (20-digit names = start offsets), in order, as (path, start).
    Raises StoreConfigError when one does not fit ``file_size``: the store was written with another
    segment size, and opening it with this one would truncate data."""
    out = []
    for n in sorted(n for n in os.listdir(directory) if n.isdigit() and len(n) == 20):
        path = os.path.join(directory, n)
        start = int(n)
        size = os.path.getsize(path)
        if size > file_size or start % file_size:
            raise StoreConfigError(f"{what} {path} ({size} bytes) does not match {key}={file_size}; "
                                   "the store was written with another segment size: set it back")
        out.append((path, start))
    return out
