"""The timer's staging lead, on the real MessageStore and a virtual clock: many messages due together are
staged earlier than timerStageAheadMs (an allowance per message of the delivering slot), a few are not;
a message that arrives after others were staged and falls due before them is still put first, at its
millisecond; nothing is put before its time."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_timer_staging import Broker, msg, step_to

from chronomq.clock import VirtualClock


async def test_many_due_together_are_staged_earlier_than_a_few(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    try:
        await b.svc.start()
        cfg = b.svc.timer.cfg
        many_due = clock.now_ms() + 5_000
        n = 3_000  # lead: 50 ms + 3,000 x 10 us = 80 ms
        b.svc.schedule_batch([(msg(f"m{i}", i % 4), many_due) for i in range(n)])
        lead = cfg.stage_ahead_ms + n * cfg.stage_item_us // 1000
        assert lead == 80
        await step_to(b, clock, many_due - lead - 1)
        assert b.svc.timer.staged_count() == 0
        await step_to(b, clock, many_due - cfg.stage_ahead_ms - 10)  # past the lead, before 50 ms
        assert b.svc.timer.staged_count() == n and b.delivered() == {}
        await step_to(b, clock, many_due)
        got = b.delivered()
        assert len(got) == n and set(got.values()) == {many_due}

        few_due = clock.now_ms() + 5_000
        b.svc.schedule_batch([(msg(f"f{i}"), few_due) for i in range(10)])
        await step_to(b, clock, few_due - cfg.stage_ahead_ms - 2)
        assert b.svc.timer.staged_count() == 0
        await step_to(b, clock, few_due - 1)
        assert b.svc.timer.staged_count() == 10
        await step_to(b, clock, few_due)
        assert len(b.delivered()) == n + 10
        assert b.svc.stats()["early_deliveries"] == 0
    finally:
        await b.close()


async def test_an_arrival_due_before_what_is_staged_is_put_first(tmp_path: Path) -> None:
    clock = VirtualClock()
    b = Broker(tmp_path, clock)
    try:
        await b.svc.start()
        due = clock.now_ms() + 5_000
        b.svc.schedule_batch([(msg(f"s{i}", i % 4), due + 20) for i in range(300)])
        await step_to(b, clock, due - 1)
        assert b.svc.timer.staged_count() == 300
        b.svc.schedule_batch([(msg(f"e{i}", i % 4), due + 5) for i in range(5)])
        await step_to(b, clock, due + 5)
        got = b.delivered()
        assert got == {f"e{i}": due + 5 for i in range(5)}
        await step_to(b, clock, due + 20)
        got = b.delivered()
        assert len(got) == 305 and all(got[f"s{i}"] == due + 20 for i in range(300))
        assert b.svc.timer.staged_count() == 0 and b.svc.stats()["early_deliveries"] == 0
    finally:
        await b.close()
