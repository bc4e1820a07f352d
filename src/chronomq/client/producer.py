"""Producer: sync/async sends, batches, oneway, ordered sends with a queue selector; route refresh,
retries on another queue/broker, timeouts, zlib compression of large bodies, topic auto-creation
through TBW102 (docs/protocol.md#topic-auto-creation)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import random
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from chronomq import message as m
from chronomq.clock import Clock, SystemClock
from chronomq.remoting.codec import RemotingCommand, append_batch_item
from chronomq.remoting.codes import SEND_V2_NAMES, RequestCode, ResponseCode
from chronomq.remoting.tls import TlsOption

from .blocking import SyncContextMixin
from .errors import (
    BrokerBusy,
    BrokerError,
    ClientClosed,
    ConnectFailed,
    InvalidMessage,
    MessageTooLarge,
    NoRouteError,
    NotPermitted,
    NotSupported,
    RequestTimeout,
    SendFailed,
    TopicNotFound,
    error_for_code,
)
from .instance import ClientInstance
from .model import (
    RESERVED_PROPERTIES,
    Message,
    MessageQueue,
    SendResult,
    SendStatus,
    TopicRoute,
    validate_property,
    validate_send_topic,
    validate_tags,
    validate_uniq_key,
)

log = logging.getLogger("chronomq.client")

QueueSelector = Callable[[list[MessageQueue], Message, Any], MessageQueue]

_DEGRADED: dict[int, SendStatus] = {ResponseCode.FLUSH_DISK_TIMEOUT: SendStatus.FLUSH_DISK_TIMEOUT,
             ResponseCode.FLUSH_SLAVE_TIMEOUT: SendStatus.FLUSH_SLAVE_TIMEOUT,
             ResponseCode.SLAVE_NOT_AVAILABLE: SendStatus.SLAVE_NOT_AVAILABLE}


class _UniqIdGen:
    """32 hex chars: ip(4) pid(2) random(4) | ms since process start (4) counter(2).

    The two top bits of the third random byte are kept clear: read as an offset msgId (host 8 bytes +
    offset 8 bytes), an id then never has bit 62 of the "offset" set, which chronomq's timer store uses to
    mark its own handles (a 32-hex UNIQ_KEY with that bit could be taken for one)."""

    def __init__(self, ip: str, clock: Clock | None = None) -> None:
        try:
            ipb = bytes(int(p) for p in ip.split("."))
        except ValueError:
            ipb = b"\x7f\x00\x00\x01"
        rnd = random.getrandbits(32) & 0xFFFF3FFF
        self._prefix = (ipb + struct.pack(">H", os.getpid() & 0xFFFF) + rnd.to_bytes(4, "big")).hex().upper()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._start = self._clock.monotonic()
        self._counter = itertools.count(random.randrange(1 << 16))
        self._lock = threading.Lock()

    def next(self) -> str:
        return self.take(1)[0]

    def take(self, count: int) -> list[str]:
        """``count`` ids at once: one lock and one clock read for every 65,536 (the counter's 16 bits;
        the next 65,536 wait for the next millisecond, so no id repeats)."""
        out: list[str] = []
        last_ms = -1
        while count > 0:
            n = min(count, 0x10000)
            with self._lock:
                first = next(self._counter)
                if n > 1:
                    self._counter = itertools.count(first + n)
            ms = self._ms()
            while ms == last_ms:
                ms = self._ms()
            last_ms = ms
            head = f"{self._prefix}{ms:08X}"
            out += [f"{head}{i & 0xFFFF:04X}" for i in range(first, first + n)]
            count -= n
        return out

    def _ms(self) -> int:
        return int((self._clock.monotonic() - self._start) * 1000) & 0xFFFFFFFF


_WAIT_TEXT = f"{m.PROPERTY_WAIT_STORE_MSG_OK}{m.NAME_VALUE_SEPARATOR}true{m.PROPERTY_SEPARATOR}"
_UNIQ_TEXT = m.PROPERTY_UNIQ_KEY + m.NAME_VALUE_SEPARATOR
_TAIL_TEXT = m.PROPERTY_SEPARATOR + _WAIT_TEXT  # after a UNIQ_KEY value


def encode_rows(bodies: Sequence[bytes], uniq_keys: Sequence[str], *,
                keys: Sequence[str | None] | None = None, tags: Sequence[str | None] | None = None,
                properties: Sequence[Iterable[tuple[str, str | None]] | None] | None = None,
                dedup: bool = False, row_numbers: Sequence[int] | None = None) -> bytes:
    """A batch body for ``Producer.send_encoded_batch`` straight from columns (row i: ``bodies[i]``, its
    UNIQ_KEY, space-separated KEYS, TAGS and user properties; a property whose value is None is left out),
    with the checks and the bytes ``send_batch`` gives the same messages without a deliver time, and
    without a Message or a dict per row. Raises InvalidMessage / MessageTooLarge naming the row (by
    ``row_numbers[i]`` when given)."""
    out = bytearray()
    sep, nv = m.PROPERTY_SEPARATOR, m.NAME_VALUE_SEPARATOR
    keys_name, tags_name, uniq_name = m.PROPERTY_KEYS + nv, m.PROPERTY_TAGS + nv, m.PROPERTY_UNIQ_KEY + nv
    tail = (f"{m.PROPERTY_DEDUP}{nv}true{sep}" if dedup else "")
    for i, body in enumerate(bodies):
        try:
            if not body:
                raise InvalidMessage("the message body is empty")
            parts: list[str] = []
            props = properties[i] if properties is not None else None
            if props:
                for k, v in props:
                    if v is None:
                        continue
                    validate_property(k, v)
                    if k in RESERVED_PROPERTIES:
                        raise InvalidMessage(f"property {k!r} is reserved")
                    parts += (k, nv, v, sep)
            k_text = keys[i] if keys is not None else None
            if k_text:
                parts += (keys_name, k_text, sep)
            t = tags[i] if tags is not None else None
            if t:
                validate_tags(t)
                parts += (tags_name, t, sep)
            parts += (tail, uniq_name, validate_uniq_key(uniq_keys[i]), sep, _WAIT_TEXT)
            text = "".join(parts).encode()
            if len(text) > m.MAX_PROPERTIES_LENGTH:
                raise MessageTooLarge("the message properties exceed 32767 bytes")
        except InvalidMessage as e:
            raise type(e)(f"row {row_numbers[i] if row_numbers is not None else i}: {e}") from None
        append_batch_item(out, body, text)
    return bytes(out)


def select_by_key(queues: list[MessageQueue], message: Message, key: Any) -> MessageQueue:
    """Queue selector for ordered sends: the same key always goes to the same queue (stable crc32)."""
    k = key if key is not None else (message.keys_list() or [""])[0]
    return queues[zlib.crc32(str(k).encode()) % len(queues)]


class Producer(SyncContextMixin):
    """``async with Producer("group", namesrv="127.0.0.1:9876") as p: await p.send(Message(...))``
    or, blocking, ``with Producer(...) as p: p.send(Message(...))``.

    ``clock`` (default: the real one) gives bornTimestamp, the deliver time of a ``delay``, the send
    timeout budget and how long a failed broker stays isolated."""

    def __init__(self, group: str = "DEFAULT_PRODUCER", namesrv: str | Sequence[str] = "127.0.0.1:9876", *,
                 send_timeout: float = 3.0, retries: int = 2, compress_threshold: int = 4096,
                 compress_level: int = 5, max_message_size: int = 4 * 1024 * 1024,
                 default_topic: str = m.DEFAULT_TOPIC, default_topic_queue_nums: int = 4,
                 heartbeat_interval: float = 30.0, route_refresh_interval: float = 30.0,
                 instance_name: str | None = None, use_v2_header: bool = True,
                 broker_isolation: float = 2.0, clock: Clock | None = None,
                 credentials: tuple[str, str] | None = None, tls: TlsOption = None) -> None:
        if not group:
            raise ValueError("the producer group must not be empty")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.group = group
        self.send_timeout = send_timeout
        self.retries = retries
        self.compress_threshold = compress_threshold
        self.compress_level = compress_level
        self.max_message_size = max_message_size
        self.default_topic = default_topic
        self.default_topic_queue_nums = default_topic_queue_nums
        self.use_v2_header = use_v2_header
        self.broker_isolation = broker_isolation
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._instance = ClientInstance(namesrv, credentials=credentials, instance_name=instance_name,
                                        tls=tls, request_timeout=send_timeout,
                                        heartbeat_interval=heartbeat_interval,
                                        route_refresh_interval=route_refresh_interval,
                                        request_handler=self._on_server_request, clock=self._clock)
        self._instance.heartbeat_body = self._heartbeat_body
        self._ids = _UniqIdGen(self._instance.client_ip, self._clock)
        self._rr = itertools.count(random.randrange(1024))
        self._isolated: dict[str, float] = {}
        self._started = False
        self._closed = False

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    async def _on_server_request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand | None:
        """A request a broker sends this producer; a plain producer answers none."""
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                            remark=f"request code {cmd.code} is not supported by this producer")

    def _heartbeat_body(self) -> dict[str, Any]:
        return {"clientID": self.client_id, "producerDataSet": [{"groupName": self.group}],
                "consumerDataSet": []}

    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this producer was closed; create a new one")
        if self._started:
            return
        await self._instance.start()
        self._started = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            try:
                async with asyncio.timeout(3.0):
                    await self._instance.unregister(producer_group=self.group)
            except (TimeoutError, Exception) as e:
                log.debug("unregister failed: %s", e)
        await self._instance.close()

    def _check(self) -> None:
        if self._closed:
            raise ClientClosed("the producer is closed")
        if not self._started:
            raise ClientClosed("the producer is not started (use `async with`/`with`, or await start())")

    # --- routes ------------------------------------------------------------------------------------
    async def _publish_route(self, topic: str) -> tuple[TopicRoute, bool]:
        """(route, auto_create): the topic's route, or the default topic's route if the topic is new."""
        try:
            return await self._instance.get_route(topic), False
        except NoRouteError:
            pass
        try:
            base = await self._instance.get_route(self.default_topic)
        except NoRouteError:
            raise NoRouteError(f"no route for topic {topic!r}, and automatic topic creation through "
                               f"{self.default_topic!r} is not available on this name server") from None
        route = TopicRoute(topic=topic, broker_addrs=base.broker_addrs)
        for q in base.queue_datas:
            n = min(self.default_topic_queue_nums, q.write_queue_nums)
            route.queue_datas.append(type(q)(q.broker_name, n, n, q.perm))
        return route, True

    async def queues(self, topic: str) -> list[MessageQueue]:
        """The writable queues of a topic (for a custom selector)."""
        self._check()
        route, _ = await self._publish_route(topic)
        return route.write_queues()

    def _pick(self, queues: list[MessageQueue], last_broker: str | None) -> MessageQueue:
        now = self._clock.monotonic()
        start = next(self._rr)
        n = len(queues)
        # prefer a broker that is neither isolated nor the one that just failed
        for i in range(n):
            q = queues[(start + i) % n]
            if q.broker_name != last_broker and self._isolated.get(q.broker_name, 0) <= now:
                return q
        for i in range(n):
            q = queues[(start + i) % n]
            if self._isolated.get(q.broker_name, 0) <= now:
                return q
        return queues[start % n]

    # --- building requests ---------------------------------------------------------------------------
    def _prepare(self, msg: Message) -> tuple[bytes, dict[str, str], int, str]:
        if not isinstance(msg, Message):
            raise InvalidMessage(f"expected a chronomq.client.Message, got {type(msg).__name__}")
        msg.validate()
        body = msg.body_bytes()
        props = msg.wire_properties(self._clock.now_ms())
        uniq = msg.uniq_key if msg.uniq_key is not None else self._ids.next()
        props[m.PROPERTY_UNIQ_KEY] = uniq
        props[m.PROPERTY_WAIT_STORE_MSG_OK] = "true"
        sys_flag = 0
        if self.compress_threshold and len(body) > self.compress_threshold:
            packed = zlib.compress(body, self.compress_level)
            if len(packed) < len(body):
                body, sys_flag = packed, m.SYSFLAG_COMPRESSED
        if len(body) > self.max_message_size:
            raise MessageTooLarge(f"the message body is {len(body)} bytes (after compression), more than "
                                  f"max_message_size={self.max_message_size}")
        if len(m.encode_properties(props).encode()) > m.MAX_PROPERTIES_LENGTH:
            raise MessageTooLarge("the message properties exceed 32767 bytes")
        return body, props, sys_flag, uniq

    def _header(self, topic: str, queue_id: int, sys_flag: int, props: dict[str, str], flag: int,
                batch: bool) -> dict[str, Any]:
        ext = {"producerGroup": self.group, "topic": topic, "defaultTopic": self.default_topic,
               "defaultTopicQueueNums": self.default_topic_queue_nums, "queueId": queue_id,
               "sysFlag": sys_flag, "bornTimestamp": self._clock.now_ms(), "flag": flag,
               "properties": m.encode_properties(props), "reconsumeTimes": 0, "unitMode": "false",
               "batch": "true" if batch else "false"}
        if self.use_v2_header:
            return {SEND_V2_NAMES[k]: v for k, v in ext.items()}
        return ext

    def _command(self, topic: str, queue_id: int, sys_flag: int, props: dict[str, str], flag: int,
                 body: bytes, batch: bool, oneway: bool = False) -> RemotingCommand:
        if self.use_v2_header:
            code = RequestCode.SEND_BATCH_MESSAGE if batch else RequestCode.SEND_MESSAGE_V2
        else:
            code = RequestCode.SEND_MESSAGE
        return self._instance.request(code, self._header(topic, queue_id, sys_flag, props, flag, batch), body,
                                      oneway=oneway)

    # --- sending -------------------------------------------------------------------------------------
    async def _send_to(self, mq: MessageQueue, route: TopicRoute, make: Callable[[int], RemotingCommand],
                       timeout: float, what: str) -> RemotingCommand:
        addr = route.master_addr(mq.broker_name) or self._instance.master_addr(mq.broker_name)
        if addr is None:
            raise NoRouteError(f"{what}: no master address for broker {mq.broker_name!r}")
        resp = await self._instance.invoke(addr, make(mq.queue_id), timeout, what)
        if resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED and self.use_v2_header:
            log.info("broker %s does not support V2 send headers; falling back to SEND_MESSAGE", addr)
            self.use_v2_header = False
            resp = await self._instance.invoke(addr, make(mq.queue_id), timeout, what)
        if resp.code != ResponseCode.SUCCESS and resp.code not in _DEGRADED:
            raise error_for_code(resp.code, resp.remark, what, addr)
        return resp

    async def _send_with_retries(self, topic: str, make: Callable[[str, int], RemotingCommand],
                                 timeout: float | None, what: str,
                                 fixed_queue: Callable[[list[MessageQueue]], MessageQueue] | None = None,
                                 ) -> tuple[MessageQueue, RemotingCommand]:
        self._check()
        budget = timeout if timeout is not None else self.send_timeout
        deadline = self._clock.monotonic() + budget
        attempts: list[tuple[str, int, BaseException]] = []
        last_broker: str | None = None
        tries = 1 if fixed_queue is not None else 1 + self.retries
        for attempt in range(tries):
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                break
            mq: MessageQueue | None = None
            try:
                route, auto = await self._publish_route(topic)
                queues = route.write_queues()
                if not queues:
                    raise NoRouteError(f"topic {topic!r} has no writable queue")
                mq = fixed_queue(queues) if fixed_queue is not None else self._pick(queues, last_broker)
                if not isinstance(mq, MessageQueue) or mq not in queues:
                    raise InvalidMessage(f"the queue selector returned {mq!r}, not one of the topic's queues")
                target = mq
                resp = await self._send_to(target, route, functools.partial(make, target.broker_name),
                                           remaining, what)
                if auto:
                    self._instance.routes.pop(topic, None)  # pick up the real route next time
                self._isolated.pop(target.broker_name, None)
                return target, resp
            except (InvalidMessage, ClientClosed, NotSupported):
                raise
            except BrokerError as e:
                if e.code == ResponseCode.MESSAGE_ILLEGAL:
                    raise
                err: BaseException = e
            except (ConnectFailed, RequestTimeout, NoRouteError) as e:
                err = e
            bname = mq.broker_name if mq is not None else "?"
            attempts.append((bname, mq.queue_id if mq is not None else -1, err))
            last_broker = bname
            log.debug("%s: attempt %d failed: %s", what, attempt + 1, err)
            if isinstance(err, ConnectFailed | RequestTimeout) and mq is not None:
                self._isolated[bname] = self._clock.monotonic() + self.broker_isolation
            if isinstance(err, TopicNotFound | NotPermitted | ConnectFailed | NoRouteError):
                self._instance.routes.pop(topic, None)
            if attempt + 1 < tries and isinstance(err, NoRouteError | BrokerBusy | ConnectFailed):
                await asyncio.sleep(min(0.05 * (attempt + 1), max(0.0, deadline - self._clock.monotonic())))
        if len(attempts) == 1 or (attempts and all(isinstance(a[2], NoRouteError) for a in attempts)):
            raise attempts[-1][2]
        if not attempts:
            raise RequestTimeout(f"{what}: the send timeout of {budget:.1f}s elapsed before any attempt")
        detail = "; ".join(f"{b}:{q}: {e}" for b, q, e in attempts)
        raise SendFailed(f"{what} failed after {len(attempts)} attempts: {detail}", attempts)

    @staticmethod
    def _result(mq: MessageQueue, resp: RemotingCommand, msg_ids: list[str]) -> SendResult:
        status = _DEGRADED.get(resp.code, SendStatus.OK)
        try:
            offset = resp.ext_int("queueOffset", -1)
            qid = resp.ext_int("queueId", mq.queue_id)
        except ValueError:
            offset, qid = -1, mq.queue_id
        # chronomq's timer store answers the deliver time(s) it scheduled: one per message, comma-joined
        times: tuple[int, ...] = ()
        raw = resp.ext_str("deliverMs")
        if raw:
            try:
                times = tuple(int(x) for x in raw.split(","))
            except ValueError:
                times = ()
            if len(times) != len(msg_ids):
                times = ()
        # a batch: our ids, joined like msg_id (a caller-chosen id may itself contain a comma)
        uniq = (resp.ext_str("uniqKey") or msg_ids[0]) if len(msg_ids) == 1 else ",".join(msg_ids)
        queue = MessageQueue(mq.topic, mq.broker_name, qid)
        return SendResult(msg_id=",".join(msg_ids), offset_msg_id=resp.ext_str("msgId", "") or "",
                          queue=queue, queue_offset=offset, status=status, msg_ids=tuple(msg_ids),
                          uniq_key=uniq, deliver_ms=times[0] if times else None, deliver_times_ms=times)

    async def send(self, message: Message, *, timeout: float | None = None,
                   selector: QueueSelector | None = None, arg: Any = None,
                   queue: MessageQueue | None = None) -> SendResult:
        """Send one message and wait for the broker's answer. With ``selector`` (or ``queue``) the
        message goes to that queue, without retries on another queue (ordered sends)."""
        body, props, sys_flag, uniq = self._prepare(message)
        topic = message.topic

        def make(_broker: str, qid: int) -> RemotingCommand:
            return self._command(topic, qid, sys_flag, props, message.flag, body, batch=False)

        fixed = None
        if queue is not None:
            fixed = lambda qs: queue  # noqa: E731
        elif selector is not None:
            fixed = lambda qs: selector(qs, message, arg)  # noqa: E731
        mq, resp = await self._send_with_retries(topic, make, timeout, f"send to topic {topic!r}", fixed)
        return self._result(mq, resp, [uniq])

    async def send_ordered(self, message: Message, key: Any, *, timeout: float | None = None) -> SendResult:
        """Ordered send: messages with the same key go to the same queue (see select_by_key)."""
        return await self.send(message, timeout=timeout, selector=select_by_key, arg=key)

    async def send_batch(self, messages: Sequence[Message], *, timeout: float | None = None,
                         queue: MessageQueue | None = None) -> SendResult:
        """Send several messages of one topic in one request; they land contiguously in one queue. Either
        every message has a deliver time (deliver_at/delay; they are scheduled all or none) or none has."""
        topic, data, ids = self.encode_batch(messages)
        return await self.send_encoded_batch(topic, data, ids, timeout=timeout, queue=queue)

    def encode_batch(self, messages: Sequence[Message]) -> tuple[str, bytes, list[str]]:
        """(topic, batch body, UNIQ_KEYs) of ``send_batch``: every check, no I/O. Raises InvalidMessage
        or MessageTooLarge."""
        msgs = list(messages)
        if not msgs:
            raise InvalidMessage("send_batch needs at least one message")
        first = msgs[0]
        if not isinstance(first, Message):
            raise InvalidMessage(f"expected chronomq.client.Message items, got {type(first).__name__}")
        topic = first.topic
        validate_send_topic(topic)
        timed = first.deliver_at is not None or first.delay is not None
        now_ms = self._clock.now_ms()  # one base for every delay of the batch
        new_ids = iter(self._ids.take(sum(1 for msg in msgs if getattr(msg, "uniq_key", None) is None)))
        out = bytearray()
        ids: list[str] = []
        for msg in msgs:
            if not isinstance(msg, Message):
                raise InvalidMessage(f"expected chronomq.client.Message items, got {type(msg).__name__}")
            if msg.topic != topic:
                raise InvalidMessage(f"a batch must have one topic; got {topic!r} and {msg.topic!r}")
            if msg.delay_level:
                raise InvalidMessage("batched messages cannot use delay_level; send them one by one")
            if (msg.deliver_at is not None or msg.delay is not None) != timed:
                raise InvalidMessage("a batch is all timed (deliver_at/delay on every message) or not timed "
                                     "at all; the broker refuses a mix: send them in separate batches")
            body = msg.checked_body()
            uniq = msg.uniq_key if msg.uniq_key is not None else next(new_ids)
            if msg.properties and m.PROPERTY_WAIT_STORE_MSG_OK in msg.properties:  # its own WAIT is replaced
                props = msg.wire_properties(now_ms)
                props[m.PROPERTY_UNIQ_KEY] = uniq
                props[m.PROPERTY_WAIT_STORE_MSG_OK] = "true"
                text = m.encode_properties(props).encode()
            else:
                text = f"{msg.wire_text(now_ms)}{_UNIQ_TEXT}{uniq}{_TAIL_TEXT}".encode()
            if len(text) > m.MAX_PROPERTIES_LENGTH:
                raise MessageTooLarge("the message properties exceed 32767 bytes")
            append_batch_item(out, body, text, msg.flag)
            ids.append(uniq)
        return topic, bytes(out), ids

    async def send_encoded_batch(self, topic: str, data: bytes, msg_ids: Sequence[str], *,
                                 timeout: float | None = None,
                                 queue: MessageQueue | None = None) -> SendResult:
        """Send a batch body already encoded (``encode_rows``, or ``send_batch``'s own encoding) whose
        messages carry ``msg_ids`` as their UNIQ_KEYs, in one request to one queue of ``topic``."""
        validate_send_topic(topic)
        if len(data) > self.max_message_size:
            raise MessageTooLarge(f"the batch is {len(data)} bytes, more than max_message_size="
                                  f"{self.max_message_size}; split it")
        wait_props = {m.PROPERTY_WAIT_STORE_MSG_OK: "true"}

        def make(_broker: str, qid: int) -> RemotingCommand:
            if self.use_v2_header:
                return self._command(topic, qid, 0, wait_props, 0, data, batch=True)
            return self._instance.request(RequestCode.SEND_MESSAGE,
                                          self._header(topic, qid, 0, wait_props, 0, True), data)

        fixed = (lambda qs: queue) if queue is not None else None
        mq, resp = await self._send_with_retries(topic, make, timeout,
                                                 f"batch send of {len(msg_ids)} to topic {topic!r}", fixed)
        return self._result(mq, resp, list(msg_ids))

    async def send_oneway(self, message: Message) -> None:
        """Fire and forget: one attempt, no answer awaited (a lost connection still raises)."""
        self._check()
        body, props, sys_flag, _ = self._prepare(message)
        route, _auto = await self._publish_route(message.topic)
        queues = route.write_queues()
        if not queues:
            raise NoRouteError(f"topic {message.topic!r} has no writable queue")
        mq = self._pick(queues, None)
        addr = route.master_addr(mq.broker_name)
        if addr is None:
            raise NoRouteError(f"no master address for broker {mq.broker_name!r}")
        cmd = self._command(message.topic, mq.queue_id, sys_flag, props, message.flag, body, batch=False,
                            oneway=True)
        await self._instance.invoke_oneway(addr, cmd, f"oneway send to topic {message.topic!r}")
