"""Staging in the timer's delivery loop, on the real MessageStore and a virtual clock: messages falling
due within timerStageAheadMs are read and encoded ahead and appended at their moment, never before; a
cancel or reschedule after staging is honoured with its definite answer; a restart with staged messages
loses none; a group the store will not prepare goes the usual way; staging can be turned off."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay.timer import TimerService
from chronomq.message import MessageExt
from chronomq.store import MessageStore
from chronomq.store.types import PutResult, PutStatus

HOST = ("127.0.0.1", 10911)


def msg(uid: str, queue_id: int = 0) -> MessageExt:
    return MessageExt(topic="Real", body=uid.encode().ljust(64, b"."), queue_id=queue_id,
                      properties={"UNIQ_KEY": uid, "KEYS": f"k-{uid}"})


class Broker:
    def __init__(self, root: Path, clock: VirtualClock, **conf: Any) -> None:
        self.config, _ = BrokerConfig.load(None, {"storePathRootDir": str(root), **conf})
        self.store = MessageStore(self.config, clock, HOST)
        self.store.start()
        self.svc = TimerService(self.store, self.config, clock, store_host=HOST)

    def delivered(self) -> dict[str, int]:
        """UNIQ_KEY -> store time of every copy put under the real topic (a second copy fails)."""
        out: dict[str, int] = {}
        for m in self.store.iter_messages(0):
            if m.topic == "Real":
                assert m.uniq_key not in out, f"{m.uniq_key} delivered twice"
                out[m.uniq_key] = m.store_timestamp
        return out

    async def close(self) -> None:
        await self.svc.shutdown()
        self.store.shutdown()


async def step_to(b: Broker, clock: VirtualClock, target: int) -> None:
    """Advance the virtual clock to ``target`` deadline by deadline, letting the loop settle after each."""
    await b.svc.settle()
    for _ in range(100_000):
        deadlines = [d for d in clock.pending_deadlines() if d <= target]
        if not deadlines:
            await clock.advance_to(target)
            await b.svc.settle()
            return
        await clock.advance_to(deadlines[0])
        await b.svc.settle()
    raise AssertionError("too many steps")


async def test_staged_messages_are_put_at_their_millisecond_not_before(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    try:
        await b.svc.start()
        due = clock.now_ms() + 10_000
        b.svc.schedule_batch([(msg(f"m{i}", i % 4), due + (i % 3)) for i in range(600)])
        await step_to(b, clock, due - 1)
        assert b.svc.timer.staged_count() == 600  # read and encoded ahead ...
        assert b.delivered() == {}  # ... but nothing is in the real topic before its time
        await step_to(b, clock, due)
        got = b.delivered()
        assert len(got) == 200 and set(got.values()) == {due}
        await step_to(b, clock, due + 2)
        got = b.delivered()
        assert len(got) == 600
        assert all(got[f"m{i}"] == due + i % 3 for i in range(600))
        assert b.svc.timer.staged_count() == 0 and b.svc.stats()["early_deliveries"] == 0
        assert b.svc.count() == 0
    finally:
        await b.close()


async def test_under_sync_flush_deliveries_ask_no_fsync_and_the_checkpoint_syncs_their_copies_first(
        tmp_path: Path) -> None:
    """Nothing waits for a delivered copy's fdatasync, so under SYNC_FLUSH the staged puts ask the group
    commit for none; instead every checkpoint makes the commit log durable before it writes the delivery
    marks into their records, so no mark reaches the disk ahead of its copy (in either flush mode)."""
    clock = VirtualClock()
    # no interval flush during the test: the one flush below writes every mark, after every delivery
    b = Broker(tmp_path, clock, flushDiskType="SYNC_FLUSH", timerFlushIntervalMs="3600000")
    asked: list[int] = []
    real_request = b.store._request_flush
    b.store._request_flush = lambda end: (asked.append(end), real_request(end))[1]  # type: ignore[method-assign]
    events: list[tuple[str, int]] = []
    t = b.svc.timer
    try:
        await b.svc.start()
        assert t.store_sync == b.store.sync_commit_log
        real_sync, real_write = t.store_sync, t.data.write_existing
        t.store_sync = lambda: (events.append(("sync", b.store.max_phy_offset)), real_sync())[1]
        marked: set[int] = set()
        t.data.write_existing = lambda pos, data: (  # type: ignore[method-assign]
            events.append(("mark", b.store.max_phy_offset)), marked.add(pos), real_write(pos, data))[2]
        due = clock.now_ms() + 10_000
        b.svc.schedule_batch([(msg(f"m{i}", i % 4), due) for i in range(300)])
        await step_to(b, clock, due - 1)
        assert t.staged_count() == 300
        await step_to(b, clock, due)
        assert len(b.delivered()) == 300 and asked == []
        assert events == []  # nothing flushed yet
        await asyncio.to_thread(t.flush)
        assert len(marked) == 300 and events[0][0] == "sync"
        synced = 0
        for k, (what, end) in enumerate(events):
            if what == "sync":
                synced = end
            else:
                assert synced >= end, (k, events[:k + 1][-3:])  # its copy was durable before its mark
        assert b.store._cl_flushed >= b.store.max_phy_offset
    finally:
        await b.close()


async def test_a_cancel_or_reschedule_after_staging_is_honoured(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    try:
        await b.svc.start()
        due = clock.now_ms() + 5_000
        res = b.svc.schedule_batch([(msg(f"c{i}"), due) for i in range(10)])
        await step_to(b, clock, due - 1)
        assert b.svc.timer.staged_count() == 10
        assert [r.outcome.value for r in b.svc.cancel("c3")] == ["CANCELLED"]
        assert b.svc.reschedule(res[5].msg_id, due + 1_000)[0].outcome.value == "RESCHEDULED"
        await step_to(b, clock, due)
        got = b.delivered()
        assert set(got) == {f"c{i}" for i in range(10)} - {"c3", "c5"}
        assert set(got.values()) == {due}
        assert b.svc.cancel("c4")[0].outcome.value == "ALREADY_DELIVERED"
        await step_to(b, clock, due + 1_000)
        got = b.delivered()
        assert got["c5"] == due + 1_000 and "c3" not in got
    finally:
        await b.close()


async def test_a_restart_with_staged_messages_delivers_each_once(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    due = clock.now_ms() + 5_000
    await b.svc.start()
    b.svc.schedule_batch([(msg(f"r{i}"), due) for i in range(50)])
    await step_to(b, clock, due - 1)
    assert b.svc.timer.staged_count() == 50
    await b.close()

    b = Broker(tmp_path, clock)
    try:
        await b.svc.start()
        assert b.svc.count() == 50 and b.delivered() == {}
        await step_to(b, clock, due + 1)
        got = b.delivered()
        assert len(got) == 50 and set(got.values()) == {due}
        assert b.svc.count() == 0
    finally:
        await b.close()


async def test_a_group_the_store_will_not_prepare_goes_the_usual_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    prepared = b.store.prepare_records
    refused: list[int] = []

    def prepare_records(topic: str, queue_id: int, records: list[Any]) -> Any:
        if queue_id == 1 and not refused:  # at staging only: the put at its moment goes through
            refused.append(len(records))
            return PutResult(PutStatus.MESSAGE_ILLEGAL, error="refused by the test")
        return prepared(topic, queue_id, records)

    monkeypatch.setattr(b.store, "prepare_records", prepare_records)
    try:
        await b.svc.start()
        due = clock.now_ms() + 5_000
        b.svc.schedule_batch([(msg(f"g{i}", i % 2), due) for i in range(20)])
        await step_to(b, clock, due - 1)
        assert refused and b.svc.timer.staged_count() == 20
        await step_to(b, clock, due)
        got = b.delivered()
        assert len(got) == 20 and set(got.values()) == {due}
        assert b.store.wait_dispatched(b.store.max_phy_offset, 10)
        assert b.store.get_max_offset_in_queue("Real", 1) == 10
    finally:
        await b.close()


async def test_staging_off(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock, timerStageAheadMs="0")
    try:
        await b.svc.start()
        due = clock.now_ms() + 5_000
        b.svc.schedule_batch([(msg(f"o{i}"), due) for i in range(20)])
        await step_to(b, clock, due - 1)
        assert b.svc.timer.staged_count() == 0 and b.delivered() == {}
        await step_to(b, clock, due)
        got = b.delivered()
        assert len(got) == 20 and set(got.values()) == {due}
    finally:
        await b.close()


def test_stage_ahead_is_validated(tmp_path: Path) -> None:
    from chronomq.delay.timer import TimerError
    from chronomq.delay.timer.types import TimerConfig

    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), "timerStageAheadMs": "-1"})
    with pytest.raises(TimerError, match="timerStageAheadMs"):
        TimerConfig.from_broker_config(config)


@pytest.mark.parametrize(("limit", "budget", "most"), [("1000", str(40 * 1024), None), ("25", None, 25)])
async def test_staging_holds_at_most_its_limits_and_the_rest_still_goes_at_its_time(
        tmp_path: Path, limit: str, budget: str | None, most: int | None) -> None:
    """timerStageBytes bounds the records staged at once (at least one is staged), timerStageLimit their
    number; what does not fit is staged as room is made or taken at its time: all on time, once."""
    conf = {"timerStageLimit": limit, **({"timerStageBytes": budget} if budget else {})}
    clock = VirtualClock()
    b = Broker(tmp_path, clock, **conf)
    try:
        await b.svc.start()
        t = b.svc.timer
        calls = []
        real_stage = t.stage

        def counting_stage(*a: Any) -> int:
            calls.append(clock.now_ms())
            return real_stage(*a)

        t.stage = counting_stage  # type: ignore[method-assign]
        due = clock.now_ms() + 10_000
        b.svc.schedule_batch([(msg(f"s{i}", i % 4), due) for i in range(300)])
        await step_to(b, clock, due - 1)
        assert len(calls) < 30, len(calls)  # full, the loop sleeps until the due time: no polling meanwhile
        staged = t.staged_count()
        assert 0 < staged < 300 and b.delivered() == {}
        assert t._staged_bytes == sum(s.item.size for s in t._staged)
        if budget:  # the records' bytes within the budget (a record is about 330 bytes here)
            assert t._staged_bytes <= int(budget) < t._staged_bytes + t._staged[0].item.size
        else:
            assert staged == most
        await step_to(b, clock, due)
        got = b.delivered()
        assert len(got) == 300 and set(got.values()) == {due}
        assert t.staged_count() == 0 and t._staged_bytes == 0 and b.svc.stats()["early_deliveries"] == 0
    finally:
        await b.close()


@pytest.mark.parametrize("key", ["timerStageLimit", "timerStageBytes"])
def test_stage_limits_are_validated(tmp_path: Path, key: str) -> None:
    from chronomq.delay.timer import TimerError
    from chronomq.delay.timer.types import TimerConfig

    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), key: "0"})
    with pytest.raises(TimerError, match="stage_"):
        TimerConfig.from_broker_config(config)
