"""The timer's on-disk layouts: the 64-byte data record header (and the blocks rewritten in it), the
48-byte index entry, the done-log entry, the record states, and the handle (offset msgId) flag.
Pure definitions and codecs; no state. The formats are described in docs/timer.md and are baked into
existing files, so nothing here may change without a migration.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

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

PENDING, DELIVERED, CANCELLED, MOVED, FAILED = 0, 1, 2, 3, 4

# --- index entry: one per schedule or reschedule ----------------------------------------------------------
IDX = struct.Struct("<qqqqiiii")  # deliver_ms, data_pos, prev+1, slot, gen, topic_id, size, crc
IDX_SIZE = IDX.size  # 48
_IDX_BODY = struct.Struct("<qqqqiii")

TIMER_OFFSET_FLAG = 1 << 62  # marks an offset msgId that names a timer data position
_SEQ_JUMP = 1 << 40  # done_seq numbers of a run after a crash start this far above the checkpoint's

Item = tuple[int, int, int, int, int, int]  # deliver_ms, index entry, data pos, gen, topic id, size
# batch index, message to put (or put_records entry: buffer, position, size, properties), header, item
_Taken = tuple[int, Any, tuple[int, ...], Item]
# a staged item: deliver_ms, index entry, item, header, real topic, queue id, the store's prepared entry
# (None when the store refused to prepare it: then the put_records entry, put the usual way at its time)
_Staged = tuple[int, int, Item, tuple[int, ...], str, int, Any, Any]


def _pack_index(deliver: int, pos: int, prev: int, slot: int, gen: int, topic: int, size: int) -> bytes:
    body = _IDX_BODY.pack(deliver, pos, prev, slot, gen, topic, size)
    return body + _I32.pack(zlib.crc32(body) - (1 << 31))


def _unpack_index(raw: bytes) -> tuple[int, int, int, int, int, int, int] | None:
    if len(raw) < IDX_SIZE:
        return None
    *body, crc = IDX.unpack(raw)
    if zlib.crc32(raw[: IDX_SIZE - 4]) - (1 << 31) != crc:
        return None
    return tuple(body)  # type: ignore[return-value]


def _pos_of(offset_msg_id: str) -> int:
    return decode_offset_msg_id(offset_msg_id)[1] & ~TIMER_OFFSET_FLAG
