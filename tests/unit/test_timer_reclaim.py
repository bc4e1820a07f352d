"""Retention reclaims the completed records of a data segment that a pending record still pins: their pages
become holes, listed in the segment's ``.holes`` file, and every reader steps over them (the retention
scan, the done logs' replay at open, queries, cancels). Only records whose completion is in a checkpoint
are reclaimed; a torn ``.holes`` entry is ignored; and with reclaims between crashes every message is still
delivered exactly once, at its time."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from test_timer_store import DAY, FakeStore, drive, msg, small_config
from tests.conftest import async_wait_for

from chronomq.clock import VirtualClock
from chronomq.delay.timer import Outcome, TimerService, TimerStore
from chronomq.delay.timer.files import SegmentedFile, punch_hole
from chronomq.delay.timer.records import _DONE_ENTRY, _STATE_BLOCK, DELIVERED
from chronomq.delay.timer.retention import RECLAIM_MIN
from chronomq.delay.timer.store import _pos_of

SEG = 1 << 20


def _open(path: Path, clock: VirtualClock) -> TimerStore:
    t = TimerStore(path, clock, small_config(data_segment_bytes=SEG))
    t.open()
    return t


def _blocks(t: TimerStore, start: int) -> int:
    return os.stat(t.data.dir / f"{start:020d}").st_blocks * 512


def _can_punch(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 3 * 4096)
    fd = os.open(probe, os.O_RDWR)
    try:
        return punch_hole(fd, 4096, 4096)
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


def _pinned_segment(t: TimerStore, clock: VirtualClock, n: int = 900) -> tuple[int, list[str]]:
    """A long-delay record first (due at ``now + 30 days``), then ``n`` short ones (more than a segment):
    the first segment is pinned."""
    now = clock.now_ms()
    t.schedule(msg("long", size=1000, keys="lk"), now + 30 * DAY)
    uids = [f"s{i}" for i in range(n)]
    t.schedule_batch([(msg(u, size=1000), now + 1000 + i) for i, u in enumerate(uids)])
    assert len(t.data.starts) >= 2
    return t.data.starts[0], uids


def test_completed_runs_of_a_pinned_segment_are_reclaimed_and_the_pinned_record_survives(
        tmp_path: Path, clock: VirtualClock) -> None:
    store = FakeStore(clock)
    path = tmp_path / "timer"
    t = _open(path, clock)
    long_due = clock.now_ms() + 30 * DAY
    first, uids = _pinned_segment(t, clock)
    drive(t, clock, store, until=clock.now_ms() + 10_000)
    t.flush()
    before = _blocks(t, first)
    out = t.run_retention()
    assert first in t.data.starts, "the long-delay record pins its segment"
    ranges = t.data.holes[first]
    assert len(ranges) == 1
    (lo, hi), = ranges.items()
    assert hi - lo >= RECLAIM_MIN and lo > first  # the pinned record (at the segment's start) is kept
    assert (path / "data" / f"{first:020d}.holes").exists()
    if _can_punch(tmp_path):
        assert out["reclaimed_bytes"] > 0
        assert _blocks(t, first) <= before - out["reclaimed_bytes"]
    # a reclaimed record answers as one whose segment is gone; one outside the range still knows its end
    in_range = [u for u in uids if t.data.in_hole(_find(t, u))]
    assert in_range
    assert t.cancel(in_range[0])[0].outcome is Outcome.UNKNOWN
    assert t.cancel(uids[-1])[0].outcome is Outcome.ALREADY_DELIVERED  # in the active segment
    assert t.count() == 1 and t.query(key="lk").items[0].msg_id == "long"
    # the next scan steps over the range and finds the pinned record; nothing more to reclaim
    scan = t._retention.scan_data_segment(first, t.persisted_done_seq, [])
    assert scan.max_pending == long_due
    assert scan.runs == []
    t.close()
    t = _open(path, clock)  # the ranges are read back
    assert t.data.holes[first] == ranges
    drive(t, clock, store)
    delivered = [u for u, _, _ in store.puts]
    assert delivered.count("long") == 1 and delivered[-1] == "long"
    assert store.puts[-1][2].body == b"long".ljust(1000, b".")
    assert sorted(delivered[:-1]) == sorted(uids)
    t.flush()
    t.run_retention()
    assert first not in t.data.starts and not (path / "data" / f"{first:020d}.holes").exists()
    t.close()


def _find(t: TimerStore, uid: str) -> int:
    """The data position of the record of ``uid`` (from the key hash, not from the record)."""
    (pos,) = t.hash.lookup("u:" + uid)
    return pos


def test_a_completion_not_yet_in_a_checkpoint_is_not_reclaimed(tmp_path: Path, clock: VirtualClock) -> None:
    t = _open(tmp_path / "timer", clock)
    first, uids = _pinned_segment(t, clock)
    t.flush()
    for u in uids[:400]:  # completed in place, after the last checkpoint
        assert t.cancel(u)[0].outcome is Outcome.CANCELLED
    out = t.run_retention()
    assert out["reclaimed_bytes"] == 0 and first not in t.data.holes
    assert t.done_since_scan.get(first, 0) > 0, "they are counted again for the next scan"
    t.flush()
    t.run_retention()
    assert first in t.data.holes
    t.close()


def test_the_done_logs_replay_at_open_skips_reclaimed_records(tmp_path: Path, clock: VirtualClock) -> None:
    """A crash after the checkpoint that let a record be reclaimed and before its done log was emptied: the
    replay must neither write into the hole nor take the record for a torn log and drop the marks after."""
    store = FakeStore(clock)
    path = tmp_path / "timer"
    t = _open(path, clock)
    first, uids = _pinned_segment(t, clock)
    drive(t, clock, store, until=clock.now_ms() + 10_000)
    t.flush()
    headers = {u: t._queries.read_record(_find(t, u))[0] for u in uids}  # type: ignore[index]
    t.run_retention()
    (lo, hi), = t.data.holes[first].items()
    victim = next(u for u in uids if lo + 4096 <= _find(t, u) and _find(t, u) + 4096 + 64 <= hi)
    victim_pos, vh = _find(t, victim), headers[victim]
    late = t.schedule(msg("late", size=100), clock.now_ms() + 5000)
    late_pos = _pos_of(late.offset_msg_id)
    lh = t._queries.read_record(late_pos)[0]  # type: ignore[index]
    t.flush()
    seq = t.done_seq
    t.abandon()
    with open(path / "done.0.log", "ab") as f:  # the victim's mark as its delivery wrote it, then late's
        f.write(_DONE_ENTRY.pack(victim_pos, _STATE_BLOCK.pack(DELIVERED, vh.gen, vh.deliver_ms, vh.done_ms,
                                                               vh.created_ms, vh.origin, vh.done_seq)))
        f.write(_DONE_ENTRY.pack(late_pos, _STATE_BLOCK.pack(DELIVERED, lh.gen, lh.deliver_ms, clock.now_ms(),
                                                             lh.created_ms, lh.origin, seq + 1)))
    blocks = os.stat(path / "data" / f"{first:020d}").st_blocks
    t = _open(path, clock)
    assert os.stat(path / "data" / f"{first:020d}").st_blocks == blocks, "nothing was written into the hole"
    assert t._queries.read_record(late_pos)[0].state == DELIVERED  # type: ignore[index]
    drive(t, clock, store, until=clock.now_ms() + 10_000)
    assert "late" not in [u for u, _, _ in store.puts]
    t.close()


def test_a_torn_holes_entry_is_ignored(tmp_path: Path) -> None:
    seg = SegmentedFile(tmp_path, SEG)
    seg.write(0, b"\x01" * (SEG // 2))
    seg.reclaim([(4096, 3 * 4096)])
    seg.reclaim([(4096, 5 * 4096), (8 * 4096, 9 * 4096 + 7)])  # the first range grown, and another
    seg.close()
    with open(tmp_path / f"{0:020d}.holes", "ab") as f:
        f.write(b"\x00" * 11)  # a torn entry (the crash came before its punch)
    again = SegmentedFile(tmp_path, SEG)
    assert again.holes[0] == {4096: 5 * 4096, 8 * 4096: 9 * 4096 + 7}
    assert again.hole_end(4096) == 5 * 4096 and again.hole_end(4097) is None
    assert again.in_hole(5 * 4096 - 1) and not again.in_hole(5 * 4096) and not again.in_hole(4095)
    with pytest.raises(ValueError):
        again.reclaim([(SEG - 10, SEG + 10)])  # across a segment's end
    again.delete_segment(0)
    assert 0 not in again.holes and not (tmp_path / f"{0:020d}.holes").exists()
    again.close()


def test_a_segment_becomes_a_candidate_once_an_eighth_of_it_completed_and_stays_one_across_a_crash(
        tmp_path: Path, clock: VirtualClock) -> None:
    store = FakeStore(clock)
    t = _open(tmp_path / "timer", clock)
    first, _uids = _pinned_segment(t, clock)
    per_seg = SEG // 1100  # records of about 1,100 bytes on disk
    now = clock.now_ms()
    drive(t, clock, store, until=now + 1000 + per_seg // 16)  # a sixteenth of the first segment delivered
    t.flush()
    assert first not in t.reclaim_candidates()
    drive(t, clock, store, until=now + 1000 + per_seg // 4)
    t.flush()
    assert first in t.reclaim_candidates()
    t.abandon()  # a crash: the counts in the checkpoint survive it
    t = _open(tmp_path / "timer", clock)
    assert first in t.reclaim_candidates()
    t.run_retention()
    assert first in t.data.holes and first not in t.reclaim_candidates()
    t.close()


def test_exactly_once_at_its_time_with_reclaims_between_crashes(tmp_path: Path) -> None:
    """Mixed short and long delays (long ones pin segments), cancels, reschedules, retention with reclaims,
    clean restarts and crashes: every message not cancelled is delivered exactly once, at its time; a
    delivered one's cancel answers ALREADY_DELIVERED, or UNKNOWN once its bytes are reclaimed or deleted."""
    rnd = random.Random(20261129)
    clock = VirtualClock()
    store = FakeStore(clock)
    path = tmp_path / "timer"
    t = _open(path, clock)
    expected: dict[str, int | None] = {}
    n_total = reclaimed = 0

    for phase in range(12):
        now = clock.now_ms()
        batch = []
        for _ in range(1_500):
            uid = f"m{n_total}"
            n_total += 1
            dm = now + (rnd.randint(0, 20 * DAY) if rnd.random() < 0.05 else rnd.randint(0, DAY // 2))
            batch.append((msg(uid, size=rnd.choice([200, 900, 3000])), dm))
            expected[uid] = dm
        t.schedule_batch(batch)
        delivered = store.delivered()
        for _ in range(100):
            uid = f"m{rnd.randrange(n_total)}"
            (r,) = t.cancel(uid) if rnd.random() < 0.5 else t.reschedule(uid, now + rnd.randint(0, DAY))
            if expected[uid] is None:
                assert r.outcome in (Outcome.ALREADY_CANCELLED, Outcome.UNKNOWN)
            elif uid in delivered:
                assert r.outcome in (Outcome.ALREADY_DELIVERED, Outcome.UNKNOWN)
            elif r.outcome is Outcome.CANCELLED:
                expected[uid] = None
            else:
                assert r.outcome is Outcome.RESCHEDULED
                expected[uid] = r.deliver_ms
        drive(t, clock, store, until=now + rnd.randint(DAY // 4, DAY))
        delivered = store.delivered()
        pending_now = sum(1 for u, d in expected.items() if d is not None and u not in delivered)
        assert t.count() == pending_now, phase
        kind = phase % 3
        if kind != 2:
            t.flush()
        reclaimed += t.run_retention()["reclaimed_bytes"]
        if kind == 0:
            t.close()
        else:  # a crash: after more deliveries past the checkpoint, or with none taken since the last
            if kind == 1:
                drive(t, clock, store, until=clock.now_ms() + DAY // 8)
            t.abandon()
        t = _open(path, clock)
    drive(t, clock, store)
    delivered = store.delivered()
    for uid, d in expected.items():
        if d is None:
            assert uid not in delivered, uid
        else:
            assert delivered.get(uid) == [d], (uid, d, delivered.get(uid))
    assert t.stats()["early_deliveries"] == 0 and t.count() == 0
    if _can_punch(tmp_path):
        assert reclaimed > 0
    t.close()


async def test_the_loop_runs_retention_right_after_the_flush_that_made_records_reclaimable(
        tmp_path: Path) -> None:
    clock = VirtualClock()
    store = FakeStore(clock)
    cfg = small_config(data_segment_bytes=SEG, retention_interval_ms=10 * DAY)  # never by the interval
    svc = TimerService(store, None, clock, timer_config=cfg, root_dir=tmp_path / "timer")
    await svc.start()
    t = svc.timer
    first, uids = _pinned_segment(t, clock)

    async def reclaimed() -> bool:
        await clock.advance(cfg.flush_interval_ms)  # deliveries, then a flush, then retention
        await svc.settle()
        return first in t.data.holes

    await async_wait_for(reclaimed, timeout=30, message="a reclaimed range in the pinned segment")
    assert len(store.puts) >= len(uids) // 2 and first in t.data.starts
    await svc.shutdown()


def test_a_scan_lets_go_of_the_gil_every_few_hundred_records(tmp_path: Path, clock: VirtualClock,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan parses headers in Python in a worker thread: without a release now and then, the event loop
    waited up to the interpreter's 5 ms switch interval for the GIL whenever it woke during a scan."""
    from chronomq.delay.timer import retention

    t = _open(tmp_path / "timer", clock)
    first, uids = _pinned_segment(t, clock)
    records = 1 + sum(1 for u in uids if t.data.seg_start(_find(t, u)) == first)
    yields: list[float] = []
    monkeypatch.setattr(retention, "YIELD_EVERY", 100)
    monkeypatch.setattr(retention.time, "sleep", yields.append)
    t._retention.scan_data_segment(first)
    assert len(yields) == records // 100 and set(yields) == {0}
    t.close()
