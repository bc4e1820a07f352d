"""The 5.x MessagingService RPCs, answered from the broker's services: routes, settings, sends through
the 4.x send path (``LocalCalls``), pop-style receives from the store with invisibility kept in
``PopTable``, acks, invisibility changes, dead-lettering, recall of timed messages, transactions.

Rules: every answer carries a v2 ``Status``; an unexpected error is answered INTERNAL_ERROR, never a
hang. Runs on the broker's event loop; store reads are the same inline reads the 4.x pull path makes.
Time comes from the broker's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from chronomq.broker.inproc import Answer, AnswerKind, LocalCalls
from chronomq.broker.processors.pull import MAX_PULL_BYTES, TagFilter
from chronomq.broker.services import BrokerServices
from chronomq.broker.topics import PERM_READ, PERM_WRITE, TopicConfig
from chronomq.delay.timer.types import Outcome
from chronomq.filter import FilterSyntaxError, Selector, compile_sql92
from chronomq.filter.records import record_filter
from chronomq.message import PROPERTY_TAGS, MessageExt, decode_record, validate_topic
from chronomq.store.types import GetStatus

from . import convert
from ._proto import rocketmq_v2_pb2 as pb
from .auth import Guard
from .convert import BadMessage, Receipt, status
from .pop import MAX_INFLIGHT_PER_QUEUE, AckOutcome, PopTable, QueueState
from .telemetry import TelemetryChannel

log = logging.getLogger("chronomq.grpc")

ALL_TYPES = (pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION)  # chronomq's topics take every kind
MAX_BATCH = 32
MAX_POLL_MS = 60_000
POLL_RESERVE_MS = 500  # a long poll ends this long before the call's deadline: room for the answer
DEFAULT_REQUEST_TIMEOUT_MS = 3_000  # a client's request timeout when its settings did not say (Java's)
AUTO_RENEW_INVISIBLE_MS = 60_000  # a push consumer's receive (auto_renew): Java's default
DLQ_RETRY_MS = 60_000  # a dead-lettering that failed is tried again after this long
MAX_CLIENTS = 100_000
OK = pb.OK
# a 5.x consumer's retry backoff (the settings reply): Java's default customized backoff
CONSUMER_BACKOFF_S = (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)
_SEND_CODES = {
    AnswerKind.ILLEGAL: pb.BAD_REQUEST,
    AnswerKind.TOPIC_NOT_FOUND: pb.TOPIC_NOT_FOUND,
    AnswerKind.FORBIDDEN: pb.FORBIDDEN,
    AnswerKind.UNAVAILABLE: pb.INTERNAL_SERVER_ERROR,
    AnswerKind.BUSY: pb.TOO_MANY_REQUESTS,
    AnswerKind.FLUSH_TIMEOUT: pb.MASTER_PERSISTENCE_TIMEOUT,
    AnswerKind.SLAVE_TIMEOUT: pb.SLAVE_PERSISTENCE_TIMEOUT,
    AnswerKind.ERROR: pb.INTERNAL_ERROR,
}



def overall_status(entries: Sequence[Any], what: str) -> pb.Status:
    """A batch answer's own status, as RocketMQ's proxy sets it: the entries' one code with its name as the
    text (clients build their exception from it; each entry keeps its detailed text), MULTIPLE_RESULTS
    when the codes differ, INTERNAL_SERVER_ERROR when there is no entry."""
    codes = {e.status.code for e in entries}
    if len(codes) > 1:
        return status(pb.MULTIPLE_RESULTS)
    if codes:
        return status(codes.pop())
    return status(pb.INTERNAL_SERVER_ERROR, f"{what} message result is empty")

class Refused(Exception):
    """A request answered with ``code`` (a v2 Code) and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class SqlFilter:
    """A receive's SQL92 FilterExpression, shaped as TagFilter for the receive path: no tag predicate
    (RocketMQ reads every record of the queue for a SQL subscription), a record filter instead."""

    __slots__ = ("records",)
    tags = None

    def __init__(self, selector: Selector) -> None:
        self.records = record_filter(selector)

    def predicate(self) -> None:
        return None


@dataclass
class ClientRecord:
    client_type: int
    group: str
    last_seen_ms: int
    peer: str


def _metadata(ctx: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (ctx.invocation_metadata() or ()) if isinstance(v, str)}


def _peer(peer: str) -> tuple[str, int]:
    """ipv4:127.0.0.1:5555 -> ("127.0.0.1", 5555)."""
    kind, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]") if kind in ("ipv4", "ipv6") else "0.0.0.0"
    return host or "0.0.0.0", int(port) if port.isdigit() else 0


class MessagingService:
    """One object per broker; ``address`` is what routes advertise (host, port) for this endpoint."""

    def __init__(self, services: BrokerServices, calls: LocalCalls, address: tuple[str, int]) -> None:
        self.services = services
        self.calls = calls
        self.address = address
        self.store = services.store
        self.clock = services.clock
        self.config = services.config
        self.pop = PopTable(services.offsets.path.parent)  # beside consumerOffset.json
        # grpc's peer() -> the client's address: the server's front relays every connection from 127.0.0.1
        self.peer_of: Callable[[str], str] = lambda peer: peer
        self.guard: Guard | None = None  # the accounts' check, when an ACL is on
        for (group, topic, q), st in self.pop.queues.items():  # consumerOffset.json may be older
            services.offsets.commit(group, topic, q, st.committed)
        self.clients: dict[str, ClientRecord] = {}
        self._channels: dict[str, TelemetryChannel] = {}  # producers' Telemetry streams, by client id
        self._fifo_events: dict[tuple[str, str], asyncio.Event] = {}  # FIFO receives waiting for an ack
        self._filters: dict[str, TagFilter] = {}
        self._sql_filters: dict[str, SqlFilter] = {}
        self._request_timeouts: dict[str, int] = {}  # a client's request timeout (ms), from its settings
        self._rr = itertools.count()
        self.sent = 0
        self.received = 0

    def _client_peer(self, ctx: grpc.aio.ServicerContext) -> str:
        """The client's address as grpc writes a peer (ipv4:host:port), not the front's relay."""
        return self.peer_of(ctx.peer() or "")

    def refused(self, rpc: str, req: Any, ctx: grpc.aio.ServicerContext) -> pb.Status | None:
        """UNAUTHORIZED when the guard refuses the call (``req`` None: its credentials only), else None."""
        if self.guard is None:
            return None
        peer = self._client_peer(ctx)
        reason = self.guard.refusal(rpc, req, _metadata(ctx), _peer(peer)[0], peer)
        return None if reason is None else status(pb.UNAUTHORIZED, reason)

    # --- shared checks -------------------------------------------------------------------------------------
    def _topic(self, name: str, *, create: bool = False) -> TopicConfig:
        reason = validate_topic(name)
        if reason:
            raise Refused(pb.ILLEGAL_TOPIC, reason)
        if self.services.topics.is_system_topic(name):  # RocketMQ's proxy: GrpcValidator.validateTopic
            raise Refused(pb.ILLEGAL_TOPIC, "cannot access system topic")
        topic_config = self.services.topics.get(name)
        if topic_config is None and create and self.config.autoCreateTopicEnable:
            topic_config = self.services.topics.create_in_send(name, None, 0)
        if topic_config is None:  # the name server's words, which RocketMQ's proxy passes on
            raise Refused(pb.TOPIC_NOT_FOUND, f"No topic route info in name server for the topic: {name}")
        return topic_config

    @staticmethod
    def _group(res: pb.Resource) -> str:
        name = res.name
        if not name or validate_topic(name):
            raise Refused(pb.ILLEGAL_CONSUMER_GROUP, f"illegal consumer group {name!r}")
        return name

    def _broker(self) -> pb.Broker:
        host, port = self.address
        return pb.Broker(
            name=self.config.brokerName,
            id=0,
            endpoints=pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host=host, port=port)]),
        )

    def _queue(self, topic: str, queue_id: int, perm: int) -> pb.MessageQueue:
        return pb.MessageQueue(
            topic=pb.Resource(name=topic),
            id=queue_id,
            permission=perm,
            broker=self._broker(),
            accept_message_types=ALL_TYPES,
        )

    def _touch(self, ctx: grpc.aio.ServicerContext, client_type: int, group: str) -> None:
        cid = _metadata(ctx).get("x-mq-client-id", "")
        if not cid:
            return
        now = self.clock.now_ms()
        if cid not in self.clients and len(self.clients) >= MAX_CLIENTS:
            idle = self.config.clientChannelMaxIdleTimeSeconds * 1000
            for k in [k for k, c in self.clients.items() if now - c.last_seen_ms > idle]:
                del self.clients[k]
            if len(self.clients) >= MAX_CLIENTS:
                return
        old = self.clients.get(cid)
        self.clients[cid] = ClientRecord(
            client_type or (old.client_type if old else 0),
            group or (old.group if old else ""),
            now,
            self._client_peer(ctx),
        )

    # --- QueryRoute, QueryAssignment ----------------------------------------------------------------------
    async def query_route(
        self, req: pb.QueryRouteRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.QueryRouteResponse:
        # never created here, whatever autoCreateTopicEnable says: RocketMQ's proxy answers TOPIC_NOT_FOUND
        # (so a 5.x producer or consumer started on a topic that does not exist fails to start)
        topic_config = self._topic(req.topic.name)
        n = max(topic_config.readQueueNums, topic_config.writeQueueNums)
        queues = []
        for q in range(n):
            r = bool(topic_config.perm & PERM_READ) and q < topic_config.readQueueNums
            w = bool(topic_config.perm & PERM_WRITE) and q < topic_config.writeQueueNums
            perm = pb.READ_WRITE if r and w else pb.READ if r else pb.WRITE if w else pb.NONE
            queues.append(self._queue(topic_config.topicName, q, perm))
        return pb.QueryRouteResponse(status=status(OK), message_queues=queues)

    async def query_assignment(
        self, req: pb.QueryAssignmentRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.QueryAssignmentResponse:
        self._group(req.group)
        topic_config = self._topic(req.topic.name)
        if not topic_config.perm & PERM_READ or topic_config.readQueueNums <= 0:
            raise Refused(pb.FORBIDDEN, f"topic {topic_config.topicName} has no readable queue")
        # one assignment for the whole broker: its receives pop from any queue (Java's, for non-FIFO groups)
        perm = pb.READ_WRITE if topic_config.perm & PERM_WRITE else pb.READ
        mq = self._queue(topic_config.topicName, -1, perm)
        return pb.QueryAssignmentResponse(status=status(OK), assignments=[pb.Assignment(message_queue=mq)])

    # --- Heartbeat, Telemetry, NotifyClientTermination ----------------------------------------------------
    async def heartbeat(
        self, req: pb.HeartbeatRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        self._touch(ctx, req.client_type, req.group.name if req.HasField("group") else "")
        channel = self._channels.get(_metadata(ctx).get("x-mq-client-id", ""))
        if channel is not None:
            channel.refresh(self.services.producers, self.clock.now_ms())
        return pb.HeartbeatResponse(status=status(OK))

    async def notify_client_termination(
        self, req: pb.NotifyClientTerminationRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.NotifyClientTerminationResponse:
        cid = _metadata(ctx).get("x-mq-client-id", "")
        self.clients.pop(cid, None)
        channel = self._channels.pop(cid, None)
        if channel is not None:
            channel.unregister(self.services.producers)
        return pb.NotifyClientTerminationResponse(status=status(OK))

    async def telemetry(
        self, requests: AsyncIterator[pb.TelemetryCommand], ctx: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TelemetryCommand]:
        """Each settings command is answered with the settings the client is to use (a producer's also
        registers it for transaction checks); other commands from the client (stack traces, verify
        results) need no answer. The server's own commands (transaction checks) go out on the same
        stream. It stays open until the client ends it or the server stops."""
        refused = self.refused("Telemetry", None, ctx)
        if refused is not None:
            yield pb.TelemetryCommand(status=refused)
            return
        peer = self._client_peer(ctx)
        channel = TelemetryChannel(_metadata(ctx).get("x-mq-client-id", "") or peer, peer)
        reader = asyncio.ensure_future(self._read_telemetry(requests, ctx, channel))
        try:
            async for out in channel.outgoing():
                yield out
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            channel.unregister(self.services.producers)
            if self._channels.get(channel.client_id) is channel:
                del self._channels[channel.client_id]

    async def _read_telemetry(
        self, requests: AsyncIterator[pb.TelemetryCommand], ctx: grpc.aio.ServicerContext,
        channel: TelemetryChannel,
    ) -> None:
        try:
            async for cmd in requests:
                if cmd.WhichOneof("command") != "settings":
                    continue
                refused = self.refused("Telemetry", cmd, ctx)
                if refused is not None:
                    channel.put(pb.TelemetryCommand(status=refused))
                    continue
                s = cmd.settings
                group = s.subscription.group.name if s.HasField("subscription") else ""
                self._touch(ctx, s.client_type, group)
                if s.HasField("request_timeout") and channel.client_id:
                    if len(self._request_timeouts) >= MAX_CLIENTS:
                        self._request_timeouts.clear()
                    self._request_timeouts[channel.client_id] = convert.duration_ms(s.request_timeout)
                if s.HasField("publishing"):
                    self._channels[channel.client_id] = channel
                    topics = [t.name for t in s.publishing.topics]
                    channel.register(self.services.producers, topics, self.clock.now_ms())
                channel.put(pb.TelemetryCommand(status=status(OK), settings=self.settings_reply(s)))
        finally:
            channel.close()

    def settings_reply(self, s: pb.Settings) -> pb.Settings:
        """The client's settings completed with the server's: body size and message type check for a
        producer, batch size, polling time and retry backoff for a consumer."""
        out = pb.Settings()
        out.CopyFrom(s)
        out.metric.CopyFrom(pb.Metric(on=False))
        if s.client_type == pb.PRODUCER or s.HasField("publishing"):
            out.publishing.max_body_size = self.config.maxMessageSize
            out.publishing.validate_message_type = True
            out.backoff_policy.CopyFrom(
                pb.RetryPolicy(
                    max_attempts=3,
                    exponential_backoff=pb.ExponentialBackoff(
                        initial=convert.duration(10), max=convert.duration(1000), multiplier=2.0
                    ),
                )
            )
        else:
            sub = out.subscription
            sub.fifo = self._is_fifo(sub.group.name)
            sub.receive_batch_size = MAX_BATCH
            if not sub.HasField("long_polling_timeout") or convert.duration_ms(sub.long_polling_timeout) <= 0:
                sub.long_polling_timeout.CopyFrom(convert.duration(20_000))
            out.backoff_policy.CopyFrom(
                pb.RetryPolicy(
                    max_attempts=self.config.maxReconsumeTimes + 1,
                    customized_backoff=pb.CustomizedBackoff(
                        next=[convert.duration(x * 1000) for x in CONSUMER_BACKOFF_S]
                    ),
                )
            )
        return out

    # --- SendMessage --------------------------------------------------------------------------------------
    async def send_message(
        self, req: pb.SendMessageRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.SendMessageResponse:
        if not req.messages:
            raise Refused(pb.BAD_REQUEST, "no message to send")
        entries = [await self._send_one(m, ctx) for m in req.messages]
        return pb.SendMessageResponse(status=overall_status(entries, "send"), entries=entries)

    async def _send_one(self, m: pb.Message, ctx: grpc.aio.ServicerContext) -> pb.SendResultEntry:
        try:
            if self.config.is_slave:
                raise Refused(pb.FORBIDDEN, "this broker is a slave: it takes messages only from its master")
            topic_config = self._topic(m.topic.name, create=True)
            out = convert.from_v2(m, self.config.maxMessageSize, self._limits())
            if (
                out.deliver_ms is not None
                and out.deliver_ms > self.clock.now_ms() + self.config.timerMaxDelaySec * 1000
            ):
                raise Refused(
                    pb.ILLEGAL_DELIVERY_TIME,
                    f"the delivery time is more than timerMaxDelaySec "
                    f"({self.config.timerMaxDelaySec} s) ahead",
                )
        except BadMessage as e:
            return pb.SendResultEntry(
                status=status(e.code, str(e)), message_id=m.system_properties.message_id
            )
        except Refused as e:
            return pb.SendResultEntry(
                status=status(e.code, str(e)), message_id=m.system_properties.message_id
            )
        queue_id = convert.fifo_queue(out.group, topic_config.writeQueueNums) if out.group is not None else -1
        peer = _peer(self._client_peer(ctx))
        born_host = (out.born_host[0] if out.born_host[0] != "0.0.0.0" else peer[0], peer[1])
        a = await self.calls.send(
            out.topic,
            out.properties,
            out.body,
            queue_id=queue_id,
            born_ms=out.born_ms or self.clock.now_ms(),
            born_host=born_host,
            producer_group=out.topic if out.transactional else "",  # 5.x producers have no group: the topic
            transactional=out.transactional,
        )
        return self._send_entry(out, a)

    def _limits(self) -> convert.Limits:
        c = self.config
        return convert.Limits(c.maxUserPropertySize, c.userPropertyMaxNum, c.maxMessageGroupSize)

    def _send_entry(self, out: convert.Outgoing, a: Answer) -> pb.SendResultEntry:
        if a.kind is not AnswerKind.OK:
            code = _SEND_CODES.get(a.kind, pb.INTERNAL_ERROR)
            if a.kind is AnswerKind.ILLEGAL and out.deliver_ms is not None:  # the timer refused the time
                code = pb.ILLEGAL_DELIVERY_TIME
            return pb.SendResultEntry(status=status(code, a.remark or a.kind.value),
                                      message_id=out.message_id)
        self.sent += 1
        entry = pb.SendResultEntry(
            status=status(OK), message_id=out.message_id, offset=max(0, a.queue_offset)
        )
        if out.transactional:
            entry.transaction_id = f"{a.msg_id}.{a.queue_offset}"
        if a.uniq_key:  # parked in the timer: the handle RecallMessage takes
            entry.recall_handle = f"{out.topic} {a.uniq_key}"
        return entry

    # --- RecallMessage, EndTransaction ----------------------------------------------------------------------
    async def recall_message(
        self, req: pb.RecallMessageRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.RecallMessageResponse:
        topic, _, key = req.recall_handle.partition(" ")
        if not key or topic != req.topic.name:
            raise Refused(pb.BAD_REQUEST, "not a recall handle of this topic")
        results = self.services.timer.cancel(key, False)
        outcome = results[0].outcome if results else Outcome.UNKNOWN
        if outcome is Outcome.CANCELLED:
            return pb.RecallMessageResponse(status=status(OK), message_id=key)
        words = {
            Outcome.ALREADY_DELIVERED: "the message was delivered already",
            Outcome.ALREADY_CANCELLED: "the message was recalled already",
        }
        raise Refused(pb.NOT_FOUND, words.get(outcome, f"no timed message {key} ({outcome.value})"))

    async def end_transaction(
        self, req: pb.EndTransactionRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.EndTransactionResponse:
        msg_id, _, qoff = req.transaction_id.partition(".")
        if not qoff.isdigit() or len(msg_id) != 32:
            raise Refused(pb.INVALID_TRANSACTION_ID, f"unknown transaction id {req.transaction_id!r}")
        if req.resolution == pb.TRANSACTION_RESOLUTION_UNSPECIFIED:
            return pb.EndTransactionResponse(status=status(OK, "unknown: the message stays undecided"))
        commit = req.resolution == pb.COMMIT
        a = await self.calls.end_transaction(req.topic.name, msg_id, int(qoff), commit)
        if a.kind is not AnswerKind.OK:
            raise Refused(
                pb.INVALID_TRANSACTION_ID
                if a.kind is AnswerKind.ERROR
                else _SEND_CODES.get(a.kind, pb.INTERNAL_ERROR),
                a.remark or a.kind.value,
            )
        return pb.EndTransactionResponse(status=status(OK, a.remark))

    # --- ReceiveMessage -------------------------------------------------------------------------------------
    def _filter(self, fe: pb.FilterExpression) -> TagFilter | SqlFilter:
        if fe.type == pb.SQL:
            if not self.config.enablePropertyFilter:
                raise Refused(pb.ILLEGAL_FILTER_EXPRESSION, "SQL92 filters are not supported; filter by tag")
            sql = self._sql_filters.get(fe.expression)
            if sql is None:
                try:
                    selector = compile_sql92(fe.expression)
                except FilterSyntaxError as e:
                    raise Refused(pb.ILLEGAL_FILTER_EXPRESSION, str(e)) from None
                if len(self._sql_filters) > 10_000:
                    self._sql_filters.clear()
                sql = self._sql_filters[fe.expression] = SqlFilter(selector)
            return sql
        expr = fe.expression or "*"
        f = self._filters.get(expr)
        if f is None:
            if len(self._filters) > 10_000:
                self._filters.clear()
            f = self._filters[expr] = TagFilter(expr)
        return f

    async def receive_message(
        self, req: pb.ReceiveMessageRequest, ctx: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReceiveMessageResponse]:
        refused = self.refused("ReceiveMessage", req, ctx)
        if refused is not None:
            yield pb.ReceiveMessageResponse(status=refused)
            return
        try:
            msgs = await self._receive(req, ctx)
        except Refused as e:
            msgs, st = [], status(e.code, str(e))
        except Exception as e:
            log.exception("ReceiveMessage failed")
            msgs, st = [], status(pb.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
        else:
            st = status(OK) if msgs else status(pb.MESSAGE_NOT_FOUND, "no new message")
        yield pb.ReceiveMessageResponse(status=st)
        for m in msgs:
            yield pb.ReceiveMessageResponse(message=m)
        yield pb.ReceiveMessageResponse(delivery_timestamp=convert.timestamp(self.clock.now_ms()))

    async def _receive(
        self, req: pb.ReceiveMessageRequest, ctx: grpc.aio.ServicerContext
    ) -> list[pb.Message]:
        if self.config.is_slave:  # pops move the group's offsets: only the master keeps them
            raise Refused(pb.FORBIDDEN, "this broker is a slave: receive from its master")
        group = self._group(req.group)
        topic_config = self._topic(req.message_queue.topic.name)
        topic = topic_config.topicName
        if not topic_config.perm & PERM_READ:
            raise Refused(pb.FORBIDDEN, f"topic {topic} is not readable")
        tag_filter = self._filter(req.filter_expression)
        batch = req.batch_size if 0 < req.batch_size <= MAX_BATCH else MAX_BATCH
        if req.auto_renew and not req.HasField("invisible_duration"):
            invisible = AUTO_RENEW_INVISIBLE_MS
        else:  # none given is 0: too small; RocketMQ's proxy puts its own in an auto_renew receive's
            invisible = convert.duration_ms(req.invisible_duration)
            least = 1 if req.auto_renew else self.config.minInvisibleTimeMillsForRecv
            self._check_invisible(invisible, least)
        qid = req.message_queue.id
        nread = topic_config.readQueueNums
        if qid >= nread:
            raise Refused(
                pb.BAD_REQUEST, f"queue {qid} of {topic} is not readable ({nread} read queues)"
            )
        # every queue, whichever the request names: RocketMQ's proxy pops from the whole broker the queue
        # belongs to, and clients rely on that (the Node.js client only ever names queue 0)
        start = next(self._rr) % max(1, nread)
        queues = [(start + i) % nread for i in range(nread)]
        remaining = ctx.time_remaining()
        remaining_ms = None if remaining is None else int(remaining * 1000)
        if req.HasField("long_polling_timeout"):
            poll_ms = convert.duration_ms(req.long_polling_timeout)
        else:
            poll_ms = self._default_poll_ms(ctx, remaining_ms)
        if remaining_ms is not None:  # answer before the client's deadline, with room for the answer
            poll_ms = min(poll_ms, remaining_ms - POLL_RESERVE_MS)
        deadline = self.clock.now_ms() + max(0, min(poll_ms, MAX_POLL_MS))
        fifo = self._is_fifo(group)
        msgs = await self._pop(group, topic, queues, batch, invisible, tag_filter, deadline, fifo)
        self.received += len(msgs)
        return msgs

    def _check_invisible(self, ms: int, least: int) -> None:
        """The proxy's check (GrpcValidator.validateInvisibleTime) and texts."""
        if ms < least:
            raise Refused(pb.ILLEGAL_INVISIBLE_TIME, f"the invisibleTime is too small. min is {least}")
        most = self.config.maxInvisibleTimeMills
        if ms > most:
            raise Refused(pb.ILLEGAL_INVISIBLE_TIME, f"the invisibleTime is too large. max is {most}")

    def _default_poll_ms(self, ctx: grpc.aio.ServicerContext, remaining_ms: int | None) -> int:
        """How long a receive without long_polling_timeout is held, as RocketMQ's proxy reckons it: the
        call's time remaining less half the client's request timeout (from its settings), within
        grpcClientConsumerMin/MaxLongPollingTimeoutMillis, and never past the deadline."""
        least = self.config.grpcClientConsumerMinLongPollingTimeoutMillis
        most = self.config.grpcClientConsumerMaxLongPollingTimeoutMillis
        if remaining_ms is None:
            return most
        cid = _metadata(ctx).get("x-mq-client-id", "")
        timeout = self._request_timeouts.get(cid, DEFAULT_REQUEST_TIMEOUT_MS)
        return min(max(remaining_ms - timeout // 2, least), most, remaining_ms)

    def _start_offset(self, group: str, topic: str, queue_id: int) -> int:
        """Where a group's first receive from a queue starts: its committed offset (a 4.x consumer of
        the same group may have left one), else the queue's first message."""
        committed = self.services.offsets.query(group, topic, queue_id)
        return committed if committed >= 0 else self.store.get_min_offset_in_queue(topic, queue_id)

    async def _pop(
        self,
        group: str,
        topic: str,
        queues: list[int],
        batch: int,
        invisible: int,
        tag_filter: TagFilter | SqlFilter,
        deadline: int,
        fifo: bool = False,
    ) -> list[pb.Message]:
        states = [(q, self.pop.state(group, topic, q, self._start_offset(group, topic, q))) for q in queues]
        for _ in range(100_000):  # each round either answers or waits for an arrival, a redelivery or the end
            out: list[pb.Message] = []
            for q, st in states:
                if len(out) < batch:
                    room = batch - len(out)
                    out += await self._take(group, topic, q, st, room, invisible, tag_filter, fifo)
            now = self.clock.now_ms()
            if out or now >= deadline or self.services.stopping:
                try:
                    await self.pop.save()
                except OSError as e:  # not handed out: they come back when their invisibility ends
                    raise Refused(
                        pb.INTERNAL_SERVER_ERROR, f"cannot persist the in-flight table: {e}"
                    ) from None
                return out
            wake = min([deadline] + [t for _, st in states if (t := st.next_visible_ms()) is not None])
            unblocked = self._fifo_event(group, topic) if fifo else None
            await self._wait(topic, states, max(wake, now + 1), unblocked)
        return []

    def _is_fifo(self, group: str) -> bool:
        """A FIFO group: named in ``grpcFifoGroups``, or its subscription group is ``consumeMessageOrderly``
        (as RocketMQ's proxy decides, from the group made with UPDATE_AND_CREATE_SUBSCRIPTIONGROUP)."""
        if group in self.config.fifo_groups:
            return True
        cfg = self.services.subscription_group(group)
        return cfg is not None and cfg.consumeMessageOrderly

    def _fifo_event(self, group: str, topic: str) -> asyncio.Event:
        """Set when a message of a FIFO group's topic is acked (or its invisibility changed): a queue held
        back for it may hand out its next message."""
        key = (group, topic)
        ev = self._fifo_events.get(key)
        if ev is None:
            if len(self._fifo_events) >= MAX_CLIENTS:
                self._fifo_events.clear()
            ev = self._fifo_events[key] = asyncio.Event()
        return ev

    def _wake_fifo(self, group: str, topic: str) -> None:
        ev = self._fifo_events.pop((group, topic), None)
        if ev is not None:
            ev.set()

    async def _wait(
        self, topic: str, states: list[tuple[int, QueueState]], until: int, unblocked: asyncio.Event | None
    ) -> None:
        hold = self.services.hold

        def current(q: int) -> Callable[[], int]:
            return lambda: self.store.get_max_offset_in_queue(topic, q)

        waits = [asyncio.ensure_future(hold.wait(topic, q, st.next, until, current(q))) for q, st in states]
        if unblocked is not None:
            waits.append(asyncio.ensure_future(unblocked.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            # asyncio.wait, not awaiting each: a cancel of this handler meanwhile goes on to its caller
            await asyncio.wait(waits)
            for w in waits:
                if not w.cancelled():
                    w.exception()  # retrieved: a failed wait only ends the hold

    def _read(self, topic: str, queue_id: int, offset: int) -> MessageExt | None:
        r = self.store.get_message(topic, queue_id, offset, 1, max_bytes=MAX_PULL_BYTES)
        if r.status is not GetStatus.FOUND or not r.messages:
            return None
        m = decode_record(r.messages[0])
        return m if m.queue_offset == offset else None

    async def _take(
        self,
        group: str,
        topic: str,
        q: int,
        st: QueueState,
        limit: int,
        invisible: int,
        tag_filter: TagFilter | SqlFilter,
        fifo: bool = False,
    ) -> list[pb.Message]:
        """Up to ``limit`` messages of one queue made invisible for ``invisible`` ms: redeliveries first,
        then fresh ones; a message past its last attempt goes to %DLQ%group instead. For a FIFO group
        nothing while a message of the queue is in flight and still invisible (the queue is held back
        until it is acked or comes back, first, at the end of its invisibility)."""
        now = self.clock.now_ms()
        if fifo and any(e.until_ms > now for e in st.inflight.values()):
            return []
        until = now + invisible
        out: list[pb.Message] = []
        max_attempts = self.config.maxReconsumeTimes
        redo = self._fifo_again(topic, q, st, limit, now, tag_filter) if fifo else st.due(now, limit)
        for offset in redo:
            m = self._read(topic, q, offset)
            e = st.inflight.get(offset)
            if m is None or e is None:  # cleaned from the store meanwhile: nothing left to deliver
                self.pop.done(st, offset)
                continue
            if e.attempt >= max_attempts:
                await self._dead_letter(group, st, offset, m)
                continue
            e = self.pop.deliver(st, offset, until)
            out.append(convert.to_v2(m, Receipt(q, offset, e.gen).encode(), e.attempt, invisible))
        room = min(limit - len(out), MAX_INFLIGHT_PER_QUEUE - len(st.inflight))
        if room > 0:
            out += self._fresh(topic, q, st, room, until, invisible, tag_filter)
        old = st.committed
        if st.settle() != old:
            self.services.offsets.commit(group, topic, q, st.committed)
        return out

    def _fifo_again(self, topic: str, q: int, st: QueueState, limit: int, now: int,
                    tag_filter: TagFilter | SqlFilter) -> list[int]:
        """RocketMQ's orderly pop, once nothing of the queue is invisible: the queue is read again from its
        first message not acked, and those after it that were acked (an ack within a batch does not
        commit) are in flight again with it; up to ``limit`` offsets, oldest first."""
        if not st.inflight:
            return []
        first = min(st.inflight)
        again = max(e.attempt for e in st.inflight.values())  # the batch's deliveries so far
        records = tag_filter.records if isinstance(tag_filter, SqlFilter) else None
        r = self.store.get_message(topic, q, first, limit, max_bytes=MAX_PULL_BYTES,
                                   tag_filter=tag_filter.predicate(), record_filter=records)
        matched = set()
        for rec in r.messages if r.status is GetStatus.FOUND else ():
            m = decode_record(rec)
            if m.queue_offset < st.next and (tag_filter.tags is None
                                              or m.properties.get(PROPERTY_TAGS) in tag_filter.tags):
                matched.add(m.queue_offset)
        redo = sorted(matched | {o for o in st.inflight if o < first + limit})[:limit]
        for offset in redo:
            if offset not in st.inflight:
                self.pop.deliver(st, offset, now, again)  # in flight again, due now
        return redo

    def _fresh(
        self, topic: str, q: int, st: QueueState, room: int, until: int, invisible: int,
        tag_filter: TagFilter | SqlFilter,
    ) -> list[pb.Message]:
        records = tag_filter.records if isinstance(tag_filter, SqlFilter) else None
        r = self.store.get_message(
            topic, q, st.next, room, max_bytes=MAX_PULL_BYTES, tag_filter=tag_filter.predicate(),
            record_filter=records,
        )
        out: list[pb.Message] = []
        if r.status is GetStatus.FOUND:
            for rec in r.messages:
                m = decode_record(rec)
                tags = tag_filter.tags
                if tags is not None and m.properties.get(PROPERTY_TAGS) not in tags:
                    continue  # a tag hash collision: not this group's, done with
                e = self.pop.deliver(st, m.queue_offset, until)
                out.append(convert.to_v2(m, Receipt(q, m.queue_offset, e.gen).encode(), e.attempt, invisible))
            self.pop.skip_to(st, r.next_begin_offset)
        elif r.status in (
            GetStatus.NO_MATCHED_MESSAGE,
            GetStatus.MESSAGE_WAS_REMOVING,
            GetStatus.OFFSET_TOO_SMALL,
        ):
            self.pop.skip_to(st, r.next_begin_offset)
        elif r.status is GetStatus.OFFSET_OVERFLOW_BADLY and not st.inflight:  # the queue is shorter now
            st.next = st.committed = r.max_offset
        return out

    async def _dead_letter(self, group: str, st: QueueState, offset: int, m: MessageExt) -> None:
        e = st.inflight[offset]
        e.until_ms = self.clock.now_ms() + DLQ_RETRY_MS  # no second receive takes it meanwhile
        a = await self.calls.send_back(group, m.commit_log_offset, -1, self.config.maxReconsumeTimes)
        if a.stored:
            log.info(
                "%s: message %s of %s queue %d offset %d moved to %%DLQ%%%s after %d deliveries",
                group,
                m.properties.get("UNIQ_KEY", ""),
                m.topic,
                m.queue_id,
                offset,
                group,
                e.attempt,
            )
            self.pop.done(st, offset)
        else:
            log.warning(
                "%s: cannot move the message at %s/%d/%d to its DLQ (%s); trying again later",
                group,
                m.topic,
                m.queue_id,
                offset,
                a.remark or a.kind.value,
            )

    # --- AckMessage, ChangeInvisibleDuration, ForwardMessageToDeadLetterQueue -------------------------------
    def _receipt(self, group: str, topic: str, handle: str) -> tuple[Receipt, QueueState]:
        r = convert.parse_receipt(handle)
        st = self.pop.get(group, topic, r.queue_id) if r is not None else None
        if r is None or st is None:
            raise Refused(pb.INVALID_RECEIPT_HANDLE, f"unknown receipt handle {handle!r}")
        return r, st

    def _check_not_expired(self, st: QueueState, r: Receipt) -> None:
        """A handle whose invisible time has passed is refused, as RocketMQ's proxy refuses it (its handle
        carries the time), even while the message has not been handed out again."""
        e = st.inflight.get(r.offset)
        if e is not None and e.gen == r.gen and e.until_ms <= self.clock.now_ms():
            raise Refused(pb.INVALID_RECEIPT_HANDLE, "receipt handle is expired")

    def _settle(self, group: str, topic: str, queue_id: int, st: QueueState) -> None:
        old = st.committed
        if st.settle() != old:
            self.services.offsets.commit(group, topic, queue_id, st.committed)

    async def ack_message(
        self, req: pb.AckMessageRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.AckMessageResponse:
        group = self._group(req.group)
        topic = req.topic.name
        entries = []
        for ent in req.entries:
            try:
                r, st = self._receipt(group, topic, ent.receipt_handle)
                self._check_not_expired(st, r)
                outcome = self.pop.ack(st, r.offset, r.gen)
                if outcome is not AckOutcome.OK:
                    raise Refused(
                        pb.INVALID_RECEIPT_HANDLE,
                        "the receipt handle is out of date (the message was "
                        "delivered again or its invisible time changed)"
                        if outcome is AckOutcome.STALE
                        else "the message was never received",
                    )
                self._settle(group, topic, r.queue_id, st)
                st_code = status(OK)
            except Refused as e:
                st_code = status(e.code, str(e))
            entries.append(
                pb.AckMessageResultEntry(
                    message_id=ent.message_id, receipt_handle=ent.receipt_handle, status=st_code
                )
            )
        try:
            await self.pop.save()
        except OSError as e:
            log.error("cannot persist the in-flight table after an ack (written later): %s", e)
        self._wake_fifo(group, topic)
        return pb.AckMessageResponse(status=overall_status(entries, "ack"), entries=entries)

    async def change_invisible_duration(
        self, req: pb.ChangeInvisibleDurationRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.ChangeInvisibleDurationResponse:
        group = self._group(req.group)
        ms = convert.duration_ms(req.invisible_duration)
        self._check_invisible(ms, 0)
        r, st = self._receipt(group, req.topic.name, req.receipt_handle)
        self._check_not_expired(st, r)
        e = self.pop.change(st, r.offset, r.gen, self.clock.now_ms() + ms)
        if e is None:
            raise Refused(
                pb.INVALID_RECEIPT_HANDLE, "the receipt handle is out of date or the message was acked"
            )
        await self.pop.save()
        self._wake_fifo(group, req.topic.name)
        return pb.ChangeInvisibleDurationResponse(
            status=status(OK), receipt_handle=Receipt(r.queue_id, r.offset, e.gen).encode()
        )

    async def forward_message_to_dead_letter_queue(
        self, req: pb.ForwardMessageToDeadLetterQueueRequest, ctx: grpc.aio.ServicerContext
    ) -> pb.ForwardMessageToDeadLetterQueueResponse:
        group = self._group(req.group)
        topic = req.topic.name
        r, st = self._receipt(group, topic, req.receipt_handle)
        e = st.inflight.get(r.offset)
        if e is None or e.gen != r.gen:
            raise Refused(
                pb.INVALID_RECEIPT_HANDLE, "the receipt handle is out of date or the message was acked"
            )
        m = self._read(topic, r.queue_id, r.offset)
        if m is None:
            self.pop.done(st, r.offset)
        else:
            await self._dead_letter(group, st, r.offset, m)
            if r.offset in st.inflight:
                raise Refused(pb.INTERNAL_SERVER_ERROR, "the dead-letter queue refused the message")
        self._settle(group, topic, r.queue_id, st)
        await self.pop.save()
        self._wake_fifo(group, topic)
        return pb.ForwardMessageToDeadLetterQueueResponse(status=status(OK))

    # --- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.pop.save_now()
        except OSError as e:
            log.error("cannot persist the in-flight table at shutdown: %s", e)

    def stats(self) -> dict[str, Any]:
        return {
            "clients": len(self.clients),
            "sent": self.sent,
            "received": self.received,
            "inflight": sum(len(st.inflight) for st in self.pop.queues.values()),
        }
