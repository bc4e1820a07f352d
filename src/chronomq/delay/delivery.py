"""The delivery path: turn a parked (scheduled) stored message back into a message of its real topic and
put it into the store as a new message. Shared by the level schedule service and (later) the timer store
for "deliver at any millisecond", so both have one way to deliver, one idempotency marker and one set
of metrics.

Idempotency: every re-put carries ``PROPERTY_DELAY_SOURCE`` = "<source>:<queue offset>:<parked
commit-log offset>" (for the level service the source is the level number). After a crash the service
scans the commit log beyond its last persisted position and skips entries whose re-put is already
there, so a crash does not cause duplicate deliveries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    MessageExt,
    validate_topic,
)
from chronomq.store.types import PutResult, PutStatus

if TYPE_CHECKING:
    from chronomq.store import MessageStore

log = logging.getLogger(__name__)

# Internal property on every re-put (see the module docstring). Stripped from anything a client sends.
PROPERTY_DELAY_SOURCE = "__CHRONOMQ_DELAY_SRC"

# Put failures after which retrying cannot help: the entry is dropped (logged and counted).
PERMANENT_FAILURES = frozenset({PutStatus.MESSAGE_ILLEGAL, PutStatus.PROPERTIES_SIZE_EXCEEDED})
# Statuses meaning the record was written (a flush timeout still wrote it).
WRITTEN = frozenset({PutStatus.PUT_OK, PutStatus.FLUSH_DISK_TIMEOUT})


def make_source(source: int, queue_offset: int, parked_phy: int) -> str:
    return f"{source}:{queue_offset}:{parked_phy}"


def parse_source(value: str | None) -> tuple[int, int, int] | None:
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 3:
        return None
    try:
        a, b, c = (int(p) for p in parts)
    except ValueError:
        return None
    return a, b, c


class UndeliverableError(ValueError):
    """A parked message whose real topic/queue cannot be restored (corrupt or forged properties)."""


def restore_real(parked: MessageExt, source: str | None) -> MessageExt:
    """The message to put on the real topic: topic = REAL_TOPIC, queue = REAL_QID, DELAY removed
    (REAL_TOPIC/REAL_QID stay, as in RocketMQ); body, flag, sysFlag, born timestamp/host and reconsume
    times copied. Raises UndeliverableError when REAL_TOPIC/REAL_QID are missing or invalid."""
    props = dict(parked.properties)
    real_topic = props.get(PROPERTY_REAL_TOPIC)
    if not real_topic or validate_topic(real_topic) is not None:
        raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_TOPIC}: {real_topic!r}")
    try:
        real_qid = int(props.get(PROPERTY_REAL_QUEUE_ID, ""))
    except ValueError:
        raise UndeliverableError(
            f"parked message has no valid {PROPERTY_REAL_QUEUE_ID}: {props.get(PROPERTY_REAL_QUEUE_ID)!r}"
        ) from None
    if real_qid < 0:
        raise UndeliverableError(f"parked message has a negative {PROPERTY_REAL_QUEUE_ID}")
    props.pop(PROPERTY_DELAY_TIME_LEVEL, None)
    if source is not None:
        props[PROPERTY_DELAY_SOURCE] = source
    else:
        props.pop(PROPERTY_DELAY_SOURCE, None)
    return MessageExt(
        topic=real_topic,
        body=parked.body,
        properties=props,
        flag=parked.flag,
        queue_id=real_qid,
        sys_flag=parked.sys_flag,
        born_timestamp=parked.born_timestamp,
        born_host=parked.born_host,
        reconsume_times=parked.reconsume_times,
        body_crc=parked.body_crc,
    )


@dataclass(slots=True)
class Delivered:
    """Outcome of one delivery attempt."""

    written: bool  # the real-topic copy is in the store
    retry: bool  # transient failure: try the same entry again later
    store_timestamp: int = 0
    result: PutResult | None = None
    error: str | None = None


class DeliveryPath:
    """Looks up the parked record, restores it and puts it (synchronously; the store's put is an
    in-memory append plus, under SYNC_FLUSH, a flush future we do not wait for)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store

    def deliver(self, parked_phy: int, source: str | None) -> Delivered:
        parked = self.store.look_message_by_offset(parked_phy)
        if parked is None:
            # The parked record is gone (cleaned or corrupt): nothing can ever deliver it.
            return Delivered(False, False, error=f"parked record at commit-log offset {parked_phy} not found")
        try:
            real = restore_real(parked, source)
        except UndeliverableError as e:
            return Delivered(False, False, error=str(e))
        res = self.store.put_message(real)
        if res.status in WRITTEN and res.append is not None:
            return Delivered(True, False, res.append.store_timestamp, res)
        if res.status in PERMANENT_FAILURES:
            return Delivered(False, False, result=res, error=f"{res.status.value}: {res.error}")
        return Delivered(False, True, result=res, error=f"{res.status.value}: {res.error}")
