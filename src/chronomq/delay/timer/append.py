"""The packing kernels of the timer's schedule path (``TimerStore.schedule_batch``, store.py): the data
records of a batch and their index entries, as bytes. The compiled kernels (store/_speedups.pyx) are used
when built; the ``*_py`` functions here are their reference, field by field as records.py names them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from chronomq.message import PROPERTY_KEYS, PROPERTY_UNIQ_KEY, MessageExt
from chronomq.store.speedups import kernels, pure_twin

from .files import add_key_items
from .records import (
    _I32,
    _IDX_BODY,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    PENDING,
    TIMER_OFFSET_FLAG,
    IndexEntry,
    Item,
    TimerHeader,
)
from .types import ScheduleResult

# the compiled encoder when it is built (chronomq.store.speedups chooses); message.encode_record is its twin
_encode_record = kernels.encode_record


@pure_twin("pack_timer_records")
def pack_timer_records_py(encoded: list[tuple[MessageExt, int, bytearray]], tids: dict[str, int], now: int,
                          origin: int, pos: int, seg_size: int, placed: list[tuple[int, int, int, int]],
                          hash_items: list[tuple[int, int]], results: list[ScheduleResult],
                          result_cls: type[ScheduleResult], id_prefix: str
                          ) -> tuple[list[tuple[int, bytearray]], int]:
    """The data log bytes of ``encoded`` [(message, deliver_ms, encoded record)] from position ``pos``:
    a PENDING header and the record each, no record across a segment boundary. Appends (position,
    size, deliver_ms, topic id) to ``placed``, the key hash entries to ``hash_items`` and a
    ``result_cls`` per message to ``results``; returns the writes [(position, bytes)] and the end."""
    writes: list[tuple[int, bytearray]] = []
    crc32 = zlib.crc32
    hdr_pack = DATA_HDR.pack
    chunk = bytearray()
    chunk_pos = pos
    for msg, deliver_ms, rec in encoded:
        size = DATA_HDR_SIZE + len(rec)
        if seg_size - pos % seg_size < size:
            if chunk:
                writes.append((chunk_pos, chunk))
                chunk = bytearray()
            pos = pos - pos % seg_size + seg_size
            chunk_pos = pos
        tid = tids[msg.topic]
        header = TimerHeader(magic=DATA_MAGIC, size=size, state=PENDING, gen=0, deliver_ms=deliver_ms,
                             done_ms=0, created_ms=now, origin=origin, done_seq=0,
                             crc=crc32(rec) - (1 << 31), topic_id=tid)
        chunk += hdr_pack(*header)
        chunk += rec
        placed.append((pos, size, deliver_ms, tid))
        props = msg.properties
        uniq = props[PROPERTY_UNIQ_KEY]
        add_key_items(hash_items, uniq, props.get(PROPERTY_KEYS), pos)
        results.append(result_cls(uniq, f"{id_prefix}{TIMER_OFFSET_FLAG | pos:016X}", deliver_ms, pos))
        pos += size
    if chunk:
        writes.append((chunk_pos, chunk))
    return writes, pos


@pure_twin("pack_index_entries")
def pack_index_entries_py(links: list[tuple[int, int, int, int, int]], floor: int, slot_ms: int,
                          start_idx: int, per_seg: int, seg_max: dict[int, int], hot: int,
                          wheel_get: Callable[[int], int]
                          ) -> tuple[bytearray, dict[int, int], list[tuple[int, Item]], int | None]:
    """The index entries of ``links`` [(deliver_ms, data pos, gen, topic id, size)] numbered from
    ``start_idx``, each linked to the previous head of its slot (from ``wheel_get`` or an earlier link
    of the run; a slot below ``floor`` is ``floor``). Raises ``seg_max`` (the highest slot of each index
    segment of ``per_seg`` entries) where needed. Returns the bytes, the new slot heads (entry + 1),
    the (slot, item) of slots up to ``hot`` (already in memory) and the earliest deliver time."""
    heads: dict[int, int] = {}
    buf = bytearray()
    items: list[tuple[int, Item]] = []
    body_pack = _IDX_BODY.pack
    i32 = _I32.pack
    crc32 = zlib.crc32
    min_deliver = None
    idx = start_idx
    for deliver, pos, gen, tid, size in links:
        slot = deliver // slot_ms
        if slot < floor:
            slot = floor
        prev = heads.get(slot)
        if prev is None:
            prev = wheel_get(slot)
        body = body_pack(*IndexEntry(deliver_ms=deliver, pos=pos, prev=prev, slot=slot, gen=gen, topic_id=tid,
                                     size=size))
        buf += body
        buf += i32(crc32(body) - (1 << 31))
        heads[slot] = idx + 1
        seg = idx // per_seg
        m = seg_max.get(seg)
        if m is None or slot > m:
            seg_max[seg] = slot
        if slot <= hot:
            item = Item(deliver_ms=deliver, entry=idx, pos=pos, gen=gen, topic_id=tid, size=size)
            items.append((slot, item))
        if min_deliver is None or deliver < min_deliver:
            min_deliver = deliver
        idx += 1
    return buf, heads, items, min_deliver


# the compiled kernels when built (chronomq.store.speedups chooses); the functions above are their twins
pack_timer_records = kernels.pack_timer_records
pack_index_entries = kernels.pack_index_entries
