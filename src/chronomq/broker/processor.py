"""Request processors of the broker (protocol.md section 2).

Most requests are answered inline (``handle_sync``: no task, no await). Two need to wait:
- a PULL with the suspend flag and nothing to return: ``handle_sync`` returns None and the async
  ``handle`` holds it (long polling);
- a SEND under SYNC_FLUSH: the put returns a flush future; the response is written from that future's
  callback (``DEFERRED``), so the event loop never blocks on fsync.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import random
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from chronomq.message import (
    DLQ_GROUP_TOPIC_PREFIX,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_TRANSACTION_PREPARED,
    PROPERTY_WAIT_STORE_MSG_OK,
    RETRY_GROUP_TOPIC_PREFIX,
    SCHEDULE_TOPIC,
    SYSFLAG_COMPRESSED,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    MessageExt,
    MessageFormatError,
    decode_offset_msg_id,
    decode_properties,
    java_string_hash,
    transaction_type,
    validate_topic,
)
from chronomq.remoting.codec import HeaderError, RemotingCommand, decode_batch_body
from chronomq.remoting.codes import (
    PERM_READ,
    PERM_WRITE,
    PULL_FLAG_COMMIT_OFFSET,
    PULL_FLAG_SUBSCRIPTION,
    PULL_FLAG_SUSPEND,
    SEND_V2_FIELDS,
    RequestCode,
    ResponseCode,
)
from chronomq.remoting.server import DEFERRED, Connection, UnsupportedCode
from chronomq.store.types import GetResult, GetStatus, PutResult, PutStatus

from .clients import ClientInfo, message_model_is_clustering
from .topics import TopicConfig, TopicError

if TYPE_CHECKING:
    from .services import BrokerServices
    from .timer_processor import TimerProcessor

log = logging.getLogger("chronomq.broker")

MAX_PULL_MSGS = 256
MAX_PULL_BYTES = 4 * 1024 * 1024
MAX_SUSPEND_MS = 60_000

_PUT_CODES = {
    PutStatus.PUT_OK: ResponseCode.SUCCESS,
    PutStatus.FLUSH_DISK_TIMEOUT: ResponseCode.FLUSH_DISK_TIMEOUT,
    PutStatus.MESSAGE_ILLEGAL: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.PROPERTIES_SIZE_EXCEEDED: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.SERVICE_NOT_AVAILABLE: ResponseCode.SERVICE_NOT_AVAILABLE,
    PutStatus.OS_PAGECACHE_BUSY: ResponseCode.SYSTEM_BUSY,
    PutStatus.UNKNOWN_ERROR: ResponseCode.SYSTEM_ERROR,
}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _inflate(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit)
    except zlib.error as e:
        raise ValueError(str(e)) from None
    if d.unconsumed_tail:
        raise ValueError(f"inflates to more than {limit} bytes")
    return out


def _parse_json_body(req: RemotingCommand, what: str) -> Any:
    try:
        return json.loads(req.body) if req.body else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise HeaderError(f"{what} body is not valid JSON: {e}") from None


def _with_v1_fields(req: RemotingCommand) -> RemotingCommand:
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


class _SendTarget(NamedTuple):
    """Where a SEND goes and the header fields its messages share."""

    topic: str
    queue_id: int
    properties: dict[str, str]
    flag: int
    sys_flag: int
    born_timestamp: int
    reconsume_times: int

    def message(self, conn: Connection, store_host: tuple[str, int], props: dict[str, str], body: bytes,
                flag: int, sys_flag: int) -> MessageExt:
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


class BrokerProcessor:
    """The 4.x request codes, answered from the broker's services; the timer codes and the parking of
    timed messages are ``timers``' (broker/timer_processor.py)."""

    def __init__(self, services: BrokerServices, timers: TimerProcessor) -> None:
        self.services = services
        self.store = services.store
        self.config = services.config
        self.clock = services.clock
        self.topics = services.topics
        self.delay = services.delay
        self.timers = timers
        self._filters: dict[str, TagFilter] = {}
        self._valid_topics: set[str] = set()
        # PULLs found empty inline, now being held (the request is kept so its id cannot be reused)
        self._checked: dict[int, tuple[RemotingCommand, RemotingCommand]] = {}
        self._posted: list[Callable[[], None]] = []
        self._posted_lock = threading.Lock()
        self._sync: dict[int, Callable[[RemotingCommand, Connection], RemotingCommand | None]] = {
            RequestCode.SEND_MESSAGE: self.send_message,
            RequestCode.SEND_MESSAGE_V2: self.send_message,
            RequestCode.SEND_BATCH_MESSAGE: self.send_message,
            RequestCode.PULL_MESSAGE: self.pull_message,
            RequestCode.HEART_BEAT: self.heart_beat,
            RequestCode.UNREGISTER_CLIENT: self.unregister_client,
            RequestCode.GET_CONSUMER_LIST_BY_GROUP: self.get_consumer_list,
            RequestCode.QUERY_CONSUMER_OFFSET: self.query_consumer_offset,
            RequestCode.UPDATE_CONSUMER_OFFSET: self.update_consumer_offset,
            RequestCode.GET_MAX_OFFSET: self.get_max_offset,
            RequestCode.GET_MIN_OFFSET: self.get_min_offset,
            RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: self.search_offset_by_timestamp,
            RequestCode.GET_EARLIEST_MSG_STORETIME: self.get_earliest_msg_storetime,
            RequestCode.VIEW_MESSAGE_BY_ID: self.view_message_by_id,
            RequestCode.QUERY_MESSAGE: self.query_message,
            RequestCode.LOCK_BATCH_MQ: self.lock_batch_mq,
            RequestCode.UNLOCK_BATCH_MQ: self.unlock_batch_mq,
            RequestCode.CONSUMER_SEND_MSG_BACK: self.consumer_send_msg_back,
            RequestCode.GET_ALL_TOPIC_CONFIG: self.get_all_topic_config,
            RequestCode.UPDATE_AND_CREATE_TOPIC: self.update_and_create_topic,
            RequestCode.DELETE_TOPIC_IN_BROKER: self.delete_topic,
            RequestCode.GET_BROKER_RUNTIME_INFO: self.get_runtime_info,
            RequestCode.GET_TOPIC_STATS_INFO: self.get_topic_stats,
            RequestCode.GET_ALL_CONSUMER_OFFSET: self.get_all_consumer_offset,
        }
        self._sync.update(timers.handlers())  # 9001-9004: broker/timer_processor.py

    # --- dispatch ------------------------------------------------------------------------------------------
    def handle_sync(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        fn = self._sync.get(req.code)
        if fn is None:
            raise UnsupportedCode(req.code)
        return fn(req, conn)

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == RequestCode.PULL_MESSAGE:
            return await self.pull_message_held(req, conn)
        return self.handle_sync(req, conn)

    # --- SEND_MESSAGE (10), SEND_MESSAGE_V2 (310), SEND_BATCH_MESSAGE (320) ---------------------------------
    def send_message(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code != RequestCode.SEND_MESSAGE:
            req = _with_v1_fields(req)
        batch = req.code == RequestCode.SEND_BATCH_MESSAGE or req.ext_bool("batch")
        target = self._send_target(req, batch)
        if isinstance(target, RemotingCommand):
            return target
        props = target.properties
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
        if batch:
            result = self.store.put_messages(admitted.put)
            wait = True
        else:
            result = self.store.put_message(admitted.put[0])
            wait = props.get(PROPERTY_WAIT_STORE_MSG_OK, "true") != "false"
        self.services.put_stats.record(result)
        return self._put_response(req, conn, result, wait, target.queue_id)

    def _send_target(self, req: RemotingCommand, batch: bool) -> _SendTarget | RemotingCommand:
        """The topic and queue a SEND goes to (a retry topic resent too often: its DLQ) and the
        message's properties, or the refusal."""
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
        try:
            tc = self.topics.create_in_send(
                topic, req.ext_str("defaultTopic"), req.ext_int("defaultTopicQueueNums", 0)
            )
        except TopicError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        if tc is None:
            return req.response(
                ResponseCode.TOPIC_NOT_EXIST, remark=f"topic[{topic}] not exist, apply first please!"
            )
        if not tc.perm & PERM_WRITE:
            return req.response(ResponseCode.NO_PERMISSION, remark=f"the topic[{topic}] sending is forbidden")
        nqueues = max(tc.writeQueueNums, tc.readQueueNums)
        if queue_id < 0:
            queue_id = random.randrange(max(1, tc.writeQueueNums))
        elif queue_id >= nqueues:
            return req.response(
                ResponseCode.SYSTEM_ERROR,
                remark=f"request queueId[{queue_id}] is illegal, topic {topic} has {nqueues} queues",
            )
        if (
            transaction_type(sys_flag) == SYSFLAG_TRANSACTION_PREPARED_TYPE
            or props.get(PROPERTY_TRANSACTION_PREPARED) == "true"
        ):
            return req.response(
                ResponseCode.NO_PERMISSION, remark="transactional messages are not supported by this broker"
            )
        # a producer resending to a retry topic too often: dead letter (Java handleRetryAndDLQ)
        if topic.startswith(RETRY_GROUP_TOPIC_PREFIX) and not batch and reconsume >= self._max_reconsume(
                req, props):
            topic = DLQ_GROUP_TOPIC_PREFIX + topic[len(RETRY_GROUP_TOPIC_PREFIX) :]
            self.topics.create_system(topic, 1)
            queue_id = 0
        return _SendTarget(topic, queue_id, props, flag, sys_flag, born_ts, reconsume)

    def _batch_messages(self, req: RemotingCommand, conn: Connection, target: _SendTarget
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
            items = decode_batch_body(body)
        except MessageFormatError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=f"bad batch body: {e}")
        if not items:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark="empty batch")
        host = self.services.store_host
        return [target.message(conn, host, it.properties, it.body, it.flag, sys_flag) for it in items]

    def _max_reconsume(self, req: RemotingCommand, props: dict[str, str]) -> int:
        v = req.ext_str("maxReconsumeTimes")
        if v is None:
            v = props.get(PROPERTY_MAX_RECONSUME_TIMES)
        try:
            return int(v) if v not in (None, "") else self.config.maxReconsumeTimes
        except ValueError:
            return self.config.maxReconsumeTimes

    def _put_response(
        self, req: RemotingCommand, conn: Connection, result: PutResult, wait: bool, queue_id: int
    ) -> RemotingCommand:
        code = _PUT_CODES.get(result.status, ResponseCode.SYSTEM_ERROR)
        if result.append is None or code not in (ResponseCode.SUCCESS, ResponseCode.FLUSH_DISK_TIMEOUT):
            return req.response(
                code if code != ResponseCode.SUCCESS else ResponseCode.SYSTEM_ERROR,
                remark=result.error or result.status.value,
            )
        a = result.append
        ext = {
            "msgId": a.msg_id,
            "queueId": str(queue_id),
            "queueOffset": str(a.queue_offset),
            "MSG_REGION": "DefaultRegion",
            "TRACE_ON": "true",
        }
        fut = result.flushed
        if fut is None or not wait:
            return req.response(code, ext_fields=ext)
        if fut.done():
            return req.response(self._flush_code(fut, code), ext_fields=ext)

        def flushed(f: concurrent.futures.Future[bool]) -> None:  # runs in the store's flush thread
            self._post(lambda: conn.reply(req, req.response(self._flush_code(f, code), ext_fields=ext)))

        fut.add_done_callback(flushed)
        return DEFERRED

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

    def _pull_once(self, req: RemotingCommand) -> tuple[RemotingCommand, bool]:
        """One attempt. Returns (response, may_hold): may_hold when the answer is PULL_NOT_FOUND."""
        group = req.require_str("consumerGroup")
        topic = req.require_str("topic")
        queue_id = req.ext_int("queueId")
        offset = req.ext_int("queueOffset")
        max_msgs = max(1, min(req.ext_int("maxMsgNums", 32), MAX_PULL_MSGS))
        sys_flag = req.ext_int("sysFlag", 0)
        tc = self.topics.get(topic)
        if tc is not None:
            if not tc.perm & PERM_READ:
                return req.response(
                    ResponseCode.NO_PERMISSION, remark=f"the topic[{topic}] pulling is forbidden"
                ), False
            if queue_id < 0 or queue_id >= max(tc.readQueueNums, tc.writeQueueNums):
                return req.response(
                    ResponseCode.SYSTEM_ERROR,
                    remark=f"queueId[{queue_id}] is illegal, topic {topic} has "
                    f"{tc.readQueueNums} read queues",
                ), False
        expr_type = req.ext_str("expressionType", "TAG") or "TAG"
        if expr_type.upper() != "TAG":
            return req.response(
                ResponseCode.SYSTEM_ERROR, remark=f"this broker filters by TAG only, not by {expr_type}"
            ), False
        tag_filter = self._filter(req, group, topic, sys_flag)
        r: GetResult = self.store.get_message(
            topic, queue_id, offset, max_msgs, max_bytes=MAX_PULL_BYTES, tag_filter=tag_filter
        )
        st = r.status
        body = b""
        nxt = r.next_begin_offset
        if st is GetStatus.FOUND and r.messages:
            code, remark = ResponseCode.SUCCESS, "FOUND"
            body = b"".join(r.messages)
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
            # protocol.md 2.3: beyond the end -> maxOffset, below the start -> minOffset
            beyond = offset > r.max_offset or st is GetStatus.NO_MESSAGE_IN_QUEUE
            nxt = r.max_offset if beyond else r.min_offset
        ext = {
            "nextBeginOffset": str(nxt),
            "minOffset": str(r.min_offset),
            "maxOffset": str(r.max_offset),
            "suggestWhichBrokerId": "0",
        }
        return req.response(
            code, ext_fields=ext, body=body, remark=remark
        ), code == ResponseCode.PULL_NOT_FOUND

    def _pull_commit(self, req: RemotingCommand) -> None:
        if req.ext_int("sysFlag", 0) & PULL_FLAG_COMMIT_OFFSET:
            commit = req.ext_int("commitOffset", -1)
            if commit >= 0:
                self.services.offsets.commit(
                    req.require_str("consumerGroup"), req.require_str("topic"), req.ext_int("queueId"), commit
                )

    def pull_message(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        resp, may_hold = self._pull_once(req)
        if may_hold and req.ext_int("sysFlag", 0) & PULL_FLAG_SUSPEND and self.config.longPollingEnable:
            if len(self._checked) > 10_000:  # entries of tasks cancelled before they ran; harmless to drop
                self._checked.clear()
            self._checked[id(req)] = (req, resp)  # the held path starts by waiting
            return None  # hold it: handle() -> pull_message_held
        self._pull_commit(req)
        return resp

    async def pull_message_held(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
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

    # --- clients -------------------------------------------------------------------------------------------
    def heart_beat(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        hb = _parse_json_body(req, "HEART_BEAT")
        if not isinstance(hb, dict):
            raise HeaderError("HEART_BEAT body is not a JSON object")
        client_id = str(hb.get("clientID") or "")
        if not client_id:
            raise HeaderError("HEART_BEAT body lacks clientID")
        now = self.clock.now_ms()
        for cd in hb.get("consumerDataSet") or []:
            if not isinstance(cd, dict) or not cd.get("groupName"):
                continue
            group = str(cd["groupName"])
            if message_model_is_clustering(cd.get("messageModel", 1)):
                self.topics.create_system(RETRY_GROUP_TOPIC_PREFIX + group, 1)
            info = ClientInfo(client_id, conn, now, req.language, req.version)
            if self.services.consumers.register(group, info, cd):
                log.info("consumer %s joined group %s", client_id, group)
                self.services.notify_consumer_ids_changed(group)
        for pd in hb.get("producerDataSet") or []:
            if isinstance(pd, dict) and pd.get("groupName"):
                self.services.producers.register(
                    str(pd["groupName"]), ClientInfo(client_id, conn, now, req.language, req.version)
                )
        return req.response()

    def unregister_client(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        client_id = req.require_str("clientID")
        pg = req.ext_str("producerGroup", "") or ""
        cg = req.ext_str("consumerGroup", "") or ""
        if pg:
            self.services.producers.unregister(pg, client_id)
        if cg and self.services.consumers.unregister(cg, client_id):
            log.info("consumer %s left group %s", client_id, cg)
            self.services.notify_consumer_ids_changed(cg)
        return req.response()

    def get_consumer_list(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        ids = self.services.consumers.client_ids(group)
        if not ids:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"no consumer for this group, {group}")
        return req.response(body=_json({"consumerIdList": ids}))

    # --- offsets -------------------------------------------------------------------------------------------
    def query_consumer_offset(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        topic = req.require_str("topic")
        qid = req.ext_int("queueId")
        off = self.services.offsets.query(group, topic, qid)
        if off >= 0:
            return req.response(ext_fields={"offset": str(off)})
        if self.store.get_min_offset_in_queue(topic, qid) <= 0:
            return req.response(ext_fields={"offset": "0"})
        return req.response(
            ResponseCode.QUERY_NOT_FOUND,
            remark="Not found, V3_0_6_SNAPSHOT maybe this group consumer boot first",
        )

    def update_consumer_offset(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        self.services.offsets.commit(
            req.require_str("consumerGroup"),
            req.require_str("topic"),
            req.ext_int("queueId"),
            req.ext_int("commitOffset"),
        )
        return req.response()

    def get_max_offset(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        off = self.store.get_max_offset_in_queue(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"offset": str(off)})

    def get_min_offset(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        off = self.store.get_min_offset_in_queue(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"offset": str(off)})

    def search_offset_by_timestamp(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        off = self.store.get_offset_in_queue_by_time(
            req.require_str("topic"), req.ext_int("queueId"), req.ext_int("timestamp")
        )
        return req.response(ext_fields={"offset": str(off)})

    def get_earliest_msg_storetime(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        ts = self.store.get_earliest_message_time(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"timestamp": str(ts)})

    def get_all_consumer_offset(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        table = {k: {str(q): o for q, o in v.items()} for k, v in self.services.offsets.table.items()}
        return req.response(body=_json({"offsetTable": table}))

    # --- lookups -------------------------------------------------------------------------------------------
    def view_message_by_id(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        offset_s = req.ext_str("offset")
        if offset_s is None:
            msg_id = req.require_str("msgId")
            try:
                _, offset = decode_offset_msg_id(msg_id)
            except ValueError as e:
                raise HeaderError(str(e)) from None
        else:
            offset = req.ext_int("offset")
        raw = self.store.read_record(offset) if offset >= 0 else None
        if raw is None:
            return req.response(
                ResponseCode.SYSTEM_ERROR, remark=f"can not find message by the offset, {offset}"
            )
        return req.response(body=bytes(raw))

    def query_message(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        topic = req.require_str("topic")
        key = req.require_str("key")
        max_num = max(1, min(req.ext_int("maxNum", 32), 64))
        begin = req.ext_int("beginTimestamp", 0)
        end = req.ext_int("endTimestamp", 2**62)
        msgs = self.store.query_message(topic, key, max_num, begin, end)
        parts = []
        for m in msgs:
            raw = self.store.read_record(m.commit_log_offset)
            if raw is not None:
                parts.append(bytes(raw))
        ext = {
            "indexLastUpdateTimestamp": str(self.clock.now_ms()),
            "indexLastUpdatePhyoffset": str(self.store.max_phy_offset),
        }
        if not parts:
            return req.response(
                ResponseCode.QUERY_NOT_FOUND,
                ext_fields=ext,
                remark="can not find message, maybe time range not correct",
            )
        return req.response(ext_fields=ext, body=b"".join(parts))

    # --- orderly consumers ------------------------------------------------------------------------------
    @staticmethod
    def _mq_list(body: dict[str, Any]) -> list[tuple[str, str, int]]:
        out = []
        for mq in body.get("mqSet") or []:
            if isinstance(mq, dict):
                out.append(
                    (str(mq.get("topic", "")), str(mq.get("brokerName", "")), int(mq.get("queueId", 0)))
                )
        return out

    def lock_batch_mq(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        body = _parse_json_body(req, "LOCK_BATCH_MQ")
        if not isinstance(body, dict):
            raise HeaderError("LOCK_BATCH_MQ body is not a JSON object")
        granted = self.services.locks.try_lock(
            str(body.get("consumerGroup", "")),
            self._mq_list(body),
            str(body.get("clientId", "")),
            self.clock.now_ms(),
        )
        return req.response(
            body=_json({"lockOKMQSet": [{"topic": t, "brokerName": b, "queueId": q} for t, b, q in granted]})
        )

    def unlock_batch_mq(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        body = _parse_json_body(req, "UNLOCK_BATCH_MQ")
        if not isinstance(body, dict):
            raise HeaderError("UNLOCK_BATCH_MQ body is not a JSON object")
        self.services.locks.unlock(
            str(body.get("consumerGroup", "")), self._mq_list(body), str(body.get("clientId", ""))
        )
        return req.response()

    # --- CONSUMER_SEND_MSG_BACK (36) ---------------------------------------------------------------------
    def consumer_send_msg_back(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
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

    # --- admin -------------------------------------------------------------------------------------------
    def get_all_topic_config(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        t = self.topics
        return req.response(body=_json({"topicConfigTable": t.snapshot(), "dataVersion": t.data_version}))

    def update_and_create_topic(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        topic = req.require_str("topic")
        if topic in (SCHEDULE_TOPIC,):
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"the topic {topic} is a system topic")
        nums = self.config.defaultTopicQueueNums
        tc = TopicConfig(
            topic,
            req.ext_int("readQueueNums", nums),
            req.ext_int("writeQueueNums", nums),
            req.ext_int("perm", PERM_READ | PERM_WRITE),
            topicSysFlag=req.ext_int("topicSysFlag", 0),
            order=req.ext_bool("order"),
        )
        if not (0 < tc.readQueueNums <= 1024 and 0 < tc.writeQueueNums <= 1024):
            raise HeaderError("queue numbers must be within 1..1024")
        try:
            self.topics.update(tc)
        except TopicError as e:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=str(e))
        return req.response()

    def delete_topic(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        self.topics.delete(req.require_str("topic"))
        return req.response()

    def get_runtime_info(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        info = self.services.runtime_info()
        return req.response(body=_json({"table": {k: str(v) for k, v in info.items()}}))

    def get_topic_stats(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        topic = req.require_str("topic")
        tc = self.topics.get(topic)
        if tc is None:
            return req.response(ResponseCode.TOPIC_NOT_EXIST, remark=f"topic[{topic}] not exist")
        table = {}
        for q in range(max(tc.readQueueNums, tc.writeQueueNums)):
            key = json.dumps({"topic": topic, "brokerName": self.config.brokerName, "queueId": q})
            table[key] = {
                "minOffset": self.store.get_min_offset_in_queue(topic, q),
                "maxOffset": self.store.get_max_offset_in_queue(topic, q),
            }
        return req.response(body=_json({"offsetTable": table}))
