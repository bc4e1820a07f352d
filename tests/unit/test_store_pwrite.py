"""A run of records written with pwrite where the mapping's pages may be write-protected (just after
what a flush wrote back), through the mapping past that zone and when it is a record or two; a run that
outran the allocator thread is never zeroed after it is written, even while the allocator is writing
zeros there; a failed pwrite refuses the put and changes nothing."""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

import pytest
from test_store_basic import make_config, msg
from tests.conftest import wait_for

from chronomq.clock import VirtualClock
from chronomq.message import decode_record
from chronomq.store import MessageStore, PutStatus, mapped, put


@pytest.fixture
def store(tmp_path: Any) -> Any:
    # no periodic flush: the tests flush when they mean to (a flush moves the zone)
    s = MessageStore(make_config(tmp_path, mappedFileSizeCommitLog=64 << 20,
                                 flushIntervalCommitLog=3_600_000), VirtualClock())
    s.start()
    yield s
    s.shutdown()


def _batch(n: int, size: int, tag: int) -> list[Any]:
    return [msg(body=bytes([tag, i % 256]) * (size // 2)) for i in range(n)]


def _pwrites(monkeypatch: pytest.MonkeyPatch, fd: int) -> list[int]:
    seen: list[int] = []
    real = os.pwrite

    def pwrite(f: int, data: Any, off: int) -> int:
        # records only: not the allocator thread's zeros, nor those of a put that outran it
        if f == fd and threading.current_thread() is threading.main_thread() and bytes(data[:4]) != bytes(4):
            seen.append(off)
        return real(f, data, off)

    monkeypatch.setattr(mapped.os, "pwrite", pwrite)
    return seen


def _bodies(store: MessageStore, first: int, n: int) -> list[bytes]:
    got = store.get_message("TopicA", 0, first, n, max_bytes=1 << 30)
    return [decode_record(r).body for r in got.messages]


def test_runs_after_a_flush_go_with_pwrite_and_runs_past_the_zone_through_the_mapping(store, monkeypatch):
    assert store.put_messages(_batch(4, 1000, 1)).ok
    store.flush()
    seg = store._cur_seg
    seen = _pwrites(monkeypatch, seg.fd)
    first = store.put_messages(_batch(64, 1000, 2))  # right after what the flush wrote back
    assert first.ok and first.append.wrote_offset - seg.start in seen
    small = store.put_message(msg(body=b"s" * 100))  # under PWRITE_MIN: the mapping
    assert small.ok and small.append.wrote_offset - seg.start not in seen
    while store.max_phy_offset - seg.start < seg.flushed + put.FLUSHED_ZONE:  # out of the zone
        assert store.put_messages(_batch(64, 1000, 4)).ok
    late = store.put_messages(_batch(64, 1000, 5))
    single = store.put_message(msg(body=b"t" * 100))
    assert late.ok and late.append.wrote_offset - seg.start not in seen
    assert single.ok and single.append.wrote_offset - seg.start not in seen
    store.flush()
    again = store.put_messages(_batch(64, 1000, 6))  # a new flush, a new zone
    assert again.ok and again.append.wrote_offset - seg.start in seen
    store.wait_dispatched(late.append.wrote_offset, 5)
    store.wait_dispatched(again.append.wrote_offset, 5)
    for r, tag in ((first, 2), (late, 5), (again, 6)):
        bodies = _bodies(store, r.append.queue_offset, r.append.msg_count)
        assert bodies == [m.body for m in _batch(r.append.msg_count, 1000, tag)]
    assert _bodies(store, small.append.queue_offset, 1) == [b"s" * 100]
    assert _bodies(store, single.append.queue_offset, 1) == [b"t" * 100]


def test_a_run_past_the_allocator_is_never_zeroed_after(store):
    assert store.put_messages(_batch(1, 100, 9)).ok
    seg = store._cur_seg
    wait_for(lambda: seg.allocated >= (1 << 20), message="the allocator went ahead")
    start = store.max_phy_offset - seg.start
    n = (seg.allocated - start) // 30_000 + 40  # well past what the allocator had zeroed
    r = store.put_messages(_batch(n, 60_000, 7))
    assert r.ok and seg.allocated >= start + r.append.wrote_bytes
    seg.allocate(seg.allocated + (4 << 20))  # what the allocator does next: zeros past the run only
    store.wait_dispatched(r.append.wrote_offset, 5)
    assert _bodies(store, r.append.queue_offset, n) == [m.body for m in _batch(n, 60_000, 7)]


def test_a_run_past_the_allocated_mark_is_written_after_the_zeros_being_written_there(store, monkeypatch):
    """The allocator thread writes zeros past ``allocated`` without the commit-log lock: a run that
    reaches past the mark waits for them (it allocates under the file's allocation lock) instead of
    being written first and zeroed after."""
    assert store.put_messages(_batch(1, 100, 9)).ok
    seg = store._cur_seg
    wait_for(lambda: seg.allocated >= (1 << 20), message="the allocator went ahead")
    store.flush()  # the run goes with pwrite
    start = store.max_phy_offset - seg.start
    real = os.pwrite
    zeroing = threading.Event()

    def slow_zeros(fd: int, data: Any, off: int) -> int:
        if fd == seg.fd and threading.current_thread().name == "zeros":
            zeroing.set()
            time.sleep(0.3)  # the run is put meanwhile
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", slow_zeros)
    zeros = threading.Thread(target=seg.allocate, args=(seg.allocated + (4 << 20), 4 << 20), name="zeros")
    zeros.start()
    assert zeroing.wait(5)
    n = (seg.allocated - start) // 60_000 + 5  # past the mark the zeros started from
    r = store.put_messages(_batch(n, 60_000, 8))
    zeros.join()
    assert r.ok and store.wait_dispatched(r.append.wrote_offset, 5)
    assert _bodies(store, r.append.queue_offset, n) == [m.body for m in _batch(n, 60_000, 8)]


def test_a_failed_pwrite_refuses_the_put_and_changes_nothing(store, monkeypatch):
    real = os.pwrite
    assert store.put_messages(_batch(4, 1000, 1)).ok
    store.flush()
    end, table = store.max_phy_offset, dict(store._queue_table)

    def full(fd: int, data: Any, off: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mapped.os, "pwrite", full)
    r = store.put_messages(_batch(64, 1000, 2))
    assert r.status is PutStatus.SERVICE_NOT_AVAILABLE and "cannot write the commit log" in r.error
    assert store.max_phy_offset == end and store._queue_table == table

    def nothing(fd: int, data: Any, off: int) -> int:  # the put's own write makes no progress
        return 0 if threading.current_thread() is threading.main_thread() else real(fd, data, off)

    monkeypatch.setattr(mapped.os, "pwrite", nothing)  # refused, not a hang
    stuck = store.put_messages(_batch(64, 1000, 2))
    assert stuck.status is PutStatus.SERVICE_NOT_AVAILABLE and "wrote nothing" in stuck.error
    assert store.max_phy_offset == end and store._queue_table == table
    monkeypatch.undo()
    again = store.put_messages(_batch(64, 1000, 2))
    assert again.ok and again.append.wrote_offset == end and again.append.queue_offset == 4
