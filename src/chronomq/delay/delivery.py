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
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chronomq.message import (
    MAGIC_V1,
    POS_BODY,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    RECORD_HEAD,
    MessageExt,
    MessageFormatError,
    record_topic_and_properties,
    unpack_host_cached,
    validate_topic,
)
from chronomq.store.types import PutResult, PutStatus, records_put_of

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


_HEAD = RECORD_HEAD  # the V1 record head up to BODYLENGTH
_TM = struct.Struct(">ii")  # TOTALSIZE, MAGICCODE
_BODYLEN = struct.Struct(">i")


_VALID_TOPICS: set[str] = set()
_NO_HOST = ("127.0.0.1", 0)


def _restore_props(props: dict[str, str], source: str | None) -> tuple[str, int]:
    """The parked message's real topic and queue id (checked), and its properties edited in place for
    the copy: no DELAY level, the delay source recorded (or dropped)."""
    real_topic = props.get(PROPERTY_REAL_TOPIC)
    if real_topic not in _VALID_TOPICS:
        if not real_topic or validate_topic(real_topic) is not None:
            raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_TOPIC}: {real_topic!r}")
        if len(_VALID_TOPICS) > 100_000:
            _VALID_TOPICS.clear()
        _VALID_TOPICS.add(real_topic)
    qid_raw = props.get(PROPERTY_REAL_QUEUE_ID, "")
    if not qid_raw.isdigit() or not qid_raw.isascii():
        raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_QUEUE_ID}: {qid_raw!r}")
    props.pop(PROPERTY_DELAY_TIME_LEVEL, None)
    if source is not None:
        props[PROPERTY_DELAY_SOURCE] = source
    else:
        props.pop(PROPERTY_DELAY_SOURCE, None)
    return real_topic, int(qid_raw)


def restore_from_record(raw: bytes, source: str | None) -> MessageExt:
    """restore_real(decode_record(raw), source), without building the intermediate message (the
    delivery hot path). Raises UndeliverableError for a record that cannot be decoded or restored."""
    try:
        (total, magic, crc, _qid, flag, _qoff, _phys, sys_flag, born_ts, born_host, _sts, _shost,
         reconsume, _prep, body_len) = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC_V1 or total != len(raw) or body_len < 0:
            raise UndeliverableError("the parked record is corrupt (bad magic or length)")
        _topic, props = record_topic_and_properties(raw, 0, total, body_len)
        body = raw[POS_BODY:POS_BODY + body_len]
    except (struct.error, IndexError, MessageFormatError) as e:
        raise UndeliverableError(f"the parked record cannot be decoded: {e}") from None
    real_topic, qid = _restore_props(props, source)
    # positional (half the cost of keywords on this path), in MessageExt's field order: topic, body,
    # properties, flag, queue_id, sys_flag, born_timestamp, born_host, store_timestamp, store_host,
    # reconsume_times, prepared_transaction_offset, queue_offset, commit_log_offset, body_crc
    return MessageExt(real_topic, body, props, flag, qid, sys_flag, born_ts, unpack_host_cached(born_host),
                      0, _NO_HOST, reconsume, 0, 0, 0, crc)


def restore_props_from_record(raw: bytes, source: str | None) -> tuple[str, int, dict[str, str]]:
    """What restore_from_record decides, without building the message: (real topic, real queue id,
    properties of the copy), for MessageStore.put_records, which copies the rest of the record from
    ``raw``. Same checks; raises UndeliverableError for a record that cannot be decoded or restored."""
    try:
        total, magic = _TM.unpack_from(raw, 0)
        (body_len,) = _BODYLEN.unpack_from(raw, POS_BODY - 4)
        if magic != MAGIC_V1 or total != len(raw) or body_len < 0:
            raise UndeliverableError("the parked record is corrupt (bad magic or length)")
        _topic, props = record_topic_and_properties(raw, 0, total, body_len)
    except (struct.error, IndexError, MessageFormatError) as e:
        raise UndeliverableError(f"the parked record cannot be decoded: {e}") from None
    real_topic, qid = _restore_props(props, source)
    return real_topic, qid, props


@dataclass(slots=True)
class Delivered:
    """Outcome of one delivery attempt."""

    written: bool  # the real-topic copy is in the store
    retry: bool  # transient failure: try the same entry again later
    store_timestamp: int = 0
    result: PutResult | None = None
    error: str | None = None


_NOT_TRIED = Delivered(False, True, error="not attempted after an earlier transient failure")


class DeliveryPath:
    """Reads parked records, restores them and puts them (synchronously: the store's put is an in-memory
    append plus, under SYNC_FLUSH, a flush future we do not wait for; the snapshot that makes deliveries
    permanent flushes first)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store

    def deliver(self, parked_phy: int, source: str | None) -> Delivered:
        return self.deliver_many([(parked_phy, source)])[0]

    def deliver_many(self, items: list[tuple[int, str | None]]) -> list[Delivered]:
        """Deliver a batch; returns one outcome per item, in order. Messages for the same real
        topic/queue are written with one put (their order kept): the store's put_records when it has one
        (the parked bytes re-put with the restored properties, no decode + re-encode), else
        put_messages / put_message with restored messages. After a transient failure the remaining
        groups are not attempted (their outcome says retry)."""
        out: list[Delivered | None] = [None] * len(items)
        groups: dict[tuple[str, int], list[tuple[int, Any]]] = {}
        read = self.store.read_record
        put_records = records_put_of(self.store)
        for i, (phy, source) in enumerate(items):
            raw = read(phy)
            if raw is None:
                out[i] = Delivered(False, False, error=f"parked record at commit-log offset {phy} not found")
                continue
            try:
                if put_records is not None:
                    topic, qid, props = restore_props_from_record(raw, source)
                    real: Any = (raw, 0, len(raw), props)
                    key = (topic, qid)
                else:
                    real = restore_from_record(raw, source)
                    key = (real.topic, real.queue_id)
            except UndeliverableError as e:
                out[i] = Delivered(False, False, error=str(e))
                continue
            g = groups.get(key)
            if g is None:
                groups[key] = [(i, real)]
            else:
                g.append((i, real))
        stopped = False
        for key, group in groups.items():
            if stopped:
                for i, _ in group:
                    out[i] = _NOT_TRIED
                continue
            msgs = [m for _, m in group]
            if put_records is not None:
                res = put_records(key[0], key[1], msgs)
            else:
                res = self.store.put_messages(msgs) if len(msgs) > 1 else self.store.put_message(msgs[0])
            if res.status in WRITTEN and res.append is not None:
                d = Delivered(True, False, res.append.store_timestamp, res)  # shared by the group
                for i, _ in group:
                    out[i] = d
                continue
            if res.status not in PERMANENT_FAILURES:
                stopped = True
                for i, _ in group:
                    out[i] = Delivered(False, True, result=res, error=f"{res.status.value}: {res.error}")
                continue
            # one bad message fails the whole group: isolate it
            for i, m in group:
                if stopped:
                    out[i] = _NOT_TRIED
                    continue
                out[i] = d = self._put_one(key, m, put_records)
                stopped = d.retry
        return out  # type: ignore[return-value]

    def _put_one(self, key: tuple[str, int], real: Any, put_records: Any) -> Delivered:
        res = put_records(key[0], key[1], [real]) if put_records is not None else self.store.put_message(real)
        if res.status in WRITTEN and res.append is not None:
            return Delivered(True, False, res.append.store_timestamp, res)
        if res.status in PERMANENT_FAILURES:
            return Delivered(False, False, result=res, error=f"{res.status.value}: {res.error}")
        return Delivered(False, True, result=res, error=f"{res.status.value}: {res.error}")
