"""How far the commit log is allocated ahead of its writer: the distance follows the write rate (grows with
it at once, up to ALLOCATE_AHEAD; shrinks back by half per quiet window down to MIN_AHEAD), a store that
writes little holds little unwritten disk, and a full disk stays an error a put reports."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from test_store_basic import make_config, msg
from tests.conftest import wait_for

import chronomq.store.mapped as mapped
from chronomq.clock import VirtualClock
from chronomq.store import MessageStore
from chronomq.store.allocate import ALLOCATE_AHEAD, MIN_AHEAD, AheadSizer
from chronomq.store.types import PutStatus

MIB = 1 << 20


def test_the_distance_grows_with_the_bytes_written_in_the_window_at_once() -> None:
    s = AheadSizer(0.0, 0)
    assert s.update(0.0, 0) == MIN_AHEAD and s.chunk == 256 * 1024
    assert s.update(0.1, 300 * 1024) == MIN_AHEAD  # two windows of 300 KiB: rounded up to the least
    assert s.update(0.2, 3 * MIB) == 6 * MIB  # within the window: twice what it wrote so far
    assert s.update(0.5, 100 * MIB) == ALLOCATE_AHEAD and s.chunk == 4 * MIB  # never past the most


def test_a_steady_rate_gives_twice_a_windows_writes() -> None:
    s = AheadSizer(0.0, 0)
    wrote = 0
    for i in range(1, 6):  # 3 MiB a second
        wrote += 3 * MIB
        ahead = s.update(float(i), wrote)
    assert ahead == 6 * MIB
    # a window measured late (the allocator slept) counts as a rate, not as one window's bytes
    assert s.update(7.0, wrote + 6 * MIB) == 6 * MIB


def test_the_distance_shrinks_by_half_per_quiet_window_down_to_the_least() -> None:
    s = AheadSizer(0.0, 0)
    assert s.update(0.9, 64 * MIB) == ALLOCATE_AHEAD
    seen = [s.update(float(t), 64 * MIB) for t in range(1, 8)]
    # the window that closed at 1.0 held the burst; then half per window
    assert seen == [ALLOCATE_AHEAD, 8 * MIB, 4 * MIB, 2 * MIB, MIN_AHEAD, MIN_AHEAD, MIN_AHEAD]
    # several updates inside one window shrink it once at most
    s = AheadSizer(0.0, 0, least=MIB, most=16 * MIB)
    s.update(0.5, 8 * MIB)
    assert s.update(1.0, 8 * MIB) == 16 * MIB  # the closed window: 8 MiB a second
    assert [s.update(t, 8 * MIB) for t in (2.0, 2.5, 2.9)] == [8 * MIB] * 3


def _store(tmp_path, clock: VirtualClock, seg_size: int = 64 * MIB) -> MessageStore:
    s = MessageStore(make_config(tmp_path, mappedFileSizeCommitLog=seg_size, maxHashSlotNum=1024,
                                 maxIndexNum=200_000), clock)
    s.start()
    return s


def test_a_store_that_writes_little_allocates_little_and_one_under_load_the_most(tmp_path) -> None:
    clock = VirtualClock()
    s = _store(tmp_path, clock)
    try:
        assert s.put_message(msg(body=b"x" * 1000)).ok
        seg = s._cur_seg
        assert seg is not None
        wait_for(lambda: seg.allocated >= s.max_phy_offset + MIN_AHEAD, message="the allocator ran ahead")
        # not ALLOCATE_AHEAD: one message was written (the put that made the segment allocated its
        # first chunk itself)
        assert seg.allocated <= mapped.ALLOC_CHUNK
        assert os.stat(seg.path).st_blocks * 512 <= mapped.ALLOC_CHUNK + 64 * 1024
        # 10 MiB within the clock's window: the distance grows to the most
        body = b"y" * 4000
        for _ in range(40):
            assert s.put_messages([msg(body=body) for _ in range(64)]).ok
        wait_for(lambda: seg.allocated >= s.max_phy_offset + ALLOCATE_AHEAD,
                 message="the allocator ran ALLOCATE_AHEAD ahead under load")
        sizer = s._allocator.sizer
        assert sizer is not None and sizer.ahead == ALLOCATE_AHEAD
        # quiet windows: the distance shrinks back to the least (what is allocated stays allocated)
        def quiet_second() -> bool:
            clock.advance_sync(1000)
            s._alloc_wake.set()
            return sizer.ahead == MIN_AHEAD

        wait_for(quiet_second, interval=0.05, message="the distance shrank back")
    finally:
        s.shutdown()


def test_a_full_disk_is_a_refused_put_and_writes_resume_when_space_returns(tmp_path, monkeypatch) -> None:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell the commit log's writes from the others'")
    clock = VirtualClock()
    s = _store(tmp_path, clock, seg_size=16 * MIB)
    seg_dir = os.path.join(str(tmp_path / "store"), "commitlog")
    room = [MIB + 512 * 1024]  # bytes the commit log may still allocate
    lock = threading.Lock()
    real = os.pwrite

    def pwrite(fd: int, data: bytes, off: int) -> int:
        # only the commit log's segment runs out of space (the queue and index files share os.pwrite),
        # and only its allocation (zeros): records go into bytes allocated before, which need no more
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(seg_dir) or bytes(data[:8]) != bytes(8):
            return real(fd, data, off)
        with lock:
            if room[0] <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real(fd, data[: room[0]], off)
            room[0] -= n
            return n

    try:
        assert s.put_message(msg(body=b"a" * 100)).ok
        seg = s._cur_seg
        assert seg is not None
        wait_for(lambda: seg.allocated >= MIN_AHEAD, message="the first allocation")
        monkeypatch.setattr(mapped.os, "pwrite", pwrite)
        body = b"z" * 8000
        acked, refused = 0, None
        for _ in range(2000):  # bounded: 16 MiB of segment, about 2 MiB of room
            r = s.put_message(msg(body=body))
            if not r.ok:
                refused = r
                break
            acked += 1
        assert refused is not None, "the disk never filled"
        assert refused.status is PutStatus.SERVICE_NOT_AVAILABLE
        assert "cannot allocate commit-log space" in (refused.error or "")
        assert acked * len(body) >= MIB  # what the disk still had was used
        assert all(t.is_alive() for t in s._threads)  # the allocator logged it and goes on
        with lock:
            room[0] = 64 * MIB
        assert s.put_message(msg(body=body)).ok
        assert s.wait_dispatched(s.max_phy_offset, 10)
        assert s.get_max_offset_in_queue("TopicA", 0) == acked + 2
    finally:
        monkeypatch.undo()
        s.shutdown()
