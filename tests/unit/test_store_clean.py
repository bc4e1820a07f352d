"""Clean service: expired commit-log segments go at deleteWhen (or at once past diskMaxUsedSpaceRatio),
queue and index files wholly below the oldest commit-log offset follow, and the min-offset guard
(undelivered delayed messages) is never crossed."""

from __future__ import annotations

import logging
import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt, decode_record
from chronomq.store import GetStatus, MessageStore

SEG = 8 * 1024
HOUR = 3_600_000


def make(root, clock, **kw) -> MessageStore:
    base = dict(storePathRootDir=str(root), mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=20 * 8,
                maxHashSlotNum=16, maxIndexNum=16, fileReservedTime=1, deleteWhen="04",
                cleanResourceInterval=10**9)  # the tests clean by hand: the service's own pass never comes
    base.update(kw)
    s = MessageStore(BrokerConfig(**base), clock)
    s.start()
    s.disk_usage_ratio = lambda: 0.10  # independent of the real disk; one test sets it high
    return s


def put_n(s: MessageStore, n: int, start: int = 0) -> list[int]:
    offs = []
    for i in range(start, start + n):
        r = s.put_message(MessageExt(topic="CleanT", body=b"c" * 1000, queue_id=0,
                                     properties={"KEYS": f"k{i}"}))
        assert r.ok
        offs.append(r.append.wrote_offset)
    assert s.wait_dispatched(s.max_phy_offset, 10)
    return offs


def hour_of(clock) -> int:
    return time.localtime(clock.now_ms() / 1000).tm_hour


def test_expired_segments_go_with_their_queue_and_index_files(tmp_path):
    clock = VirtualClock()
    s = make(tmp_path, clock)
    try:
        old = put_n(s, 30)  # ~4 segments
        clock.advance_sync(2 * HOUR)
        new = put_n(s, 10, 30)
        segs_before = len(s._cl.segments)
        cq_files_before = len(s._queues[("CleanT", 0)].files)
        idx_before = len(s._index.files)
        assert s.run_clean_once(force=True) > 0
        assert s.min_phy_offset > 0 and s.min_phy_offset <= new[0]
        assert len(s._cl.segments) < segs_before
        assert all(s.read_record(o) is None for o in old if o < s.min_phy_offset)
        assert not os.path.exists(os.path.join(tmp_path, "commitlog", f"{0:020d}"))
        lo = s.get_min_offset_in_queue("CleanT", 0)
        expect_lo = next(i for i, o in enumerate(old + new) if o >= s.min_phy_offset)
        assert lo == expect_lo
        assert len(s._queues[("CleanT", 0)].files) < cq_files_before
        assert len(s._index.files) < idx_before
        assert s.get_message("CleanT", 0, 0, 5).status is GetStatus.OFFSET_TOO_SMALL
        g = s.get_message("CleanT", 0, lo, 100, max_bytes=1 << 20)
        assert [decode_record(b).commit_log_offset for b in g.messages] == (old + new)[lo:]
        assert s.query_message("CleanT", "k0", 5, 0, 2**62) == []
        assert len(s.query_message("CleanT", "k35", 5, 0, 2**62)) == 1
        assert s.get_earliest_message_time("CleanT", 0) == s.look_message_by_offset(
            (old + new)[lo]).store_timestamp
    finally:
        s.shutdown()
    s2 = make(tmp_path, clock)  # the cleaned state survives a restart
    try:
        assert s2.min_phy_offset == s.min_phy_offset
        assert s2.get_min_offset_in_queue("CleanT", 0) == lo
        assert s2.get_max_offset_in_queue("CleanT", 0) == 40
    finally:
        s2.shutdown()


def test_nothing_is_deleted_before_reserved_time_or_outside_delete_hours(tmp_path):
    clock = VirtualClock()
    other_hour = f"{(hour_of(clock) + 5) % 24:02d}"
    s = make(tmp_path, clock, deleteWhen=other_hour)
    try:
        put_n(s, 30)
        assert s.run_clean_once(force=True) == 0  # not expired yet
        clock.advance_sync(2 * HOUR)
        if hour_of(clock) != int(other_hour):
            assert s.run_clean_once() == 0  # expired, but not the hour to delete
        assert s.run_clean_once(force=True) > 0
    finally:
        s.shutdown()


def test_delete_when_hour_triggers_without_force(tmp_path):
    clock = VirtualClock()
    s = make(tmp_path, clock)
    try:
        put_n(s, 30)
        clock.advance_sync(2 * HOUR)
        s.config.deleteWhen = f"{hour_of(clock):02d}"
        assert s.run_clean_once() > 0
    finally:
        s.shutdown()


def test_guard_keeps_segments_with_undelivered_delayed_messages(tmp_path, caplog):
    clock = VirtualClock()
    s = make(tmp_path, clock)
    try:
        offs = put_n(s, 40)
        clock.advance_sync(2 * HOUR)
        put_n(s, 2, 40)
        guard = offs[12]  # in the second segment
        s.set_min_offset_guard(lambda: guard)
        with caplog.at_level(logging.INFO, logger="chronomq.store"):
            s.run_clean_once(force=True)
        assert s.min_phy_offset <= guard
        assert s.read_record(guard) is not None
        assert "undelivered delayed messages" in caplog.text
        s.set_min_offset_guard(lambda: None)
        assert s.run_clean_once(force=True) > 0
        assert s.min_phy_offset > guard
    finally:
        s.shutdown()


def test_disk_full_cleans_unexpired_segments_but_not_the_current_one(tmp_path):
    clock = VirtualClock()
    s = make(tmp_path, clock, diskMaxUsedSpaceRatio=75)
    try:
        offs = put_n(s, 30)
        before = len(s._cl.segments)
        assert before >= 3
        s.disk_usage_ratio = lambda: 0.50
        assert s.run_clean_once() == 0  # below the ratio, not expired, not the hour: nothing
        s.disk_usage_ratio = lambda: 0.90
        deleted = s.run_clean_once()
        assert deleted == before - 1  # all but the segment being written
        assert s.read_record(offs[-1]) is not None
        assert len(s._cl.segments) == 1
        assert s.put_message(MessageExt(topic="CleanT", body=b"x", queue_id=0)).ok
    finally:
        s.shutdown()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_old=st.integers(1, 50), n_new=st.integers(0, 10), guard_idx=st.one_of(st.none(), st.integers(0, 59)))
def test_clean_invariants(tmp_path_factory, n_old, n_new, guard_idx):
    clock = VirtualClock()
    s = make(tmp_path_factory.mktemp("clean"), clock)
    try:
        offs = put_n(s, n_old)
        clock.advance_sync(2 * HOUR)
        offs += put_n(s, n_new, n_old)
        guard = offs[guard_idx % len(offs)] if guard_idx is not None else None
        s.set_min_offset_guard(lambda: guard)
        s.run_clean_once(force=True)
        lo_phys = s.min_phy_offset
        if guard is not None:
            assert lo_phys <= guard  # nothing at or beyond the guard was deleted
        # the segment being written always remains
        assert lo_phys <= offs[-1] and s.read_record(offs[-1]) is not None
        lo = s.get_min_offset_in_queue("CleanT", 0)
        assert lo == next(i for i, o in enumerate(offs) if o >= lo_phys)
        g = s.get_message("CleanT", 0, lo, 100, max_bytes=1 << 20)
        assert [decode_record(b, check_crc=True).commit_log_offset for b in g.messages] == offs[lo:]
        # only expired data went: everything written after the clock jump is still there
        assert all(s.read_record(o) is not None for o in offs[n_old:])
    finally:
        s.shutdown()
