"""Consumer and producer groups as RocketMQ 5's AdminBrokerProcessor answers about them: subscription
groups (UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, GET_ALL_SUBSCRIPTIONGROUP_CONFIG, DELETE_SUBSCRIPTIONGROUP,
GET_SUBSCRIPTIONGROUP_CONFIG), who is connected (GET_CONSUMER_CONNECTION_LIST,
GET_PRODUCER_CONNECTION_LIST, QUERY_TOPIC_CONSUME_BY_WHO), progress (GET_CONSUME_STATS), the offset
reset by time (INVOKE_BROKER_TO_RESET_OFFSET) and a consumer's running info (GET_CONSUMER_RUNNING_INFO,
asked of the consumer itself).

Rules: bodies are the JSON the Java tools parse (a map keyed by a MessageQueue is written with the
queue's JSON text as key, which fastjson reads back as the object). A reset commits the new offsets here
and pushes RESET_CONSUMER_CLIENT_OFFSET to the group's online clients (RocketMQ's Broker2Client), so a
running consumer that honours it jumps; one that does not keeps committing its own position.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED

from ..clients import _CONSUME_FROM, ClientInfo
from ..subgroups import SubscriptionGroupConfig, SubscriptionGroupError
from .base import Handler, ProcessorBase, RequestConnection, dump_json, parse_json_body

if TYPE_CHECKING:
    from ..services import BrokerServices

log = logging.getLogger("chronomq.broker")

_CONSUME_FROM_NAMES = {v: k for k, v in _CONSUME_FROM.items()}
CALL_CONSUMER_TIMEOUT = 5.0  # seconds: RocketMQ's Broker2Client.callClient waits 10 s; the admin 5 s


def mq_key(topic: str, broker_name: str, queue_id: int) -> str:
    """A MessageQueue as a JSON map key (fastjson reads the text back as the object)."""
    return json.dumps({"brokerName": broker_name, "queueId": queue_id, "topic": topic},
                      separators=(",", ":"))


def consume_from_name(v: Any) -> str:
    """ConsumeFromWhere's name, from the name (Java, Go) or its ordinal (C++)."""
    if isinstance(v, str) and not v.lstrip("-").isdigit():
        return v
    try:
        return _CONSUME_FROM_NAMES.get(int(v), "CONSUME_FROM_LAST_OFFSET")
    except (TypeError, ValueError):
        return "CONSUME_FROM_LAST_OFFSET"


def _connection(c: ClientInfo) -> dict[str, Any]:
    addr = c.conn.remote_addr if c.conn is not None else ""
    return {"clientId": c.client_id, "clientAddr": addr, "language": c.language or "OTHER",
            "version": c.version}


class GroupProcessor(ProcessorBase):
    """Subscription groups, connections, consume stats, offset reset and consumer running info."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self.subgroups = services.subgroups
        self._consumer_calls: set[asyncio.Future[None]] = set()

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP: self.update_subscription_group,
            RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG: self.get_all_subscription_groups,
            RequestCode.DELETE_SUBSCRIPTIONGROUP: self.delete_subscription_group,
            RequestCode.GET_SUBSCRIPTIONGROUP_CONFIG: self.get_subscription_group,
            RequestCode.GET_CONSUMER_CONNECTION_LIST: self.get_consumer_connections,
            RequestCode.GET_PRODUCER_CONNECTION_LIST: self.get_producer_connections,
            RequestCode.QUERY_TOPIC_CONSUME_BY_WHO: self.query_topic_consume_by_who,
            RequestCode.GET_CONSUME_STATS: self.get_consume_stats,
            RequestCode.INVOKE_BROKER_TO_RESET_OFFSET: self.invoke_reset_offset,
            RequestCode.GET_CONSUMER_RUNNING_INFO: self.get_consumer_running_info,
        }

    # --- subscription groups ---------------------------------------------------------------------------
    def update_subscription_group(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        body = parse_json_body(req, "UPDATE_AND_CREATE_SUBSCRIPTIONGROUP")
        try:
            cfg = SubscriptionGroupConfig.from_json(body)
            self.subgroups.update(cfg)
        except SubscriptionGroupError as e:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=str(e))
        log.info("subscription group %s created or updated by %s", cfg.groupName, conn.remote_addr)
        return req.response()

    def get_all_subscription_groups(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        return req.response(body=dump_json(self.subgroups.snapshot()))

    def get_subscription_group(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        cfg = self.subgroups.get(req.require_str("group"))
        if cfg is None:
            return req.response(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST, remark="No group in this broker")
        return req.response(body=dump_json(cfg.to_json()))

    def delete_subscription_group(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("groupName")
        self.subgroups.delete(group)
        if req.ext_bool("cleanOffset"):
            self.services.offsets.remove_group(group)
        log.info("subscription group %s deleted by %s", group, conn.remote_addr)
        return req.response()

    # --- connections -----------------------------------------------------------------------------------
    def get_consumer_connections(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        g = self.services.consumers.groups.get(group)
        if g is None or not g.clients:
            return req.response(ResponseCode.CONSUMER_NOT_ONLINE,
                                remark=f"the consumer group[{group}] not online")
        body = {
            "connectionSet": [_connection(c) for c in g.clients.values()],
            "subscriptionTable": dict(g.subscriptions),
            "consumeType": g.consume_type,
            "messageModel": "CLUSTERING" if g.clustering else "BROADCASTING",
            "consumeFromWhere": consume_from_name(g.consume_from_where),
        }
        return req.response(body=dump_json(body))

    def get_producer_connections(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("producerGroup")
        clients = self.services.producers.groups.get(group)
        if not clients:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"the producer group[{group}] not exist")
        return req.response(body=dump_json({"connectionSet": [_connection(c) for c in clients.values()]}))

    def query_topic_consume_by_who(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        topic = req.require_str("topic")
        groups = set(self.services.consumers.groups_subscribing(topic))
        groups.update(self.services.offsets.groups_of_topic(topic))
        return req.response(body=dump_json({"groupList": sorted(groups)}))

    # --- consume stats ---------------------------------------------------------------------------------
    def _stats_topics(self, req: RemotingCommand, group: str) -> list[str]:
        """RocketMQ's getTopicsForCollectingConsumeStats: the topicList given; else the topic given or
        every topic the group has offsets on, less those an online group does not subscribe to."""
        listed = [t for t in (req.ext_str("topicList") or "").split(";") if t]
        if listed:
            return listed
        topic = req.ext_str("topic")
        topics = [topic] if topic else sorted({k.split("@", 1)[0] for k in self.services.offsets.table
                                               if k.split("@", 1)[1] == group})
        g = self.services.consumers.groups.get(group)
        if g is not None and g.subscriptions:
            topics = [t for t in topics if t in g.subscriptions]
        return topics

    def get_consume_stats(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        broker = self.config.brokerName
        table: dict[str, dict[str, int]] = {}
        for topic in self._stats_topics(req, group):
            topic_config = self.topics.get(topic)
            if topic_config is None:
                continue
            for q in range(topic_config.readQueueNums):
                hi = max(0, self.store.get_max_offset_in_queue(topic, q))
                committed = max(0, self.services.offsets.query(group, topic, q))
                row = {"brokerOffset": hi, "consumerOffset": committed, "pullOffset": committed,
                       "lastTimestamp": 0}
                if committed > 0:
                    row["lastTimestamp"] = self._store_time(topic, q, committed - 1)
                table[mq_key(topic, broker, q)] = row
        return req.response(body=dump_json({"offsetTable": table, "consumeTps": 0.0}))

    def _store_time(self, topic: str, queue_id: int, offset: int) -> int:
        units = self.store.get_cq_units(topic, queue_id, offset, 1)
        if not units:
            return 0
        msg = self.store.look_message_by_offset(units[0].commit_log_offset)
        return msg.store_timestamp if msg is not None else 0

    # --- offset reset ----------------------------------------------------------------------------------
    def invoke_reset_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        """INVOKE_BROKER_TO_RESET_OFFSET: each queue of the topic (or the queueId given) moves to the first
        message stored at or after ``timestamp`` (-1: the queue's end; an ``offset`` given with a
        queueId: that offset, whatever isForce); without isForce a queue only moves back. The offsets
        are committed and pushed to the group's online clients; the answer is ResetOffsetBody."""
        topic = req.require_str("topic")
        group = req.require_str("group")
        timestamp = req.ext_int("timestamp", -1)
        force = req.ext_bool("isForce", True)
        queue_id = req.ext_int("queueId", -1)
        offset = req.ext_int("offset", -1)
        if self.config.is_slave:
            return req.response(ResponseCode.SYSTEM_ERROR, remark="Can not reset offset in slave broker")
        topic_config = self.topics.get(topic)
        if topic_config is None:
            return req.response(ResponseCode.TOPIC_NOT_EXIST, remark=f"Topic {topic} does not exist")
        if group not in self.subgroups:
            return req.response(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST,
                                remark=f"Group {group} does not exist")
        queues = [queue_id] if queue_id >= 0 else list(range(topic_config.readQueueNums))
        offsets: dict[int, int] = {}
        for q in queues:
            lo = self.store.get_min_offset_in_queue(topic, q)
            hi = self.store.get_max_offset_in_queue(topic, q)
            if queue_id >= 0 and offset >= 0:
                if offset < lo or offset > hi:
                    why = f"Target offset {offset} not in consume queue range [{lo}-{hi}]"
                    return req.response(ResponseCode.SYSTEM_ERROR, remark=why)
                target = offset
            elif timestamp < 0:
                target = hi
            else:
                target = max(0, self.store.get_offset_in_queue_by_time(topic, q, timestamp))
            committed = self.services.offsets.query(group, topic, q)
            explicit = queue_id >= 0 and offset >= 0
            offsets[q] = target if explicit or force or committed < 0 or target < committed else committed
        for q, off in offsets.items():
            self.services.offsets.commit(group, topic, q, off)
        table = {mq_key(topic, self.config.brokerName, q): off for q, off in sorted(offsets.items())}
        pushed = self._push_reset(topic, group, timestamp, table)
        log.info("offsets of group %s on topic %s reset to %s (asked by %s, %d client(s) told)", group, topic,
                 dict(sorted(offsets.items())), conn.remote_addr, pushed)
        return req.response(body=dump_json({"offsetTable": table}))

    def _push_reset(self, topic: str, group: str, timestamp: int, table: dict[str, int]) -> int:
        """RESET_CONSUMER_CLIENT_OFFSET to each online client of the group (oneway): ResetOffsetBody, or
        ResetOffsetBodyForC (a list) to a C++ client. Returns how many were sent."""
        g = self.services.consumers.groups.get(group)
        if g is None:
            return 0
        header = {"topic": topic, "group": group, "timestamp": str(timestamp), "isForce": "true"}
        body = dump_json({"offsetTable": table})
        body_c = dump_json({"offsetTable": [{**json.loads(k), "offset": v} for k, v in table.items()]})
        sent = 0
        for c in list(g.clients.values()):
            if c.conn is None or c.conn.closed:
                continue
            cmd = RemotingCommand.request(RequestCode.RESET_CONSUMER_CLIENT_OFFSET, header,
                                          body_c if c.language == "CPP" else body, oneway=True)
            cmd.language = "JAVA"
            if c.conn.send_oneway(cmd):
                sent += 1
        return sent

    # --- a consumer's running info ---------------------------------------------------------------------
    def get_consumer_running_info(self, req: RemotingCommand, conn: RequestConnection
                                  ) -> RemotingCommand | None:
        """GET_CONSUMER_RUNNING_INFO: asked of the consumer (RocketMQ's callConsumer), its answer relayed."""
        group = req.require_str("consumerGroup")
        client_id = req.require_str("clientId")
        g = self.services.consumers.groups.get(group)
        client = g.clients.get(client_id) if g is not None else None
        if client is None or client.conn is None or client.conn.closed:
            return req.response(ResponseCode.SYSTEM_ERROR,
                                remark=f"The Consumer <{group}> <{client_id}> not online")
        target = client.conn
        ask = RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO, dict(req.ext_fields), req.body)
        ask.language = "JAVA"

        async def run() -> None:
            try:
                got = await target.invoke(ask, CALL_CONSUMER_TIMEOUT)
                resp = req.response(got.code, body=got.body, remark=got.remark)
            except TimeoutError as e:
                resp = req.response(ResponseCode.CONSUME_MSG_TIMEOUT,
                                    remark=f"consumer <{group}> <{client_id}> Timeout: {e}")
            except Exception as e:
                resp = req.response(ResponseCode.SYSTEM_ERROR,
                                    remark=f"invoke consumer <{group}> <{client_id}> Exception: {e}"[:500])
            conn.reply(req, resp)

        task = asyncio.ensure_future(run())
        self._consumer_calls.add(task)
        task.add_done_callback(self._consumer_calls.discard)
        return DEFERRED

