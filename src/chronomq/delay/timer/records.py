"""The timer's on-disk layouts: the 64-byte data record header (and the blocks rewritten in it), the
48-byte index entry, the done-log entry, the record states, and the handle (offset msgId) flag; and the
named records read from them and handed between the timer's parts (``TimerHeader``, ``IndexEntry``,
``Item``, ``Taken``, ``Staged``). Pure definitions and codecs; no state. The formats are described in
docs/timer.md and are baked into existing files, so nothing here may change without a migration.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

from chronomq.message import decode_offset_msg_id

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

PENDING, DELIVERED, CANCELLED, MOVED, FAILED = 0, 1, 2, 3, 4  # MOVED is reserved: never written

# --- index entry: one per schedule or reschedule ----------------------------------------------------------
IDX = struct.Struct("<qqqqiiii")  # deliver_ms, data_pos, prev+1, slot, gen, topic_id, size, crc
IDX_SIZE = IDX.size  # 48
_IDX_BODY = struct.Struct("<qqqqiii")

TIMER_OFFSET_FLAG = 1 << 62  # marks an offset msgId that names a timer data position
_SEQ_JUMP = 1 << 40  # done_seq numbers of a run after a crash start this far above the checkpoint's


class TimerHeader(NamedTuple):
    """A data record's header (``DATA_HDR``), field by field: what ``unpack_header`` returns. The compiled
    kernels (store/_speedups.pyx) write and read these fields by position; tests/unit/test_timer_records.py
    holds their positions to this order."""

    magic: int  # DATA_MAGIC
    size: int  # header + message bytes
    state: int  # PENDING, DELIVERED, CANCELLED or FAILED
    gen: int  # generation: only the index entry carrying the record's generation is live
    deliver_ms: int
    done_ms: int  # when it was delivered, cancelled or failed
    created_ms: int
    origin: int  # -1, or on a slave the commit-log offset of the journal record it came from
    done_seq: int  # the completion's sequence number (crash recovery of the pending counters)
    crc: int  # the message bytes' CRC-32 - 2**31
    topic_id: int


# The delivery path builds these records from a tuple of their fields with tuple.__new__ (a C call; calling
# a NamedTuple class runs its Python-level __new__, about 100-150 ns more per record)
_new = tuple.__new__


def unpack_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> TimerHeader:
    return _new(TimerHeader, DATA_HDR.unpack_from(buf, offset))


class IndexEntry(NamedTuple):
    """An index entry (``IDX`` without its CRC): what ``_unpack_index`` returns."""

    deliver_ms: int
    pos: int  # the data record's position
    prev: int  # the entry number + 1 of the slot's previous entry (0: none): the slot's chain
    slot: int
    gen: int
    topic_id: int
    size: int  # the data record's size


class Item(NamedTuple):
    """A live index entry in the delivery window, as ``poll`` hands it out (ordered by deliver time,
    then entry number)."""

    deliver_ms: int
    entry: int  # the index entry's number
    pos: int  # the data record's position
    gen: int
    topic_id: int
    size: int


class Taken(NamedTuple):
    """An item of a batch being delivered, its record read and checked."""

    batch_index: int  # its place in the batch (the outcome's index)
    put: Any  # what to put: a MessageExt, a put_records entry (buffer, position, size, properties) or
    # the store's prepared entry
    header: TimerHeader
    item: Item


class Staged(NamedTuple):
    """An item taken ahead of its deliver time, its record read and its store entry prepared."""

    item: Item
    header: TimerHeader
    topic: str  # the real topic and queue
    queue_id: int
    prepared: Any  # the store's prepared entry, or None when the store refused to prepare it ...
    record: Any  # ... and then the put_records entry, put the usual way at its time


# A delivery mark in memory, by data position: the state, done_ms, done_seq and the 48-byte state block
# written into the record by the next flush (built by mark_delivered_run)
Mark = tuple[int, int, int, bytes]


def _pack_index(deliver: int, pos: int, prev: int, slot: int, gen: int, topic: int, size: int) -> bytes:
    body = _IDX_BODY.pack(deliver, pos, prev, slot, gen, topic, size)
    return body + _I32.pack(zlib.crc32(body) - (1 << 31))


def _unpack_index(raw: bytes) -> IndexEntry | None:
    if len(raw) < IDX_SIZE:
        return None
    *body, crc = IDX.unpack(raw)
    if zlib.crc32(raw[: IDX_SIZE - 4]) - (1 << 31) != crc:
        return None
    return _new(IndexEntry, body)


def _pos_of(offset_msg_id: str) -> int:
    return decode_offset_msg_id(offset_msg_id)[1] & ~TIMER_OFFSET_FLAG
