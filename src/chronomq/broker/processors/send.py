"""SEND_MESSAGE (10), SEND_MESSAGE_V2 (310), SEND_BATCH_MESSAGE (320) and CONSUMER_SEND_MSG_BACK (36):
the way in for produced and sent-back messages (RocketMQ's SendMessageProcessor).

Rules: a sent message goes through ``services.delay.admit`` / ``admit_batch`` (timed ones are parked by
``TimerProcessor.schedule``), everything else into the store; a plain batch (no item that admission, the
timer or the stamps act on: ``PLAIN_ONLY``) goes from its body to the store's records in one pass
(``MessageStore.encode_batch``), which admission would pass unchanged; under SYNC_FLUSH the answer is
DEFERRED and written from the flush future's callback through the event loop, which never waits on fsync.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import struct
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from chronomq.config import SYNC_MASTER
from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE
from chronomq.delay.timer.props import TIMER_PROPERTIES
from chronomq.ha import SlaveWait
from chronomq.message import (
    DLQ_GROUP_TOPIC_PREFIX,
    POS_BODYLENGTH,
    PROPERTY_CLUSTER,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_MSG_REGION,
    PROPERTY_TRACE_SWITCH,
    PROPERTY_WAIT_STORE_MSG_OK,
    RETRY_GROUP_TOPIC_PREFIX,
    SCHEDULE_TOPIC,
    SYSFLAG_COMPRESSED,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    SYSFLAG_TRANSACTION_ROLLBACK_TYPE,
    MessageExt,
    MessageFormatError,
    decode_properties,
    transaction_type,
    validate_topic,
)
from chronomq.remoting.codec import RemotingCommand, batch_items
from chronomq.remoting.codes import PERM_WRITE, SEND_V2_FIELDS, RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import PutResult, PutStatus

from ..dedup import LEVEL, NOW, Original
from ..topics import TopicError
from ..transaction import is_half_send, is_transactional
from .base import (
    Handler,
    ProcessorBase,
    RequestConnection,
    not_available_remark,
    send_result_fields,
    stamped_properties,
)

if TYPE_CHECKING:
    from chronomq.store.put import EncodedBatch

    from ..services import BrokerServices
    from ..timer_processor import TimerProcessor

log = logging.getLogger("chronomq.broker")

# RocketMQ's store answers SERVICE_NOT_AVAILABLE to a put on a slave
SLAVE_REFUSES = "this broker is a slave (brokerRole=SLAVE): it takes messages only from its master"

_PUT_CODES = {
    PutStatus.PUT_OK: ResponseCode.SUCCESS,
    PutStatus.FLUSH_DISK_TIMEOUT: ResponseCode.FLUSH_DISK_TIMEOUT,
    PutStatus.MESSAGE_ILLEGAL: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.PROPERTIES_SIZE_EXCEEDED: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.SERVICE_NOT_AVAILABLE: ResponseCode.SERVICE_NOT_AVAILABLE,
    PutStatus.OS_PAGECACHE_BUSY: ResponseCode.SYSTEM_BUSY,
    PutStatus.UNKNOWN_ERROR: ResponseCode.SYSTEM_ERROR,
}


def _inflate(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit)
    except zlib.error as e:
        raise ValueError(str(e)) from None
    if d.unconsumed_tail:
        raise ValueError(f"inflates to more than {limit} bytes")
    return out


def with_v1_fields(req: RemotingCommand) -> RemotingCommand:
    """A SEND_MESSAGE_V2 / batch request with its short header names (a, b, ...) spelled out."""
    return RemotingCommand(
        code=req.code,
        ext_fields={SEND_V2_FIELDS.get(k, k): v for k, v in req.ext_fields.items()},
        body=req.body,
        opaque=req.opaque,
        flag=req.flag,
        language=req.language,
        version=req.version,
        serialize_type=req.serialize_type,
    )

# the compiled split when it is built (chronomq.store.speedups chooses); codec.batch_items is its twin,
# registered here since remoting/ may not import store/
pure_twin("batch_items")(batch_items)
_batch_items = kernels.batch_items


# What admission, the timer and the stamps act on in a batch item's properties: an item with one of these
# goes the general way (decoded, admitted, stamped), one without is stored as it came plus the stamps.
PLAIN_ONLY = tuple(name.encode() for name in (
    PROPERTY_DELAY_TIME_LEVEL, *TIMER_PROPERTIES, PROPERTY_DELAY_SOURCE,
    PROPERTY_CLUSTER, PROPERTY_MSG_REGION, PROPERTY_TRACE_SWITCH))
_BODY_LEN = struct.Struct(">i")


def takes_encoded(store: object) -> bool:
    """The store encodes and puts a batch body itself (MessageStore.encode_batch / put_encoded), and its
    put_messages is its class's own (not replaced on the instance, as a test's recorder does)."""
    return hasattr(type(store), "encode_batch") and "put_messages" not in getattr(store, "__dict__", ())


class SendTarget(NamedTuple):
    """Where a SEND goes and the header fields its messages share."""

    topic: str
    queue_id: int
    properties: dict[str, str]
    flag: int
    sys_flag: int
    born_timestamp: int
    reconsume_times: int

    def message(self, conn: RequestConnection, store_host: tuple[str, int], props: dict[str, str],
                body: bytes, flag: int, sys_flag: int) -> MessageExt:
        return MessageExt(
            topic=self.topic,
            body=body,
            properties=props,
            flag=flag,
            queue_id=self.queue_id,
            sys_flag=sys_flag,
            born_timestamp=self.born_timestamp,
            born_host=conn.remote,
            store_host=store_host,
            reconsume_times=self.reconsume_times,
        )


class SendProcessor(ProcessorBase):
    """Sends and send-backs: admission, the put, the (possibly deferred) answer. What the delay service
    finds timed goes to ``timers`` (the timer codes' processor, which parks it)."""

    def __init__(self, services: BrokerServices, timers: TimerProcessor) -> None:
        super().__init__(services)
        self.timers = timers
        self._valid_topics: set[str] = set()
        self._posted: list[Callable[[], None]] = []
        self._posted_lock = threading.Lock()
        self._slave_waits: set[asyncio.Future[None]] = set()
        # CLUSTER, MSG_REGION, TRACE_ON: written into every sent message, as RocketMQ's broker does
        self.stamps = stamped_properties(self.config)
        self.region = self.config.regionId
        self.trace_on = self.stamps["TRACE_ON"]
        # the stamps as a batch item's properties text ends with them (encode_batch); None when a stamp
        # would not be a plain property (then every batch goes the general way, which refuses it)
        text = "".join(f"{k}\x01{v}\x02" for k, v in self.stamps.items())
        clean = all(k and not {"\x01", "\x02"} & set(k + v) for k, v in self.stamps.items())
        self.stamps_b = text.encode() if clean else b""

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.SEND_MESSAGE: self.send_message,
            RequestCode.SEND_MESSAGE_V2: self.send_message,
            RequestCode.SEND_BATCH_MESSAGE: self.send_message,
            RequestCode.CONSUMER_SEND_MSG_BACK: self.consumer_send_msg_back,
        }

    # --- SEND_MESSAGE (10), SEND_MESSAGE_V2 (310), SEND_BATCH_MESSAGE (320) ---------------------------------
    def send_message(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if self.config.is_slave:
            return req.response(ResponseCode.SERVICE_NOT_AVAILABLE, remark=SLAVE_REFUSES)
        if req.code != RequestCode.SEND_MESSAGE:
            req = with_v1_fields(req)
        batch = req.code == RequestCode.SEND_BATCH_MESSAGE or req.ext_bool("batch")
        target = self.send_target(req, batch)
        if isinstance(target, RemotingCommand):
            return target
        props = target.properties
        if is_half_send(props, target.sys_flag):  # stored as it is, never parked
            half = self.services.transactions.half(
                target.message(conn, self.services.store_host, props, req.body, target.flag, target.sys_flag))
            result = self.store.put_message(half)
            self.services.put_stats.record(result)
            if result.ok:
                self.services.traffic.produce(target.topic, "Transaction", 1, len(req.body))
            return self._put_response(req, conn, result, True, target.queue_id)
        if batch and self.stamps_b and not target.sys_flag & SYSFLAG_COMPRESSED \
                and not target.topic.startswith(RETRY_GROUP_TOPIC_PREFIX) and takes_encoded(self.store):
            encoded = self.store.encode_batch(target.topic, target.queue_id, req.body, target.sys_flag,
                                              target.born_timestamp, conn.remote, target.reconsume_times,
                                              self.stamps_b, PLAIN_ONLY)
            if encoded is not None:
                return self._put_encoded(req, conn, target, encoded)
        if batch:
            msgs = self._batch_messages(req, conn, target)
            if isinstance(msgs, RemotingCommand):
                return msgs
            admitted = self.delay.admit_batch(msgs)
        else:
            admitted = self.delay.admit(target.message(conn, self.services.store_host, props, req.body,
                                                       target.flag, target.sys_flag))
        if admitted.refused is not None:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=admitted.refused)
        if admitted.timed:
            return self.timers.schedule(req, conn, admitted.timed)
        put = admitted.put
        dedup = self.services.dedup
        plan = None if dedup is None else \
            dedup.plan(put, target.topic, LEVEL if put[0].topic == SCHEDULE_TOPIC else NOW)
        if plan is not None:
            put = plan.keep(put)
            if not put:
                return self._replayed(req, plan.settle([]))
        if batch:
            result = self.store.put_messages(put)
            wait = True
        else:
            result = self.store.put_message(put[0])
            wait = props.get(PROPERTY_WAIT_STORE_MSG_OK, "true") != "false"
        self.services.put_stats.record(result)
        if plan is not None and result.ok and result.append is not None:
            a = result.append
            stored = [Original(mid, put[0].queue_id, a.queue_offset + i)
                      for i, mid in enumerate(a.msg_id.split(","))]
            a.msg_id = ",".join(o.offset_msg_id for o in plan.settle(stored))
        if result.ok:
            kind = "Delay" if put[0].topic == SCHEDULE_TOPIC else "Normal"
            self.services.traffic.produce(target.topic, kind, len(put), sum(len(msg.body) for msg in put))
        return self._put_response(req, conn, result, wait, target.queue_id)

    def _replayed(self, req: RemotingCommand, originals: list[Original]) -> RemotingCommand:
        """A send whose every message was stored before: answered as the first time was."""
        return req.response(ext_fields=send_result_fields(
            ",".join(o.offset_msg_id for o in originals), originals[0].queue_id, originals[0].queue_offset,
            self.region, self.trace_on))

    def _put_encoded(self, req: RemotingCommand, conn: RequestConnection, target: SendTarget,
                     encoded: EncodedBatch) -> RemotingCommand:
        """A plain batch (no item with a deliver time, a level or a stamp of its own: what admission
        passes as it is) encoded in one pass by the store: de-duplicated, put, answered as
        ``send_message`` answers the same batch decoded into messages."""
        entries, asks, body_bytes = encoded
        topic, qid = target.topic, target.queue_id
        dedup = self.services.dedup
        plan = None if dedup is None or asks is None else dedup.plan_uniqs(topic, asks, NOW)
        if plan is not None:
            n = len(entries)
            entries = plan.keep(entries)
            if not entries:
                return self._replayed(req, plan.settle([]))
            if len(entries) != n:
                body_bytes = sum(_BODY_LEN.unpack_from(e.record, POS_BODYLENGTH)[0] for e in entries)
        result = self.store.put_encoded(topic, qid, entries)
        self.services.put_stats.record(result)
        if result.ok and result.append is not None:
            if plan is not None:
                a = result.append
                a.msg_id = plan.settle_text(a.msg_id, a.msg_count, qid, a.queue_offset)
            self.services.traffic.produce(topic, "Normal", len(entries), body_bytes)
        return self._put_response(req, conn, result, True, qid)

    def send_target(self, req: RemotingCommand, batch: bool, stamps: dict[str, str] | None = None
                    ) -> SendTarget | RemotingCommand:
        """The topic and queue a SEND goes to (a retry topic resent too often: its DLQ) and the
        message's properties (stamped with ``stamps``, by default CLUSTER, MSG_REGION and TRACE_ON), or
        the refusal. The level service's internal marker is never taken from a client."""
        topic = req.require_str("topic")
        if topic not in self._valid_topics:
            reason = validate_topic(topic)
            if reason:
                return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=reason)
            if len(self._valid_topics) < 100_000:
                self._valid_topics.add(topic)
        if topic == SCHEDULE_TOPIC:
            return req.response(
                ResponseCode.NO_PERMISSION, remark=f"sending to the system topic {topic} is not allowed"
            )
        queue_id = req.ext_int("queueId", -1)
        sys_flag = req.ext_int("sysFlag", 0)
        flag = req.ext_int("flag", 0)
        born_ts = req.ext_int("bornTimestamp", 0) or self.clock.now_ms()
        reconsume = req.ext_int("reconsumeTimes", 0)
        try:
            props = decode_properties(req.ext_str("properties", "") or "")
        except Exception:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark="the properties field cannot be decoded")
        # only the level service writes this marker (its crash recovery trusts it): a client's is dropped
        # here, where sends, replies and half messages all pass
        props.pop(PROPERTY_DELAY_SOURCE, None)
        try:
            topic_config = self.topics.create_in_send(
                topic, req.ext_str("defaultTopic"), req.ext_int("defaultTopicQueueNums", 0)
            )
        except TopicError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        if topic_config is None:
            return req.response(
                ResponseCode.TOPIC_NOT_EXIST, remark=f"topic[{topic}] not exist, apply first please!"
            )
        if not topic_config.perm & PERM_WRITE:
            return req.response(ResponseCode.NO_PERMISSION, remark=f"the topic[{topic}] sending is forbidden")
        nqueues = max(topic_config.writeQueueNums, topic_config.readQueueNums)
        if queue_id < 0:
            queue_id = random.randrange(max(1, topic_config.writeQueueNums))
        elif queue_id >= nqueues:
            return req.response(
                ResponseCode.SYSTEM_ERROR,
                remark=f"request queueId[{queue_id}] is illegal, topic {topic} has {nqueues} queues",
            )
        tx_bits = transaction_type(sys_flag)
        if tx_bits in (SYSFLAG_TRANSACTION_PREPARED_TYPE, SYSFLAG_TRANSACTION_ROLLBACK_TYPE) \
                and not is_transactional(props):
            # RocketMQ would store it and never index it: invisible for good
            return req.response(ResponseCode.MESSAGE_ILLEGAL,
                                remark="a prepared or rolled-back transactional message must carry the "
                                "property TRAN_MSG=true and END_TRANSACTION decides it")
        if is_half_send(props, sys_flag):
            if self.config.rejectTransactionMessage:
                return req.response(ResponseCode.NO_PERMISSION, remark=f"the broker[{self.config.brokerIP1}] "
                                    "sending transaction message is forbidden")
            if batch:
                return req.response(ResponseCode.MESSAGE_ILLEGAL,
                                    remark="a transactional message cannot be sent in a batch")
        # a producer resending to a retry topic too often: dead letter at once (Java handleRetryAndDLQ,
        # which sets the delay level to 0: the retry level the consumer asked for must not park it)
        if topic.startswith(RETRY_GROUP_TOPIC_PREFIX) and not batch and reconsume >= self._max_reconsume(
                req, props):
            topic = DLQ_GROUP_TOPIC_PREFIX + topic[len(RETRY_GROUP_TOPIC_PREFIX) :]
            self.topics.create_system(topic, 1)
            queue_id = 0
            props[PROPERTY_DELAY_TIME_LEVEL] = "0"
        if not batch:  # a batch's items are stamped one by one (_batch_messages)
            props.update(self.stamps if stamps is None else stamps)
        return SendTarget(topic, queue_id, props, flag, sys_flag, born_ts, reconsume)

    def _batch_messages(self, req: RemotingCommand, conn: RequestConnection, target: SendTarget
                        ) -> list[MessageExt] | RemotingCommand:
        """The items of a SEND_BATCH_MESSAGE body, or the refusal."""
        if target.topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
            return req.response(
                ResponseCode.MESSAGE_ILLEGAL, remark="batch messages to a retry topic are not supported"
            )
        body = req.body
        sys_flag = target.sys_flag
        if sys_flag & SYSFLAG_COMPRESSED:
            # the C++ client deflates a whole batch body over 4 KiB; items are stored uncompressed
            try:
                body = _inflate(body, self.config.maxMessageSize * 4)
            except ValueError as e:
                return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=f"bad compressed batch: {e}")
            sys_flag &= ~SYSFLAG_COMPRESSED
        try:
            items = _batch_items(body)
        except MessageFormatError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=f"bad batch body: {e}")
        if not items:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark="empty batch")
        host = self.services.store_host
        stamps = self.stamps
        msgs = []
        for item_body, props, flag in items:
            props.update(stamps)  # RocketMQ appends its batch properties (CLUSTER, ...) to every item
            msgs.append(target.message(conn, host, props, item_body, flag, sys_flag))
        return msgs

    def _max_reconsume(self, req: RemotingCommand, props: dict[str, str]) -> int:
        v = req.ext_str("maxReconsumeTimes")
        if v is None:
            v = props.get(PROPERTY_MAX_RECONSUME_TIMES)
        try:
            return int(v) if v not in (None, "") else self.config.maxReconsumeTimes
        except ValueError:
            return self.config.maxReconsumeTimes

    def _put_response(
        self, req: RemotingCommand, conn: RequestConnection, result: PutResult, wait: bool, queue_id: int
    ) -> RemotingCommand:
        code: int = _PUT_CODES.get(result.status, ResponseCode.SYSTEM_ERROR)
        if result.append is None or code not in (ResponseCode.SUCCESS, ResponseCode.FLUSH_DISK_TIMEOUT):
            if code == ResponseCode.SERVICE_NOT_AVAILABLE:
                return req.response(code, remark=not_available_remark(self.store, result.error))
            return req.response(
                code if code != ResponseCode.SUCCESS else ResponseCode.SYSTEM_ERROR,
                remark=result.error or result.status.value,
            )
        a = result.append
        ext = send_result_fields(a.msg_id, queue_id, a.queue_offset, self.region, self.trace_on)
        fut = result.flushed
        ha = self.services.ha
        if ha is not None and wait and self.config.brokerRole == SYNC_MASTER:
            end = a.wrote_offset + a.wrote_bytes
            if ha.push_to_slave_max < end or (fut is not None and not fut.done()):
                task = asyncio.ensure_future(self._reply_after_slave(req, conn, code, ext, fut, end))
                self._slave_waits.add(task)
                task.add_done_callback(self._slave_waits.discard)
                return DEFERRED
            if fut is not None:
                code = self._flush_code(fut, code)
            return req.response(code, ext_fields=ext)
        if fut is None or not wait:
            return req.response(code, ext_fields=ext)
        if fut.done():
            return req.response(self._flush_code(fut, code), ext_fields=ext)

        def flushed(f: concurrent.futures.Future[bool]) -> None:  # runs in the store's flush thread
            self._post(lambda: conn.reply(req, req.response(self._flush_code(f, code), ext_fields=ext)))

        fut.add_done_callback(flushed)
        return DEFERRED

    async def _reply_after_slave(self, req: RemotingCommand, conn: RequestConnection, code: int,
                                 ext: dict[str, str], fut: concurrent.futures.Future[bool] | None,
                                 end: int) -> None:
        """SYNC_MASTER: answer once the disk (SYNC_FLUSH) and then a slave hold the message, as RocketMQ
        does: FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT or SLAVE_NOT_AVAILABLE when they do not."""
        if fut is not None:
            await asyncio.wrap_future(fut)
            code = self._flush_code(fut, code)
        ha = self.services.ha
        assert ha is not None
        waited = await ha.wait_slave(end, self.config.syncFlushTimeout)
        if waited == SlaveWait.TIMEOUT:
            code = ResponseCode.FLUSH_SLAVE_TIMEOUT
        elif waited == SlaveWait.NO_SLAVE:
            code = ResponseCode.SLAVE_NOT_AVAILABLE
        conn.reply(req, req.response(code, ext_fields=ext))

    def _post(self, fn: Callable[[], None]) -> None:
        """Run fn on the event loop; from other threads, many posts share one loop wake-up."""
        with self._posted_lock:
            self._posted.append(fn)
            if len(self._posted) > 1:
                return
        loop = self.services.loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._run_posted)
        except RuntimeError:
            pass  # loop closed at shutdown: the clients time out and retry

    def _run_posted(self) -> None:
        with self._posted_lock:
            todo, self._posted = self._posted, []
        for fn in todo:
            try:
                fn()
            except Exception:
                log.exception("deferred reply failed")

    @staticmethod
    def _flush_code(f: concurrent.futures.Future[bool], code: int) -> int:
        try:
            ok = f.result()
        except Exception:
            ok = False
        return code if ok else ResponseCode.FLUSH_DISK_TIMEOUT

    # --- CONSUMER_SEND_MSG_BACK (36) ---------------------------------------------------------------------
    def consumer_send_msg_back(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if self.config.is_slave:
            return req.response(ResponseCode.SERVICE_NOT_AVAILABLE, remark=SLAVE_REFUSES)
        group = req.require_str("group")
        offset = req.ext_int("offset")
        delay_level = req.ext_int("delayLevel", 0)
        old = self.store.look_message_by_offset(offset)
        if old is None:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"look message by offset failed, {offset}")
        max_times = self._max_reconsume(req, old.properties)
        self.topics.create_system(RETRY_GROUP_TOPIC_PREFIX + group, 1)
        new = self.delay.build_send_back(old, group, delay_level, max_times)
        if new.topic.startswith(DLQ_GROUP_TOPIC_PREFIX):
            self.topics.create_system(new.topic, 1)
            log.info(
                "message at %d of group %s moved to %s after %d reconsumes",
                offset,
                group,
                new.topic,
                old.reconsume_times,
            )
        new.store_host = self.services.store_host
        self.delay.prepare_put(new)
        result = self.store.put_message(new)
        resp = self._put_response(req, conn, result, True, new.queue_id)
        if resp is DEFERRED:
            return resp
        if resp.code in (ResponseCode.SUCCESS, ResponseCode.FLUSH_DISK_TIMEOUT):
            return req.response()
        return resp
