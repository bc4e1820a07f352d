"""Public result and configuration types of the timer store (see ``chronomq.delay.timer``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

DAY_MS = 86_400_000


class TimerError(ValueError):
    """Bad input to the timer store (a clear message, safe to send back to a client)."""


class TimerRefused(TimerError):
    """The deliver time is beyond the configured maximum delay (or otherwise not acceptable)."""


class TimerUnavailable(TimerError):
    """The timer store could not write (disk full, I/O error): nothing was parked; worth retrying later."""


class TimerPropertyError(TimerError):
    """A TIMER_* / __STARTDELIVERTIME property that is not a usable number."""


class Outcome(Enum):
    CANCELLED = "CANCELLED"
    RESCHEDULED = "RESCHEDULED"
    ALREADY_DELIVERED = "ALREADY_DELIVERED"
    ALREADY_CANCELLED = "ALREADY_CANCELLED"
    UNKNOWN = "UNKNOWN"
    FAILED = "FAILED"  # the message store refused it for good (e.g. MESSAGE_ILLEGAL): never delivered


@dataclass(slots=True)
class OpResult:
    """The definite answer to a cancel or reschedule, one per matching message.

    ``deliver_ms``: the new deliver time (RESCHEDULED), the time it would have been delivered
    (CANCELLED), or when it was delivered (ALREADY_DELIVERED) / cancelled (ALREADY_CANCELLED)."""

    outcome: Outcome
    msg_id: str
    deliver_ms: int | None = None
    topic: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "msg_id": self.msg_id, "deliver_ms": self.deliver_ms,
                "topic": self.topic}


@dataclass(slots=True)
class ScheduleResult:
    msg_id: str  # the UNIQ_KEY (generated when the message had none): the handle for cancel/reschedule
    offset_msg_id: str  # 32 hex chars, host + (timer flag | timer data position); also accepted as a handle
    deliver_ms: int
    timer_pos: int


@dataclass(slots=True)
class PendingInfo:
    msg_id: str
    offset_msg_id: str
    topic: str
    queue_id: int
    tags: str | None
    keys: list[str]
    deliver_ms: int
    created_ms: int
    body_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class QueryPage:
    items: list[PendingInfo] = field(default_factory=list)
    next_cursor: str | None = None  # pass back to get the next page; None when there is no more
    scanned: int = 0


@dataclass
class TimerConfig:
    """Timer store settings. Broker keys (``-c broker.conf`` / ``--set``): timerMaxDelaySec,
    timerPrecisionMs (slot size), timerFlushIntervalMs, timerFlushEntries, timerDataSegmentSize,
    timerRetentionIntervalMs, timerStageAheadMs, timerStageLimit, timerStageBytes."""

    max_delay_ms: int = 40 * DAY_MS
    slot_ms: int = 1000
    data_segment_bytes: int = 64 * 1024 * 1024
    index_segment_entries: int = 1 << 20
    hash_buckets: int = 1 << 20
    hash_generation_entries: int = 8 << 20
    flush_interval_ms: int = 1000
    # ... or sooner, once this many index entries were written since the last checkpoint: a crash's
    # recovery re-reads what the last checkpoint does not cover, so this bounds it under a heavy load
    flush_entries: int = 16_384
    retention_interval_ms: int = 60_000
    # Start reading the next slot's chain (bounded: one slot) this long before it falls due, so a burst
    # of hundreds of thousands is sorted in memory before its first message is due ...
    preload_ms: int = 60_000
    # ... but make it the delivering slot (which earlier-due new schedules then join) only this close.
    promote_ms: int = 2000
    preload_step: int = 512  # chain entries read per step between deliveries
    deliver_batch: int = 256
    # Read, check and encode the messages falling due within this many ms before their moment (0: off),
    # at most stage_limit of them and stage_bytes of their records at once (the memory staging holds), so
    # that when they fall due only the store append is left.
    # Many due together start earlier: stage_item_us more for each message in the delivering slot (a
    # generous allowance for the ~4.5 us the preparation costs), so a burst is prepared by its moment.
    stage_ahead_ms: int = 50
    stage_limit: int = 131_072
    stage_bytes: int = 192 * 1024 * 1024
    stage_item_us: int = 10
    retry_backoff_ms: int = 100
    max_query_scan: int = 10_000  # entries examined per query page at most (the lock is held)

    def validate(self) -> None:
        if self.max_delay_ms <= 0:
            raise TimerError("timerMaxDelaySec must be positive")
        if self.slot_ms <= 0 or DAY_MS % self.slot_ms:
            raise TimerError(f"timerPrecisionMs {self.slot_ms} must be positive and divide 86,400,000")
        if self.data_segment_bytes < 64 * 1024:
            raise TimerError("timerDataSegmentSize must be at least 64 KiB")
        if self.stage_ahead_ms < 0 or self.stage_ahead_ms > 10_000:
            raise TimerError(f"timerStageAheadMs {self.stage_ahead_ms} must be between 0 and 10000")
        if self.stage_item_us < 0:
            raise TimerError(f"timer setting stage_item_us {self.stage_item_us} must not be negative")
        for name in ("index_segment_entries", "hash_buckets", "hash_generation_entries",
                     "flush_interval_ms", "flush_entries", "preload_step", "deliver_batch", "stage_limit",
                     "stage_bytes"):
            if getattr(self, name) <= 0:
                raise TimerError(f"timer setting {name} must be positive")

    @classmethod
    def from_broker_config(cls, cfg: Any) -> TimerConfig:
        """Read the timer keys from a BrokerConfig (its typed attributes; a plain object may carry them in
        an ``extra`` dict instead)."""
        extra = getattr(cfg, "extra", {}) or {}

        def get(key: str) -> int | None:
            raw = getattr(cfg, key, None)
            if raw is None:
                raw = extra.get(key)
            if raw is None:
                return None
            try:
                return int(str(raw).strip())
            except ValueError:
                raise TimerError(f"{key}: {raw!r} is not an integer") from None

        timer_cfg = cls()
        if (v := get("timerMaxDelaySec")) is not None:
            timer_cfg.max_delay_ms = v * 1000
        if (v := get("timerPrecisionMs")) is not None:
            timer_cfg.slot_ms = v
        if (v := get("timerFlushIntervalMs")) is not None:
            timer_cfg.flush_interval_ms = v
        if (v := get("timerFlushEntries")) is not None:
            timer_cfg.flush_entries = v
        if (v := get("timerDataSegmentSize")) is not None:
            timer_cfg.data_segment_bytes = v
        if (v := get("timerRetentionIntervalMs")) is not None:
            timer_cfg.retention_interval_ms = v
        if (v := get("timerStageAheadMs")) is not None:
            timer_cfg.stage_ahead_ms = v
        if (v := get("timerStageLimit")) is not None:
            timer_cfg.stage_limit = v
        if (v := get("timerStageBytes")) is not None:
            timer_cfg.stage_bytes = v
        timer_cfg.validate()
        return timer_cfg
