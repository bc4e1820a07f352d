"""Admin: the cluster, topics and routes, group progress and lag, broker runtime figures, message lookup
by id and key, message traces, offset reset by timestamp, dead-letter redrive, chronomq delay statistics
(request code 9001), and chronomq's timer store: cancel (9002), reschedule (9003) and the pending index
(9004).

Cluster-wide calls ask every master broker the name server knows; the ``broker_*`` calls and the
``broker_addr=`` keyword ask one broker by address, without the name server. Times come from the
``clock`` given (the real one by default).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from chronomq import message as m
from chronomq.clock import Clock, SystemClock
from chronomq.remoting import fastjson
from chronomq.remoting.codes import PERM_READ, PERM_WRITE, RequestCode, ResponseCode
from chronomq.remoting.tls import TlsOption

from . import ops
from .blocking import SyncContextMixin
from .errors import BrokerError, ClientClosed, ClientError, NoRouteError, NotSupported, error_for_code
from .instance import ClientInstance
from .model import Message, MessageQueue, ReceivedMessage, TopicRoute, deliver_time_ms
from .trace import TRACE_TOPIC, TraceDecodeError, TraceRecord, TraceType, decode_trace_body

log = logging.getLogger("chronomq.client")

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
    last_consumed_ms: int = 0   # store time of the last message the group committed (0: none or unknown)


class TimerOutcome(StrEnum):
    """The definite answer of a cancel or reschedule (per matching message)."""

    CANCELLED = "CANCELLED"                  # it will not be delivered; deliver_ms: when it would have been
    RESCHEDULED = "RESCHEDULED"              # deliver_ms: the new deliver time
    ALREADY_DELIVERED = "ALREADY_DELIVERED"  # too late: deliver_ms says when it was delivered
    ALREADY_CANCELLED = "ALREADY_CANCELLED"  # deliver_ms: when it was cancelled
    UNKNOWN = "UNKNOWN"                      # no pending, delivered or cancelled message has this id/key
    FAILED = "FAILED"                        # the broker's store refused it for good: never delivered


@dataclass(frozen=True, slots=True)
class TimerOpResult:
    """One message's outcome of Admin.cancel / Admin.reschedule. ``outcome`` is a TimerOutcome (or the
    raw string of an outcome this client does not know); ``broker`` the broker name that answered."""

    outcome: TimerOutcome | str
    msg_id: str
    deliver_ms: int | None = None
    topic: str | None = None
    broker: str | None = None

    @property
    def deliver_at(self) -> datetime | None:
        return _to_datetime(self.deliver_ms)

    @classmethod
    def from_dict(cls, d: Any, broker: str) -> TimerOpResult:
        if not isinstance(d, dict) or "outcome" not in d:
            raise ValueError(f"not a timer result: {d!r}")
        raw = str(d["outcome"])
        try:
            outcome: TimerOutcome | str = TimerOutcome(raw)
        except ValueError:
            outcome = raw
        dms = d.get("deliver_ms")
        topic = d.get("topic")
        return cls(outcome, str(d.get("msg_id") or ""), None if dms is None else int(dms),
                   None if topic is None else str(topic), broker)


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """A message waiting in a broker's timer store (Admin.pending)."""

    msg_id: str                 # its UNIQ_KEY: the handle for cancel/reschedule
    offset_msg_id: str          # the timer handle (also accepted by cancel/reschedule)
    topic: str
    queue_id: int
    tags: str | None
    keys: list[str]
    deliver_ms: int
    created_ms: int
    body_size: int
    broker: str

    @property
    def deliver_at(self) -> datetime:
        return datetime.fromtimestamp(self.deliver_ms / 1000, UTC)

    @classmethod
    def from_dict(cls, d: Any, broker: str) -> PendingMessage:
        if not isinstance(d, dict):
            raise ValueError(f"not a pending message: {d!r}")
        keys = d.get("keys") or []
        return cls(str(d["msg_id"]), str(d.get("offset_msg_id") or ""), str(d["topic"]),
                   int(d.get("queue_id", 0)), None if d.get("tags") is None else str(d["tags"]),
                   [str(k) for k in keys], int(d["deliver_ms"]), int(d.get("created_ms", 0)),
                   int(d.get("body_size", 0)), broker)


@dataclass(frozen=True, slots=True)
class PendingPage:
    """One page of Admin.pending. Pass ``next_cursor`` back as ``cursor=`` for the next page; it is None
    when there is nothing more. A page may hold fewer than ``limit`` items and still have a next one
    (a broker examines a bounded number of index entries per request)."""

    items: list[PendingMessage] = field(default_factory=list)
    next_cursor: str | None = None


def _to_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


def _window_ms(value: datetime | int | None, name: str) -> int | None:
    """A query bound: timezone-aware datetime or epoch ms (any non-negative int) -> epoch ms."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"{name} must be a timezone-aware datetime (or epoch ms)")
        return (value - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{name} must be a timezone-aware datetime or epoch ms >= 0, not {value!r}")


# chronomq's timer store marks the offset of its handles (offset msg ids naming a timer record) with bit 62
TIMER_HANDLE_FLAG = 1 << 62


def _timer_handle_addr(ident: str) -> str | None:
    """"host:port" of the broker a timer handle (SendResult.offset_msg_id of a scheduled message) names,
    or None when ``ident`` is not shaped like one."""
    if len(ident) != 32:
        return None
    try:
        (host, port), offset = m.decode_offset_msg_id(ident)
    except ValueError:
        return None
    if offset < 0 or not offset & TIMER_HANDLE_FLAG:
        return None
    return f"{host}:{port}"


def _encode_cursor(broker: str, cursor: str | None) -> str:
    raw = json.dumps([broker, cursor or ""], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[str, str | None]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        broker, inner = json.loads(raw)
        if not isinstance(broker, str) or not isinstance(inner, str):
            raise ValueError
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ValueError(f"cursor {cursor!r} is not a cursor returned by Admin.pending") from None
    return broker, inner or None


class NotANameServer(NotSupported):
    """The address given as the name server answered a name-server request (cluster info, route, topic
    list) with REQUEST_CODE_NOT_SUPPORTED: it is a broker (or something else), not a name server."""


def _json_body(body: bytes, what: str, addr: str) -> dict[str, Any]:
    try:
        data = fastjson.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise BrokerError(f"{what}: {addr} answered a body that is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BrokerError(f"{what}: {addr} answered {type(data).__name__}, not a JSON object")
    return data


# the order of a message's trace records of the same millisecond
_TRACE_ORDER = {TraceType.PUB: 0, TraceType.END_TRANSACTION: 1, TraceType.SUB_BEFORE: 2,
                TraceType.SUB_AFTER: 3, TraceType.RECALL: 4}

BROWSE_GROUP = "CHRONOMQ_BROWSE"  # the consumer group named by read-only pulls (it never commits)
MAX_BROWSE = 1_000


class Admin(SyncContextMixin):
    def __init__(self, namesrv: str | Sequence[str] = "127.0.0.1:9876", *, request_timeout: float = 5.0,
                 instance_name: str | None = None, clock: Clock | None = None,
                 credentials: tuple[str, str] | None = None, tls: TlsOption = None) -> None:
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._instance = ClientInstance(namesrv, credentials=credentials, instance_name=instance_name,
                                        request_timeout=request_timeout, clock=self._clock, tls=tls)
        self._closed = False

    @property
    def clock(self) -> Clock:
        """The clock this client reads the time from (given, or the system's)."""
        return self._clock

    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this admin client was closed; create a new one")
        await self._instance.start()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._instance.close()

    # --- brokers, topics, routes ---------------------------------------------------------------------
    async def _namesrv_json(self, code: int, what: str, ext: dict[str, Any] | None = None, *,
                            soft: bool = False) -> dict[str, Any] | None:
        """A name-server request's JSON body. An answer of REQUEST_CODE_NOT_SUPPORTED raises
        NotANameServer (a name server serves every one of these codes); another error code raises
        (or gives None when ``soft``)."""
        resp = await self._instance.invoke_namesrv(lambda: self._instance.request(code, ext), what=what)
        addr = self._instance.namesrv_addrs[self._instance._ns_index]  # the one that answered
        if resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
            raise NotANameServer(f"{what}: {addr} is a broker, not a name server (it answered "
                                 "REQUEST_CODE_NOT_SUPPORTED to a name-server request); give the name "
                                 "server's address", resp.code, resp.remark, addr)
        if resp.code != ResponseCode.SUCCESS:
            if soft:
                return None
            raise error_for_code(resp.code, resp.remark, what, addr)
        return _json_body(resp.body, what, addr)

    async def brokers(self) -> dict[str, dict[int, str]]:
        """broker name -> {broker id: address} (from GET_BROKER_CLUSTER_INFO, else the TBW102 route)."""
        data = await self._namesrv_json(RequestCode.GET_BROKER_CLUSTER_INFO, "cluster info", soft=True)
        if data:
            out = {}
            for name, bd in (data.get("brokerAddrTable") or {}).items():
                out[str(name)] = {int(k): str(v) for k, v in (bd.get("brokerAddrs") or {}).items()}
            if out:
                self._instance.broker_addrs.update(out)
                return out
        route = await self._instance.get_route(m.DEFAULT_TOPIC, refresh=True)
        return {k: dict(v) for k, v in route.broker_addrs.items()}

    async def cluster(self) -> dict[str, dict[str, dict[int, str]]]:
        """cluster name -> broker name -> {broker id: address}, as the name server lists them."""
        data = await self._namesrv_json(RequestCode.GET_BROKER_CLUSTER_INFO, "cluster info") or {}
        addrs = data.get("brokerAddrTable") or {}
        out: dict[str, dict[str, dict[int, str]]] = {}
        for cluster, names in (data.get("clusterAddrTable") or {}).items():
            out[str(cluster)] = {
                str(n): {int(k): str(v) for k, v in ((addrs.get(n) or {}).get("brokerAddrs") or {}).items()}
                for n in names}
        return out

    async def masters(self, broker_addr: str | None = None) -> list[tuple[str, str]]:
        """(broker name, master address) of every master broker, sorted by name; with ``broker_addr``,
        just that broker, named by its address (the name server is not asked)."""
        if broker_addr is not None:
            return [(broker_addr, broker_addr)]
        table = await self.brokers()
        out = [(name, table[name][0]) for name in sorted(table) if table[name].get(0)]
        if not out:
            raise NoRouteError("the name server knows no master broker")
        return out

    async def create_topic(self, topic: str, queue_nums: int = 4, *, perm: int = PERM_READ | PERM_WRITE,
                           order: bool = False, brokers: Sequence[str] | None = None,
                           broker_addr: str | None = None) -> list[str]:
        """Create or update a topic on every master broker (or the named ones, or only the broker at
        ``broker_addr``); returns the broker names (the address for ``broker_addr``)."""
        reason = m.validate_topic(topic)
        if reason:
            raise ValueError(f"invalid topic: {reason}")
        if not 1 <= queue_nums <= 1024:
            raise ValueError("queue_nums must be within 1..1024")
        if broker_addr is not None:
            targets = [(broker_addr, broker_addr)]
        else:
            table = await self.brokers()
            targets = []
            for name in (list(brokers) if brokers is not None else sorted(table)):
                addr = table.get(name, {}).get(0)
                if addr is None:
                    raise NoRouteError(f"no master address for broker {name!r}")
                targets.append((name, addr))
        ext = {"topic": topic, "defaultTopic": m.DEFAULT_TOPIC, "readQueueNums": queue_nums,
               "writeQueueNums": queue_nums, "perm": perm, "topicFilterType": "SINGLE_TAG",
               "topicSysFlag": 0, "order": "true" if order else "false"}
        for name, addr in targets:
            cmd = self._instance.request(RequestCode.UPDATE_AND_CREATE_TOPIC, ext)
            await self._instance.invoke_ok(addr, cmd, what=f"create topic {topic!r} on {name}")
        self._instance.routes.pop(topic, None)
        return [name for name, _ in targets]

    async def list_topics(self, *, sort: bool = True) -> list[str]:
        """Every topic the name server knows (sorted, or in the name server's order)."""
        data = await self._namesrv_json(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, "topic list") or {}
        topics = [str(t) for t in data.get("topicList") or []]
        return sorted(topics) if sort else topics

    async def route(self, topic: str) -> TopicRoute:
        return await self._instance.get_route(topic, refresh=True)

    async def route_data(self, topic: str) -> dict[str, Any]:
        """The name server's route data of ``topic`` as it sent it (queueDatas, brokerDatas, ...)."""
        return await self._namesrv_json(RequestCode.GET_ROUTEINFO_BY_TOPIC, f"route of topic {topic!r}",
                                        {"topic": topic}) or {}

    # --- one broker, by address ----------------------------------------------------------------------
    async def promote(self, addr: str, role: str = "ASYNC_MASTER", timeout: float = 120.0) -> str:
        """Make the slave at ``addr`` the master of its broker name (chronomq's CHRONOMQ_PROMOTE), as
        ``role`` (ASYNC_MASTER or SYNC_MASTER); returns the broker's answer once it is done. Promote
        only when the old master is down: two masters of one name would take turns in the route."""
        what = f"promotion of {addr}"
        resp = await self._instance.invoke_ok(
            addr, self._instance.request(RequestCode.CHRONOMQ_PROMOTE, {"brokerRole": role}), timeout,
            what=what)
        return resp.remark or "promoted"

    async def broker_runtime_info(self, addr: str) -> dict[str, str]:
        """The runtime figures of the broker at ``addr`` (GET_BROKER_RUNTIME_INFO's table)."""
        what = f"runtime info of {addr}"
        resp = await self._instance.invoke_ok(
            addr, self._instance.request(RequestCode.GET_BROKER_RUNTIME_INFO), what=what)
        table = _json_body(resp.body, what, addr).get("table") or {}
        return {str(k): str(v) for k, v in table.items()}

    async def broker_delay_stats(self, addr: str) -> dict[str, Any]:
        """chronomq delay statistics of the broker at ``addr`` (request code 9001), as it sent them."""
        what = f"delay stats of {addr}"
        resp = await self._instance.invoke_ok(
            addr, self._instance.request(RequestCode.CHRONOMQ_DELAY_STATS), what=what)
        return _json_body(resp.body, what, addr)

    # --- ACL 2.0 users and ACLs (RocketMQ 5.3's codes 3001-3010) ---------------------------------------
    async def _auth(self, addr: str, code: int, ext: dict[str, Any], body: Any, what: str) -> Any:
        data = b"" if body is None else json.dumps(body).encode("utf-8")
        resp = await self._instance.invoke_ok(addr, self._instance.request(code, ext, data), what=what)
        try:
            return fastjson.loads(resp.body) if resp.body else None
        except (ValueError, UnicodeDecodeError) as e:
            raise BrokerError(f"{what}: {addr} answered a body that is not JSON: {e}") from None

    async def create_user(self, addr: str, username: str, password: str, user_type: str = "Normal") -> None:
        await self._auth(addr, RequestCode.AUTH_CREATE_USER, {"username": username},
                         {"username": username, "password": password, "userType": user_type},
                         f"create user {username!r} on {addr}")

    async def update_user(self, addr: str, username: str, password: str | None = None,
                          user_type: str | None = None, user_status: str | None = None) -> None:
        body = {k: v for k, v in (("username", username), ("password", password), ("userType", user_type),
                                  ("userStatus", user_status)) if v}
        await self._auth(addr, RequestCode.AUTH_UPDATE_USER, {"username": username}, body,
                         f"update user {username!r} on {addr}")

    async def delete_user(self, addr: str, username: str) -> None:
        await self._auth(addr, RequestCode.AUTH_DELETE_USER, {"username": username}, None,
                         f"delete user {username!r} on {addr}")

    async def get_user(self, addr: str, username: str) -> dict[str, Any] | None:
        """The user's UserInfo (with its password, as RocketMQ answers it), or None."""
        got = await self._auth(addr, RequestCode.AUTH_GET_USER, {"username": username}, None,
                               f"get user {username!r} on {addr}")
        return got if isinstance(got, dict) else None

    async def list_users(self, addr: str, filter: str | None = None) -> list[dict[str, Any]]:
        got = await self._auth(addr, RequestCode.AUTH_LIST_USER, {"filter": filter} if filter else {}, None,
                               f"list users on {addr}")
        return list(got or [])

    async def create_acl(self, addr: str, subject: str, resources: Sequence[str], actions: Sequence[str],
                         source_ips: Sequence[str] = (), decision: str = "Allow", *,
                         update: bool = False) -> None:
        """One policy entry per resource (RocketMQ's AclInfo.of); ``update``: AUTH_UPDATE_ACL."""
        entries = [{"resource": r, "actions": list(actions), "sourceIps": list(source_ips),
                    "decision": decision} for r in resources]
        body = {"subject": subject, "policies": [{"policyType": "Custom", "entries": entries}]}
        code = RequestCode.AUTH_UPDATE_ACL if update else RequestCode.AUTH_CREATE_ACL
        await self._auth(addr, code, {"subject": subject}, body,
                         f"{'update' if update else 'create'} ACL of {subject!r} on {addr}")

    async def delete_acl(self, addr: str, subject: str, resource: str | None = None,
                         policy_type: str | None = None) -> None:
        ext = {k: v for k, v in (("subject", subject), ("resource", resource), ("policyType", policy_type))
               if v}
        await self._auth(addr, RequestCode.AUTH_DELETE_ACL, ext, None, f"delete ACL of {subject!r} on {addr}")

    async def get_acl(self, addr: str, subject: str) -> dict[str, Any] | None:
        got = await self._auth(addr, RequestCode.AUTH_GET_ACL, {"subject": subject}, None,
                               f"get ACL of {subject!r} on {addr}")
        return got if isinstance(got, dict) else None

    async def list_acls(self, addr: str, subject_filter: str | None = None,
                        resource_filter: str | None = None) -> list[dict[str, Any]]:
        ext = {k: v for k, v in (("subjectFilter", subject_filter), ("resourceFilter", resource_filter)) if v}
        got = await self._auth(addr, RequestCode.AUTH_LIST_ACL, ext, None, f"list ACLs on {addr}")
        return list(got or [])

    async def broker_consumer_ids(self, addr: str, group: str) -> list[str]:
        """Client ids of the group's consumers connected to the broker at ``addr`` ([] when it knows
        none: a broker answers that case with an error code)."""
        resp = await self._instance.invoke(
            addr, self._instance.request(RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": group}),
            what=f"consumers of group {group!r} on {addr}")
        if resp.code != ResponseCode.SUCCESS:
            return []
        ids = _json_body(resp.body, f"consumers of group {group!r}", addr).get("consumerIdList") or []
        return [str(i) for i in ids]

    async def broker_group_progress(self, addr: str, group: str,
                                    broker_name: str | None = None) -> list[QueueProgress]:
        """Every queue on which the group has a committed offset at the broker at ``addr`` (from its
        offset table: no topic needs naming), with the queue's max offset and the lag, ordered by
        topic@group then queue id. ``broker_name`` names the queues (default: ``addr``)."""
        what = f"consumer offsets on {addr}"
        resp = await self._instance.invoke_ok(
            addr, self._instance.request(RequestCode.GET_ALL_CONSUMER_OFFSET), what=what)
        table = _json_body(resp.body, what, addr).get("offsetTable") or {}
        rows: list[QueueProgress] = []
        for key, queues in sorted(table.items()):
            topic, _, owner = str(key).rpartition("@")
            if owner != group:
                continue
            last = await self._last_consumed(addr, group, topic)
            for q, committed in sorted(queues.items(), key=lambda kv: int(kv[0])):
                mq = MessageQueue(topic, broker_name or addr, int(q))
                resp = await self._instance.invoke_ok(
                    addr, self._instance.request(RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": q}),
                    what=f"max offset of {mq}")
                hi = resp.ext_int("offset", 0)
                rows.append(QueueProgress(mq, hi, int(committed), max(0, hi - int(committed)),
                                          last.get(int(q), 0)))
        return rows

    async def _last_consumed(self, addr: str, group: str, topic: str) -> dict[int, int]:
        """Per queue id, the store time of the last message ``group`` committed on ``topic`` at ``addr``
        (GET_CONSUME_STATS's lastTimestamp); empty where the broker keeps no statistics for it."""
        resp = await self._instance.invoke(
            addr, self._instance.request(RequestCode.GET_CONSUME_STATS,
                                         {"consumerGroup": group, "topic": topic}))
        if resp.code != ResponseCode.SUCCESS:
            return {}
        table = _json_body(resp.body, f"consume stats of group {group!r}", addr).get("offsetTable") or {}
        out: dict[int, int] = {}
        for key, row in table.items():
            try:
                mq, ts = json.loads(key), int(row.get("lastTimestamp") or 0)
                if mq.get("topic") == topic:
                    out[int(mq["queueId"])] = ts
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a row this reader does not understand: its time stays unknown
        return out

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
        after ``timestamp_ms``, from this client. Stop the group's consumers first: a running consumer
        commits its own position every few seconds and would overwrite the reset (``reset_offsets_by_time``
        tells running consumers instead)."""
        out: dict[MessageQueue, int] = {}
        for mq in await self.queues(topic):
            off = await ops.offset_for_timestamp(self._instance, mq, timestamp_ms)
            await ops.update_consumer_offset(self._instance, group, mq, off)
            out[mq] = off
        return out

    async def reset_offsets_by_time(self, group: str, topic: str, timestamp_ms: int, *, force: bool = True,
                                    broker_addr: str | None = None) -> dict[MessageQueue, int]:
        """Ask each broker serving ``topic`` (or only the one at ``broker_addr``) to move the group's
        offsets on its queues to the first message stored at or after ``timestamp_ms`` (-1: the end of
        each queue); without ``force`` a queue only moves back. The broker commits the offsets and tells
        the group's online consumers, which start again from there (INVOKE_BROKER_TO_RESET_OFFSET, as
        RocketMQ's mqadmin resetOffsetByTime). Returns the new offset per queue."""
        if broker_addr is not None:
            targets = [broker_addr]
        else:
            route = await self.route(topic)
            targets = sorted({a for name in route.broker_addrs if (a := route.master_addr(name))})
            if not targets:
                raise NoRouteError(f"no master broker serves topic {topic!r}")
        ext = {"topic": topic, "group": group, "timestamp": timestamp_ms, "offset": -1,
               "isForce": "true" if force else "false"}
        out: dict[MessageQueue, int] = {}
        for addr in targets:
            what = f"reset offsets of group {group!r} on topic {topic!r} at {addr}"
            resp = await self._instance.invoke_ok(
                addr, self._instance.request(RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, ext), what=what)
            for key, offset in (_json_body(resp.body, what, addr).get("offsetTable") or {}).items():
                q = json.loads(key)
                out[MessageQueue(str(q["topic"]), str(q["brokerName"]), int(q["queueId"]))] = int(offset)
        return dict(sorted(out.items()))

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
        end = end_ms if end_ms is not None else self._clock.now_ms() + 60_000
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

    async def message_trace(self, msg_id: str, topic: str | None = None) -> list[TraceRecord]:
        """The trace of a message, by its id (SendResult.msg_id / ReceivedMessage.id: the UNIQ_KEY that
        RocketMQ clients with message trace on write into their trace records): every record of it in the
        trace topic (``topic``, default RMQ_SYS_TRACE_TOPIC; a client's customizedTraceTopic otherwise),
        found by key as RocketMQ's dashboard finds them, oldest first. [] when there is none or the trace
        topic does not exist. A record without a client host gets the trace message's born host (where
        the dashboard reads it); a SubAfter without a group gets its SubBefore's (same request id). Trace
        messages whose body does not decode are skipped."""
        trace_topic = topic if topic is not None else TRACE_TOPIC
        self._check_ident(msg_id)
        try:
            found = await self.query_messages(trace_topic, msg_id, 64)
        except NoRouteError:
            return []
        rows: list[tuple[int, int, TraceRecord]] = []
        for msg in found:
            try:
                records = decode_trace_body(msg.body)
            except TraceDecodeError as e:
                log.debug("trace message %s in %s skipped: %s", msg.offset_msg_id, trace_topic, e)
                continue
            for r in records:
                if r.msg_id != msg_id:
                    continue
                if r.client_host is None:
                    r = replace(r, client_host=msg.born_host[0])
                when = r.timestamp if r.timestamp is not None else msg.born_timestamp
                rows.append((when, _TRACE_ORDER.get(r.type, 9), r))
        groups = {r.request_id: r.group for _, _, r in rows
                  if r.type == TraceType.SUB_BEFORE and r.request_id}
        out = []
        for _, _, r in sorted(rows, key=lambda x: (x[0], x[1])):
            if r.type == TraceType.SUB_AFTER and r.group is None and r.request_id in groups:
                r = replace(r, group=groups[r.request_id])
            out.append(r)
        return out

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

    # --- browsing: read-only views (nothing is committed) -------------------------------------------------
    async def consumer_groups(self) -> dict[str, list[str]]:
        """group -> the topics on which it has committed offsets (its retry topic among them), over every
        master broker's offset table, sorted."""
        out: dict[str, set[str]] = {}
        for _name, addr in await self.masters():
            what = f"consumer offsets on {addr}"
            resp = await self._instance.invoke_ok(
                addr, self._instance.request(RequestCode.GET_ALL_CONSUMER_OFFSET), what=what)
            for key in (_json_body(resp.body, what, addr).get("offsetTable") or {}):
                topic, _, group = str(key).rpartition("@")
                if topic and group:
                    out.setdefault(group, set()).add(topic)
        return {g: sorted(t) for g, t in sorted(out.items())}

    async def topic_offsets(self, topic: str) -> list[tuple[MessageQueue, int, int]]:
        """(queue, min offset, max offset) of every read queue of ``topic``."""
        qs = await self.queues(topic)

        async def one(mq: MessageQueue) -> tuple[MessageQueue, int, int]:
            lo, hi = await asyncio.gather(ops.min_offset(self._instance, mq),
                                          ops.max_offset(self._instance, mq))
            return mq, lo, hi

        return list(await asyncio.gather(*(one(q) for q in qs)))

    async def browse(self, topic: str, *, begin_ms: int | None = None, end_ms: int | None = None,
                     limit: int = 50, group: str = BROWSE_GROUP) -> list[ReceivedMessage]:
        """Messages of ``topic`` in store-time order, read without committing anything: with ``begin_ms``
        the first ``limit`` stored at or after it (and at or before ``end_ms`` when given), otherwise the
        newest ``limit`` (stored at or before ``end_ms`` when given)."""
        if not 1 <= limit <= MAX_BROWSE:
            raise ValueError(f"limit must be within 1..{MAX_BROWSE}, got {limit}")
        found: list[ReceivedMessage] = []
        for mq, lo, hi in await self.topic_offsets(topic):
            stop = hi
            if begin_ms is not None:
                offset = max(lo, await ops.offset_for_timestamp(self._instance, mq, begin_ms))
            else:
                if end_ms is not None:  # the newest at or before end_ms: count back from there
                    stop = min(hi, await ops.offset_for_timestamp(self._instance, mq, end_ms + 1) + 1)
                offset = max(lo, stop - limit)
            got = 0
            while offset < stop and got < limit:
                res = await ops.pull(self._instance, mq, offset, min(32, limit - got), group=group)
                if res.status == ops.PullStatus.OFFSET_ILLEGAL and res.next_offset > offset:
                    offset = res.next_offset
                    continue
                if res.status != ops.PullStatus.FOUND or not res.messages:
                    break
                for msg in res.messages:
                    if begin_ms is not None and msg.store_timestamp < begin_ms:
                        continue
                    if end_ms is not None and msg.store_timestamp > end_ms:
                        if begin_ms is not None:
                            got = limit  # past the window: this queue is done
                        continue
                    found.append(msg)
                    got += 1
                offset = max(offset + 1, res.next_offset)
        found.sort(key=lambda x: (x.store_timestamp, x.commit_log_offset))
        return found[:limit] if begin_ms is not None else found[-limit:]

    async def resend_dead_letter(self, offset_msg_id: str, *, producer_group: str = "CHRONOMQ_DLQ_REDRIVE"
                                 ) -> str:
        """Send a copy of one dead-letter message (named by its offset message id) back to its original
        topic; returns the new message's id. The dead letter itself stays where it is."""
        from .producer import Producer

        msg = await self.get_message(offset_msg_id)
        if not msg.raw_topic.startswith(m.DLQ_GROUP_TOPIC_PREFIX):
            raise ClientError(f"message {offset_msg_id} is in {msg.raw_topic!r}, not a dead-letter topic")
        copy = self._redrive_message(msg)
        producer = Producer(producer_group, self._instance.namesrv_addrs)
        await producer.start()
        try:
            return (await producer.send(copy)).msg_id
        finally:
            await producer.close()

    # --- chronomq extensions ---------------------------------------------------------------------------
    async def delay_stats(self, *, broker_addr: str | None = None) -> dict[str, dict[str, Any]]:
        """Delay-level statistics of every master broker (or the one at ``broker_addr``):
        {broker name: stats} (request code 9001)."""
        return {name: await self.broker_delay_stats(addr) for name, addr in await self.masters(broker_addr)}

    # --- chronomq timer store: cancel, reschedule, pending --------------------------------------------
    async def _timer_op(self, code: int, ext: dict[str, str], what: str,
                        broker_addr: str | None) -> list[TimerOpResult]:
        found: list[TimerOpResult] = []
        unknown: list[TimerOpResult] = []
        masters = await self.masters(broker_addr)
        if ext["byKey"] == "false" and broker_addr is None:
            # a timer handle (offset msg id with the timer flag) names a position in ONE broker's timer
            # store: asking the others would make them read that position in theirs
            owner = _timer_handle_addr(ext["id"])
            masters = [(n, a) for n, a in masters if a == owner] or masters
        for name, addr in masters:
            resp = await self._instance.invoke_ok(addr, self._instance.request(code, ext), what=what)
            data = _json_body(resp.body, what, addr)
            try:
                results = [TimerOpResult.from_dict(d, name) for d in data.get("results") or []]
            except (KeyError, TypeError, ValueError) as e:
                raise BrokerError(f"{what}: {addr} answered a malformed result: {e}") from None
            for r in results:
                (unknown if r.outcome == TimerOutcome.UNKNOWN else found).append(r)
        if found:
            return found
        return unknown[:1] or [TimerOpResult(TimerOutcome.UNKNOWN, ext["id"])]

    @staticmethod
    def _check_ident(ident: str) -> str:
        if not isinstance(ident, str) or not ident or "\x01" in ident or "\x02" in ident:
            raise ValueError(f"a message id or key must be a non-empty str, got {ident!r}")
        return ident

    async def cancel(self, msg_id: str, by_key: bool = False, *,
                     broker_addr: str | None = None) -> list[TimerOpResult]:
        """Cancel a message waiting in the timer store (sent with deliver_at/delay), by its id
        (SendResult.uniq_key / msg_id, or its offset_msg_id) or, with ``by_key=True``, every pending
        message with that key (a word of KEYS). Returns one definite result per matching message:
        CANCELLED, ALREADY_DELIVERED, ALREADY_CANCELLED, FAILED, or a single UNKNOWN when nothing
        matched on any broker. ``broker_addr``: ask only that broker."""
        ext = {"id": self._check_ident(msg_id), "byKey": "true" if by_key else "false"}
        return await self._timer_op(RequestCode.CHRONOMQ_CANCEL_SCHEDULED, ext, f"cancel {msg_id!r}",
                                    broker_addr)

    async def reschedule(self, msg_id: str, deliver_at: datetime | int | None = None, by_key: bool = False,
                         *, delay: timedelta | float | None = None,
                         broker_addr: str | None = None) -> list[TimerOpResult]:
        """Move a pending message (or, ``by_key=True``, every pending message with that key) to a new
        deliver time: ``deliver_at`` (timezone-aware datetime or epoch ms) or ``delay`` (timedelta or
        seconds from now). Results: RESCHEDULED (deliver_ms = the new time), ALREADY_DELIVERED,
        ALREADY_CANCELLED, FAILED, or a single UNKNOWN. A delay counts from the admin's clock.
        ``broker_addr``: ask only that broker."""
        if (deliver_at is None) == (delay is None):
            raise ValueError("give deliver_at or delay (exactly one)")
        deliver_ms = deliver_time_ms(deliver_at, delay, self._clock.now_ms())
        ext = {"id": self._check_ident(msg_id), "byKey": "true" if by_key else "false",
               "deliverMs": str(deliver_ms)}
        return await self._timer_op(RequestCode.CHRONOMQ_RESCHEDULE, ext, f"reschedule {msg_id!r}",
                                    broker_addr)

    @staticmethod
    def _pending_ext(topic: str | None, key: str | None, tag: str | None, start: datetime | int | None,
                     end: datetime | int | None) -> dict[str, str]:
        ext: dict[str, str] = {}
        for name, v in (("topic", topic), ("key", key), ("tag", tag)):
            if v is not None:
                if not isinstance(v, str) or not v:
                    raise ValueError(f"{name} must be a non-empty str, got {v!r}")
                ext[name] = v
        s, e = _window_ms(start, "start"), _window_ms(end, "end")
        if s is not None:
            ext["startMs"] = str(s)
        if e is not None:
            ext["endMs"] = str(e)
        if s is not None and e is not None and e < s:
            raise ValueError(f"end ({e}) is before start ({s})")
        return ext

    async def pending(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
                      start: datetime | int | None = None, end: datetime | int | None = None,
                      limit: int = 100, cursor: str | None = None, *,
                      broker_addr: str | None = None) -> PendingPage:
        """One page of the messages waiting in the brokers' timer stores, ordered by broker then deliver
        time, filtered by topic, key (a word of KEYS or the id), tag and a deliver-time window
        [start, end] (timezone-aware datetimes or epoch ms). ``limit``: 1..1000 items per page; pass the
        page's ``next_cursor`` back as ``cursor`` for the next one. ``broker_addr``: ask only that
        broker (its items are named by the address)."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise ValueError(f"limit must be an int within 1..1000, got {limit!r}")
        base = self._pending_ext(topic, key, tag, start, end)
        bname, inner = _decode_cursor(cursor) if cursor is not None else (None, None)
        masters = await self.masters(broker_addr)
        names = [n for n, _ in masters]
        first = 0
        if bname is not None:
            if bname not in names:
                raise ValueError(f"the cursor names broker {bname!r}, which is not in the cluster "
                                 f"({', '.join(names)})")
            first = names.index(bname)
        items: list[PendingMessage] = []
        for i in range(first, len(masters)):
            name, addr = masters[i]
            if len(items) >= limit:
                return PendingPage(items, _encode_cursor(name, None))
            ext = dict(base, limit=str(limit - len(items)))
            if i == first and inner:
                ext["cursor"] = inner
            what = f"pending messages of {name}"
            resp = await self._instance.invoke_ok(
                addr, self._instance.request(RequestCode.CHRONOMQ_QUERY_PENDING, ext), what=what)
            data = _json_body(resp.body, what, addr)
            try:
                items.extend(PendingMessage.from_dict(d, name) for d in data.get("items") or [])
            except (KeyError, TypeError, ValueError) as e:
                raise BrokerError(f"{what}: {addr} answered a malformed item: {e}") from None
            nxt = data.get("next_cursor")
            if nxt:
                return PendingPage(items, _encode_cursor(name, str(nxt)))
        return PendingPage(items, None)

    async def pending_count(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
                            start: datetime | int | None = None, end: datetime | int | None = None, *,
                            broker_addr: str | None = None) -> int:
        """How many messages wait in the brokers' timer stores (same filters as ``pending``)."""
        return sum((await self.pending_counts(topic, key, tag, start, end, broker_addr=broker_addr)).values())

    async def pending_counts(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
                             start: datetime | int | None = None, end: datetime | int | None = None, *,
                             broker_addr: str | None = None) -> dict[str, int]:
        """How many messages wait in each broker's timer store: {broker name: count}, in name order."""
        ext = dict(self._pending_ext(topic, key, tag, start, end), countOnly="true")
        counts: dict[str, int] = {}
        for name, addr in await self.masters(broker_addr):
            what = f"pending count of {name}"
            resp = await self._instance.invoke_ok(
                addr, self._instance.request(RequestCode.CHRONOMQ_QUERY_PENDING, ext), what=what)
            data = _json_body(resp.body, what, addr)
            try:
                counts[name] = int(data["count"])
            except (KeyError, TypeError, ValueError):
                raise BrokerError(f"{what}: {addr} answered no count: {data!r}"[:500]) from None
        return counts
