"""Request helpers shared by the consumers and Admin: pull, offsets, queries (docs/protocol.md#requests)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from chronomq import message as m
from chronomq.remoting import fastjson
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import (
    PULL_EXT_BULK_READ,
    PULL_FLAG_COMMIT_OFFSET,
    PULL_FLAG_SUBSCRIPTION,
    PULL_FLAG_SUSPEND,
    RequestCode,
    ResponseCode,
)

from .errors import BrokerError, error_for_code
from .instance import ClientInstance
from .model import MessageQueue, ReceivedMessage, RecordColumns, decode_received, record_columns, tag_set


class PullStatus(StrEnum):
    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    NO_MATCHED_MSG = "NO_MATCHED_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


@dataclass(slots=True)
class PullResult:
    status: PullStatus
    next_offset: int
    min_offset: int
    max_offset: int
    messages: list[ReceivedMessage] = field(default_factory=list)
    suggest_broker_id: int = 0  # where the broker suggests the next pull go (0: the master)
    records: RecordColumns | None = None  # a raw pull's FOUND answer, column by column (messages is empty)
    body: bytes | None = None  # a raw="bytes" pull's FOUND answer: the stored records, undecoded


_PULL_CODES = (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND, ResponseCode.PULL_RETRY_IMMEDIATELY,
               ResponseCode.PULL_OFFSET_MOVED)


def pull_request(inst: ClientInstance, mq: MessageQueue, offset: int, max_count: int, group: str,
                 expression: str, suspend_ms: int, commit_offset: int | None,
                 bulk: bool = False) -> RemotingCommand:
    """The PULL_MESSAGE request (the pull consumer's and the push consumer's). ``bulk``: ask a chronomq
    broker for an answer up to its bulk-read caps (PULL_EXT_BULK_READ; other brokers ignore it)."""
    flag = PULL_FLAG_SUBSCRIPTION
    if suspend_ms > 0:
        flag |= PULL_FLAG_SUSPEND
    if commit_offset is not None and commit_offset >= 0:
        flag |= PULL_FLAG_COMMIT_OFFSET
    ext = {"consumerGroup": group, "topic": mq.topic, "queueId": mq.queue_id, "queueOffset": offset,
           "maxMsgNums": max_count, "sysFlag": flag, "commitOffset": commit_offset or 0,
           "suspendTimeoutMillis": suspend_ms or 20000, "subscription": expression or "*",
           "subVersion": 0}
    if bulk:
        ext[PULL_EXT_BULK_READ] = "true"
    return inst.request(RequestCode.PULL_MESSAGE, ext)


def pull_result(resp: RemotingCommand, mq: MessageQueue, offset: int, tags: set[str] | None, what: str,
                addr: str, raw: bool | Literal["bytes"] = False) -> PullResult:
    """A PULL_MESSAGE response as a PullResult: its status, offsets and the messages that match ``tags``
    (None: all), decoded straight from the stored records. ``raw``: a FOUND answer's records as
    RecordColumns in ``records``, every record the broker sent (the caller checks tags); ``raw="bytes"``:
    the records undecoded in ``body`` (the caller decodes and checks them)."""
    code = resp.code
    if code not in _PULL_CODES:
        raise error_for_code(code, resp.remark, what, addr)
    nxt = resp.ext_int("nextBeginOffset", offset)
    lo = resp.ext_int("minOffset", 0)
    hi = resp.ext_int("maxOffset", 0)
    suggest = resp.ext_int("suggestWhichBrokerId", 0)
    if code == ResponseCode.PULL_NOT_FOUND:
        return PullResult(PullStatus.NO_NEW_MSG, nxt, lo, hi, suggest_broker_id=suggest)
    if code == ResponseCode.PULL_RETRY_IMMEDIATELY:
        return PullResult(PullStatus.NO_MATCHED_MSG, nxt, lo, hi, suggest_broker_id=suggest)
    if code == ResponseCode.PULL_OFFSET_MOVED:
        return PullResult(PullStatus.OFFSET_ILLEGAL, nxt, lo, hi, suggest_broker_id=suggest)
    if raw == "bytes":
        return PullResult(PullStatus.FOUND, nxt, lo, hi, suggest_broker_id=suggest, body=resp.body)
    try:
        if raw:
            return PullResult(PullStatus.FOUND, nxt, lo, hi, suggest_broker_id=suggest,
                              records=record_columns(resp.body))
        msgs = decode_received(resp.body, mq.broker_name)
    except m.MessageFormatError as e:
        raise BrokerError(f"{what}: the broker returned an undecodable message body: {e}",
                          ResponseCode.SYSTEM_ERROR, None, addr) from None
    if tags is not None:
        msgs = [x for x in msgs if x.properties.get(m.PROPERTY_TAGS) in tags]
    if not msgs:
        return PullResult(PullStatus.NO_MATCHED_MSG, nxt, lo, hi, suggest_broker_id=suggest)
    return PullResult(PullStatus.FOUND, nxt, lo, hi, msgs, suggest)


async def pull(inst: ClientInstance, mq: MessageQueue, offset: int, max_count: int, *, group: str,
               expression: str = "*", suspend_ms: int = 0, commit_offset: int | None = None,
               timeout: float | None = None, raw: bool | Literal["bytes"] = False,
               bulk: bool = False) -> PullResult:
    if offset < 0:
        raise ValueError(f"pull offset must be >= 0, got {offset}")
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    addr, slave = await inst.read_addr(mq.broker_name, mq.topic)
    if slave:
        commit_offset = None  # offsets are committed to the master only
    req = pull_request(inst, mq, offset, max_count, group, expression, suspend_ms, commit_offset, bulk)
    rto = timeout if timeout is not None else (suspend_ms / 1000 + 10 if suspend_ms else inst.request_timeout)
    what = f"pull {mq} at offset {offset}"
    resp = await inst.invoke(addr, req, rto, what)
    return pull_result(resp, mq, offset, tag_set(expression), what, addr, raw)


async def _offset_call(inst: ClientInstance, code: int, mq: MessageQueue, what: str,
                       extra: dict[str, Any] | None = None) -> int:
    addr, _ = await inst.read_addr(mq.broker_name, mq.topic)
    ext = {"topic": mq.topic, "queueId": mq.queue_id, **(extra or {})}
    resp = await inst.invoke_ok(addr, inst.request(code, ext), what=f"{what} of {mq}")
    return resp.ext_int("offset", 0) if code != RequestCode.GET_EARLIEST_MSG_STORETIME \
        else resp.ext_int("timestamp", -1)


async def max_offset(inst: ClientInstance, mq: MessageQueue) -> int:
    return await _offset_call(inst, RequestCode.GET_MAX_OFFSET, mq, "max offset")


async def min_offset(inst: ClientInstance, mq: MessageQueue) -> int:
    return await _offset_call(inst, RequestCode.GET_MIN_OFFSET, mq, "min offset")


async def offset_for_timestamp(inst: ClientInstance, mq: MessageQueue, timestamp_ms: int) -> int:
    return await _offset_call(inst, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, mq, "offset by timestamp",
                              {"timestamp": int(timestamp_ms)})


async def earliest_store_time(inst: ClientInstance, mq: MessageQueue) -> int:
    return await _offset_call(inst, RequestCode.GET_EARLIEST_MSG_STORETIME, mq, "earliest store time")


async def query_consumer_offset(inst: ClientInstance, group: str, mq: MessageQueue) -> int | None:
    """The group's committed offset, or None when the broker has none (QUERY_NOT_FOUND)."""
    addr, _ = await inst.read_addr(mq.broker_name, mq.topic)
    ext = {"consumerGroup": group, "topic": mq.topic, "queueId": mq.queue_id}
    what = f"query offset of group {group!r} on {mq}"
    resp = await inst.invoke(addr, inst.request(RequestCode.QUERY_CONSUMER_OFFSET, ext), 5.0, what)
    if resp.code == ResponseCode.QUERY_NOT_FOUND:
        return None
    if resp.code != ResponseCode.SUCCESS:
        raise error_for_code(resp.code, resp.remark, what, addr)
    return resp.ext_int("offset", 0)


async def update_consumer_offset(inst: ClientInstance, group: str, mq: MessageQueue, offset: int) -> None:
    # the master's when there is one; with it down, the slave keeps the offset (RocketMQ's client does
    # the same, and the consumer's own offsets go to the master once it is back)
    addr, _ = await inst.read_addr(mq.broker_name, mq.topic)
    ext = {"consumerGroup": group, "topic": mq.topic, "queueId": mq.queue_id, "commitOffset": offset}
    await inst.invoke_ok(addr, inst.request(RequestCode.UPDATE_CONSUMER_OFFSET, ext), 5.0,
                         f"commit offset {offset} of group {group!r} on {mq}")


async def consumer_ids(inst: ClientInstance, group: str, addr: str) -> list[str]:
    resp = await inst.invoke_ok(addr, inst.request(RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                                   {"consumerGroup": group}), 5.0,
                                f"consumer list of group {group!r}")
    try:
        data = fastjson.loads(resp.body) if resp.body else {}
    except ValueError:
        raise BrokerError(f"consumer list of group {group!r}: body is not JSON", 1, None, addr) from None
    return sorted(str(c) for c in data.get("consumerIdList") or [])


async def lock_queues(inst: ClientInstance, group: str, addr: str,
                      mqs: list[MessageQueue]) -> set[MessageQueue]:
    body = json.dumps({"consumerGroup": group, "clientId": inst.client_id,
                       "mqSet": [q.to_json() for q in mqs]}).encode()
    resp = await inst.invoke_ok(addr, inst.request(RequestCode.LOCK_BATCH_MQ, body=body), 5.0,
                                f"lock queues of group {group!r}")
    try:
        data = fastjson.loads(resp.body) if resp.body else {}
    except ValueError:
        return set()
    return {MessageQueue(str(q["topic"]), str(q["brokerName"]), int(q["queueId"]))
            for q in data.get("lockOKMQSet") or []}


async def unlock_queues(inst: ClientInstance, group: str, addr: str, mqs: list[MessageQueue]) -> None:
    body = json.dumps({"consumerGroup": group, "clientId": inst.client_id,
                       "mqSet": [q.to_json() for q in mqs]}).encode()
    await inst.invoke_ok(addr, inst.request(RequestCode.UNLOCK_BATCH_MQ, body=body), 5.0,
                         f"unlock queues of group {group!r}")
