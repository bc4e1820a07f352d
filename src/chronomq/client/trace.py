"""Message trace records, sans-IO: the body of a trace message (what a RocketMQ client with
``enableMsgTrace`` sends to ``RMQ_SYS_TRACE_TOPIC``) decoded into one typed ``TraceRecord`` per trace
context, read field by field as RocketMQ's ``TraceDataEncoder.decoderFromTraceDataString`` reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"  # the default trace topic (a client's customizedTraceTopic may differ)
CONTENT_SEPARATOR = "\x01"  # between the fields of one context (TraceConstants.CONTENT_SPLITOR)
CONTEXT_SEPARATOR = "\x02"  # after each context (TraceConstants.FIELD_SPLITOR)

# org.apache.rocketmq.common.message.MessageType, by ordinal (Order_Msg is 5.x's)
MESSAGE_TYPES = ("Normal_Msg", "Trans_Msg_Half", "Trans_msg_Commit", "Delay_Msg", "Order_Msg")
# org.apache.rocketmq.client.consumer.listener.ConsumeReturnType, by ordinal (a SubAfter's context code)
CONSUME_RETURN_TYPES = ("SUCCESS", "TIME_OUT", "EXCEPTION", "RETURNNULL", "FAILED")
TRANSACTION_STATES = ("COMMIT_MESSAGE", "ROLLBACK_MESSAGE", "UNKNOW")

_INT = re.compile(r"[+-]?[0-9]+")  # what Long.parseLong / Integer.parseInt accept (ASCII digits)
_LONG_MAX, _INT_MAX = (1 << 63) - 1, (1 << 31) - 1


class TraceDecodeError(ValueError):
    """A trace body that is not what TraceDataEncoder writes (the reason says where and why)."""


class TraceType(StrEnum):
    PUB = "Pub"                        # the producer's send
    SUB_BEFORE = "SubBefore"           # a consumer is about to hand the message to its listener
    SUB_AFTER = "SubAfter"             # the listener returned (cost, success, return type)
    END_TRANSACTION = "EndTransaction"  # a transactional message was committed or rolled back
    RECALL = "Recall"                  # 5.x: a timed message was recalled


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trace context. A field a context of its type does not carry (or an older, shorter form of
    it leaves out) is None; strings are as the client wrote them ("null" where it had none)."""

    type: TraceType
    msg_id: str                              # the traced message's id (its UNIQ_KEY)
    timestamp: int | None = None             # epoch ms; a SubAfter of an old client has none
    region: str | None = None
    group: str | None = None                 # producer group (Pub, EndTransaction) or consumer group
    request_id: str | None = None            # pairs a SubBefore with its SubAfter
    topic: str | None = None
    tags: str | None = None
    keys: str | None = None
    store_host: str | None = None            # "ip:port" of the broker that stored it (Pub)
    client_host: str | None = None           # only an old Pub form carries it
    body_length: int | None = None
    cost_ms: int | None = None
    msg_type: int | None = None              # ordinal of MESSAGE_TYPES
    offset_msg_id: str | None = None
    success: bool | None = None              # None: not said (RocketMQ's decoder then reads true)
    retry_times: int | None = None           # SubBefore: how often it was consumed before
    context_code: int | None = None          # SubAfter: ordinal of CONSUME_RETURN_TYPES
    transaction_id: str | None = None
    transaction_state: str | None = None     # one of TRANSACTION_STATES
    from_transaction_check: bool | None = None

    @property
    def time(self) -> datetime | None:
        return None if self.timestamp is None else datetime.fromtimestamp(self.timestamp / 1000, UTC)

    @property
    def msg_type_name(self) -> str | None:
        if self.msg_type is None:
            return None
        return MESSAGE_TYPES[self.msg_type] if self.msg_type < len(MESSAGE_TYPES) else f"type {self.msg_type}"

    @property
    def consume_return(self) -> str | None:
        """A SubAfter's ConsumeReturnType name (SUCCESS, TIME_OUT, EXCEPTION, RETURNNULL, FAILED)."""
        if self.context_code is None:
            return None
        code = self.context_code
        return CONSUME_RETURN_TYPES[code] if 0 <= code < len(CONSUME_RETURN_TYPES) else f"code {code}"


class _Fields:
    """One context's fields. ``count`` is what Java's String.split gives (trailing empty fields dropped:
    the decoder's optional fields depend on it); a field the encoder wrote empty at the end reads as ""."""

    def __init__(self, kind: str, parts: list[str], index: int) -> None:
        self.kind, self.parts, self.index = kind, parts, index
        count = len(parts)
        while count and not parts[count - 1]:
            count -= 1
        self.count = count

    def _fail(self, i: int, what: str) -> TraceDecodeError:
        return TraceDecodeError(f"trace context {self.index} ({self.kind}): field {i} ({what}) "
                                f"{self._said(i)}")

    def _said(self, i: int) -> str:
        if i >= len(self.parts):
            return f"is missing (the context has {self.count} fields)"
        return f"is {self.parts[i][:40]!r}"

    def need(self, n: int) -> _Fields:
        """Refuse a context cut short: fewer than the ``n`` fields its type always has."""
        if len(self.parts) < n:
            raise TraceDecodeError(f"trace context {self.index} ({self.kind}) is cut short: "
                                   f"{len(self.parts)} fields, it has at least {n}")
        return self

    def text(self, i: int, what: str) -> str:
        if i >= len(self.parts):
            raise self._fail(i, what)
        return self.parts[i]

    def number(self, i: int, what: str, limit: int = _INT_MAX) -> int:
        raw = self.parts[i] if i < len(self.parts) else ""
        if not _INT.fullmatch(raw) or not -limit - 1 <= int(raw) <= limit:
            raise self._fail(i, what)
        return int(raw)

    def long(self, i: int, what: str) -> int:
        return self.number(i, what, _LONG_MAX)

    def msg_type(self, i: int) -> int:
        n = self.number(i, "message type")
        if n < 0:
            raise self._fail(i, "message type")
        return n

    @staticmethod
    def boolean(raw: str) -> bool:
        return raw.lower() == "true"  # Boolean.parseBoolean: anything else is false


def _pub(f: _Fields) -> TraceRecord:
    f.need(12)
    offset_msg_id = client_host = None
    success: bool | None = None
    if f.count == 13:
        success = f.boolean(f.text(12, "success"))
    elif f.count >= 14:
        offset_msg_id, success = f.text(12, "offset msg id"), f.boolean(f.text(13, "success"))
        if f.count >= 15:
            client_host = f.text(14, "client host")
    return TraceRecord(
        TraceType.PUB, f.text(5, "msg id"), timestamp=f.long(1, "timestamp"), region=f.text(2, "region"),
        group=f.text(3, "group"), topic=f.text(4, "topic"), tags=f.text(6, "tags"), keys=f.text(7, "keys"),
        store_host=f.text(8, "store host"), body_length=f.number(9, "body length"),
        cost_ms=f.number(10, "cost time"), msg_type=f.msg_type(11), offset_msg_id=offset_msg_id,
        success=success, client_host=client_host)


def _sub_before(f: _Fields) -> TraceRecord:
    f.need(8)
    return TraceRecord(
        TraceType.SUB_BEFORE, f.text(5, "msg id"), timestamp=f.long(1, "timestamp"),
        region=f.text(2, "region"), group=f.text(3, "group"), request_id=f.text(4, "request id"),
        retry_times=f.number(6, "retry times"), keys=f.text(7, "keys"))


def _sub_after(f: _Fields) -> TraceRecord:
    f.need(6)
    # older clients end at the keys or the context code; newer ones add the timestamp, then the group
    return TraceRecord(
        TraceType.SUB_AFTER, f.text(2, "msg id"), request_id=f.text(1, "request id"),
        cost_ms=f.number(3, "cost time"), success=f.boolean(f.text(4, "success")), keys=f.text(5, "keys"),
        context_code=f.number(6, "context code") if f.count >= 7 else None,
        timestamp=f.long(7, "timestamp") if f.count >= 8 else None,
        group=f.text(8, "group") if f.count >= 9 else None)


def _end_transaction(f: _Fields) -> TraceRecord:
    f.need(13)
    state = f.text(11, "transaction state")
    if state not in TRANSACTION_STATES:
        raise f._fail(11, "transaction state")
    return TraceRecord(
        TraceType.END_TRANSACTION, f.text(5, "msg id"), timestamp=f.long(1, "timestamp"),
        region=f.text(2, "region"), group=f.text(3, "group"), topic=f.text(4, "topic"),
        tags=f.text(6, "tags"), keys=f.text(7, "keys"), store_host=f.text(8, "store host"),
        msg_type=f.msg_type(9), transaction_id=f.text(10, "transaction id"), transaction_state=state,
        from_transaction_check=f.boolean(f.text(12, "from transaction check")))


def _recall(f: _Fields) -> TraceRecord:
    f.need(7)
    return TraceRecord(
        TraceType.RECALL, f.text(5, "msg id"), timestamp=f.long(1, "timestamp"), region=f.text(2, "region"),
        group=f.text(3, "group"), topic=f.text(4, "topic"), success=f.boolean(f.text(6, "success")))


_DECODERS = {TraceType.PUB.value: _pub, TraceType.SUB_BEFORE.value: _sub_before,
             TraceType.SUB_AFTER.value: _sub_after, TraceType.END_TRANSACTION.value: _end_transaction,
             TraceType.RECALL.value: _recall}


def decode_trace_body(body: bytes | str) -> list[TraceRecord]:
    """Every trace context of a trace message's body, in body order. A context of a type this decoder
    does not know is skipped, as RocketMQ's decoder skips it; an empty body holds none. Raises
    TraceDecodeError for a body that is not UTF-8 or a context of a known type that is cut short or
    holds a field that does not parse (where RocketMQ's decoder would throw)."""
    if isinstance(body, bytes | bytearray | memoryview):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceDecodeError(f"a trace body is UTF-8 text; byte {e.start} is not") from None
    elif isinstance(body, str):
        text = body
    else:
        raise TypeError(f"a trace body is bytes or str, not {type(body).__name__}")
    records: list[TraceRecord] = []
    for index, context in enumerate(text.split(CONTEXT_SEPARATOR)):
        parts = context.split(CONTENT_SEPARATOR)
        decoder = _DECODERS.get(parts[0])
        if decoder is not None:
            records.append(decoder(_Fields(parts[0], parts, index)))
    return records
