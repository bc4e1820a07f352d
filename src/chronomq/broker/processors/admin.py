"""Admin and queue-information requests (RocketMQ's AdminBrokerProcessor): topic config
(GET_ALL_TOPIC_CONFIG, UPDATE_AND_CREATE_TOPIC, DELETE_TOPIC_IN_BROKER), runtime and topic stats, queue
offsets (GET_MAX_OFFSET, GET_MIN_OFFSET, SEARCH_OFFSET_BY_TIMESTAMP, GET_EARLIEST_MSG_STORETIME,
GET_ALL_CONSUMER_OFFSET, GET_ALL_DELAY_OFFSET: what a slave copies) and the orderly consumers' queue
locks (LOCK_BATCH_MQ, UNLOCK_BATCH_MQ).

Rules: answered inline from the services; system topics (TopicConfigManager.is_system_topic: the
schedule topic, TBW102, the cluster- and broker-named topics, ...) cannot be created or updated here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from chronomq.config import ASYNC_MASTER
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import PERM_READ, PERM_WRITE, RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED

from ..services import PromoteError
from ..topics import TopicConfig, TopicError
from .base import Handler, ProcessorBase, RequestConnection, dump_json, parse_json_body

if TYPE_CHECKING:
    from ..services import BrokerServices

log = logging.getLogger("chronomq.broker")

class AdminProcessor(ProcessorBase):
    """Topics, stats, queue offsets and queue locks."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self._promotions: set[asyncio.Future[None]] = set()
        self._started_ms = self.clock.now_ms()

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.GET_MAX_OFFSET: self.get_max_offset,
            RequestCode.GET_MIN_OFFSET: self.get_min_offset,
            RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: self.search_offset_by_timestamp,
            RequestCode.GET_EARLIEST_MSG_STORETIME: self.get_earliest_msg_storetime,
            RequestCode.LOCK_BATCH_MQ: self.lock_batch_mq,
            RequestCode.UNLOCK_BATCH_MQ: self.unlock_batch_mq,
            RequestCode.GET_ALL_TOPIC_CONFIG: self.get_all_topic_config,
            RequestCode.UPDATE_AND_CREATE_TOPIC: self.update_and_create_topic,
            RequestCode.DELETE_TOPIC_IN_BROKER: self.delete_topic,
            RequestCode.GET_BROKER_RUNTIME_INFO: self.get_runtime_info,
            RequestCode.GET_TOPIC_STATS_INFO: self.get_topic_stats,
            RequestCode.GET_TOPIC_CONFIG: self.get_topic_config,
            RequestCode.GET_ALL_CONSUMER_OFFSET: self.get_all_consumer_offset,
            RequestCode.GET_ALL_DELAY_OFFSET: self.get_all_delay_offset,
            RequestCode.CHRONOMQ_PROMOTE: self.promote,
        }

    # --- queue offsets ---------------------------------------------------------------------------------
    def get_max_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        off = self.store.get_max_offset_in_queue(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"offset": str(off)})

    def get_min_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        off = self.store.get_min_offset_in_queue(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"offset": str(off)})

    def search_offset_by_timestamp(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        off = self.store.get_offset_in_queue_by_time(
            req.require_str("topic"), req.ext_int("queueId"), req.ext_int("timestamp")
        )
        return req.response(ext_fields={"offset": str(off)})

    def get_earliest_msg_storetime(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        ts = self.store.get_earliest_message_time(req.require_str("topic"), req.ext_int("queueId"))
        return req.response(ext_fields={"timestamp": str(ts)})

    def get_all_consumer_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        table = {k: {str(q): o for q, o in v.items()} for k, v in self.services.offsets.table.items()}
        return req.response(body=dump_json({"offsetTable": table}))

    def get_all_delay_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        """The delay levels' schedule offsets as delayOffset.json holds them (what a slave copies)."""
        return req.response(body=self.delay.schedule.snapshot().to_json().encode())

    def promote(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        """CHRONOMQ_PROMOTE: this slave becomes the master (ext brokerRole: ASYNC_MASTER by default, or
        SYNC_MASTER); answered once it is done."""
        role = req.ext_str("brokerRole") or ASYNC_MASTER
        fn = self.services.promote
        if fn is None or not self.config.is_slave:
            return req.response(ResponseCode.SYSTEM_ERROR,
                                remark=f"this broker is not a slave but {self.config.brokerRole}")

        async def run() -> None:
            try:
                await fn(role)
                resp = req.response(remark=f"{self.config.brokerName}: this broker is now its {role}")
            except PromoteError as e:
                resp = req.response(ResponseCode.SYSTEM_ERROR, remark=str(e))
            except Exception as e:
                log.exception("promotion failed")
                resp = req.response(ResponseCode.SYSTEM_ERROR, remark=f"promotion failed: {e}"[:500])
            conn.reply(req, resp)

        task = asyncio.ensure_future(run())
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)
        return DEFERRED

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

    def lock_batch_mq(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        body = parse_json_body(req, "LOCK_BATCH_MQ")
        if not isinstance(body, dict):
            raise HeaderError("LOCK_BATCH_MQ body is not a JSON object")
        granted = self.services.locks.try_lock(
            str(body.get("consumerGroup", "")),
            self._mq_list(body),
            str(body.get("clientId", "")),
            self.clock.now_ms(),
        )
        locked = [{"topic": t, "brokerName": b, "queueId": q} for t, b, q in granted]
        return req.response(body=dump_json({"lockOKMQSet": locked}))

    def unlock_batch_mq(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        body = parse_json_body(req, "UNLOCK_BATCH_MQ")
        if not isinstance(body, dict):
            raise HeaderError("UNLOCK_BATCH_MQ body is not a JSON object")
        self.services.locks.unlock(
            str(body.get("consumerGroup", "")), self._mq_list(body), str(body.get("clientId", ""))
        )
        return req.response()

    # --- admin -------------------------------------------------------------------------------------------
    def get_all_topic_config(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        t = self.topics
        return req.response(body=dump_json({"topicConfigTable": t.snapshot(), "dataVersion": t.data_version}))

    def update_and_create_topic(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        topic = req.require_str("topic")
        if self.topics.is_system_topic(topic):  # RocketMQ's answer (TopicValidator.isSystemTopic)
            return req.response(ResponseCode.SYSTEM_ERROR,
                                remark=f"The topic[{topic}] is conflict with system topic.")
        nums = self.config.defaultTopicQueueNums
        topic_config = TopicConfig(
            topic,
            req.ext_int("readQueueNums", nums),
            req.ext_int("writeQueueNums", nums),
            req.ext_int("perm", PERM_READ | PERM_WRITE),
            topicSysFlag=req.ext_int("topicSysFlag", 0),
            order=req.ext_bool("order"),
        )
        if not (0 < topic_config.readQueueNums <= 1024 and 0 < topic_config.writeQueueNums <= 1024):
            raise HeaderError("queue numbers must be within 1..1024")
        try:
            self.topics.update(topic_config)
        except TopicError as e:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=str(e))
        return req.response()

    def delete_topic(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        self.topics.delete(req.require_str("topic"))
        return req.response()

    def get_runtime_info(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        info = {**self._rocketmq_runtime_keys(), **self.services.runtime_info()}
        return req.response(body=dump_json({"table": {k: str(v) for k, v in info.items()}}))

    def _rocketmq_runtime_keys(self) -> dict[str, Any]:
        """The keys of RocketMQ's runtime table that its mqadmin reads (clusterList, brokerStatus), from
        what chronomq counts: the TPS figures are averages since the broker started (chronomq keeps no
        per-window history), its thread-pool queues are 0 (requests are answered inline, not queued)."""
        now = self.clock.now_ms()
        uptime_s = max(1.0, (now - self._started_ms) / 1000)
        traffic = self.services.traffic
        put = self.services.put_stats.count
        got = sum(v[0] for v in list(traffic.consumed.values()))
        earliest = now
        if self.store.max_phy_offset > self.store.min_phy_offset:
            first = self.store.look_message_by_offset(self.store.min_phy_offset)
            if first is not None:
                earliest = first.store_timestamp
        put_tps, get_tps = f"{put / uptime_s:.2f}", f"{got / uptime_s:.2f}"
        return {"putTps": " ".join([put_tps] * 3), "getTransferedTps": " ".join([get_tps] * 3),
                "getTransferredTps": " ".join([get_tps] * 3), "sendThreadPoolQueueSize": 0,
                "sendThreadPoolQueueHeadWaitTimeMills": 0, "pullThreadPoolQueueSize": 0,
                "pullThreadPoolQueueHeadWaitTimeMills": 0, "pageCacheLockTimeMills": 0,
                "earliestMessageTimeStamp": earliest, "brokerActive": "true", "msgPutTotalTodayNow": put,
                "msgGetTotalTodayNow": got}

    def get_topic_config(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        """GET_TOPIC_CONFIG (351), as RocketMQ 5's AdminBrokerProcessor answers it: the topic's config
        (TopicConfigAndQueueMapping, without static-topic mapping), or TOPIC_NOT_EXIST."""
        topic = req.require_str("topic")
        topic_config = self.topics.get(topic)
        if topic_config is None:
            return req.response(ResponseCode.TOPIC_NOT_EXIST,
                                remark=f"No topic in this broker. topic: {topic}")
        body = {**topic_config.to_json(), "attributes": {}, "mappingDetail": None}
        return req.response(body=dump_json(body))

    def get_topic_stats(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        topic = req.require_str("topic")
        topic_config = self.topics.get(topic)
        if topic_config is None:
            return req.response(ResponseCode.TOPIC_NOT_EXIST, remark=f"topic[{topic}] not exist")
        table = {}
        for q in range(max(topic_config.readQueueNums, topic_config.writeQueueNums)):
            key = json.dumps({"topic": topic, "brokerName": self.config.brokerName, "queueId": q})
            table[key] = {
                "minOffset": self.store.get_min_offset_in_queue(topic, q),
                "maxOffset": self.store.get_max_offset_in_queue(topic, q),
            }
        return req.response(body=dump_json({"offsetTable": table}))
