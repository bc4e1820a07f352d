"""The acceptance run for the timer store: 100,000+ messages with random deliver times over 40 days,
cancels and reschedules interleaved, clean restarts and simulated crashes (including torn tails and a
wheel link lost between the index write and the head move) in between. Every message that was not
cancelled is delivered exactly once, exactly at its time, never early; cancelled ones never."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from test_timer_store import DAY, FakeStore, drive, msg, small_config

from chronomq.clock import VirtualClock
from chronomq.delay.timer import Outcome, TimerStore
from chronomq.delay.timer.store import IDX_SIZE, _unpack_index


def _reopen(path: Path, clock: VirtualClock) -> TimerStore:
    t = TimerStore(path, clock, small_config(data_segment_bytes=4 << 20, index_segment_entries=16_384,
                                             hash_buckets=1 << 16, hash_generation_entries=1 << 18))
    t.open()
    return t


def _lose_last_wheel_link(t: TimerStore) -> None:
    """Undo the wheel-head move of the newest index entry (a crash between the two writes)."""
    idx = t.index_end - 1
    e = _unpack_index(t.index.read(idx * IDX_SIZE, IDX_SIZE))
    assert e is not None
    slot, prev = e[3], e[2]
    assert t.wheel.get(slot) == idx + 1
    t.wheel.set(slot, prev)


def _tear_tails(path: Path) -> None:
    """Half-written records at the end of the newest index and data segments."""
    for sub in ("index", "data"):
        last = sorted(p for p in (path / sub).iterdir() if p.name.isdigit())[-1]
        with open(last, "ab") as f:
            f.write(os.urandom(37))


def test_hundred_thousand_over_forty_days_with_restarts_and_crashes(tmp_path: Path) -> None:
    rnd = random.Random(20261122)
    clock = VirtualClock()
    store = FakeStore(clock)
    path = tmp_path / "timer"
    t = _reopen(path, clock)
    expected: dict[str, int | None] = {}  # uid -> deliver time, None when cancelled
    n_total = 0
    restarts = {"clean": 0, "crash": 0, "torn": 0}

    for phase in range(20):
        now = clock.now_ms()
        # 1. schedule a chunk; a few are already due
        chunk = []
        for _ in range(5_200):
            uid = f"m{n_total}"
            n_total += 1
            dm = now + (rnd.randint(0, 40 * DAY) if rnd.random() < 0.97 else rnd.randint(0, 5000))
            if rnd.random() < 0.002:
                dm = now - rnd.randint(1, 10_000)  # in the past: delivered at once
            chunk.append((msg(uid, keys=f"k{n_total % 5000}"), dm))
            expected[uid] = max(dm, now)
        for i in range(0, len(chunk), 1000):
            t.schedule_batch(chunk[i : i + 1000])
        # 2. cancels and reschedules, of pending and of delivered messages
        delivered = store.delivered()
        for _ in range(300):
            uid = f"m{rnd.randrange(n_total)}"
            if rnd.random() < 0.5:
                (r,) = t.cancel(uid)
                if expected[uid] is None:
                    assert r.outcome is Outcome.ALREADY_CANCELLED
                elif uid in delivered:
                    assert (r.outcome, r.deliver_ms) == (Outcome.ALREADY_DELIVERED, delivered[uid][0])
                else:
                    assert (r.outcome, r.deliver_ms) == (Outcome.CANCELLED, expected[uid])
                    expected[uid] = None
            else:
                new = now + rnd.choice([rnd.randint(0, 40 * DAY), rnd.randint(0, 2000)])
                (r,) = t.reschedule(uid, new)
                if expected[uid] is None:
                    assert r.outcome is Outcome.ALREADY_CANCELLED
                elif uid in delivered:
                    assert r.outcome is Outcome.ALREADY_DELIVERED
                else:
                    assert (r.outcome, r.deliver_ms) == (Outcome.RESCHEDULED, new)
                    expected[uid] = new
        # 3. let time pass
        drive(t, clock, store, until=now + rnd.randint(DAY // 2, 3 * DAY))
        delivered = store.delivered()
        pending_now = sum(1 for u, d in expected.items() if d is not None and u not in delivered)
        assert t.count() == pending_now, phase
        # 4. restart: clean, crash, or crash with torn tails and a lost wheel link
        kind = ["clean", "crash", "torn"][phase % 3]
        restarts[kind] += 1
        if kind == "clean":
            t.close()
        elif kind == "crash":
            t.abandon()
        else:
            # one more schedule whose wheel link is lost: the crash came between the two writes
            uid = f"m{n_total}"
            n_total += 1
            t.schedule(msg(uid), clock.now_ms() + rnd.randint(0, 40 * DAY))
            expected[uid] = int(t.query(key=uid).items[0].deliver_ms)
            _lose_last_wheel_link(t)
            t.abandon()
            _tear_tails(path)
        t = _reopen(path, clock)
        fp = t.footprint()
        assert fp["window_entries"] == 0 and fp["topics"] == 1

    drive(t, clock, store)
    delivered = store.delivered()
    assert n_total >= 100_000 and all(restarts.values())
    for uid, d in expected.items():
        if d is None:
            assert uid not in delivered, f"cancelled {uid} was delivered"
        else:
            assert delivered.get(uid) == [d], (uid, d, delivered.get(uid))
    assert len(delivered) == sum(1 for d in expected.values() if d is not None)
    s = t.stats()
    assert s["early_deliveries"] == 0 and s["pending"] == 0
    t.close()


def test_a_crash_right_after_a_delivery_does_not_deliver_it_again(tmp_path: Path) -> None:
    # The timer goes to sleep after its last batch; a process killed then (before any later poll or
    # flush) must find that batch's delivery marks on disk.
    clock = VirtualClock(1_700_000_000_000)
    store = FakeStore(clock)
    t = _reopen(tmp_path, clock)
    t.schedule(msg("once"), clock.now_ms() + 1_000)
    t.schedule(msg("later"), clock.now_ms() + 3_600_000)
    clock.advance_sync(1_000)
    items, _ = t.poll(clock.now_ms())
    assert [o for o in t.deliver_many(items, store.put_message)] == ["delivered"]
    t.abandon()  # a process crash: no poll, no flush, no checkpoint after the delivery
    t = _reopen(tmp_path, clock)
    drive(t, clock, store, until=clock.now_ms() + 60_000)
    assert [uid for uid, _, _ in store.puts] == ["once"]
    assert t.count() == 1


def test_a_record_damaged_on_disk_is_never_handed_out(tmp_path: Path) -> None:
    clock = VirtualClock(1_700_000_000_000)
    store = FakeStore(clock)
    t = _reopen(tmp_path, clock)
    bad = t.schedule(msg("bad", size=200), clock.now_ms() + 1_000)
    t.schedule(msg("good", size=200), clock.now_ms() + 2_000)
    t.flush()
    seg = sorted(p for p in (tmp_path / "data").iterdir() if p.name.isdigit())[0]
    with open(seg, "r+b") as f:  # a few bytes of the first message's body overwritten
        f.seek(bad.timer_pos - int(seg.name) + 64 + 120)
        f.write(b"\xff\x00\xff")
    drive(t, clock, store)
    assert [uid for uid, _, _ in store.puts] == ["good"]
    assert t.failed == 1 and t.count() == 0


def test_garbage_at_the_end_of_a_done_log_rewrites_no_record(tmp_path: Path, caplog) -> None:
    from chronomq.delay.timer.records import _DONE_ENTRY

    clock = VirtualClock(1_700_000_000_000)
    store = FakeStore(clock)
    t = _reopen(tmp_path, clock)
    t.schedule(msg("first"), clock.now_ms() + 1_000)
    second = t.schedule(msg("second"), clock.now_ms() + 5_000)
    clock.advance_sync(1_000)
    items, _ = t.poll(clock.now_ms())
    assert t.deliver_many(items, store.put_message) == ["delivered"]
    t.abandon()
    # a torn tail: an entry that names the second record with bytes that are not its mark
    with open(tmp_path / "done.0.log", "ab") as f:
        f.write(_DONE_ENTRY.pack(second.timer_pos, os.urandom(48)))
    t = _reopen(tmp_path, clock)
    assert "done.0.log is torn" in caplog.text
    drive(t, clock, store)
    assert [uid for uid, _, _ in store.puts] == ["first", "second"]
    assert store.puts[1][1] == 1_700_000_005_000


def test_a_damaged_key_index_answers_lookups_without_an_error(tmp_path: Path) -> None:
    import struct

    clock = VirtualClock(1_700_000_000_000)
    t = _reopen(tmp_path, clock)
    t.schedule(msg("k1"), clock.now_ms() + 1_000)
    g = t.hash.gens[-1]
    damaged = 0
    for b in range(0, t.hash.buckets * 8, 8):  # every bucket head in use now names a negative entry
        if g._head(b):
            struct.pack_into("<q", g.bmap, b, -(1 << 62))
            damaged += 1
    assert damaged
    assert [r.outcome for r in t.cancel("k1")] == [Outcome.UNKNOWN]
    t.close()


@pytest.mark.parametrize("generation", [100_000, 2_500], ids=["one-generation", "generations-added"])
@pytest.mark.parametrize("lost", ["none", "all", "entries", "buckets"])
def test_keys_scheduled_after_the_last_flush_survive_a_crash_that_lost_hash_pages(
        tmp_path: Path, lost: str, generation: int) -> None:
    """A SYNC_FLUSH round syncs the data and index logs only; the key hash reaches the disk with the
    periodic flush. A crash may lose any of the hash's pages written since: none, all of them, the
    entries (the bucket heads then name entries that are gone) or the bucket pages (stale heads), also
    when the hash started new generations after the flush. Every key still finds its message after the
    restart."""
    clock = VirtualClock()
    path = tmp_path / "timer"
    cfg = small_config(hash_buckets=256, hash_generation_entries=generation)
    t = TimerStore(path, clock, cfg)
    t.open()
    later = clock.now_ms() + DAY
    before = t.schedule_batch([(msg(f"a{i}", keys=f"ka{i} shared"), later) for i in range(1500)])
    t.flush()
    at_flush = {p.name: p.read_bytes() for p in (path / "hash").iterdir()}
    after = t.schedule_batch([(msg(f"b{i}", keys=f"kb{i} shared"), later) for i in range(1500)])
    t.sync_files()
    t.abandon()
    for name, raw in at_flush.items():  # the disk as it was at the flush, for the pages that were lost
        if lost == "all" or name.endswith("." + lost):
            (path / "hash" / name).write_bytes(raw)

    t = TimerStore(path, clock, cfg)
    t.open()
    try:
        for prefix, results in (("a", before), ("b", after)):
            for i in range(0, 1500, 7):
                assert [r.msg_id for r in t.records_of(results[i].msg_id)] == [f"{prefix}{i}"]
                assert [r.msg_id for r in t.query(key=f"k{prefix}{i}").items] == [f"{prefix}{i}"]
        assert t.count(key="shared") == 3000
        assert [r.outcome for r in t.cancel("kb42", by_key=True)] == [Outcome.CANCELLED]
    finally:
        t.close()


def test_hash_entries_of_a_batch_whose_index_was_lost_do_not_hide_the_records_written_after_it(
        tmp_path: Path) -> None:
    """The hash is written before the index: a crash between the two leaves hash entries for a batch
    that was never acknowledged, at positions the recovered data log reuses. The records written there
    later (and only synced, not flushed) are still found after a second crash."""
    clock = VirtualClock()
    path = tmp_path / "timer"
    cfg = small_config(hash_buckets=256, hash_generation_entries=100_000)
    later = clock.now_ms() + DAY
    t = TimerStore(path, clock, cfg)
    t.open()
    a = t.schedule_batch([(msg(f"a{i}", keys=f"ka{i}"), later) for i in range(300)])
    t.flush()
    b = t.schedule_batch([(msg(f"b{i}", keys=f"kb{i}"), later) for i in range(300)])
    t.sync_files()
    acked_index_end = t.index_end
    t.schedule_batch([(msg(f"c{i}", keys=f"kc{i}"), later) for i in range(300)])
    t.index.truncate(acked_index_end * IDX_SIZE)  # the crash came before the index entries of c
    t.abandon()

    t = TimerStore(path, clock, cfg)
    t.open()
    assert t.query(key="kc5").items == []
    synced = {p.name: p.read_bytes() for p in (path / "hash").iterdir()}  # recovery synced the hash
    d = t.schedule_batch([(msg(f"d{i}", keys=f"kd{i}"), later) for i in range(300)])
    t.sync_files()
    t.abandon()
    for name, raw in synced.items():  # the hash pages written for d are lost with the crash
        (path / "hash" / name).write_bytes(raw)

    t = TimerStore(path, clock, cfg)
    t.open()
    try:
        for prefix, results in (("a", a), ("b", b), ("d", d)):
            for i in range(0, 300, 11):
                assert [r.msg_id for r in t.records_of(results[i].msg_id)] == [f"{prefix}{i}"]
                assert [r.msg_id for r in t.query(key=f"k{prefix}{i}").items] == [f"{prefix}{i}"]
        assert t.query(key="kc5").items == []
    finally:
        t.close()
