"""The message model shared by every layer: property names, the properties string, the stored-record
codec (RocketMQ's V1 layout, docs/protocol.md#stored-record), offset message ids and the tag hash.

Pure functions over bytes; no I/O. The store writes records in exactly this layout so a pull can ship
stored bytes to a client without re-encoding them.
"""

from __future__ import annotations

import re
import socket
import struct
import zlib
from dataclasses import dataclass, field

# --- property names (RocketMQ MessageConst) ------------------------------------------------------------
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
PROPERTY_WAIT_STORE_MSG_OK = "WAIT"
PROPERTY_DELAY_TIME_LEVEL = "DELAY"
PROPERTY_REAL_TOPIC = "REAL_TOPIC"
PROPERTY_REAL_QUEUE_ID = "REAL_QID"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
PROPERTY_RECONSUME_TIME = "RECONSUME_TIME"
PROPERTY_MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
PROPERTY_DEDUP = "CHRONOMQ_DEDUP"  # "true": the broker stores this UNIQ_KEY once per topic within its window
PROPERTY_TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
PROPERTY_TIMER_DELAY_MS = "TIMER_DELAY_MS"
PROPERTY_STARTDELIVERTIME = "__STARTDELIVERTIME"
PROPERTY_DLQ_ORIGIN_TOPIC = "DLQ_ORIGIN_TOPIC"
PROPERTY_DLQ_ORIGIN_MESSAGE_ID = "DLQ_ORIGIN_MESSAGE_ID"
# stamped by the broker on every message a producer sends (RocketMQ's SendMessageProcessor and send context)
PROPERTY_CLUSTER = "CLUSTER"
PROPERTY_MSG_REGION = "MSG_REGION"
PROPERTY_TRACE_SWITCH = "TRACE_ON"
# request-reply (RocketMQ's MessageConst)
PROPERTY_CORRELATION_ID = "CORRELATION_ID"
PROPERTY_MESSAGE_REPLY_TO_CLIENT = "REPLY_TO_CLIENT"
PROPERTY_MESSAGE_TTL = "TTL"
PROPERTY_MESSAGE_TYPE = "MSG_TYPE"
PROPERTY_PUSH_REPLY_TIME = "PUSH_REPLY_TIME"
REPLY_TOPIC_POSTFIX = "REPLY_TOPIC"

# --- system topics and prefixes -------------------------------------------------------------------------
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
DEFAULT_TOPIC = "TBW102"
RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"
DLQ_GROUP_TOPIC_PREFIX = "%DLQ%"

# --- sysFlag bits (MessageSysFlag) ----------------------------------------------------------------------
SYSFLAG_COMPRESSED = 0x1
SYSFLAG_MULTI_TAGS = 0x2
SYSFLAG_TRANSACTION_NOT_TYPE = 0x0
SYSFLAG_TRANSACTION_PREPARED_TYPE = 0x1 << 2
SYSFLAG_TRANSACTION_COMMIT_TYPE = 0x2 << 2
SYSFLAG_TRANSACTION_ROLLBACK_TYPE = 0x3 << 2
SYSFLAG_BORNHOST_V6 = 0x1 << 4
SYSFLAG_STOREHOST_V6 = 0x1 << 5


def transaction_type(sys_flag: int) -> int:
    return sys_flag & SYSFLAG_TRANSACTION_ROLLBACK_TYPE


# --- stored record layout (V1 magic, IPv4 hosts) ----------------------------------------------------------
MAGIC_V1 = 0xDAA320A7 - (1 << 32)  # -626843481 as a signed int32
BLANK_MAGIC = 0xCBD43194 - (1 << 32)  # end-of-segment filler marker (RocketMQ's BLANK_MAGIC_CODE)

# Fixed field positions inside a record; the store patches offsets and store time in place.
POS_TOTALSIZE = 0
POS_MAGIC = 4
POS_BODYCRC = 8
POS_QUEUEID = 12
POS_FLAG = 16
POS_QUEUEOFFSET = 20
POS_PHYSICALOFFSET = 28
POS_SYSFLAG = 36
POS_BORNTIMESTAMP = 40
POS_BORNHOST = 48
POS_STORETIMESTAMP = 56
POS_STOREHOST = 64
POS_RECONSUMETIMES = 72
POS_PREPAREDTXOFFSET = 76
POS_BODYLENGTH = 84
POS_BODY = 88
RECORD_FIXED_SIZE = 91  # calMsgLength without body, topic and properties

_HEAD = struct.Struct(">iiiiiqqiq8sq8siqi")  # up to and including BODYLENGTH
RECORD_HEAD = _HEAD  # public: fast decoders of the fixed head (delay delivery)
assert _HEAD.size == POS_BODY
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_H16 = struct.Struct(">H")

MAX_TOPIC_LENGTH = 127
MAX_PROPERTIES_LENGTH = 32767
_TOPIC_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")

NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"


class MessageFormatError(ValueError):
    """A record or a properties string that cannot be decoded (corrupt or truncated)."""


def validate_topic(topic: str) -> str | None:
    """Return None if the topic name is legal (RocketMQ's rules), else a human-readable reason."""
    if not topic:
        return "the topic name is empty"
    if len(topic.encode()) > MAX_TOPIC_LENGTH:
        return f"the topic name is longer than {MAX_TOPIC_LENGTH} characters"
    if not _TOPIC_RE.match(topic):
        return f"the topic name {topic!r} contains characters outside [%|a-zA-Z0-9_-]"
    return None


def encode_properties(props: dict[str, str]) -> str:
    """key\\x01value\\x02 ... (trailing \\x02, as Java and the C++ client write it)."""
    if not props:
        return ""
    parts = []
    for k, v in props.items():
        parts.append(k)
        parts.append(NAME_VALUE_SEPARATOR)
        parts.append(v)
        parts.append(PROPERTY_SEPARATOR)
    return "".join(parts)


def decode_properties(text: str) -> dict[str, str]:
    props: dict[str, str] = {}
    if not text:
        return props
    for item in text.split(PROPERTY_SEPARATOR):
        if not item:
            continue
        k, sep, v = item.partition(NAME_VALUE_SEPARATOR)
        if sep and k:
            props[k] = v
    return props


def java_string_hash(s: str) -> int:
    """Java's String.hashCode() (over UTF-16 code units), as a signed 32-bit int: the tag hash that
    RocketMQ puts in the consume-queue tagsCode and that server-side tag filtering compares."""
    h = 0
    data = s.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def tags_code(tags: str | None) -> int:
    return java_string_hash(tags) if tags else 0


def body_crc(body: bytes) -> int:
    return zlib.crc32(body) & 0x7FFFFFFF


def pack_host(host: tuple[str, int]) -> bytes:
    """IPv4 address bytes + port as int32 (the record's BORNHOST/STOREHOST field)."""
    ip, port = host
    try:
        raw = socket.inet_aton(ip)
    except OSError:
        raw = b"\x00\x00\x00\x00"
    return raw + _I32.pack(port)


def unpack_host(raw: bytes) -> tuple[str, int]:
    return socket.inet_ntoa(raw[:4]), _I32.unpack(raw[4:8])[0]


_HOSTS: dict[bytes, tuple[str, int]] = {}


def unpack_host_cached(raw: bytes) -> tuple[str, int]:
    """unpack_host for hot decode paths: a record batch repeats a handful of hosts, so each distinct
    8-byte value is decoded once (the cache is emptied past 10,000 entries)."""
    h = _HOSTS.get(raw)
    if h is None:
        if len(_HOSTS) > 10_000:
            _HOSTS.clear()
        h = _HOSTS[bytes(raw)] = unpack_host(raw)
    return h


@dataclass(slots=True)
class Message:
    """What a producer sends: topic, body and properties (tags, keys, delay level, user properties)."""

    topic: str
    body: bytes
    properties: dict[str, str] = field(default_factory=dict)
    flag: int = 0

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> str | None:
        return self.properties.get(PROPERTY_KEYS)

    @property
    def delay_level(self) -> int:
        try:
            return int(self.properties.get(PROPERTY_DELAY_TIME_LEVEL, "0"))
        except ValueError:
            return 0


@dataclass(slots=True)
class MessageExt:
    """A stored message: every field of the record layout. Used both to build a record to append
    (queue_offset, commit_log_offset and store_timestamp are filled in by the store) and as the result
    of decoding one."""

    topic: str
    body: bytes
    properties: dict[str, str] = field(default_factory=dict)
    flag: int = 0
    queue_id: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_host: tuple[str, int] = ("127.0.0.1", 0)
    store_timestamp: int = 0
    store_host: tuple[str, int] = ("127.0.0.1", 0)
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0
    queue_offset: int = 0
    commit_log_offset: int = 0
    body_crc: int = 0
    store_size: int = 0

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        raw = self.properties.get(PROPERTY_KEYS, "")
        return [k for k in raw.split(" ") if k]

    @property
    def uniq_key(self) -> str | None:
        return self.properties.get(PROPERTY_UNIQ_KEY)

    @property
    def delay_level(self) -> int:
        try:
            return int(self.properties.get(PROPERTY_DELAY_TIME_LEVEL, "0"))
        except ValueError:
            return 0

    @property
    def msg_id(self) -> str:
        """The offset message id (store host + commit-log offset)."""
        return create_offset_msg_id(self.store_host, self.commit_log_offset)

    def inflated_body(self) -> bytes:
        if self.sys_flag & SYSFLAG_COMPRESSED:
            return zlib.decompress(self.body)
        return self.body


def encode_record(msg: MessageExt, properties_text: str | None = None) -> bytearray:
    """Encode a message in the stored V1 layout. Returns a bytearray so the store can patch
    queue offset, physical offset and store timestamp in place (see patch_record)."""
    topic_b = msg.topic.encode()
    props_b = (encode_properties(msg.properties) if properties_text is None else properties_text).encode()
    if len(topic_b) > MAX_TOPIC_LENGTH:
        raise MessageFormatError("topic too long")
    if len(props_b) > MAX_PROPERTIES_LENGTH:
        raise MessageFormatError("properties too long")
    body = msg.body
    total = RECORD_FIXED_SIZE + len(body) + len(topic_b) + len(props_b)
    crc = msg.body_crc or body_crc(body)
    buf = bytearray(total)
    _HEAD.pack_into(
        buf,
        0,
        total,
        MAGIC_V1,
        crc,
        msg.queue_id,
        msg.flag,
        msg.queue_offset,
        msg.commit_log_offset,
        msg.sys_flag & ~(SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6),
        msg.born_timestamp,
        pack_host(msg.born_host),
        msg.store_timestamp,
        pack_host(msg.store_host),
        msg.reconsume_times,
        msg.prepared_transaction_offset,
        len(body),
    )
    p = POS_BODY
    buf[p : p + len(body)] = body
    p += len(body)
    buf[p] = len(topic_b)
    p += 1
    buf[p : p + len(topic_b)] = topic_b
    p += len(topic_b)
    _H16.pack_into(buf, p, len(props_b))
    p += 2
    buf[p : p + len(props_b)] = props_b
    return buf


def patch_record(
    buf: bytearray | memoryview, queue_offset: int, physical_offset: int, store_timestamp: int
) -> None:
    _I64.pack_into(buf, POS_QUEUEOFFSET, queue_offset)
    _I64.pack_into(buf, POS_PHYSICALOFFSET, physical_offset)
    _I64.pack_into(buf, POS_STORETIMESTAMP, store_timestamp)


def record_size_at(buf: bytes | bytearray | memoryview, pos: int = 0) -> int:
    return _I32.unpack_from(buf, pos)[0]


def record_topic_and_properties(
    buf: bytes | bytearray | memoryview, pos: int, total: int, body_len: int
) -> tuple[str, dict[str, str]]:
    """The topic and properties of the V1 record of ``total`` bytes at ``buf[pos:]``, whose head the caller
    has unpacked (``body_len``: its BODYLENGTH): every length checked against the record's end. Raises
    MessageFormatError."""
    end = pos + total
    p = pos + POS_BODY
    if body_len < 0 or p + body_len + 3 > end:
        raise MessageFormatError("body length out of range")
    p += body_len
    topic_len = buf[p]
    p += 1
    try:
        topic = bytes(buf[p : p + topic_len]).decode()
    except UnicodeDecodeError as e:
        raise MessageFormatError("topic is not UTF-8") from e
    p += topic_len
    if p + 2 > end:
        raise MessageFormatError("properties length out of range")
    (props_len,) = _H16.unpack_from(buf, p)
    p += 2
    if p + props_len != end:
        raise MessageFormatError("record length does not match its fields")
    try:
        props = decode_properties(bytes(buf[p:end]).decode())
    except UnicodeDecodeError as e:
        raise MessageFormatError("properties are not UTF-8") from e
    return topic, props


def decode_record(
    buf: bytes | bytearray | memoryview, pos: int = 0, *, check_crc: bool = False, read_body: bool = True
) -> MessageExt:
    """Decode one stored record starting at ``pos``. Raises MessageFormatError on a bad magic code,
    an inconsistent length, or (with check_crc) a body CRC mismatch."""
    if len(buf) - pos < RECORD_FIXED_SIZE:
        raise MessageFormatError("record truncated")
    (
        total,
        magic,
        crc,
        queue_id,
        flag,
        queue_offset,
        phys,
        sys_flag,
        born_ts,
        born_host,
        store_ts,
        store_host,
        reconsume,
        prepared,
        body_len,
    ) = _HEAD.unpack_from(buf, pos)
    if magic != MAGIC_V1:
        raise MessageFormatError(f"bad magic code {magic & 0xFFFFFFFF:#x}")
    if total < RECORD_FIXED_SIZE or pos + total > len(buf):
        raise MessageFormatError("record length out of range")
    topic, props = record_topic_and_properties(buf, pos, total, body_len)
    p = pos + POS_BODY
    body = bytes(buf[p : p + body_len]) if read_body else b""
    if check_crc and body_crc(bytes(buf[p : p + body_len])) != crc:
        raise MessageFormatError("body CRC mismatch")
    return MessageExt(
        topic=topic,
        body=body,
        properties=props,
        flag=flag,
        queue_id=queue_id,
        sys_flag=sys_flag,
        born_timestamp=born_ts,
        born_host=unpack_host(born_host),
        store_timestamp=store_ts,
        store_host=unpack_host(store_host),
        reconsume_times=reconsume,
        prepared_transaction_offset=prepared,
        queue_offset=queue_offset,
        commit_log_offset=phys,
        body_crc=crc,
        store_size=total,
    )


def decode_records(buf: bytes | bytearray | memoryview) -> list[MessageExt]:
    """Decode a concatenation of records (a PULL_MESSAGE body)."""
    out = []
    pos = 0
    while pos < len(buf):
        m = decode_record(buf, pos)
        out.append(m)
        pos += m.store_size
    return out


# --- offset message ids (docs/protocol.md#message-ids) ------------------------------------------------------
def create_offset_msg_id(store_host: tuple[str, int], commit_log_offset: int) -> str:
    return (pack_host(store_host) + _I64.pack(commit_log_offset)).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[tuple[str, int], int]:
    """Parse an offset message id back into ((ip, port), commit-log offset). Raises ValueError."""
    if len(msg_id) != 32:
        raise ValueError(f"not an offset message id: {msg_id!r}")
    raw = bytes.fromhex(msg_id)
    return unpack_host(raw[:8]), _I64.unpack(raw[8:16])[0]

