"""The timer's journal in the commit log and a follower rebuilding another timer store from it: parks,
cancels by key, reschedules and deliveries arrive in order; a replay changes nothing; a record that
cannot be applied is skipped with a count; a journal record the store refuses is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay.timer import TimerService
from chronomq.delay.timer.journal import JOURNAL_TOPIC, OP_PARK, P_OP, TimerFollower, TimerJournal
from chronomq.message import MessageExt
from chronomq.store import MessageStore
from chronomq.store.types import PutResult, PutStatus

HOST = ("127.0.0.1", 10911)


def msg(body: str, keys: str = "") -> MessageExt:
    props = {"KEYS": keys} if keys else {}
    return MessageExt("Real", body.encode(), props, 0, 2, 0, 1, HOST, 0, HOST, 0, 0, 0, 0, 0)


async def settle(svc: TimerService, clock: VirtualClock, ms: int) -> None:
    await clock.advance(ms)
    await svc.settle()


async def test_a_follower_rebuilds_the_timer_from_the_journal(tmp_path: Path) -> None:
    clock = VirtualClock()
    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path / "m")})
    store = MessageStore(config, clock, HOST)
    store.start()
    master = TimerService(store, config, clock, store_host=HOST)
    replica = TimerService(store, config, clock, root_dir=tmp_path / "s" / "timer", store_host=HOST)
    try:
        master.enable_journal(TimerJournal(store, clock, HOST))
        await master.start()
        replica.open()
        follower = TimerFollower(store, replica, tmp_path / "s")
        now = clock.now_ms()
        res = master.schedule_batch([(msg("a"), now + 1000), (msg("b"), now + 2000),
                                     (msg("c"), now + 10_000), (msg("d", "order-3"), now + 10_000)])
        e = master.schedule(msg("e"), now + 20_000)
        assert [r.outcome.value for r in master.cancel("order-3", by_key=True)] == ["CANCELLED"]
        assert master.reschedule(res[2].msg_id, now + 30_000)[0].outcome.value == "RESCHEDULED"
        await settle(master, clock, 2500)  # a and b are delivered
        assert master.count() == 2
        assert store.wait_dispatched(store.max_phy_offset, 5)

        # one record per parked message, one per cancel, reschedule and delivery batch: all of them
        assert follower.apply_available() == store.get_max_offset_in_queue(JOURNAL_TOPIC, 0) >= 8
        assert replica.count() == 2 and follower.skipped == 0
        pending = {i.msg_id: i.deliver_ms for i in replica.query().items}
        assert pending == {res[2].msg_id: now + 30_000, e.msg_id: now + 20_000}

        follower.offset = 0  # a replay from the start (a crash before the position was saved)
        follower.apply_available()
        stats = replica.stats()
        assert replica.count() == 2 and stats["delivered"] == 2 and stats["cancelled"] == 1

        follower.save()
        assert TimerFollower(store, replica, tmp_path / "s").offset == follower.offset

        # a record that is not a journal operation is skipped, counted, and the follower goes on
        bad = msg("x")
        bad.topic, bad.queue_id, bad.properties = JOURNAL_TOPIC, 0, {P_OP: "explode"}
        store.put_message(bad)
        lost = msg("y")
        lost.topic, lost.queue_id, lost.properties = JOURNAL_TOPIC, 0, {P_OP: OP_PARK}  # no deliver time
        store.put_message(lost)
        master.schedule(msg("f"), now + 50_000)
        assert store.wait_dispatched(store.max_phy_offset, 5)
        assert follower.apply_available() == 3 and follower.skipped == 2
        assert replica.count() == 3
    finally:
        await master.shutdown()
        await replica.shutdown()
        store.shutdown()


class RefusingStore:
    def put_message(self, m: MessageExt) -> PutResult:
        return PutResult(PutStatus.SERVICE_NOT_AVAILABLE, error="disk full")

    def put_messages(self, ms: list[Any]) -> PutResult:
        return self.put_message(ms[0])


def test_a_journal_record_the_store_refuses_is_counted() -> None:
    journal = TimerJournal(RefusingStore(), VirtualClock(), HOST)
    assert journal.parked([msg("a"), msg("b")]) is False
    journal.done(["U1"])
    assert journal.failures == 2 and journal.end == 0 and journal.records == 0
