"""PULL_MESSAGE (11): the inline attempt and the long-polling hold (RocketMQ's PullMessageProcessor).

Rules: ``pull_message`` answers inline unless the queue had nothing, the request carries the suspend
flag and ``longPollingEnable`` is on; then it returns None and the dispatcher's async ``handle`` runs
``pull_message_held``, which waits on ``services.hold`` (PullHoldService) until an arrival or the
deadline. Tags are filtered in the store through ``TagFilter``; with enablePropertyFilter, a SQL92
subscription filters each record read by its properties (``_filters_for``, chronomq.filter). An answer
holds at most maxTransferCountOnMessageInMemory messages and, past its first,
maxTransferBytesOnMessageInMemory bytes, as RocketMQ's store answers, whatever maxMsgNums asks; a pull
with the extField chronomqBulkRead=true (chronomq's readers) is capped by maxTransferCountOnBulkRead and
maxTransferBytesOnBulkRead instead.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from chronomq.delay.delivery import DELAY_SOURCE_MARK, hide_delay_sources
from chronomq.message import (
    NAME_VALUE_SEPARATOR,
    POS_BODY,
    POS_PHYSICALOFFSET,
    PROPERTY_TIMER_DELIVER_MS,
    RECORD_FIXED_SIZE,
    java_string_hash,
)
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import (
    PERM_READ,
    PULL_EXT_BULK_READ,
    PULL_FLAG_COMMIT_OFFSET,
    PULL_FLAG_SUBSCRIPTION,
    PULL_FLAG_SUSPEND,
    RequestCode,
    ResponseCode,
)
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import GetResult, GetStatus

from .base import Handler, ProcessorBase, RequestConnection, no_filter_remark

if TYPE_CHECKING:
    from ..services import BrokerServices

MAX_PULL_BYTES = 4 * 1024 * 1024  # a gRPC receive's read (a PULL answer: maxTransferBytesOnMessageInMemory)
MAX_SUSPEND_MS = 60_000


_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_DUE_MARK = (PROPERTY_TIMER_DELIVER_MS + NAME_VALUE_SEPARATOR).encode()
_SRC_MARK = DELAY_SOURCE_MARK


def _props_at(rec: bytes) -> int | None:
    """Where a stored V1 record's properties start (after their length), or None when its fixed part and
    body length do not lead there."""
    if len(rec) < RECORD_FIXED_SIZE:
        return None
    (body_len,) = _I32.unpack_from(rec, POS_BODY - 4)
    p = POS_BODY + body_len
    if body_len < 0 or p + 3 > len(rec):
        return None
    return p + 3 + rec[p]  # the topic's length byte and bytes, the properties' length


@pure_twin("due_ms_of")
def due_ms_of_py(rec: bytes) -> int | None:
    """The TIMER_DELIVER_MS property of a stored V1 record (what the timer delivered), or None: looked
    up in the record's properties only, never in its body."""
    props = _props_at(rec)
    if props is None:
        return None
    i = rec.find(_DUE_MARK, props)
    if i < 0 or (i > props and rec[i - 1] != 2):  # not a whole property name
        return None
    start = i + len(_DUE_MARK)
    end = rec.find(b"\x02", start)
    raw = rec[start:end if end >= 0 else len(rec)]
    return int(raw) if raw.isdigit() else None


@pure_twin("count_lateness")
def count_lateness_py(records: list[bytes], now: int, lates: dict[int, int]) -> None:
    """For each record that holds a deliver time (``due_ms_of``), how late ``now`` is after it (0 when not
    after), counted in ``lates`` by value: an answer's timed messages share few distinct values."""
    for rec in records:
        due = due_ms_of_py(rec)
        if due is not None:
            late = now - due if now > due else 0
            lates[late] = lates.get(late, 0) + 1


@pure_twin("props_marks")
def props_marks_py(records: list[bytes], marks: tuple[bytes, ...]) -> int:
    """Bit i set when some record's properties (all after its properties' length) hold marks[i]: an
    answer's records are searched there only, not through their bodies; a record whose layout does not
    lead to its properties counts as holding every mark (the exact per-record functions then decide)."""
    found, every = 0, (1 << len(marks)) - 1
    for rec in records:
        at = _props_at(rec)
        if at is None:
            return every
        props = bytes(rec[at:])
        for i, mark in enumerate(marks):
            if mark in props:
                found |= 1 << i
        if found == every:
            break
    return found


# the compiled lookups when they are built (chronomq.store.speedups chooses); the _py functions are twins
count_lateness: Callable[[list[bytes], int, dict[int, int]], None] = kernels.count_lateness
props_marks: Callable[[list[bytes], tuple[bytes, ...]], int] = kernels.props_marks
_MARKS = (_SRC_MARK, _DUE_MARK)


def _physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30  # unknown: as an 8 GiB machine

def _int(v: object) -> int:
    """A JSON value as an int: 0 when it is neither a number nor numeric text."""
    if not isinstance(v, str | int | float):
        return 0
    try:
        return int(v)
    except ValueError:
        return 0


class TagFilter:
    """Server-side tag filter from a subscription expression: "*" / "" (all) or "a || b"."""

    __slots__ = ("codes", "tags")

    def __init__(self, expression: str) -> None:
        expr = (expression or "").strip()
        if expr in ("", "*"):
            self.tags: frozenset[str] | None = None
            self.codes: frozenset[int] = frozenset()
        else:
            self.tags = frozenset(t.strip() for t in expr.split("||") if t.strip())
            self.codes = frozenset(java_string_hash(t) for t in self.tags)

    def predicate(self) -> Callable[[int], bool] | None:
        if self.tags is None:
            return None
        codes = self.codes
        return codes.__contains__


class PullProcessor(ProcessorBase):
    """Pulls: topic checks, the tag filter, the store read, the hold."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self._filters: dict[str, TagFilter] = {}
        # PULLs found empty inline, now being held (the request is kept so its id cannot be reused)
        self._checked: dict[int, tuple[RemotingCommand, RemotingCommand]] = {}
        self.slave_read_behind_bytes = _physical_ram() * self.config.accessMessageInMemoryMaxRatio // 100

    def handlers(self) -> dict[int, Handler]:
        return {RequestCode.PULL_MESSAGE: self.pull_message}

    # --- PULL_MESSAGE (11) --------------------------------------------------------------------------------
    def _filter(
        self, req: RemotingCommand, group: str, topic: str, sys_flag: int
    ) -> Callable[[int], bool] | None:
        if sys_flag & PULL_FLAG_SUBSCRIPTION:
            expr = req.ext_str("subscription", "*") or "*"
        else:
            g = self.services.consumers.groups.get(group)
            sub = g.subscriptions.get(topic) if g else None
            expr = str(sub.get("subString", "*")) if sub else "*"
        f = self._filters.get(expr)
        if f is None:
            if len(self._filters) > 10_000:
                self._filters.clear()
            f = self._filters[expr] = TagFilter(expr)
        return f.predicate()

    def _filters_for(
        self, req: RemotingCommand, group: str, topic: str, sys_flag: int, header_type: str
    ) -> tuple[Callable[[int], bool] | None, Callable[[bytes], bool] | None] | RemotingCommand:
        """With enablePropertyFilter: (tag filter, record filter) for the subscription RocketMQ's
        PullMessageProcessor takes (the request's own with the subscription flag, else the group's
        registered one), or the refusal it answers. TAG subscriptions go the tag path unchanged."""
        sub = None
        if sys_flag & PULL_FLAG_SUBSCRIPTION:
            expr_type = header_type
        else:
            g = self.services.consumers.groups.get(group)
            sub = g.subscriptions.get(topic) if g else None
            if sub is None:
                if header_type.upper() == "TAG":
                    return self._filter(req, group, topic, sys_flag), None
                return req.response(ResponseCode.SUBSCRIPTION_NOT_EXIST,
                                    remark="the consumer's subscription not exist")
            expr_type = str(sub.get("expressionType") or "TAG")
        if expr_type.upper() == "TAG":
            return self._filter(req, group, topic, sys_flag), None
        expr = (req.ext_str("subscription", "") if sub is None else str(sub.get("subString") or "")) or ""
        from chronomq.filter.records import record_filter  # loaded by the first SQL92 subscription
        from chronomq.filter.sql92 import FilterSyntaxError, compile_sql92

        try:
            if expr_type != "SQL92":
                raise ValueError(f"the broker cannot filter message by {expr_type}")
            selector = compile_sql92(expr)
        except (FilterSyntaxError, ValueError) as e:
            if sub is None:  # RocketMQ: the request's subscription does not compile
                return req.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                                    remark=f"parse the consumer's subscription failed: {e}")
            # RocketMQ registers no filter data for a heartbeat's expression that does not compile
            return req.response(ResponseCode.FILTER_DATA_NOT_EXIST, remark="The broker's consumer filter "
                                f"data is not exist!Your expression may be wrong! ({e})")
        if sub is not None and _int(sub.get("subVersion")) < req.ext_int("subVersion", 0):
            return req.response(ResponseCode.FILTER_DATA_NOT_LATEST,
                                remark="the consumer's consumer filter data not latest")
        return None, record_filter(selector)

    def _pull_once(self, req: RemotingCommand) -> tuple[RemotingCommand, bool]:
        """One attempt. Returns (response, may_hold): may_hold when the answer is PULL_NOT_FOUND."""
        group = req.require_str("consumerGroup")
        topic = req.require_str("topic")
        queue_id = req.ext_int("queueId")
        offset = req.ext_int("queueOffset")
        # RocketMQ's caps on one answer, whatever maxMsgNums asks: clients pull again from nextBeginOffset
        if req.ext_str(PULL_EXT_BULK_READ, "") == "true":
            cap_count = self.config.maxTransferCountOnBulkRead
            cap_bytes = self.config.maxTransferBytesOnBulkRead
        else:
            cap_count = self.config.maxTransferCountOnMessageInMemory
            cap_bytes = self.config.maxTransferBytesOnMessageInMemory
        max_msgs = max(1, min(req.ext_int("maxMsgNums", 32), cap_count))
        sys_flag = req.ext_int("sysFlag", 0)
        topic_config = self.topics.get(topic)
        if topic_config is not None:
            if not topic_config.perm & PERM_READ:
                return req.response(
                    ResponseCode.NO_PERMISSION, remark=f"the topic[{topic}] pulling is forbidden"
                ), False
            if queue_id < 0 or queue_id >= max(topic_config.readQueueNums, topic_config.writeQueueNums):
                return req.response(
                    ResponseCode.SYSTEM_ERROR,
                    remark=f"queueId[{queue_id}] is illegal, topic {topic} has "
                    f"{topic_config.readQueueNums} read queues",
                ), False
        expr_type = req.ext_str("expressionType", "TAG") or "TAG"
        records: Callable[[bytes], bool] | None = None
        if self.config.enablePropertyFilter:
            chosen = self._filters_for(req, group, topic, sys_flag, expr_type)
            if isinstance(chosen, RemotingCommand):
                return chosen, False
            tag_filter, records = chosen
        elif expr_type.upper() != "TAG":  # RocketMQ's answer with enablePropertyFilter=false
            return req.response(ResponseCode.SYSTEM_ERROR, remark=no_filter_remark(expr_type)), False
        else:
            tag_filter = self._filter(req, group, topic, sys_flag)
        r: GetResult = self.store.get_message(
            topic, queue_id, offset, max_msgs, max_bytes=cap_bytes,
            tag_filter=tag_filter,
            record_filter=records,
        )
        st = r.status
        body = b""
        nxt = r.next_begin_offset
        if st is GetStatus.FOUND and r.messages:
            code, remark = ResponseCode.SUCCESS, "FOUND"
            marks = props_marks(r.messages, _MARKS)  # searched in the properties, not the bodies
            if marks & 1:  # level re-puts among them: their internal marker is not for clients
                r.messages = hide_delay_sources(r.messages)
            body = b"".join(r.messages)
            traffic = self.services.traffic
            traffic.consume(topic, group, len(r.messages), len(body))
            if marks & 2:  # timed messages among them: how late they reach a consumer
                lates: dict[int, int] = {}
                count_lateness(r.messages, self.clock.now_ms(), lates)
                record = traffic.pull_lateness.record
                for late, n in lates.items():  # an answer shares few distinct values
                    record(late, n)
        elif st in (GetStatus.FOUND, GetStatus.NO_MATCHED_MESSAGE, GetStatus.MESSAGE_WAS_REMOVING):
            code, remark = ResponseCode.PULL_RETRY_IMMEDIATELY, st.value
        elif st in (GetStatus.OFFSET_OVERFLOW_ONE, GetStatus.OFFSET_FOUND_NULL):
            code, remark = ResponseCode.PULL_NOT_FOUND, st.value
        elif st in (GetStatus.NO_MATCHED_LOGIC_QUEUE, GetStatus.NO_MESSAGE_IN_QUEUE):
            if offset != 0:
                code, remark = ResponseCode.PULL_OFFSET_MOVED, st.value
            else:
                code, remark = ResponseCode.PULL_NOT_FOUND, st.value
        else:  # OFFSET_OVERFLOW_BADLY, OFFSET_TOO_SMALL
            code, remark = ResponseCode.PULL_OFFSET_MOVED, st.value
        if code == ResponseCode.PULL_OFFSET_MOVED:
            # docs/protocol.md#pull: beyond the end -> maxOffset, below the start -> minOffset
            beyond = offset > r.max_offset or st is GetStatus.NO_MESSAGE_IN_QUEUE
            nxt = r.max_offset if beyond else r.min_offset
        ext = {
            "nextBeginOffset": str(nxt),
            "minOffset": str(r.min_offset),
            "maxOffset": str(r.max_offset),
            "suggestWhichBrokerId": str(self._suggest(r.messages[-1] if body else None)),
        }
        return req.response(
            code, ext_fields=ext, body=body, remark=remark
        ), code == ResponseCode.PULL_NOT_FOUND

    def _suggest(self, last_record: bytes | None) -> int:
        """suggestWhichBrokerId: 0 (the master) unless slaveReadEnable. Then RocketMQ's rule: 1 (the
        slave) when the consumer's position (the last record of this answer) is more than
        accessMessageInMemoryMaxRatio % of the machine's RAM behind the commit log's end, so its reads
        would come from disk rather than the page cache; on a slave the same rule keeps a far-behind
        consumer there and sends the others back. An answer with no message keeps the consumer where it
        is."""
        if not self.config.slaveReadEnable:
            return 0
        if last_record is None:
            return self.config.brokerId
        (phys,) = _I64.unpack_from(last_record, POS_PHYSICALOFFSET)
        return 1 if self.store.max_phy_offset - phys > self.slave_read_behind_bytes else 0

    def _pull_commit(self, req: RemotingCommand) -> None:
        if req.ext_int("sysFlag", 0) & PULL_FLAG_COMMIT_OFFSET:
            commit = req.ext_int("commitOffset", -1)
            if commit >= 0:
                self.services.offsets.commit(
                    req.require_str("consumerGroup"), req.require_str("topic"), req.ext_int("queueId"), commit
                )

    def pull_message(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        resp, may_hold = self._pull_once(req)
        if may_hold and req.ext_int("sysFlag", 0) & PULL_FLAG_SUSPEND and self.config.longPollingEnable:
            if len(self._checked) > 10_000:  # entries of tasks cancelled before they ran; harmless to drop
                self._checked.clear()
            self._checked[id(req)] = (req, resp)  # the held path starts by waiting
            return None  # hold it: handle() -> pull_message_held
        self._pull_commit(req)
        return resp

    async def pull_message_held(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        self._pull_commit(req)
        topic = req.require_str("topic")
        queue_id = req.ext_int("queueId")
        offset = req.ext_int("queueOffset")
        suspend = min(max(0, req.ext_int("suspendTimeoutMillis", 15_000)), MAX_SUSPEND_MS)
        deadline = self.clock.now_ms() + suspend
        hold = self.services.hold
        entry = self._checked.pop(id(req), None)
        first = entry[1] if entry is not None and entry[0] is req else None
        while True:
            if first is not None:
                resp, may_hold, first = first, True, None
            else:
                resp, may_hold = self._pull_once(req)
            if not may_hold or self.services.stopping or self.clock.now_ms() >= deadline:
                return resp
            arrived = await hold.wait(
                topic, queue_id, offset, deadline, lambda: self.store.get_max_offset_in_queue(topic, queue_id)
            )
            if not arrived:
                resp, _ = self._pull_once(req)
                return resp
