"""The four ways a producer asks for a deliver time (docs/protocol.md#timer-properties)."""

from __future__ import annotations

from collections.abc import Mapping

from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_STARTDELIVERTIME,
    PROPERTY_TIMER_DELAY_MS,
    PROPERTY_TIMER_DELAY_SEC,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_TRANSACTION_PREPARED,
    SYSFLAG_TRANSACTION_COMMIT_TYPE,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    MessageExt,
    transaction_type,
)

from .types import TimerPropertyError

# An absolute time below this is taken as epoch *seconds*: 10**11 ms is March 1973, 10**11 s is the
# year 5138, so the two readings never overlap for real clocks (docs/protocol.md#timer-properties).
SECONDS_THRESHOLD = 10**11

TIMER_PROPERTIES = (PROPERTY_TIMER_DELAY_SEC, PROPERTY_TIMER_DELAY_MS, PROPERTY_TIMER_DELIVER_MS,
                    PROPERTY_STARTDELIVERTIME)


def _int(props: Mapping[str, str], name: str) -> int:
    raw = props[name].strip()
    try:
        value = int(raw)
    except ValueError:
        try:
            f = float(raw)
        except ValueError:
            raise TimerPropertyError(f"property {name}={raw!r} is not a number") from None
        if f != f or f in (float("inf"), float("-inf")):
            raise TimerPropertyError(f"property {name}={raw!r} is not a finite number") from None
        value = int(f)
    if value < 0:
        raise TimerPropertyError(f"property {name}={raw!r} must not be negative")
    return value


def _absolute(value: int) -> int:
    return value * 1000 if 0 < value < SECONDS_THRESHOLD else value


def has_timer_property(props: Mapping[str, str]) -> bool:
    return not props.keys().isdisjoint(TIMER_PROPERTIES)


def deliver_ms_from_properties(props: Mapping[str, str], now_ms: int) -> int | None:
    """The absolute deliver time (epoch ms) a message asks for, or None when it asks for none.

    Precedence (as RocketMQ 5.x's broker): ``TIMER_DELAY_SEC`` (relative seconds), ``TIMER_DELAY_MS``
    (relative ms), ``TIMER_DELIVER_MS`` (absolute), ``__STARTDELIVERTIME`` (absolute, older commercial
    clients). An absolute value below 10**11 is read as epoch seconds (a client that put seconds where
    milliseconds belong). Raises TimerPropertyError for a value that is not a non-negative number.
    A time in the past is returned as is: the caller delivers it at once."""
    if PROPERTY_TIMER_DELAY_SEC in props:
        return now_ms + _int(props, PROPERTY_TIMER_DELAY_SEC) * 1000
    if PROPERTY_TIMER_DELAY_MS in props:
        return now_ms + _int(props, PROPERTY_TIMER_DELAY_MS)
    if PROPERTY_TIMER_DELIVER_MS in props:
        return _absolute(_int(props, PROPERTY_TIMER_DELIVER_MS))
    if PROPERTY_STARTDELIVERTIME in props:
        return _absolute(_int(props, PROPERTY_STARTDELIVERTIME))
    return None


def timed_deliver_ms(msg: MessageExt, now_ms: int) -> int | None:
    """The one rule for a sent message's way into the timer: the future deliver time its TIMER_*
    property asks for, or None (put it now). A TIMER_* property overrides DELAY, which is then dropped.
    A transactional half message is never timed (its commit decides). Raises TimerPropertyError for an
    unusable value."""
    props = msg.properties
    if PROPERTY_TIMER_DELIVER_MS not in props and not has_timer_property(props):
        return None
    tx = transaction_type(msg.sys_flag)
    if tx == SYSFLAG_TRANSACTION_PREPARED_TYPE or \
            (tx != SYSFLAG_TRANSACTION_COMMIT_TYPE and props.get(PROPERTY_TRANSACTION_PREPARED) == "true"):
        return None  # a committed message keeps TRAN_MSG (as RocketMQ's does); its commit bits say so
    deliver_ms = deliver_ms_from_properties(props, now_ms)
    props.pop(PROPERTY_DELAY_TIME_LEVEL, None)
    if deliver_ms is None or deliver_ms <= now_ms:
        return None
    return deliver_ms
