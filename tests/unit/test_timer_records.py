"""The timer's named records (delay/timer/records.py) against the layouts they name, and the kernels that
build or read those layouts by position (store/_speedups.pyx, and their pure twins): every field is given
a value of its own, so a kernel reading or writing one field in another's place fails here by name."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from typing import Any

import pytest

from chronomq.delay.timer import append, records, window
from chronomq.delay.timer.records import (
    _STATE_BLOCK,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    DELIVERED,
    IDX,
    PENDING,
    IndexEntry,
    Item,
    Taken,
    TimerHeader,
    _pack_index,
    _unpack_index,
    unpack_header,
)
from chronomq.delay.timer.types import ScheduleResult
from chronomq.message import MessageExt
from chronomq.store import speedups

native = speedups.native


def _kernels(name: str, pure: Any) -> list[Any]:
    """The pure twin, and the compiled kernel when it is built."""
    return [pure] + ([getattr(native, name)] if native is not None else [])


def test_the_named_records_have_the_layouts_fields():
    assert len(TimerHeader._fields) == len(DATA_HDR.unpack(bytes(DATA_HDR_SIZE))) == 11
    assert len(IndexEntry._fields) + 1 == len(IDX.unpack(bytes(IDX.size)))  # + the CRC
    h = TimerHeader(*range(100, 111))
    assert unpack_header(b"xx" + DATA_HDR.pack(*h), 2) == h
    assert (h.magic, h.size, h.state, h.gen, h.deliver_ms, h.done_ms, h.created_ms, h.origin, h.done_seq,
            h.crc, h.topic_id) == tuple(range(100, 111))
    e = _unpack_index(_pack_index(1, 2, 3, 4, 5, 6, 7))
    assert e == IndexEntry(deliver_ms=1, pos=2, prev=3, slot=4, gen=5, topic_id=6, size=7)
    assert _unpack_index(b"\0" * IDX.size) is None  # a bad CRC


def test_header_offsets_of_the_in_place_writes_name_the_right_fields():
    h = TimerHeader(DATA_MAGIC, 200, PENDING, 1, 2, 3, 4, 5, 6, 7, 8)
    raw = bytearray(DATA_HDR.pack(*h))
    records._I32.pack_into(raw, records.OFF_STATE, DELIVERED)
    records._I32.pack_into(raw, records.OFF_GEN, 41)
    records._I64.pack_into(raw, records.OFF_DELIVER, 42)
    records._DONE_BLOCK.pack_into(raw, records.OFF_DONE, 43, 44, 45, 46)
    assert unpack_header(raw) == h._replace(state=DELIVERED, gen=41, deliver_ms=42, done_ms=43, created_ms=44,
                                            origin=45, done_seq=46)
    _STATE_BLOCK.pack_into(raw, records.OFF_STATE, 1, 2, 3, 4, 5, 6, 7)
    assert unpack_header(raw) == h._replace(state=1, gen=2, deliver_ms=3, done_ms=4, created_ms=5, origin=6,
                                            done_seq=7)


@pytest.mark.parametrize("fn", _kernels("pack_timer_records", append.pack_timer_records_py))
def test_pack_timer_records_writes_each_header_field_in_its_place(fn):
    rec = bytearray(b"r" * 90)
    msg = MessageExt(topic="T", body=b"x", properties={"UNIQ_KEY": "U1", "KEYS": "k1"})
    placed: list[Any] = []
    writes, end = fn([(msg, 123_456, rec)], {"T": 9}, 777, 55, 1000, 1 << 20, placed, [], [], ScheduleResult,
                     "C0A8000100002A9F")
    [(pos, chunk)] = writes
    h = unpack_header(chunk)
    assert h == TimerHeader(magic=DATA_MAGIC, size=DATA_HDR_SIZE + 90, state=PENDING, gen=0,
                            deliver_ms=123_456, done_ms=0, created_ms=777, origin=55, done_seq=0,
                            crc=zlib.crc32(rec) - (1 << 31), topic_id=9)
    assert (pos, end, placed) == (1000, 1000 + h.size, [(1000, h.size, 123_456, 9)])


@pytest.mark.parametrize("fn", _kernels("pack_index_entries", append.pack_index_entries_py))
def test_pack_index_entries_fields_and_items_in_their_places(fn):
    # links: (deliver_ms, data pos, gen, topic id, size); slot 5 is in memory (hot), its wheel head is 12
    buf, heads, items, min_deliver = fn([(5_500, 4_096, 3, 7, 300)], 0, 1000, 40, 1 << 20, {}, 5,
                                        lambda slot: 12 if slot == 5 else 0)
    assert _unpack_index(bytes(buf)) == IndexEntry(deliver_ms=5_500, pos=4_096, prev=12, slot=5, gen=3,
                                                   topic_id=7, size=300)
    [(slot, item)] = items
    assert slot == 5 and Item._make(item) == Item(deliver_ms=5_500, entry=40, pos=4_096, gen=3, topic_id=7,
                                                  size=300)
    assert (heads, min_deliver) == ({5: 41}, 5_500)


@pytest.mark.parametrize("fn", _kernels("mark_delivered_run", window.mark_delivered_run_py))
def test_mark_delivered_run_reads_each_field_from_its_place(fn):
    h = TimerHeader(magic=DATA_MAGIC, size=200, state=PENDING, gen=3, deliver_ms=10_000, done_ms=0,
                    created_ms=9_000, origin=77, done_seq=0, crc=5, topic_id=8)
    item = Item(deliver_ms=10_500, entry=21, pos=4_096, gen=3, topic_id=8, size=200)
    marks: dict[int, Any] = {}
    buf = bytearray()
    pending: Counter[int] = Counter({8: 2})
    lates: dict[tuple[int, int], int] = {}
    out = ["?", "?"]
    seq = fn([Taken(batch_index=1, put=None, header=h, item=item)], 10_600, 30, marks, buf, pending, lates,
             out)
    block = _STATE_BLOCK.pack(DELIVERED, h.gen, h.deliver_ms, 10_600, h.created_ms, h.origin, 31)
    assert seq == 31
    assert marks == {item.pos: (DELIVERED, 10_600, 31, block)}
    assert bytes(buf) == struct.pack("<q", item.pos) + block
    assert pending == Counter({item.topic_id: 1})
    assert lates == {(item.topic_id, 10_600 - item.deliver_ms): 1}  # lateness from the item's deliver time
    assert out == ["?", "delivered"]
    # scheduled for a time already past: lateness counts from its creation
    lates.clear()
    fn([Taken(0, None, h._replace(created_ms=10_550), item)], 10_600, 0, {}, bytearray(), Counter(), lates,
       ["?"])
    assert lates == {(item.topic_id, 50): 1}
