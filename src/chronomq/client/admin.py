"""Admin: topics and routes, group progress and lag, message lookup by id and key, offset reset by
timestamp, dead-letter redrive, chronomq delay statistics (request code 9001)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chronomq import message as m
from chronomq.remoting.codes import PERM_READ, PERM_WRITE, RequestCode, ResponseCode

from . import ops
from .blocking import SyncContextMixin
from .errors import BrokerError, ClientClosed, ClientError, NoRouteError, error_for_code
from .instance import ClientInstance
from .model import Message, MessageQueue, ReceivedMessage, TopicRoute

_SKIP_ON_REDRIVE = {m.PROPERTY_UNIQ_KEY, m.PROPERTY_WAIT_STORE_MSG_OK, m.PROPERTY_DELAY_TIME_LEVEL,
                    m.PROPERTY_REAL_TOPIC, m.PROPERTY_REAL_QUEUE_ID, m.PROPERTY_RETRY_TOPIC,
                    m.PROPERTY_ORIGIN_MESSAGE_ID, "MIN_OFFSET", "MAX_OFFSET", "CONSUME_START_TIME",
                    m.PROPERTY_KEYS, m.PROPERTY_TAGS, m.PROPERTY_DLQ_ORIGIN_TOPIC,
                    m.PROPERTY_DLQ_ORIGIN_MESSAGE_ID, m.PROPERTY_RECONSUME_TIME}


@dataclass(frozen=True, slots=True)
class QueueProgress:
    queue: MessageQueue
    broker_offset: int          # max offset of the queue
    consumer_offset: int        # the group's committed offset (-1: none)
    lag: int                    # broker_offset - consumer_offset (all of the queue when none)


class Admin(SyncContextMixin):
    def __init__(self, namesrv: str | Sequence[str] = "127.0.0.1:9876", *, request_timeout: float = 5.0,
                 instance_name: str | None = None) -> None:
        self._instance = ClientInstance(namesrv, instance_name=instance_name, request_timeout=request_timeout)
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this admin client was closed; create a new one")
        await self._instance.start()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._instance.close()

    # --- brokers, topics, routes ---------------------------------------------------------------------
    async def brokers(self) -> dict[str, dict[int, str]]:
        """broker name -> {broker id: address} (from GET_BROKER_CLUSTER_INFO, else the TBW102 route)."""
        resp = await self._instance.invoke_namesrv(
            lambda: self._instance.request(RequestCode.GET_BROKER_CLUSTER_INFO), what="cluster info")
        if resp.code == ResponseCode.SUCCESS and resp.body:
            data = json.loads(resp.body)
            out = {}
            for name, bd in (data.get("brokerAddrTable") or {}).items():
                out[str(name)] = {int(k): str(v) for k, v in (bd.get("brokerAddrs") or {}).items()}
            if out:
                self._instance.broker_addrs.update(out)
                return out
        route = await self._instance.get_route(m.DEFAULT_TOPIC, refresh=True)
        return {k: dict(v) for k, v in route.broker_addrs.items()}

    async def create_topic(self, topic: str, queue_nums: int = 4, *, perm: int = PERM_READ | PERM_WRITE,
                           order: bool = False, brokers: Sequence[str] | None = None) -> list[str]:
        """Create or update a topic on every master broker (or the named ones); returns the broker names."""
        reason = m.validate_topic(topic)
        if reason:
            raise ValueError(f"invalid topic: {reason}")
        if not 1 <= queue_nums <= 1024:
            raise ValueError("queue_nums must be within 1..1024")
        table = await self.brokers()
        names = list(brokers) if brokers is not None else sorted(table)
        ext = {"topic": topic, "defaultTopic": m.DEFAULT_TOPIC, "readQueueNums": queue_nums,
               "writeQueueNums": queue_nums, "perm": perm, "topicFilterType": "SINGLE_TAG",
               "topicSysFlag": 0, "order": "true" if order else "false"}
        for name in names:
            addr = table.get(name, {}).get(0)
            if addr is None:
                raise NoRouteError(f"no master address for broker {name!r}")
            cmd = self._instance.request(RequestCode.UPDATE_AND_CREATE_TOPIC, ext)
            await self._instance.invoke_ok(addr, cmd, what=f"create topic {topic!r} on {name}")
        self._instance.routes.pop(topic, None)
        return names

    async def list_topics(self) -> list[str]:
        resp = await self._instance.invoke_namesrv(
            lambda: self._instance.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER), what="topic list")
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark, "topic list")
        data = json.loads(resp.body) if resp.body else {}
        return sorted(str(t) for t in data.get("topicList") or [])

    async def route(self, topic: str) -> TopicRoute:
        return await self._instance.get_route(topic, refresh=True)

    async def queues(self, topic: str) -> list[MessageQueue]:
        return (await self.route(topic)).read_queues()

    # --- consumer groups -----------------------------------------------------------------------------
    async def group_progress(self, group: str,
                             topics: str | Sequence[str] | None = None) -> list[QueueProgress]:
        """Per queue: broker max offset, the group's committed offset and the lag. ``topics`` defaults
        to the group's retry topic only; pass the topics the group consumes."""
        names = [topics] if isinstance(topics, str) else list(topics or [])
        names.append(m.RETRY_GROUP_TOPIC_PREFIX + group)
        rows: list[QueueProgress] = []
        for topic in names:
            try:
                qs = await self.queues(topic)
            except NoRouteError:
                continue

            async def one(mq: MessageQueue) -> QueueProgress:
                hi, committed = await asyncio.gather(ops.max_offset(self._instance, mq),
                                                     ops.query_consumer_offset(self._instance, group, mq))
                c = -1 if committed is None else committed
                return QueueProgress(mq, hi, c, max(0, hi - max(c, 0)))

            rows.extend(await asyncio.gather(*(one(q) for q in qs)))
        return rows

    async def reset_offsets(self, group: str, topic: str, timestamp_ms: int) -> dict[MessageQueue, int]:
        """Set the group's committed offset on every queue of ``topic`` to the first message stored at or
        after ``timestamp_ms``. Stop the group's consumers first: a running consumer commits its own
        position every few seconds and would overwrite the reset."""
        out: dict[MessageQueue, int] = {}
        for mq in await self.queues(topic):
            off = await ops.offset_for_timestamp(self._instance, mq, timestamp_ms)
            await ops.update_consumer_offset(self._instance, group, mq, off)
            out[mq] = off
        return out

    # --- messages --------------------------------------------------------------------------------------
    async def get_message(self, msg_id: str, topic: str | None = None) -> ReceivedMessage:
        """Look a message up by its offset message id (SendResult.offset_msg_id), or by its client id
        (SendResult.msg_id / ReceivedMessage.id) when ``topic`` is given."""
        if topic is not None:
            found = await self.query_messages(topic, msg_id, unique_key=True)
            if found:
                return found[0]
        try:
            (host, port), offset = m.decode_offset_msg_id(msg_id)
        except ValueError:
            host, port, offset = "", 0, 0
        if not host or not 0 < port < 65536 or host == "0.0.0.0":
            if topic is None:
                raise ValueError(f"{msg_id!r} is not an offset message id; give the topic to look up a "
                                 "client id")
            raise BrokerError(f"no message with id {msg_id!r} in topic {topic!r}",
                              ResponseCode.QUERY_NOT_FOUND)
        addr = f"{host}:{port}"
        resp = await self._instance.invoke(addr, self._instance.request(RequestCode.VIEW_MESSAGE_BY_ID,
                                                                        {"offset": offset}),
                                           what=f"view message {msg_id}")
        if resp.code != ResponseCode.SUCCESS or not resp.body:
            raise error_for_code(resp.code, resp.remark, f"view message {msg_id}", addr)
        return ReceivedMessage.from_ext(m.decode_record(resp.body), self._broker_name_of(addr))

    def _broker_name_of(self, addr: str) -> str:
        for name, addrs in self._instance.broker_addrs.items():
            if addr in addrs.values():
                return name
        return addr

    async def query_messages(self, topic: str, key: str, max_num: int = 64, begin_ms: int = 0,
                             end_ms: int | None = None, *, unique_key: bool = False) -> list[ReceivedMessage]:
        """Messages of ``topic`` whose KEYS contain ``key`` (or whose client id is ``key``)."""
        route = await self.route(topic)
        end = end_ms if end_ms is not None else int(time.time() * 1000) + 60_000
        ext: dict[str, Any] = {"topic": topic, "key": key, "maxNum": max_num, "beginTimestamp": begin_ms,
                               "endTimestamp": end}
        if unique_key:
            ext["_UNIQUE_KEY_QUERY"] = "true"
        seen: dict[str, ReceivedMessage] = {}
        for name in sorted(route.broker_addrs):
            addr = route.master_addr(name)
            if addr is None:
                continue
            resp = await self._instance.invoke(addr, self._instance.request(RequestCode.QUERY_MESSAGE, ext),
                                               what=f"query topic {topic!r} by key {key!r}")
            if resp.code in (ResponseCode.QUERY_NOT_FOUND, ResponseCode.SUCCESS) and not resp.body:
                continue
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, resp.remark, f"query topic {topic!r} by key {key!r}", addr)
            for ext_msg in m.decode_records(resp.body):
                msg = ReceivedMessage.from_ext(ext_msg, name)
                if msg.raw_topic != topic:
                    continue
                if unique_key and msg.id != key:
                    continue
                if not unique_key and key not in msg.keys and msg.id != key:
                    continue
                seen[msg.offset_msg_id] = msg
        return sorted(seen.values(), key=lambda x: (x.store_timestamp, x.commit_log_offset))[:max_num]

    async def redrive_dlq(self, group: str, max_messages: int | None = None, *,
                          producer_group: str = "CHRONOMQ_DLQ_REDRIVE") -> int:
        """Move messages from %DLQ%<group> back to their original topic (the RETRY_TOPIC property).
        Progress is kept as the committed offset of the group ``<producer_group>_<group>`` on the DLQ,
        so running it twice does not move a message twice. Returns how many were moved."""
        from .producer import Producer

        dlq = m.DLQ_GROUP_TOPIC_PREFIX + group
        try:
            qs = await self.queues(dlq)
        except NoRouteError:
            return 0
        tracker = f"{producer_group}_{group}".replace("%", "_")
        moved = 0
        producer = Producer(producer_group, self._instance.namesrv_addrs)
        await producer.start()
        try:
            for mq in qs:
                offset = await ops.query_consumer_offset(self._instance, tracker, mq)
                if offset is None:
                    offset = await ops.min_offset(self._instance, mq)
                while max_messages is None or moved < max_messages:
                    res = await ops.pull(self._instance, mq, offset, 32, group=tracker)
                    if res.status == ops.PullStatus.OFFSET_ILLEGAL and res.next_offset != offset:
                        offset = res.next_offset
                        continue
                    if res.status != ops.PullStatus.FOUND:
                        break
                    for msg in res.messages:
                        if max_messages is not None and moved >= max_messages:
                            break
                        await producer.send(self._redrive_message(msg))
                        moved += 1
                        offset = msg.queue_offset + 1
                    else:
                        offset = max(offset, res.next_offset)
                    await ops.update_consumer_offset(self._instance, tracker, mq, offset)
        finally:
            await producer.close()
        return moved

    @staticmethod
    def _redrive_message(msg: ReceivedMessage) -> Message:
        target = msg.properties.get(m.PROPERTY_RETRY_TOPIC) or msg.properties.get(m.PROPERTY_DLQ_ORIGIN_TOPIC)
        if not target or target.startswith(m.RETRY_GROUP_TOPIC_PREFIX):
            raise ClientError(f"DLQ message {msg.id} does not say its original topic")
        props = {k: v for k, v in msg.properties.items() if k not in _SKIP_ON_REDRIVE}
        props["DLQ_REDRIVE_FROM"] = msg.offset_msg_id
        return Message(target, msg.body, keys=msg.keys or None, tags=msg.tags, properties=props,
                       flag=msg.flag)

    # --- chronomq extensions ---------------------------------------------------------------------------
    async def delay_stats(self) -> dict[str, dict[str, Any]]:
        """Delay-level statistics of every master broker: {broker name: stats} (request code 9001)."""
        table = await self.brokers()
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(table):
            addr = table[name].get(0)
            if addr is None:
                continue
            resp = await self._instance.invoke_ok(
                addr, self._instance.request(RequestCode.CHRONOMQ_DELAY_STATS), what=f"delay stats of {name}")
            out[name] = json.loads(resp.body) if resp.body else {}
        return out
