"""Translation between the 5.x messages (apache.rocketmq.v2, ``_proto``) and chronomq's 4.x message model.

Rules: pure functions, no I/O. The two protocols share one store, so a 5.x message is stored as the 4.x
message a 4.x client would have sent (tag -> TAGS, keys -> KEYS, message id -> UNIQ_KEY, message group ->
__SHARDINGKEY, delivery timestamp -> TIMER_DELIVER_MS) and read back the same way.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import zlib
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from chronomq.message import (
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_TRANSACTION_PREPARED,
    PROPERTY_UNIQ_KEY,
    SYSFLAG_COMPRESSED,
    MessageExt,
    create_offset_msg_id,
    java_string_hash,
)

from ._proto import rocketmq_v2_pb2 as pb

PROPERTY_SHARDING_KEY = "__SHARDINGKEY"  # RocketMQ 5's message group, as a 4.x property
# properties that have a field of their own in a 5.x message or are the broker's
_FIELD_PROPERTIES = frozenset(
    {
        PROPERTY_KEYS,
        PROPERTY_TAGS,
        PROPERTY_UNIQ_KEY,
        PROPERTY_TIMER_DELIVER_MS,
        PROPERTY_TRANSACTION_PREPARED,
        PROPERTY_SHARDING_KEY,
        "WAIT",
        "DELAY",
        "REAL_TOPIC",
        "REAL_QID",
        "RETRY_TOPIC",
        "ORIGIN_MESSAGE_ID",
        "RECONSUME_TIME",
        "MAX_RECONSUME_TIMES",
        "PGROUP",
        "TIMER_DELAY_SEC",
        "TIMER_DELAY_MS",
        "__STARTDELIVERTIME",
        "MIN_OFFSET",
        "MAX_OFFSET",
        "TRAN_PREPARED_QUEUE_OFFSET",
    }
)
# properties a 5.x client may not set as user properties: those, and the rest of RocketMQ's
# MessageConst.STRING_HASH_SET, which its proxy refuses too
RESERVED_PROPERTIES = _FIELD_PROPERTIES | frozenset((
    "TRACE_ON", "MSG_REGION", "BUYER_ID", "TRANSFER_FLAG", "CORRECTION_FLAG", "MQ2_FLAG",
    "CONSUME_START_TIME", "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME", "DUP_INFO", "EXTEND_UNIQ_INFO",
    "INSTANCE_ID", "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME", "CLUSTER",
    "MSG_TYPE", "INNER_MULTI_QUEUE_OFFSET", "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES",
    "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY", "TIMER_DELAY_LEVEL", "__BORNHOST", "BORN_TIMESTAMP",
    "DLQ_ORIGIN_TOPIC", "DLQ_ORIGIN_MESSAGE_ID", "__CRC32#",
))
# what a stored message's properties carry besides the user's (never handed back as user properties)
_SYSTEM_PROPERTIES = _FIELD_PROPERTIES | {"CLUSTER", "MSG_REGION", "TRACE_ON", "__CHRONOMQ_DELAY_SRC"}
# Java's Character.isISOControl (Guava's CharMatcher.javaIsoControl), what the proxy refuses in names
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
MILLIS_CUTOFF = 10**11  # a delivery "seconds" value above this is in ms (a known 5.x Python client usage)


class BadMessage(ValueError):
    """A 5.x message that cannot be stored; ``code`` is the v2 status code to answer."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def status(code: int, message: str = "") -> pb.Status:
    return pb.Status(code=code, message=message or pb.Code.Name(code))


def ms_of(ts: Timestamp) -> int:
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def timestamp(ms: int) -> Timestamp:
    return Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def duration_ms(d: Duration) -> int:
    return d.seconds * 1000 + d.nanos // 1_000_000


def duration(ms: int) -> Duration:
    return Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def delivery_ms(ts: Timestamp) -> int:
    """A delivery timestamp in epoch ms; a seconds field too large for seconds is taken as ms."""
    return ts.seconds if ts.seconds > MILLIS_CUTOFF else ms_of(ts)


def fifo_queue(group: str, queues: int) -> int:
    """The queue of a message group: Java's String.hashCode of the group, modulo the write queues (so one
    group stays in one queue, the same one whichever producer sends)."""
    return abs(java_string_hash(group)) % max(1, queues)


@dataclass
class Outgoing:
    """A 5.x message as chronomq stores it."""

    topic: str
    body: bytes
    properties: dict[str, str]
    message_id: str
    group: str | None  # FIFO
    deliver_ms: int | None  # DELAY
    born_ms: int
    born_host: tuple[str, int]
    transactional: bool


@dataclass(frozen=True)
class Limits:
    """What a sent message may carry besides its body (RocketMQ proxy's keys and defaults)."""

    max_property_size: int = 16 * 1024  # maxUserPropertySize: UTF-8 bytes of properties, tag and keys
    max_property_num: int = 128  # userPropertyMaxNum
    max_group_size: int = 64  # maxMessageGroupSize: a message group's UTF-8 bytes must stay below it


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def check_tag(tag: str) -> None:
    """An empty tag is no tag; else not blank, no ``|``, no control character (the proxy's checks)."""
    if not tag:
        return
    if not tag.strip():
        raise BadMessage(pb.ILLEGAL_MESSAGE_TAG, "tag cannot be the char sequence of whitespace")
    if "|" in tag:
        raise BadMessage(pb.ILLEGAL_MESSAGE_TAG, "tag cannot contain '|'")
    if has_control(tag):
        raise BadMessage(pb.ILLEGAL_MESSAGE_TAG, "tag cannot contain control character")


def check_key(key: str) -> None:
    """Not blank, no control character (the proxy's checks); no space either: keys are stored joined by
    spaces (4.x KEYS), so a key holding one would read back as two."""
    if not key.strip():
        raise BadMessage(pb.ILLEGAL_MESSAGE_KEY, "key cannot be the char sequence of whitespace")
    if has_control(key):
        raise BadMessage(pb.ILLEGAL_MESSAGE_KEY, "key cannot contain control character")
    if " " in key:
        raise BadMessage(pb.ILLEGAL_MESSAGE_KEY, "a message key may not contain a space")


def check_group(group: str, max_size: int) -> None:
    if not group.strip():
        raise BadMessage(pb.ILLEGAL_MESSAGE_GROUP, "message group cannot be the char sequence of whitespace")
    if len(group.encode()) >= max_size:
        raise BadMessage(pb.ILLEGAL_MESSAGE_GROUP, f"message group exceed the max size {max_size}")
    if has_control(group):
        raise BadMessage(pb.ILLEGAL_MESSAGE_GROUP, "message group cannot contain control character")


def user_properties(m: pb.Message, limits: Limits) -> dict[str, str]:
    """The message's user properties, tag and keys as 4.x properties, checked in the proxy's order: the
    number of user properties, each name (not a system one) and value (no control character), the tag,
    each key, then the UTF-8 bytes of all of them together."""
    user = m.user_properties
    if len(user) > limits.max_property_num:
        raise BadMessage(pb.MESSAGE_PROPERTIES_TOO_LARGE,
                         f"too many user properties, max is {limits.max_property_num}")
    size = 0
    props: dict[str, str] = {}
    for k, v in user.items():
        if k in RESERVED_PROPERTIES:
            raise BadMessage(pb.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property is used by system: {k}")
        if has_control(k):
            raise BadMessage(pb.ILLEGAL_MESSAGE_PROPERTY_KEY,
                             "the key of property cannot contain control character")
        if has_control(v):
            raise BadMessage(pb.ILLEGAL_MESSAGE_PROPERTY_KEY,
                             "the value of property cannot contain control character")
        size += len(k.encode()) + len(v.encode())
        props[k] = v
    tag = m.system_properties.tag
    check_tag(tag)
    if tag:
        props[PROPERTY_TAGS] = tag
        size += len(tag.encode())
    keys = [k for k in m.system_properties.keys if k]
    for k in keys:
        check_key(k)
        size += len(k.encode())
    if keys:
        props[PROPERTY_KEYS] = " ".join(keys)
    if size > limits.max_property_size:
        raise BadMessage(pb.MESSAGE_PROPERTIES_TOO_LARGE,
                         f"the total size of user property is too large, max is {limits.max_property_size}")
    return props


def from_v2(m: pb.Message, max_body: int, limits: Limits = Limits()) -> Outgoing:
    """The 4.x form of a sent 5.x message, or BadMessage."""
    sp = m.system_properties
    topic = m.topic.name
    body = m.body
    if sp.body_encoding == pb.GZIP:
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError, zlib.error) as e:
            raise BadMessage(pb.MESSAGE_CORRUPTED, f"the body is not gzip: {e}") from None
    if not body:
        raise BadMessage(pb.MESSAGE_BODY_EMPTY, "message body cannot be empty")
    if len(body) > max_body:
        raise BadMessage(pb.MESSAGE_BODY_TOO_LARGE, f"message body cannot exceed the max {max_body}")
    props = user_properties(m, limits)
    if not sp.message_id.strip():
        raise BadMessage(pb.ILLEGAL_MESSAGE_ID, "message id cannot be empty")
    props[PROPERTY_UNIQ_KEY] = sp.message_id
    mtype = sp.message_type
    group = sp.message_group if sp.HasField("message_group") and sp.message_group else None
    if group is not None:
        check_group(group, limits.max_group_size)
    deliver = delivery_ms(sp.delivery_timestamp) if sp.HasField("delivery_timestamp") else None
    tx = mtype == pb.TRANSACTION
    if tx and (group is not None or deliver is not None):
        raise BadMessage(
            pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
            "a transactional message has no message group and no delivery timestamp",
        )
    if mtype == pb.FIFO and group is None:
        raise BadMessage(pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a FIFO message needs a message group")
    if mtype == pb.DELAY and deliver is None:
        raise BadMessage(pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a DELAY message needs a delivery timestamp")
    if group is not None:
        props[PROPERTY_SHARDING_KEY] = group
    if deliver is not None:
        props[PROPERTY_TIMER_DELIVER_MS] = str(deliver)
    born = ms_of(sp.born_timestamp) if sp.HasField("born_timestamp") else 0
    return Outgoing(
        topic, body, props, sp.message_id, group, deliver, born, (sp.born_host or "0.0.0.0", 0), tx
    )


def message_type_of(props: dict[str, str]) -> int:
    if PROPERTY_SHARDING_KEY in props:
        return pb.FIFO
    if PROPERTY_TIMER_DELIVER_MS in props:
        return pb.DELAY
    if props.get(PROPERTY_TRANSACTION_PREPARED) == "true":
        return pb.TRANSACTION
    return pb.NORMAL


def to_v2(msg: MessageExt, receipt_handle: str, attempt: int, invisible_ms: int) -> pb.Message:
    """The 5.x form of a stored message handed to a consumer."""
    props = msg.properties
    body = msg.body
    if msg.sys_flag & SYSFLAG_COMPRESSED:  # a 4.x client's zlib body; gRPC's GZIP is another format
        try:
            body = zlib.decompress(body)
        except zlib.error:
            pass  # handed over as stored; the digest below still matches what is sent
    sp = pb.SystemProperties(
        message_id=props.get(PROPERTY_UNIQ_KEY)
        or create_offset_msg_id(msg.store_host, msg.commit_log_offset),
        # MD5 in upper-case hex, as RocketMQ's proxy (GrpcConverter): the clients' CRC32 checks disagree on
        # zero padding (Java's Long.toHexString has none), so a padded CRC32 is "corrupted" to some of them
        body_digest=pb.Digest(type=pb.MD5, checksum=hashlib.md5(body).hexdigest().upper()),
        body_encoding=pb.IDENTITY,
        message_type=message_type_of(props),
        born_timestamp=timestamp(msg.born_timestamp),
        born_host=msg.born_host[0],
        store_timestamp=timestamp(msg.store_timestamp),
        store_host=f"{msg.store_host[0]}:{msg.store_host[1]}",
        receipt_handle=receipt_handle,
        queue_id=msg.queue_id,
        queue_offset=msg.queue_offset,
        invisible_duration=duration(invisible_ms),
        delivery_attempt=attempt,
    )
    if props.get(PROPERTY_TAGS):
        sp.tag = props[PROPERTY_TAGS]
    if props.get(PROPERTY_KEYS):
        sp.keys.extend(k for k in props[PROPERTY_KEYS].split(" ") if k)
    if props.get(PROPERTY_SHARDING_KEY):
        sp.message_group = props[PROPERTY_SHARDING_KEY]
    due = props.get(PROPERTY_TIMER_DELIVER_MS, "")
    if due.isdigit():
        sp.delivery_timestamp.CopyFrom(timestamp(int(due)))
    user = {k: v for k, v in props.items() if k not in _SYSTEM_PROPERTIES}
    return pb.Message(
        topic=pb.Resource(name=msg.topic), user_properties=user, system_properties=sp, body=body
    )


# --- receipt handles ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Receipt:
    """What a receipt handle names: one delivery (``gen``) of the message at (queue, offset)."""

    queue_id: int
    offset: int
    gen: int

    def encode(self) -> str:
        return f"{self.queue_id}.{self.offset}.{self.gen}"


def parse_receipt(handle: str) -> Receipt | None:
    parts = handle.split(".")
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 19 for p in parts):
        return None
    q, off, gen = (int(p) for p in parts)
    return Receipt(q, off, gen)
