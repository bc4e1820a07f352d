"""CONSUMER_SEND_MSG_BACK semantics (Java 4.9): the retry ladder and the DLQ
(docs/protocol.md#retry-and-dead-letters)."""

from __future__ import annotations

from chronomq.message import (
    DLQ_GROUP_TOPIC_PREFIX,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_RETRY_TOPIC,
    RETRY_GROUP_TOPIC_PREFIX,
    MessageExt,
)

# The level the ladder starts at: the first retry waits level 3 (10 s by default), then 4, 5, ...
RETRY_BASE_LEVEL = 3


def retry_topic(group: str) -> str:
    return RETRY_GROUP_TOPIC_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_GROUP_TOPIC_PREFIX + group


def effective_max_reconsume_times(msg: MessageExt, requested: int | None, default: int) -> int:
    """The limit for this send-back: the value the request carried (Java header ``maxReconsumeTimes``,
    version >= V3_4_9) when the broker passes one (>= 0); else the message's ``MAX_RECONSUME_TIMES``
    property when it is a valid integer; else the broker/group default."""
    if requested is not None and requested >= 0:
        return requested
    raw = msg.properties.get(PROPERTY_MAX_RECONSUME_TIMES)
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value >= 0:
            return value
    return default


def build_send_back(msg: MessageExt, group: str, delay_level: int, max_reconsume_times: int,
                    strip: tuple[str, ...] = ()) -> MessageExt:
    """The message to store for a send-back of ``msg`` (the copy the consumer consumed).

    reconsume_times >= max, or delay_level < 0 -> ``%DLQ%<group>`` queue 0, DELAY = 0 (RocketMQ's
    setDelayTimeLevel(0): whatever level the consumed copy still carries, it is not parked). Otherwise
    ``%RETRY%<group>`` queue 0 with DELAY = delay_level if > 0 else 3 + reconsume_times (clamping to
    the highest level happens in prepare_put). Body, flag, sysFlag, born timestamp/host and properties
    are copied; RETRY_TOPIC is set on first send-back; ORIGIN_MESSAGE_ID keeps the first copy's
    offset msgId; reconsume_times + 1.
    """
    props = {k: v for k, v in msg.properties.items() if k not in strip}
    if PROPERTY_RETRY_TOPIC not in props:
        props[PROPERTY_RETRY_TOPIC] = msg.topic
    if not props.get(PROPERTY_ORIGIN_MESSAGE_ID):
        props[PROPERTY_ORIGIN_MESSAGE_ID] = msg.msg_id
    if msg.reconsume_times >= max_reconsume_times or delay_level < 0:
        topic = dlq_topic(group)
        props[PROPERTY_DELAY_TIME_LEVEL] = "0"
    else:
        topic = retry_topic(group)
        level = delay_level if delay_level > 0 else RETRY_BASE_LEVEL + msg.reconsume_times
        props[PROPERTY_DELAY_TIME_LEVEL] = str(level)
    return MessageExt(
        topic=topic,
        body=msg.body,
        properties=props,
        flag=msg.flag,
        queue_id=0,
        sys_flag=msg.sys_flag,
        born_timestamp=msg.born_timestamp,
        born_host=msg.born_host,
        reconsume_times=msg.reconsume_times + 1,
    )
