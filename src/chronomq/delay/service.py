"""DelayService: the delay feature's facade for the broker: the way in for sent messages (``admit``),
the level schedule service, and send-back (retry ladder / DLQ) message building."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.delay.admission import (
    BATCH_DELAY_REFUSED,
    Admission,
    batch_has_delay_level,
    mixed_batch_reason,
)
from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE
from chronomq.delay.levels import DelayLevels, parse_level
from chronomq.delay.retry import build_send_back, effective_max_reconsume_times
from chronomq.delay.schedule import ScheduleService
from chronomq.delay.timer.props import timed_deliver_ms
from chronomq.delay.timer.types import TimerError
from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    SCHEDULE_TOPIC,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    SYSFLAG_TRANSACTION_ROLLBACK_TYPE,
    MessageExt,
    transaction_type,
)

if TYPE_CHECKING:
    from chronomq.store import MessageStore


class DelayService:
    """Delay levels, the schedule service, and send-back (retry ladder / DLQ) message building.

    ``svc = DelayService(store, config, clock)``; the broker calls ``admit`` / ``admit_batch`` on what a
    producer sends (timer, delay level or put now: see chronomq.delay.admission), ``build_send_back``
    then ``prepare_put`` for CONSUMER_SEND_MSG_BACK (retry copies follow the level ladder only), and
    ``await start()`` after the store has started (``await shutdown()`` before the store shuts down).
    The broker installs ``min_needed_offset`` as the store's cleaning guard."""

    def __init__(self, store: MessageStore, config: BrokerConfig, clock: Clock) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.levels = DelayLevels.parse(config.messageDelayLevel)
        self.schedule = ScheduleService(store, self.levels, clock, config.storePathRootDir,
                                        config.flushDelayOffsetInterval)

    # --- the way in ---------------------------------------------------------------------------------------
    def admit(self, msg: MessageExt) -> Admission:
        """A sent message: timed (park it in the timer store), or put now, parked under its delay level
        when it has one (``prepare_put``); refused for an unusable TIMER_* value."""
        try:
            deliver_ms = timed_deliver_ms(msg, self.clock.now_ms())
        except TimerError as e:
            return Admission(refused=str(e))
        if deliver_ms is not None:
            return Admission(timed=[(msg, deliver_ms)])
        return Admission(put=[self.prepare_put(msg)])

    def admit_batch(self, msgs: list[MessageExt]) -> Admission:
        """A sent batch: refused with a DELAY level or when it mixes timed and immediate items, else all
        timed or all put now."""
        if batch_has_delay_level(msgs):
            return Admission(refused=BATCH_DELAY_REFUSED)
        now = self.clock.now_ms()
        try:
            times = [timed_deliver_ms(m, now) for m in msgs]
        except TimerError as e:
            return Admission(refused=str(e))
        timed = [(m, t) for m, t in zip(msgs, times, strict=True) if t is not None]
        if not timed:
            for m in msgs:
                m.properties.pop(PROPERTY_DELAY_SOURCE, None)
            return Admission(put=msgs)
        if len(timed) != len(msgs):
            return Admission(refused=mixed_batch_reason(len(timed), len(msgs)))
        return Admission(timed=timed)

    @property
    def schedule_topic_queue_nums(self) -> int:
        return self.levels.max_level

    def prepare_put(self, msg: MessageExt) -> MessageExt:
        """DELAY > 0 and not a transactional prepare/rollback: park the message (in place) under
        SCHEDULE_TOPIC_XXXX, queue level-1 (level clamped to the highest, DELAY rewritten to the clamped
        value), REAL_TOPIC/REAL_QID kept. Otherwise unchanged, except that the internal delivery
        marker is always stripped (clients cannot forge a re-put)."""
        msg.properties.pop(PROPERTY_DELAY_SOURCE, None)
        level = parse_level(msg.properties.get(PROPERTY_DELAY_TIME_LEVEL))
        if level <= 0:
            return msg
        if transaction_type(msg.sys_flag) in (SYSFLAG_TRANSACTION_PREPARED_TYPE,
                                              SYSFLAG_TRANSACTION_ROLLBACK_TYPE):
            return msg
        level = self.levels.clamp(level)
        msg.properties[PROPERTY_DELAY_TIME_LEVEL] = str(level)
        msg.properties[PROPERTY_REAL_TOPIC] = msg.topic
        msg.properties[PROPERTY_REAL_QUEUE_ID] = str(msg.queue_id)
        msg.topic = SCHEDULE_TOPIC
        msg.queue_id = self.levels.queue_id(level)
        return msg

    # --- send-back ----------------------------------------------------------------------------------------
    def build_send_back(self, msg: MessageExt, group: str, delay_level: int,
                        max_reconsume_times: int | None) -> MessageExt:
        """docs/protocol.md#retry-and-dead-letters. ``max_reconsume_times``: the request header's value when
        the broker has one (Java clients >= V3_4_9); pass None or a negative number when the request carries
        none, then the message's MAX_RECONSUME_TIMES property or else the broker's ``maxReconsumeTimes``
        apply. The result still has to go through ``prepare_put`` (retry copies carry DELAY) and the store."""
        limit = effective_max_reconsume_times(msg, max_reconsume_times, self.config.maxReconsumeTimes)
        return build_send_back(msg, group, delay_level, limit, strip=(PROPERTY_DELAY_SOURCE,))

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load delayOffset.json, skip entries already re-put before a crash, register the arrival
        listener, and start one task per level (plus the offset flusher)."""
        await self.schedule.start()

    async def shutdown(self) -> None:
        """Stop the level tasks and persist delayOffset.json (after a store flush)."""
        await self.schedule.shutdown()

    def min_needed_offset(self) -> int | None:
        """The lowest commit-log offset a parked level message still needs (the store's cleaning
        guard; the timer keeps its own copies and pins nothing)."""
        return self.schedule.min_needed_offset()

    def stats(self) -> dict:
        levels = [self.schedule.level_stats(st) for st in self.schedule.states.values()]
        early = sum(st.early for st in self.schedule.states.values())
        return {
            "levels": levels,
            "early_deliveries": early,
            "recovered_skips": sum(st.recovered_skips for st in self.schedule.states.values()),
        }
