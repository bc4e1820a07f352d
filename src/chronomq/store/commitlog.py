"""The commit log: append-only segment files of ``mappedFileSizeCommitLog`` bytes, each named by the
20-digit physical offset of its first byte, written through the shared mapping (mapped.py). Records are
RocketMQ's V1 stored layout (message.py, protocol.md 3.1), encoded outside the lock and copied in once; a
record never spans two segments: when the rest of a segment is too small, a blank record (TOTALSIZE =
rest, BLANK_MAGIC) fills it and the log rolls to a new segment. Why mmap and not pwrite: docs/store.md.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterator

from chronomq.message import (
    BLANK_MAGIC,
    MAGIC_V1,
    POS_BODY,
    POS_PHYSICALOFFSET,
    POS_STORETIMESTAMP,
    RECORD_FIXED_SIZE,
    SYSFLAG_BORNHOST_V6,
    SYSFLAG_STOREHOST_V6,
    MessageExt,
    validate_topic,
)
from chronomq.store.mapped import MappedFile, segment_files
from chronomq.store.speedups import crc32, pure_twin

HEAD = struct.Struct(">iiiiiqqiq8sq8siqi")  # the record up to and including BODYLENGTH
I32 = struct.Struct(">i")
I64 = struct.Struct(">q")
H16 = struct.Struct(">H")
QQ = struct.Struct(">qq")
PATCH = struct.Struct(">qq")  # queue offset + physical offset (adjacent fields at 20 and 28)
BLANK_HEAD = struct.Struct(">ii")
HOST_MASK = ~(SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6)
MIN_BLANK = 8
TOPIC_LEN = [bytes((n,)) for n in range(256)]


def encode(msg: MessageExt, topic_b: bytes, props_b: bytes, store_host_b: bytes, born_host_b: bytes
           ) -> bytes:
    """The record for ``msg`` with queue offset, physical offset and store time left 0 (patched later).
    The body CRC is always computed here (never trusted from the caller's object)."""
    body = msg.body
    total = RECORD_FIXED_SIZE + len(body) + len(topic_b) + len(props_b)
    head = HEAD.pack(total, MAGIC_V1, zlib.crc32(body) & 0x7FFFFFFF, msg.queue_id, msg.flag, 0, 0,
                     msg.sys_flag & HOST_MASK, msg.born_timestamp, born_host_b, 0, store_host_b,
                     msg.reconsume_times, msg.prepared_transaction_offset, len(body))
    return b"".join((head, body, TOPIC_LEN[len(topic_b)], topic_b, H16.pack(len(props_b)), props_b))


@pure_twin("splice")
def splice_py(buf: bytes | bytearray | memoryview, pos: int, size: int, topic_b: bytes, queue_id: int,
              props_b: bytes, store_host_b: bytes) -> tuple[bytes, int]:
    """The record ``encode`` would build for the stored V1 record of ``size`` bytes at ``buf[pos:]``
    re-addressed to ``topic_b``/``queue_id`` with the properties ``props_b``: flag, sysFlag (IPv6 bits
    cleared), born timestamp and host, reconsume times and body copied as they are; prepared
    transaction offset 0, our store host, queue offset, physical offset and store time 0 (patched
    later), the body CRC computed anew (never trusted from the old record), sizes recomputed. Returns
    (record, body length). Raises ValueError when the bytes are not one whole V1 record."""
    if size < RECORD_FIXED_SIZE or pos < 0 or pos + size > len(buf):
        raise ValueError("record truncated")
    (total, magic, _crc, _qid, flag, _qoff, _phys, sys_flag, born_ts, born_host_b, _sts, _shost,
     reconsume, _prep, body_len) = HEAD.unpack_from(buf, pos)
    if magic != MAGIC_V1 or total != size:
        raise ValueError("not a V1 record of the given size")
    b = pos + POS_BODY
    if body_len < 0 or b + body_len + 3 > pos + size:
        raise ValueError("body length out of range")
    body = buf[b : b + body_len]
    new_total = RECORD_FIXED_SIZE + body_len + len(topic_b) + len(props_b)
    head = HEAD.pack(new_total, MAGIC_V1, zlib.crc32(body) & 0x7FFFFFFF, queue_id, flag, 0, 0,
                     sys_flag & HOST_MASK, born_ts, born_host_b, 0, store_host_b, reconsume, 0, body_len)
    rec = b"".join((head, body, TOPIC_LEN[len(topic_b)], topic_b, H16.pack(len(props_b)), props_b))
    return rec, body_len



def check_record(mm, r: int, seg_start: int, seg_size: int, check_crc: bool) -> int:
    """Validate the record at relative position ``r`` of a segment. Returns its size (> 0), 0 at the
    clean end of the data (zeros), -1 for a blank filler that ends the segment, or -2 when the bytes are
    not a whole valid record (torn or corrupt)."""
    if r + MIN_BLANK > seg_size:
        return -1 if r == seg_size else -2
    total, magic = BLANK_HEAD.unpack_from(mm, r)
    if total == 0 and magic == 0:
        return 0
    if magic == BLANK_MAGIC:
        return -1 if total == seg_size - r else -2
    if magic != MAGIC_V1 or total < RECORD_FIXED_SIZE or r + total > seg_size:
        return -2
    (_, _, crc, queue_id, _, queue_off, phys, _, _, _, _, _, _, _, body_len) = HEAD.unpack_from(mm, r)
    if phys != seg_start + r or queue_id < 0 or queue_off < 0 or body_len < 0:
        return -2
    p = r + POS_BODY + body_len
    if p + 3 > r + total:
        return -2
    tlen = mm[p]
    tp = p + 1
    if tp + tlen + 2 > r + total:
        return -2
    plen = H16.unpack_from(mm, tp + tlen)[0]
    if tp + tlen + 2 + plen != r + total:
        return -2
    try:
        if validate_topic(mm[tp : tp + tlen].decode()) is not None:
            return -2
    except UnicodeDecodeError:
        return -2
    if plen and not properties_well_formed(mm[tp + tlen + 2 : r + total]):
        return -2  # a torn write leaves zeros or garbage where the properties text should be
    if check_crc and (crc32(mm[r + POS_BODY : r + POS_BODY + body_len]) & 0x7FFFFFFF) != crc:
        return -2
    return total


def properties_well_formed(raw: bytes) -> bool:
    """``raw`` is a properties text as the put path stores it (put.property_fields_py): UTF-8, pairs
    ``name\x01value`` each closed by ``\x02``, no empty name, no separator inside a name or value. The
    body CRC does not cover the properties; this is what tells a torn or overwritten tail from them."""
    if raw[-1:] != b"\x02":
        return False
    for item in raw[:-1].split(b"\x02"):
        i = item.find(b"\x01")
        if i <= 0 or item.find(b"\x01", i + 1) >= 0:
            return False
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


class CommitLog:
    """Segments plus the write position. ``lock`` serialises appends (the store's put path holds it)."""

    def __init__(self, directory: str, segment_size: int) -> None:
        self.dir = directory
        self.seg_size = segment_size
        # Contiguous segments, oldest first. The list is replaced, never mutated in place, once the log is
        # open, so a reader's snapshot (one attribute read) is always consistent.
        self.segments: list[MappedFile] = []
        self.wrote = 0  # max physical offset: the end of the last record written
        self.lock = threading.Lock()
        self.seg_lock = threading.Lock()  # guards the segment list (roll, clean)
        os.makedirs(directory, exist_ok=True)

    # --- files --------------------------------------------------------------------------------------
    def load(self) -> None:
        for path, start in segment_files(self.dir, self.seg_size, "commit-log segment",
                                         "mappedFileSizeCommitLog"):
            if self.segments and start != self.segments[-1].end:
                # A gap (a lost middle file) makes everything after it unreachable; keep the prefix.
                os.replace(path, path + ".orphan")
                continue
            mf = MappedFile(path, start, self.seg_size)
            self.segments.append(mf)

    def new_segment(self, start: int) -> MappedFile:
        mf = MappedFile(os.path.join(self.dir, f"{start:020d}"), start, self.seg_size)
        # The new name must survive a power loss too (fdatasync on the file does not cover its entry).
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        with self.seg_lock:
            self.segments = [*self.segments, mf]
        return mf

    def segment_for(self, offset: int) -> MappedFile | None:
        segs = self.segments
        if not segs:
            return None
        i = (offset - segs[0].start) // self.seg_size
        if 0 <= i < len(segs):
            return segs[i]
        return None

    @property
    def min_offset(self) -> int:
        segs = self.segments
        return segs[0].start if segs else self.wrote

    # --- reads --------------------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes | None:
        seg = self.segment_for(offset)
        if seg is None or offset + size > self.wrote:
            return None
        r = offset - seg.start
        try:
            return seg.mm[r : r + size]
        except ValueError:
            return None  # the segment was cleaned meanwhile

    def record_at(self, offset: int) -> bytes | None:
        """The whole record starting at ``offset``, or None (out of range, blank filler, not a record)."""
        seg = self.segment_for(offset)
        if seg is None or offset + RECORD_FIXED_SIZE > self.wrote:
            return None
        r = offset - seg.start
        try:
            total, magic = BLANK_HEAD.unpack_from(seg.mm, r)
            if magic != MAGIC_V1 or total < RECORD_FIXED_SIZE or r + total > seg.file_size:
                return None
            if I64.unpack_from(seg.mm, r + POS_PHYSICALOFFSET)[0] != offset:
                return None
            return seg.mm[r : r + total]
        except (ValueError, struct.error):
            return None

    def store_time_at(self, offset: int) -> int | None:
        seg = self.segment_for(offset)
        if seg is None:
            return None
        try:
            return I64.unpack_from(seg.mm, offset - seg.start + POS_STORETIMESTAMP)[0]
        except (ValueError, struct.error):
            return None

    def iter_records(self, start: int) -> Iterator[tuple[int, bytes]]:
        """(offset, record bytes) from ``start`` (a record boundary) to the write position."""
        off = max(start, self.min_offset)
        while off < self.wrote:
            seg = self.segment_for(off)
            if seg is None:
                return
            r = off - seg.start
            try:
                total, magic = BLANK_HEAD.unpack_from(seg.mm, r) if r + 8 <= seg.file_size else (0, 0)
            except ValueError:
                return
            if magic == MAGIC_V1 and total >= RECORD_FIXED_SIZE:
                try:
                    data = seg.mm[r : r + total]
                except ValueError:
                    return  # cleaned meanwhile
                yield off, data
                off += total
            else:  # blank filler or end of segment
                off = seg.end

    # --- flush --------------------------------------------------------------------------------------
    def flush(self) -> int:
        """fdatasync every segment's written bytes not yet flushed; returns the flushed physical offset."""
        wrote = self.wrote
        for seg in self.segments:
            if seg.start >= wrote:
                break
            if seg.flushed < seg.written:
                seg.flush()
        return wrote

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
