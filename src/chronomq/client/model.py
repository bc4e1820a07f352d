"""The client's data model: Message (what you send), SendResult, MessageQueue, ReceivedMessage,
TopicRoute (name-server route data, docs/protocol.md#route-data)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from chronomq import message as m
from chronomq.clock import SystemClock
from chronomq.remoting import fastjson
from chronomq.remoting.codes import PERM_READ, PERM_WRITE
from chronomq.remoting.decode import kernels, pure_twin

from .errors import InvalidMessage

# property names a user may not set through ``properties=`` (the client/broker own them)
# RocketMQ's MessageConst.STRING_HASH_SET (5.3): names a broker or a client writes, never a user property
SYSTEM_PROPERTIES = frozenset({
    m.PROPERTY_KEYS, m.PROPERTY_TAGS, m.PROPERTY_UNIQ_KEY, m.PROPERTY_WAIT_STORE_MSG_OK,
    m.PROPERTY_DELAY_TIME_LEVEL, m.PROPERTY_REAL_TOPIC, m.PROPERTY_REAL_QUEUE_ID, m.PROPERTY_RETRY_TOPIC,
    m.PROPERTY_ORIGIN_MESSAGE_ID, m.PROPERTY_RECONSUME_TIME, m.PROPERTY_MAX_RECONSUME_TIMES,
    m.PROPERTY_TRANSACTION_PREPARED, "MIN_OFFSET", "MAX_OFFSET", "CONSUME_START_TIME", "PGROUP", "BUYER_ID",
    "TRANSFER_FLAG", "CORRECTION_FLAG", "MQ2_FLAG", "TRAN_PREPARED_QUEUE_OFFSET", "TRANSACTION_CHECK_TIMES",
    "CHECK_IMMUNITY_TIME_IN_SECONDS", "__SHARDINGKEY", "CLUSTER", "MSG_REGION", "TRACE_ON",
    "INSTANCE_ID", "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME",
    "MSG_TYPE", "TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "TIMER_OUT_MS",
    "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_DEL_UNIQKEY", "INNER_NUM",
    "INNER_BASE", "INNER_MULTI_DISPATCH", "INNER_MULTI_QUEUE_OFFSET", "TRACE_CONTEXT", "POP_CK",
    "POP_CK_OFFSET", "1ST_POP_TIME", "SHARDING_KEY",
})

RESERVED_PROPERTIES = {m.PROPERTY_UNIQ_KEY, m.PROPERTY_REAL_TOPIC, m.PROPERTY_REAL_QUEUE_ID,
                       m.PROPERTY_RETRY_TOPIC}


@dataclass(frozen=True, slots=True, order=True)
class MessageQueue:
    topic: str
    broker_name: str
    queue_id: int

    def to_json(self) -> dict[str, Any]:
        return {"brokerName": self.broker_name, "queueId": self.queue_id, "topic": self.topic}

    def __str__(self) -> str:
        return f"{self.topic}@{self.broker_name}:{self.queue_id}"


@dataclass(slots=True)
class Message:
    """A message to send.

    ``body``: bytes (str is UTF-8 encoded). ``keys``: one key or several (stored space separated; query
    them with Admin.query_messages). ``tags``: one tag (consumers filter with ``"tagA || tagB"``).
    ``delay_level``: RocketMQ 4.x delay level (1..18: 1s 5s 10s 30s 1m ... 2h by default).
    ``deliver_at`` / ``delay``: deliver at a time (timezone-aware datetime, or epoch ms) or after a delay
    (timedelta or seconds, counted from the send), to the millisecond: sent as ``TIMER_DELIVER_MS`` (the
    RocketMQ 5.x timer property, which chronomq's timer store reads). Not together with delay_level.
    ``uniq_key``: the message id (UNIQ_KEY) to use instead of a generated one (non-empty, at most 128
    chars, no \\x01/\\x02), e.g. a deterministic id so a retried writer re-sends the same ids.
    ``dedup``: ask a chronomq broker to store this UNIQ_KEY once per topic (within its dedupWindowSec):
    a resend is answered as the original and not stored again. Give a deterministic ``uniq_key`` with
    it; other RocketMQ brokers ignore it.
    """

    topic: str
    body: bytes | str
    keys: str | Sequence[str] | None = None
    tags: str | None = None
    properties: Mapping[str, str] | None = None
    delay_level: int = 0
    deliver_at: datetime | int | None = None
    delay: timedelta | float | None = None
    flag: int = 0
    uniq_key: str | None = None
    dedup: bool = False

    def body_bytes(self) -> bytes:
        if isinstance(self.body, str):
            return self.body.encode()
        if isinstance(self.body, bytes | bytearray | memoryview):
            return bytes(self.body)
        raise InvalidMessage(f"message body must be bytes or str, not {type(self.body).__name__}")

    def keys_list(self) -> list[str]:
        if self.keys is None:
            return []
        if isinstance(self.keys, str):
            return [k for k in self.keys.split(" ") if k]
        return [str(k) for k in self.keys if str(k)]

    def validate(self) -> None:
        validate_send_topic(self.topic)
        self.checked_body()

    def checked_body(self) -> bytes:
        """The body as bytes, after checking every field but the topic (a batch checks its one topic
        once). Raises InvalidMessage."""
        if not isinstance(self.delay_level, int) or self.delay_level < 0:
            raise InvalidMessage(f"delay_level must be an int >= 0, got {self.delay_level!r}")
        if self.properties:
            for k, v in self.properties.items():
                validate_property(k, v)
        if self.tags is not None:
            validate_tags(self.tags)
        body = self.body_bytes()
        if not body:
            raise InvalidMessage("the message body is empty")
        if self.uniq_key is not None:
            validate_uniq_key(self.uniq_key)
        return body

    def wire_properties(self, now_ms: int | None = None) -> dict[str, str]:
        """The properties as sent on the wire (without UNIQ_KEY/WAIT, which the producer adds); a delay
        counts from ``now_ms`` (the producer's clock), by default the current time."""
        props: dict[str, str] = {}
        for k, v in (self.properties or {}).items():
            if k in RESERVED_PROPERTIES:
                raise InvalidMessage(f"property {k!r} is reserved")
            props[k] = v
        keys = self.keys_list()
        if keys:
            props[m.PROPERTY_KEYS] = " ".join(keys)
        if self.tags:
            props[m.PROPERTY_TAGS] = self.tags
        if self.delay_level:
            props[m.PROPERTY_DELAY_TIME_LEVEL] = str(self.delay_level)
        if self.dedup:
            props[m.PROPERTY_DEDUP] = "true"
        props.update(self._deliver_time_properties(now_ms))
        return props

    def wire_text(self, now_ms: int | None = None) -> str:
        """``wire_properties`` as the wire writes them (``key\\x01value\\x02`` ...), without building a
        dict for a message whose only property is its deliver time."""
        if self.properties or self.keys or self.tags or self.delay_level or self.dedup:
            return m.encode_properties(self.wire_properties(now_ms))
        if self.deliver_at is None and self.delay is None:
            return ""
        if self.deliver_at is not None and self.delay is not None:
            raise InvalidMessage("give deliver_at or delay, not both")
        return f"{_TIMER_TEXT}{deliver_time_ms(self.deliver_at, self.delay, now_ms)}{m.PROPERTY_SEPARATOR}"

    def _deliver_time_properties(self, now_ms: int | None) -> dict[str, str]:
        """``TIMER_DELIVER_MS`` (epoch ms) for deliver_at / delay; nothing when neither is given."""
        if self.deliver_at is None and self.delay is None:
            return {}
        if self.deliver_at is not None and self.delay is not None:
            raise InvalidMessage("give deliver_at or delay, not both")
        if self.delay_level:
            raise InvalidMessage("give delay_level or deliver_at/delay, not both")
        clash = sorted(k for k in (self.properties or {}) if k in TIMER_PROPERTIES)
        if clash:
            raise InvalidMessage(f"give deliver_at/delay or the property {clash[0]!r}, not both")
        return {m.PROPERTY_TIMER_DELIVER_MS: str(deliver_time_ms(self.deliver_at, self.delay, now_ms))}

    def deliver_ms(self, now_ms: int | None = None) -> int | None:
        """The deliver time this message asks for (epoch ms), or None (a delay counts from ``now_ms``,
        by default the current time)."""
        if self.deliver_at is None and self.delay is None:
            return None
        return deliver_time_ms(self.deliver_at, self.delay, now_ms)


_TIMER_TEXT = m.PROPERTY_TIMER_DELIVER_MS + m.NAME_VALUE_SEPARATOR

# the properties through which RocketMQ producers ask for a deliver time (chronomq reads all four)
TIMER_PROPERTIES = (m.PROPERTY_TIMER_DELIVER_MS, m.PROPERTY_TIMER_DELAY_SEC, m.PROPERTY_TIMER_DELAY_MS,
                    m.PROPERTY_STARTDELIVERTIME)

# an epoch-ms value below this (March 1973) is almost certainly epoch *seconds*; the broker would read it
# as seconds, so the client refuses it instead of guessing
MIN_EPOCH_MS = 10**11
MAX_UNIQ_KEY_LENGTH = 128


def validate_send_topic(topic: object) -> str:
    """A topic a producer may send to: legal (RocketMQ's rules) and not a retry or the schedule topic."""
    reason = m.validate_topic(topic) if isinstance(topic, str) else "the topic must be a str"
    if reason:
        raise InvalidMessage(f"invalid topic: {reason}")
    assert isinstance(topic, str)
    if topic.startswith(m.RETRY_GROUP_TOPIC_PREFIX) or topic == m.SCHEDULE_TOPIC:
        raise InvalidMessage(f"cannot send to the system topic {topic!r}")
    return topic


def validate_property(name: object, value: object) -> None:
    """A user property: name and value str without the wire separators \\x01/\\x02."""
    for s in (name, value):
        if not isinstance(s, str) or "\x01" in s or "\x02" in s:
            raise InvalidMessage(f"property {name!r}={value!r}: names and values must be str without "
                                 "\\x01/\\x02")


def validate_tags(tags: object) -> None:
    if not isinstance(tags, str) or "\x01" in tags or "\x02" in tags:
        raise InvalidMessage(f"invalid tags {tags!r}")


def validate_uniq_key(key: object) -> str:
    """A caller-chosen message id (UNIQ_KEY): a non-empty str of at most 128 chars without \\x01/\\x02."""
    if not isinstance(key, str):
        raise InvalidMessage(f"uniq_key must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidMessage("uniq_key must not be empty")
    if len(key) > MAX_UNIQ_KEY_LENGTH:
        raise InvalidMessage(f"uniq_key is {len(key)} chars, more than {MAX_UNIQ_KEY_LENGTH}")
    if "\x01" in key or "\x02" in key:
        raise InvalidMessage("uniq_key must not contain \\x01 or \\x02")
    return key


def deliver_time_ms(deliver_at: datetime | int | None, delay: timedelta | float | None,
                    now_ms: int | None = None) -> int:
    """Epoch ms for a deliver_at (timezone-aware datetime, or epoch ms) or a delay (timedelta or seconds,
    counted from ``now_ms``, by default the current time). A delay is rounded up to the millisecond so
    the deliver time is never earlier than asked. Raises InvalidMessage for anything else."""
    if deliver_at is not None:
        if isinstance(deliver_at, datetime):
            if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
                raise InvalidMessage("deliver_at must be a timezone-aware datetime (e.g. "
                                     "datetime.now(timezone.utc) + timedelta(minutes=5)); a naive "
                                     "datetime is ambiguous")
            ms = (deliver_at - _EPOCH) // timedelta(milliseconds=1)
            if ms < 0:
                raise InvalidMessage(f"deliver_at {deliver_at.isoformat()} is before 1970")
            return ms
        if isinstance(deliver_at, int) and not isinstance(deliver_at, bool):
            if deliver_at < MIN_EPOCH_MS:
                raise InvalidMessage(f"deliver_at={deliver_at} is not epoch milliseconds (it would be before "
                                     "1973: epoch seconds?); pass epoch ms or a datetime")
            return deliver_at
        raise InvalidMessage(f"deliver_at must be a datetime or epoch ms (int), not {deliver_at!r}")
    if delay is None:
        raise InvalidMessage("give deliver_at or delay")
    if isinstance(delay, timedelta):
        ms_f = delay / timedelta(milliseconds=1)
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        ms_f = float(delay) * 1000
    else:
        raise InvalidMessage(f"delay must be a timedelta or seconds (int/float), not {delay!r}")
    if not math.isfinite(ms_f):
        raise InvalidMessage(f"delay must be finite, got {delay!r}")
    if ms_f < 0:
        raise InvalidMessage(f"delay must be >= 0, got {delay!r}")
    base = now_ms if now_ms is not None else _REAL_CLOCK.now_ms()
    return base + math.ceil(ms_f)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_REAL_CLOCK = SystemClock()  # when a caller gives no time of its own


class SendStatus(StrEnum):
    OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


@dataclass(frozen=True, slots=True)
class SendResult:
    """``msg_id`` is the client message id (UNIQ_KEY, what consumers see as ``id``; ``Message.uniq_key``
    when given); ``offset_msg_id`` the broker's id (store host + commit-log offset, for
    Admin.get_message). For a batch, the ids of every message, comma-joined, and ``queue_offset`` is the
    first message's offset.

    A message sent with ``deliver_at``/``delay`` is parked in chronomq's timer store until its time:
    ``deliver_ms`` is the deliver time the broker scheduled (epoch ms; None when the broker did not say,
    e.g. an Apache broker, or the time had already come and the message was stored at once),
    ``uniq_key`` the handle for Admin.cancel/reschedule (the UNIQ_KEY the broker returned; for other sends
    the UNIQ_KEY sent; for a batch the ids comma-joined like ``msg_id``), ``offset_msg_id`` a timer handle
    (also accepted by cancel/reschedule) and ``queue_offset`` 0 (the message is stored in its queue when
    delivered). For a timed batch ``deliver_times_ms`` has one deliver time per message (``deliver_ms``
    is the first)."""

    msg_id: str
    offset_msg_id: str
    queue: MessageQueue
    queue_offset: int
    status: SendStatus = SendStatus.OK
    msg_ids: tuple[str, ...] = ()
    uniq_key: str | None = None
    deliver_ms: int | None = None
    deliver_times_ms: tuple[int, ...] = ()

    @property
    def scheduled(self) -> bool:
        """True when the broker parked the message in its timer store (it answered a deliver time)."""
        return self.deliver_ms is not None

    @property
    def topic(self) -> str:
        return self.queue.topic

    @property
    def queue_id(self) -> int:
        return self.queue.queue_id


@dataclass(slots=True)
class ReceivedMessage:
    """A consumed message. ``id`` is the client id (UNIQ_KEY) when present, else the offset msg id.
    ``topic`` is the original topic also for a retried message (``raw_topic`` is where it was read)."""

    topic: str
    body: bytes
    id: str
    queue: MessageQueue
    queue_offset: int
    commit_log_offset: int
    properties: dict[str, str]
    reconsume_times: int
    born_timestamp: int
    store_timestamp: int
    born_host: tuple[str, int]
    store_host: tuple[str, int]
    flag: int = 0
    sys_flag: int = 0
    store_size: int = 0
    raw_topic: str = ""

    @property
    def offset_msg_id(self) -> str:
        """The broker's id of this copy: store host + commit-log offset (for Admin.get_message)."""
        return m.create_offset_msg_id(self.store_host, self.commit_log_offset)

    @property
    def tags(self) -> str | None:
        return self.properties.get(m.PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        return [k for k in self.properties.get(m.PROPERTY_KEYS, "").split(" ") if k]

    @property
    def queue_id(self) -> int:
        return self.queue.queue_id

    @property
    def delay_level(self) -> int:
        try:
            return int(self.properties.get(m.PROPERTY_DELAY_TIME_LEVEL, "0"))
        except ValueError:
            return 0

    def get_property(self, name: str, default: str | None = None) -> str | None:
        return self.properties.get(name, default)

    def user_properties(self) -> dict[str, str]:
        """The properties the producer's application set: not RocketMQ's system ones
        (``MessageConst.STRING_HASH_SET``), which brokers and clients write."""
        return {k: v for k, v in self.properties.items() if k not in SYSTEM_PROPERTIES}

    @classmethod
    def from_ext(cls, ext: m.MessageExt, broker_name: str) -> ReceivedMessage:
        body = ext.inflated_body()
        topic = ext.topic
        props = ext.properties
        if topic.startswith(m.RETRY_GROUP_TOPIC_PREFIX):
            topic = props.get(m.PROPERTY_RETRY_TOPIC, topic)
        return cls(topic=topic, body=body, id=props.get(m.PROPERTY_UNIQ_KEY) or ext.msg_id,
                   queue=MessageQueue(ext.topic, broker_name, ext.queue_id),
                   queue_offset=ext.queue_offset, commit_log_offset=ext.commit_log_offset,
                   properties=props, reconsume_times=ext.reconsume_times,
                   born_timestamp=ext.born_timestamp, store_timestamp=ext.store_timestamp,
                   born_host=ext.born_host, store_host=ext.store_host, flag=ext.flag,
                   sys_flag=ext.sys_flag & ~m.SYSFLAG_COMPRESSED, store_size=ext.store_size,
                   raw_topic=ext.topic)


_HEAD = m.RECORD_HEAD
_host = m.unpack_host_cached


@dataclass(slots=True)
class RecordColumns:
    """The stored records of a PULL_MESSAGE body field by field: index i of every list is the i-th record.
    ``bodies`` are inflated, ``sys_flags`` without the compressed bit, ``topics`` as stored (a retried
    message's is ``%RETRY%group``), ``properties`` the undecoded property text, hosts the 8 raw bytes."""

    queue_ids: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    queue_offsets: list[int] = field(default_factory=list)
    commit_log_offsets: list[int] = field(default_factory=list)
    sys_flags: list[int] = field(default_factory=list)
    born_timestamps: list[int] = field(default_factory=list)
    born_hosts: list[bytes] = field(default_factory=list)
    store_timestamps: list[int] = field(default_factory=list)
    store_hosts: list[bytes] = field(default_factory=list)
    reconsume_times: list[int] = field(default_factory=list)
    store_sizes: list[int] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    properties: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.queue_offsets)

    def take(self, rows: Sequence[int]) -> RecordColumns:
        """The records at these indices, in this order."""
        return RecordColumns(*([col[i] for i in rows] for col in (getattr(self, f) for f in _RECORD_FIELDS)))


_RECORD_FIELDS = tuple(RecordColumns.__dataclass_fields__)


def record_columns(buf: bytes) -> RecordColumns:
    """Split a PULL_MESSAGE body (concatenated stored records) into RecordColumns, with the length, magic
    and UTF-8 checks of ``m.decode_records`` (MessageFormatError), and no object per record. Compiled when
    built (chronomq.remoting.decode chooses); record_columns_py is the reference."""
    return _record_columns(buf, RecordColumns)


@pure_twin("record_columns")
def record_columns_py(buf: bytes, cls: Callable[..., RecordColumns] = RecordColumns) -> RecordColumns:
    """record_columns in Python: ``cls`` is called with the 14 columns, in RecordColumns' order."""
    cols = RecordColumns()
    unpack = _HEAD.unpack_from
    fixed, pos_body = m.RECORD_FIXED_SIZE, m.POS_BODY
    magic_v1, compressed = m.MAGIC_V1, m.SYSFLAG_COMPRESSED
    (queue_ids, flags, queue_offsets, commit_log_offsets, sys_flags, born_timestamps, born_hosts,
     store_timestamps, store_hosts, reconsume_times, store_sizes, bodies, topics, properties) = (
        cols.queue_ids, cols.flags, cols.queue_offsets, cols.commit_log_offsets, cols.sys_flags,
        cols.born_timestamps, cols.born_hosts, cols.store_timestamps, cols.store_hosts, cols.reconsume_times,
        cols.store_sizes, cols.bodies, cols.topics, cols.properties)
    n = len(buf)
    pos = 0
    while pos < n:
        if n - pos < fixed:
            raise m.MessageFormatError("record truncated")
        (total, magic, _crc, queue_id, flag, queue_offset, phys, sys_flag, born_ts, born_host, store_ts,
         store_host, reconsume, _prepared, body_len) = unpack(buf, pos)
        if magic != magic_v1:
            raise m.MessageFormatError(f"bad magic code {magic & 0xFFFFFFFF:#x}")
        end = pos + total
        if total < fixed or end > n:
            raise m.MessageFormatError("record length out of range")
        p = pos + pos_body
        if body_len < 0 or p + body_len + 3 > end:
            raise m.MessageFormatError("body length out of range")
        body = buf[p : p + body_len]
        p += body_len
        topic_len = buf[p]
        p += 1
        try:
            topics.append(buf[p : p + topic_len].decode())
        except UnicodeDecodeError as e:
            raise m.MessageFormatError("topic is not UTF-8") from e
        p += topic_len
        if p + 2 > end:
            raise m.MessageFormatError("properties length out of range")
        props_len = (buf[p] << 8) | buf[p + 1]
        p += 2
        if p + props_len != end:
            raise m.MessageFormatError("record length does not match its fields")
        try:
            properties.append(buf[p:end].decode() if props_len else "")
        except UnicodeDecodeError as e:
            raise m.MessageFormatError("properties are not UTF-8") from e
        if sys_flag & compressed:
            body = zlib.decompress(body)
        bodies.append(body)
        queue_ids.append(queue_id)
        flags.append(flag)
        queue_offsets.append(queue_offset)
        commit_log_offsets.append(phys)
        sys_flags.append(sys_flag & ~compressed)
        born_timestamps.append(born_ts)
        born_hosts.append(born_host)
        store_timestamps.append(store_ts)
        store_hosts.append(store_host)
        reconsume_times.append(reconsume)
        store_sizes.append(total)
        pos = end
    return cols if cls is RecordColumns else cls(*(getattr(cols, f) for f in _RECORD_FIELDS))


def parse_properties(text: str) -> dict[str, str]:
    """Stored property text -> dict (an item without a name or a separator is skipped; the last wins).
    Compiled when built (chronomq.remoting.decode chooses); parse_properties_py is the reference."""
    return _parse_properties(text)


@pure_twin("parse_properties")
def parse_properties_py(text: str) -> dict[str, str]:
    """parse_properties in Python."""
    props: dict[str, str] = {}
    if text:
        nvsep = m.NAME_VALUE_SEPARATOR
        for item in text.split(m.PROPERTY_SEPARATOR):
            k, sep, v = item.partition(nvsep)
            if sep and k:
                props[k] = v
    return props


def decode_received(buf: bytes, broker_name: str) -> list[ReceivedMessage]:
    """A PULL_MESSAGE body (concatenated stored records) straight to ReceivedMessages: the same result as
    ``[ReceivedMessage.from_ext(x, broker_name) for x in m.decode_records(buf)]`` and the same
    MessageFormatError checks (record_columns), without the intermediate MessageExt, and with one
    MessageQueue per queue and one host tuple per distinct host shared by the messages of the batch (the
    consumer's hot path). Compiled when built (chronomq.remoting.decode chooses); decode_received_py is the
    reference."""
    return _decode_received(buf, broker_name, ReceivedMessage, MessageQueue)


@pure_twin("decode_received")
def decode_received_py(buf: bytes, broker_name: str, received_cls: type[ReceivedMessage] = ReceivedMessage,
                       queue_cls: Callable[[str, str, int], MessageQueue] = MessageQueue
                       ) -> list[ReceivedMessage]:
    """decode_received in Python: ``received_cls`` objects made without __init__, one ``queue_cls(raw_topic,
    broker_name, queue_id)`` per queue."""
    c = record_columns_py(buf)
    out: list[ReceivedMessage] = []
    retry_prefix, uniq, retry_topic = m.RETRY_GROUP_TOPIC_PREFIX, m.PROPERTY_UNIQ_KEY, m.PROPERTY_RETRY_TOPIC
    queues: dict[tuple[str, int], MessageQueue] = {}
    hosts: dict[bytes, tuple[str, int]] = {}
    last_topic, last_qid, mq = "", -1, None
    new = received_cls.__new__
    for i, raw_topic in enumerate(c.topics):
        props = parse_properties_py(c.properties[i])
        queue_id = c.queue_ids[i]
        topic = raw_topic
        if topic.startswith(retry_prefix):
            topic = props.get(retry_topic, topic)
        if mq is None or queue_id != last_qid or raw_topic != last_topic:  # a batch is mostly one queue
            mq = queues.get((raw_topic, queue_id))
            if mq is None:
                mq = queues[(raw_topic, queue_id)] = queue_cls(raw_topic, broker_name, queue_id)
            last_topic, last_qid = raw_topic, queue_id
        store_host, born_host = c.store_hosts[i], c.born_hosts[i]
        shost = hosts.get(store_host)
        if shost is None:
            shost = hosts[store_host] = _host(store_host)
        bhost = hosts.get(born_host)
        if bhost is None:
            bhost = hosts[born_host] = _host(born_host)
        phys = c.commit_log_offsets[i]
        msg = new(received_cls)
        msg.topic = topic
        msg.body = c.bodies[i]
        msg.id = props.get(uniq) or m.create_offset_msg_id(shost, phys)
        msg.queue = mq
        msg.queue_offset = c.queue_offsets[i]
        msg.commit_log_offset = phys
        msg.properties = props
        msg.reconsume_times = c.reconsume_times[i]
        msg.born_timestamp = c.born_timestamps[i]
        msg.store_timestamp = c.store_timestamps[i]
        msg.born_host = bhost
        msg.store_host = shost
        msg.flag = c.flags[i]
        msg.sys_flag = c.sys_flags[i]
        msg.store_size = c.store_sizes[i]
        msg.raw_topic = raw_topic
        out.append(msg)
    return out


# The columns record_buffers builds besides the fixed-width ones (offset, timestamp, born_timestamp,
# reconsume_times), as bits of its ``want`` (the compiled kernel's WANT_*; a test checks they agree).
WANT_VALUE = 1
WANT_PROPERTIES = 2
WANT_KEYS = 4  # the keys list and the first key
WANT_TAGS = 8
WANT_MSG_ID = 16
WANT_DELIVER = 32


def record_buffers(parts: list[tuple[bytes, int, int]], want: int) -> dict[str, Any] | None:
    """Pull answers' stored records (``parts``: body, first offset, end offset; the records with a queue
    offset in [first, end) are taken) straight into the buffers of Arrow columns, for the Spark source
    (chronomq.spark.schema reads them): a dict of bytearrays by column. None when the compiled decode is not
    built, or an answer needs the general path (record_columns, then the columns from its lists): a record
    it would refuse, a text that is not ASCII, a deliver time not written plainly."""
    return _record_buffers(parts, want)


@pure_twin("record_buffers")
def record_buffers_py(parts: list[tuple[bytes, int, int]], want: int) -> dict[str, Any] | None:
    """record_buffers without the compiled decode: always the general path."""
    return None


# the compiled decode when it is built (chronomq.remoting.decode chooses); the functions above are its twins
_record_buffers = kernels.record_buffers
_record_columns = kernels.record_columns
_parse_properties = kernels.parse_properties
_decode_received = kernels.decode_received


@dataclass(slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int


@dataclass(slots=True)
class TopicRoute:
    topic: str
    queue_datas: list[QueueData] = field(default_factory=list)
    broker_addrs: dict[str, dict[int, str]] = field(default_factory=dict)
    order_topic_conf: str | None = None
    _cache: dict[tuple[str, str], list[MessageQueue]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, topic: str, body: bytes) -> TopicRoute:
        try:
            data = fastjson.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"route data for {topic!r} is not JSON: {e}") from None
        route = cls(topic=topic, order_topic_conf=data.get("orderTopicConf") or None)
        for q in data.get("queueDatas") or []:
            route.queue_datas.append(QueueData(str(q["brokerName"]), int(q.get("readQueueNums", 0)),
                                               int(q.get("writeQueueNums", 0)), int(q.get("perm", 6))))
        for b in data.get("brokerDatas") or []:
            addrs = {int(k): str(v) for k, v in (b.get("brokerAddrs") or {}).items()}
            route.broker_addrs[str(b["brokerName"])] = addrs
        return route

    def master_addr(self, broker_name: str) -> str | None:
        return self.broker_addrs.get(broker_name, {}).get(0)

    def write_queues(self, topic: str | None = None) -> list[MessageQueue]:
        t = topic or self.topic
        cached = self._cache.get(("w", t))
        if cached is not None:
            return cached
        out: list[MessageQueue] = []
        for q in sorted(self.queue_datas, key=lambda q: q.broker_name):
            if q.perm & PERM_WRITE and self.master_addr(q.broker_name):
                out.extend(MessageQueue(t, q.broker_name, i) for i in range(q.write_queue_nums))
        self._cache[("w", t)] = out
        return out

    def read_queues(self, topic: str | None = None) -> list[MessageQueue]:
        t = topic or self.topic
        out: list[MessageQueue] = []
        for q in sorted(self.queue_datas, key=lambda q: q.broker_name):
            if q.perm & PERM_READ:
                out.extend(MessageQueue(t, q.broker_name, i) for i in range(q.read_queue_nums))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic,
                "queues": [{"broker_name": q.broker_name, "read_queue_nums": q.read_queue_nums,
                            "write_queue_nums": q.write_queue_nums, "perm": q.perm}
                           for q in self.queue_datas],
                "brokers": {n: {str(i): a for i, a in addrs.items()}
                            for n, addrs in self.broker_addrs.items()}}


def tag_set(expression: str | None) -> set[str] | None:
    """``"*"``/empty -> None (everything); ``"a || b"`` -> {"a", "b"}."""
    if expression is None:
        return None
    expr = expression.strip()
    if not expr or expr == "*":
        return None
    tags = {t.strip() for t in expr.split("||") if t.strip()}
    return tags or None


def ids_of(results: Iterable[SendResult]) -> list[str]:
    return [r.msg_id for r in results]
