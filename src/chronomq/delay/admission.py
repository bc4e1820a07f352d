"""How a message a producer sends enters delayed storage (``DelayService.admit`` / ``admit_batch``).

The rule: a message with a TIMER_* property (TIMER_DELAY_SEC, TIMER_DELAY_MS, TIMER_DELIVER_MS,
__STARTDELIVERTIME) whose deliver time is in the future is parked in the timer store, and its DELAY
level is dropped (the more precise request wins; with a time not in the future the DELAY is dropped
too and the message is put now). Otherwise a DELAY level > 0 parks it under SCHEDULE_TOPIC_XXXX.
A batch may not carry DELAY levels; its items are either all timed or none. The timed rule itself is
``timer.props.timed_deliver_ms`` (the timer service's ``maybe_schedule`` applies the same one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chronomq.message import PROPERTY_DELAY_TIME_LEVEL, MessageExt

BATCH_DELAY_REFUSED = "TimeDelayLevel is not supported for batched messages"


@dataclass(slots=True)
class Admission:
    """What to do with a sent message (or batch): exactly one of the three is set."""

    put: list[MessageExt] = field(default_factory=list)  # put into the store now (level-parked ones too)
    timed: list[tuple[MessageExt, int]] = field(default_factory=list)  # park in the timer: (msg, deliver_ms)
    refused: str | None = None  # refuse the send (MESSAGE_ILLEGAL) with this reason


def batch_has_delay_level(msgs: list[MessageExt]) -> bool:
    return any(m.properties.get(PROPERTY_DELAY_TIME_LEVEL, "0") not in ("", "0") for m in msgs)


def mixed_batch_reason(timed: int, total: int) -> str:
    return (f"the batch mixes {timed} timed and {total - timed} immediate messages;"
            " send them in separate batches")
