"""TimerService: the asyncio delivery loop on a virtual clock (sleeps exactly until the next deliver
time, wakes for an earlier schedule, survives a restart), maybe_schedule and stats."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_timer_store import FakeStore, msg, small_config

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay.timer import TimerError, TimerRefused, TimerService


def make(tmp_path: Path, clock: VirtualClock, store: FakeStore) -> TimerService:
    return TimerService(store, None, clock, timer_config=small_config(), root_dir=tmp_path / "timer")


async def run_until(svc: TimerService, clock: VirtualClock, end_ms: int) -> None:
    """Advance the virtual clock deadline by deadline, letting the loop settle after each."""
    await svc.settle()
    for _ in range(1_000_000):
        deadlines = [d for d in clock.pending_deadlines() if d <= end_ms]
        if not deadlines:
            await clock.advance_to(end_ms)
            await svc.settle()
            return
        await clock.advance_to(deadlines[0])
        await svc.settle()
    raise AssertionError("too many steps")


async def test_loop_delivers_exactly_on_time_and_survives_restart(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = FakeStore(clock)
    svc = make(tmp_path, clock, store)
    await svc.start()
    now = clock.now_ms()
    rnd = random.Random(5)
    expected = {}
    for i in range(600):
        dm = now + rnd.randint(1, 3_600_000)
        svc.schedule(msg(f"s{i}"), dm)
        expected[f"s{i}"] = dm
    await run_until(svc, clock, now + 1_800_000)
    first = len(store.puts)
    assert 0 < first < 600
    await svc.shutdown()

    svc = make(tmp_path, clock, store)
    await svc.start()
    assert svc.count() == 600 - first
    await run_until(svc, clock, now + 3_700_000)
    await svc.shutdown()
    got = {u: at for u, at, _ in store.puts}
    assert len(store.puts) == 600 and got == expected


async def test_earlier_schedule_wakes_the_sleeping_loop(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = FakeStore(clock)
    svc = make(tmp_path, clock, store)
    await svc.start()
    now = clock.now_ms()
    svc.schedule(msg("late"), now + 60_000)
    await run_until(svc, clock, now + 1_000)
    assert store.puts == []
    svc.schedule(msg("early"), now + 1_500)  # earlier than what the loop sleeps for
    svc.schedule(msg("now"), now + 1_000)  # due right away
    await run_until(svc, clock, now + 70_000)
    assert [(u, at - now) for u, at, _ in store.puts] == [("now", 1_000), ("early", 1_500), ("late", 60_000)]
    await svc.shutdown()


async def test_maybe_schedule_and_stats(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = FakeStore(clock)
    svc = make(tmp_path, clock, store)
    await svc.start()
    now = clock.now_ms()
    m = msg("p1")
    m.properties["TIMER_DELIVER_MS"] = str(now + 2_500)
    r = svc.maybe_schedule(m)
    assert r is not None and (r.msg_id, r.deliver_ms) == ("p1", now + 2_500)
    plain = msg("p2")
    assert svc.maybe_schedule(plain) is None
    leveled = msg("p3")
    leveled.properties.update({"DELAY": "3", "TIMER_DELAY_SEC": "5"})
    r3 = svc.maybe_schedule(leveled)  # the timer time wins over the level, which is dropped
    assert r3 is not None and r3.deliver_ms == now + 5_000 and "DELAY" not in leveled.properties
    half = msg("p4")
    half.properties.update({"TRAN_MSG": "true", "TIMER_DELAY_SEC": "5"})
    assert svc.maybe_schedule(half) is None
    past = msg("p5")
    past.properties["TIMER_DELIVER_MS"] = str(now - 1)
    assert svc.maybe_schedule(past) is None  # due already: put it normally
    far = msg("p6")
    far.properties["TIMER_DELAY_SEC"] = str(41 * 86_400)
    with pytest.raises(TimerRefused):
        svc.maybe_schedule(far)
    bad = msg("p7")
    bad.properties["TIMER_DELAY_MS"] = "soon"
    with pytest.raises(TimerError, match="TIMER_DELAY_MS"):
        svc.maybe_schedule(bad)
    assert svc.min_needed_offset() is None
    await run_until(svc, clock, now + 3_000)
    s = svc.stats()
    json.dumps(s)
    assert s["delivered"] == 1 and s["pending"] == 1 and s["early_deliveries"] == 0  # p3 is due at +5 s
    assert s["lateness_ms_by_topic"]["T"]["max"] == 0
    await svc.shutdown()


def test_config_keys_from_broker_config(tmp_path: Path) -> None:
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), "timerMaxDelaySec": "3600",
                                      "timerPrecisionMs": "100"})
    svc = TimerService(FakeStore(VirtualClock()), cfg, VirtualClock())
    assert svc.timer.cfg.max_delay_ms == 3_600_000 and svc.timer.cfg.slot_ms == 100
    assert svc.timer.root == tmp_path / "timer"
    bad, _ = BrokerConfig.load(None, {"timerPrecisionMs": "7"})
    with pytest.raises(TimerError, match="divide"):
        TimerService(FakeStore(VirtualClock()), bad, VirtualClock())


async def test_schedule_async_under_sync_flush(tmp_path: Path) -> None:
    clock = VirtualClock()
    store = FakeStore(clock)
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), "flushDiskType": "SYNC_FLUSH"})
    svc = TimerService(store, cfg, clock, timer_config=small_config())
    assert svc.sync_flush
    await svc.start()
    now = clock.now_ms()
    r = await svc.schedule_async(msg("a1"), now + 700)
    rs = await svc.schedule_batch_async([(msg("a2"), now + 800), (msg("a3"), now + 900)])
    assert [r.msg_id] + [x.msg_id for x in rs] == ["a1", "a2", "a3"]
    await run_until(svc, clock, now + 1000)
    assert [(u, at - now) for u, at, _ in store.puts] == [("a1", 700), ("a2", 800), ("a3", 900)]
    await svc.shutdown()


async def test_sync_flush_group_commit_acknowledges_only_after_a_round_covering_the_write(
        tmp_path: Path) -> None:
    import asyncio
    import threading

    clock = VirtualClock()
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), "flushDiskType": "SYNC_FLUSH"})
    svc = TimerService(FakeStore(clock), cfg, clock, timer_config=small_config())
    await svc.start()
    written: list[str] = []
    rounds: list[tuple[int, int]] = []  # (writes covered when the round started, writes when it ended)
    real_batch, real_sync = svc.timer.schedule_batch, svc.timer.sync_files
    gate, started = threading.Event(), threading.Event()

    def counting_batch(items: list) -> list:
        out = real_batch(items)
        written.append(items[0][0].uniq_key)
        return out

    def slow_sync() -> None:
        covers = len(written)
        started.set()
        gate.wait(5)  # the first round stays open until the other requests have written
        real_sync()
        rounds.append((covers, len(written)))

    svc.timer.schedule_batch = counting_batch  # type: ignore[method-assign]
    svc.timer.sync_files = slow_sync  # type: ignore[method-assign]
    now = clock.now_ms()

    async def one(i: int) -> None:
        await svc.schedule_batch_async([(msg(f"g{i}"), now + 500 + i)])
        pos = written.index(f"g{i}") + 1
        assert rounds and max(c for c, _ in rounds) >= pos, (i, pos, rounds)  # its write was fsynced

    tasks = [asyncio.create_task(one(0))]
    await asyncio.wait_for(asyncio.to_thread(started.wait, 5), 10)  # the first round is in its fsync
    tasks += [asyncio.create_task(one(i)) for i in range(1, 20)]
    for _ in range(100):
        await asyncio.sleep(0)
    assert len(written) == 20 and not rounds and not any(t.done() for t in tasks)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    # the open round covered the first write only; the 19 writes behind it shared one more round
    assert rounds == [(1, 20), (20, 20)] and svc.sync_rounds == 2

    def failing_sync() -> None:
        raise OSError(5, "Input/output error")

    svc.timer.sync_files = failing_sync  # type: ignore[method-assign]
    results = await asyncio.gather(*(svc.schedule_batch_async([(msg(f"f{i}"), now + 900)]) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)  # never acknowledged as durable
    svc.timer.sync_files = real_sync  # type: ignore[method-assign]
    assert (await svc.schedule_batch_async([(msg("ok"), now + 950)]))[0].msg_id == "ok"
    await svc.shutdown()


async def test_retention_runs_off_the_loop_so_deliveries_go_on(tmp_path: Path) -> None:
    """A retention pass scans whole data segments (seconds for a backlog of them): it runs in a worker
    thread, and a message falling due meanwhile is still delivered on time."""
    import asyncio
    import threading

    clock = VirtualClock()
    store = FakeStore(clock)
    svc = TimerService(store, None, clock, root_dir=tmp_path / "timer",
                       timer_config=small_config(retention_interval_ms=1_000))
    await svc.start()
    now = clock.now_ms()
    svc.schedule(msg("a"), now + 500)
    in_scan, release = threading.Event(), threading.Event()
    real_retention = svc.timer.run_retention

    threads: list[int] = []

    def slow_retention(at: int | None = None) -> dict[str, int]:
        threads.append(threading.get_ident())
        in_scan.set()
        release.wait(10)  # a long scan
        return real_retention(at)

    svc.timer.run_retention = slow_retention  # type: ignore[method-assign]
    await run_until(svc, clock, now + 1_000)  # the first pass starts and stays in its scan
    assert await asyncio.to_thread(in_scan.wait, 5)
    svc.schedule(msg("b"), now + 1_200)
    await run_until(svc, clock, now + 1_200)
    assert [u for u, _, _ in store.puts] == ["a", "b"]  # delivered while the scan is still running
    assert not release.is_set() and threads and threading.get_ident() not in threads
    release.set()
    await svc.shutdown()  # waits for the pass to end


async def test_first_batch_after_a_wake_up_is_small_then_batches_grow(tmp_path: Path) -> None:
    """1,000 due at one ms: the first put carries at most the first batch's 64 messages (they reach
    consumers at once), later ones grow to the configured batch; every message still goes out once, in
    order, on time."""
    clock = VirtualClock()
    store = FakeStore(clock)
    sizes: list[int] = []

    def put_messages(msgs: list) -> object:
        sizes.append(len(msgs))
        res = None
        for m in msgs:
            res = store.put_message(m)
        return res

    store.put_messages = put_messages  # type: ignore[attr-defined]
    svc = make(tmp_path, clock, store)
    await svc.start()
    due = clock.now_ms() + 5_000
    for i in range(1000):
        svc.schedule(msg(f"b{i}"), due)
    await run_until(svc, clock, due + 1)
    await svc.shutdown()
    assert [u for u, _, _ in store.puts] == [f"b{i}" for i in range(1000)]
    assert all(at == due for _, at, _ in store.puts)
    assert sizes[0] <= 64 and max(sizes) > 64


def _checkpoint_index_end(path: Path) -> int:
    """The checkpoint's index_end. write_atomic(backup=True) moves the old file aside before the new one is
    moved in: between the two the file is missing for a moment, and is read again (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return int(json.loads(path.read_text())["index_end"])
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


async def test_a_heavy_load_is_flushed_every_flush_entries_not_only_every_interval(tmp_path: Path) -> None:
    clock = VirtualClock()
    svc = TimerService(FakeStore(clock), None, clock, timer_config=small_config(flush_entries=100),
                       root_dir=tmp_path / "timer")
    await svc.start()
    try:
        ckpt = tmp_path / "timer" / "checkpoint.json"
        at_start = _checkpoint_index_end(ckpt)
        far = clock.now_ms() + 3_600_000
        await svc.schedule_batch_async([(msg(f"a{i}"), far + i) for i in range(99)])
        await svc.settle()
        assert _checkpoint_index_end(ckpt) == at_start  # below the count: the interval's
        def behind() -> int:
            return svc.timer.index_end - _checkpoint_index_end(ckpt)

        for k in range(3):
            await svc.schedule_batch_async([(msg(f"b{k}-{i}"), far + i) for i in range(60)])
            for _ in range(500):  # the flush runs in a worker thread: poll for its checkpoint (bounded)
                await svc.settle()
                if behind() < 100:
                    break
                await asyncio.sleep(0.01)
            # with the virtual clock standing still, only the count can have started those flushes
            assert behind() < 100, (k, behind())
    finally:
        await svc.shutdown()


async def test_a_count_flush_asked_while_one_runs_starts_when_that_one_ends(tmp_path: Path) -> None:
    # the loop never runs two flushes at once; a count reached meanwhile must not wait for the interval
    clock = VirtualClock()
    svc = TimerService(FakeStore(clock), None, clock, timer_config=small_config(flush_entries=100),
                       root_dir=tmp_path / "timer")
    await svc.start()
    gate = threading.Event()
    fsyncs: list[int] = []
    real_fsync = svc.timer._fsync_all

    def held_fsync(fds: list[int]) -> None:  # the first flush, its snapshot taken, waits for the gate
        fsyncs.append(len(fds))
        if len(fsyncs) == 1:
            gate.wait(30)
        real_fsync(fds)

    svc.timer._fsync_all = held_fsync  # type: ignore[method-assign]
    ckpt = tmp_path / "timer" / "checkpoint.json"
    try:
        far = clock.now_ms() + 3_600_000

        async def wait_until(cond: Callable[[], bool], what: str) -> None:
            for _ in range(1000):  # bounded: the flush runs in a worker thread
                await svc.settle()
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(what)

        await svc.schedule_batch_async([(msg(f"a{i}"), far + i) for i in range(100)])
        await wait_until(lambda: len(fsyncs) == 1, "the first flush did not start")
        await svc.schedule_batch_async([(msg(f"b{i}"), far + i) for i in range(100)])
        await svc.settle()
        assert len(fsyncs) == 1  # held: no second flush beside it
        gate.set()
        # the virtual clock stands still: only the count can start the second flush
        await wait_until(lambda: _checkpoint_index_end(ckpt) == svc.timer.index_end,
                         f"the checkpoint stayed behind after the held flush ended: {fsyncs}")
    finally:
        gate.set()
        await svc.shutdown()


def test_flush_entries_is_a_broker_key(tmp_path: Path) -> None:
    cfg = BrokerConfig(storePathRootDir=str(tmp_path))
    cfg.timerFlushEntries = 5_000
    svc = TimerService(FakeStore(VirtualClock()), cfg, VirtualClock())
    assert svc.timer.cfg.flush_entries == 5_000
    cfg.timerFlushEntries = 0
    with pytest.raises(TimerError, match="flush_entries"):
        TimerService(FakeStore(VirtualClock()), cfg, VirtualClock())


async def test_delivering_holds_from_a_burst_s_first_batch_until_the_loop_sleeps(tmp_path: Path) -> None:
    """The store defers its key index writes while ``delivering`` (a burst's answers go out first): it
    turns on once a batch was handed over, stays on between the burst's batches and turns off when the
    loop goes back to sleep."""
    clock = VirtualClock()
    store = FakeStore(clock)
    svc = make(tmp_path, clock, store)
    seen: list[bool] = []
    put = store.put_message

    def watched(m):  # type: ignore[no-untyped-def]
        seen.append(svc.delivering)
        return put(m)

    store.put_message = watched  # type: ignore[method-assign]
    await svc.start()
    try:
        due = clock.now_ms() + 1_000
        for i in range(600):
            svc.schedule(msg(f"b{i}"), due)
        await svc.settle()
        assert not svc.delivering and seen == []  # asleep until the due time
        await run_until(svc, clock, due)
        assert len(seen) == 600
        first = seen.index(True)
        assert 0 < first < 600 and all(seen[first:])  # on from the second batch to the burst's end
        assert not svc.delivering  # the burst delivered: the loop sleeps again
    finally:
        await svc.shutdown()
