"""The timer store: deliver a message at any millisecond, with cancel, reschedule and a pending index.

API (synchronous and thread-safe, but for the coroutines start, shutdown, schedule_async,
schedule_batch_async and settle)::

    svc = TimerService(message_store, broker_config, clock)   # files in <storePathRootDir>/timer
    await svc.start()                       # recover, then run the delivery loop on this event loop
    r = svc.schedule(msg, deliver_ms)       # -> ScheduleResult(msg_id=UNIQ_KEY, offset_msg_id, ...)
    svc.maybe_schedule(msg)                 # TIMER_* in the future (DELAY dropped): schedule; else None
    svc.cancel(msg_id_or_key, by_key=False)             # -> [OpResult(CANCELLED | ALREADY_... | UNKNOWN)]
    svc.reschedule(msg_id_or_key, deliver_ms, by_key=False)   # -> [OpResult(RESCHEDULED ...)]
    svc.query(topic=, key=, tag=, start_ms=, end_ms=, limit=, cursor=)   # -> QueryPage (paged)
    svc.count(...) ; svc.stats() ; await svc.shutdown()
    deliver_ms_from_properties(props, now_ms)  # TIMER_* properties -> epoch ms or None

Rules: nothing is delivered before its deliver time; memory does not grow with the number pending
(every per-message fact lives on disk); a delivered message is put into ``message_store`` as a new
message of its real topic and queue, with TIMER_DELIVER_MS = its deliver time, through the delivery
path shared with the level service (chronomq.delay.delivery: one put_records per real queue when the
store has it). The broker's send path reaches the timer through ``DelayService.admit``. On-disk
format, recovery, duplicate window and retention: docs/timer.md.
"""

from .props import SECONDS_THRESHOLD, deliver_ms_from_properties, has_timer_property
from .service import TimerService
from .store import TimerStore
from .types import (
    OpResult,
    Outcome,
    PendingInfo,
    QueryPage,
    ScheduleResult,
    TimerConfig,
    TimerError,
    TimerPropertyError,
    TimerRefused,
    TimerUnavailable,
)

__all__ = [
    "SECONDS_THRESHOLD",
    "OpResult",
    "Outcome",
    "PendingInfo",
    "QueryPage",
    "ScheduleResult",
    "TimerConfig",
    "TimerError",
    "TimerPropertyError",
    "TimerRefused",
    "TimerService",
    "TimerStore",
    "TimerUnavailable",
    "deliver_ms_from_properties",
    "has_timer_property",
]
