"""A crash's recovery of the timer's index tail (entries written since the last checkpoint): wheel heads
whose moves were lost are re-linked slot by slot (many entries of one slot, and slots in several index
segments), the pending counters and each index segment's latest slot come out as a clean run leaves them,
and every message is then delivered once, at its time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_timer_store import FakeStore, drive, msg, small_config

from chronomq.clock import VirtualClock
from chronomq.delay.timer import TimerStore


def _open(path: Path, clock: VirtualClock) -> TimerStore:
    t = TimerStore(path, clock, small_config(index_segment_entries=64))
    t.open()
    return t


@pytest.mark.parametrize("lost", [False, True], ids=["heads-kept", "heads-lost"])
def test_a_crash_tail_is_relinked_and_recounted_slot_by_slot(tmp_path: Path, lost: bool, caplog) -> None:
    clock = VirtualClock()
    path = tmp_path / "timer"
    t = _open(path, clock)
    base = clock.now_ms() + 60_000
    first = t.schedule_batch([(msg(f"a{i}", topic="A"), base + i % 3 * 1000) for i in range(50)])
    t.flush()  # the checkpoint: what follows is the crash's tail
    slots = {base // 1000 + k for k in range(4)}
    heads_at_flush = {s: t.wheel.get(s) for s in slots}
    dues = {f"b{i}": base + (i % 4) * 1000 + i for i in range(250)}  # 4 slots, index segments of 64
    t.schedule_batch([(msg(uid, topic="B" if i % 2 else "A"), due)
                      for i, (uid, due) in enumerate(dues.items())])
    expected_pending = dict(t.pending)
    expected_seg_max = dict(t.idx_seg_max)
    if lost:  # the wheel's pages as they were at the flush: every head move since is lost
        for s, head in heads_at_flush.items():
            t.wheel.set(s, head)
    t.abandon()

    caplog.set_level(logging.INFO, logger="chronomq.delay.timer.store")
    t = _open(path, clock)
    assert ("re-linked 250 index entries" in caplog.text) is lost
    assert dict(t.pending) == expected_pending
    assert t.idx_seg_max == expected_seg_max
    store = FakeStore(clock)
    drive(t, clock, store)
    got = {uid: at for uid, at, _m in store.puts}
    assert len(store.puts) == 300 and len(got) == 300  # each once
    assert all(got[uid] == due for uid, due in dues.items())
    assert all(got[f"a{i}"] == first[i].deliver_ms for i in range(50))
    t.close()
