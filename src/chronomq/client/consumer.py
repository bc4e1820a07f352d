"""PushConsumer: subscriptions with tag expressions, a listener (sync function or coroutine) returning
success or "later"; clustering (average allocation, takeover on membership change) or broadcasting;
bounded concurrency; offsets committed every 5 s and on close; automatic %RETRY%<group> subscription
and send-back of failed messages; orderly consumption with queue locks; flow control per queue."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chronomq import message as m
from chronomq.clock import Clock, SystemClock
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import (
    RequestCode,
    ResponseCode,
)

from . import ops
from .blocking import SyncContextMixin
from .errors import ClientClosed, ClientError, NoRouteError
from .instance import ClientInstance
from .model import MessageQueue, ReceivedMessage, TopicRoute, tag_set

# while a queue has a backlog, a pull asks for up to this many messages (chronomq's broker answers at
# most 256 per pull; an Apache broker its maxTransferCountOnMessageInMemory): fewer round trips
MAX_BACKLOG_PULL = 256
_PULL_CODES = (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND, ResponseCode.PULL_RETRY_IMMEDIATELY,
               ResponseCode.PULL_OFFSET_MOVED)

log = logging.getLogger("chronomq.client")


class ConsumeResult(StrEnum):
    SUCCESS = "success"
    LATER = "later"


SUCCESS = ConsumeResult.SUCCESS
LATER = ConsumeResult.LATER

Listener = Callable[[ReceivedMessage], Any]


def _is_success(result: Any) -> bool:
    if result is None or result is True:
        return True
    if result is False:
        return False
    if isinstance(result, str):
        r = result.lower()
        if r in ("success", "consume_success", "ok"):
            return True
        if r in ("later", "reconsume_later", "retry"):
            return False
    raise ClientError(f"a listener must return success/None/True or 'later'/False, not {result!r}")


def allocate_average(mqs: Sequence[MessageQueue], cids: Sequence[str], cid: str) -> list[MessageQueue]:
    """RocketMQ's AllocateMessageQueueAveragely over the sorted queue and consumer-id lists."""
    mqs = sorted(mqs)
    cids = sorted(cids)
    if cid not in cids or not mqs:
        return []
    index = cids.index(cid)
    n, k = len(mqs), len(cids)
    mod = n % k
    if n <= k:
        average = 1
    elif mod > 0 and index < mod:
        average = n // k + 1
    else:
        average = n // k
    start = index * average if (mod > 0 and index < mod) else index * average + mod
    count = min(average, n - start)
    return [mqs[(start + i) % n] for i in range(max(0, count))]


@dataclass(eq=False)
class ProcessQueue:
    mq: MessageQueue
    expression: str
    next_offset: int
    high: int  # offset after the last pulled (or skipped) message
    msgs: dict[int, ReceivedMessage] = field(default_factory=dict)
    dropped: bool = False
    locked: bool = False
    space: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    puller: asyncio.Task[None] | None = None
    worker: asyncio.Task[None] | None = None
    consumed: int = 0
    backlog: int = 0  # messages beyond next_offset, as of the last pull (maxOffset - nextBeginOffset)
    tags: set[str] | None = None  # tag_set(expression), for the client-side filter of pulled messages

    order: collections.deque[int] = field(default_factory=collections.deque)

    def add(self, msg: ReceivedMessage) -> None:
        self.msgs[msg.queue_offset] = msg
        self.order.append(msg.queue_offset)  # offsets arrive in increasing order

    def first(self) -> int | None:
        """The smallest offset still in flight (amortised O(1); iterating a dict whose front entries
        were popped is O(popped) in CPython, hence the deque)."""
        order, msgs = self.order, self.msgs
        while order and order[0] not in msgs:
            order.popleft()
        return order[0] if order else None

    def commit_offset(self) -> int:
        first = self.first()
        return self.high if first is None else first


class PushConsumer(SyncContextMixin):
    """``PushConsumer(group, subscriptions={"Topic": "tagA || tagB"}, listener=fn, namesrv=...)``.

    A pull asks for ``pull_batch_size`` messages; while the broker reports a backlog on the queue (its
    maxOffset beyond the next offset) it asks for up to MAX_BACKLOG_PULL, within
    ``max_inflight_per_queue``, so catching up costs fewer round trips. At most ``concurrency`` listener
    calls run at once, each message in its own call. ``clock`` (default: the real one) dates the
    subscriptions (their subVersion)."""

    def __init__(self, group: str, subscriptions: Mapping[str, str] | Sequence[str] | str,
                 listener: Listener | None = None, namesrv: str | Sequence[str] = "127.0.0.1:9876", *,
                 broadcasting: bool = False, orderly: bool = False, concurrency: int = 20,
                 consume_from: str = "last", consume_timestamp: int | None = None,
                 max_inflight_per_queue: int = 1000, pull_batch_size: int = 32,
                 long_poll_timeout: float = 15.0, rebalance_interval: float = 10.0,
                 offset_commit_interval: float = 5.0, heartbeat_interval: float = 30.0,
                 route_refresh_interval: float = 30.0, lock_interval: float = 20.0,
                 max_reconsume_times: int | None = None, retry_delay_level: int = 0,
                 orderly_retry_delay: float = 1.0, shutdown_timeout: float = 10.0,
                 request_timeout: float = 3.0, instance_name: str | None = None,
                 clock: Clock | None = None) -> None:
        if not group:
            raise ValueError("the consumer group must not be empty")
        if isinstance(subscriptions, str):
            subs = {subscriptions: "*"}
        elif isinstance(subscriptions, Mapping):
            subs = {str(t): (e or "*") for t, e in subscriptions.items()}
        else:
            subs = {str(t): "*" for t in subscriptions}
        if not subs:
            raise ValueError("subscribe to at least one topic")
        for t in subs:
            reason = m.validate_topic(t)
            if reason:
                raise ValueError(f"invalid subscription topic: {reason}")
        if consume_from not in ("last", "first", "timestamp"):
            raise ValueError("consume_from must be 'last', 'first' or 'timestamp'")
        if consume_from == "timestamp" and consume_timestamp is None:
            raise ValueError("consume_from='timestamp' needs consume_timestamp (epoch ms)")
        if concurrency < 1 or max_inflight_per_queue < 1 or pull_batch_size < 1:
            raise ValueError("concurrency, max_inflight_per_queue and pull_batch_size must be >= 1")
        self.group = group
        self.listener = listener
        self.broadcasting = broadcasting
        self.orderly = orderly
        self.concurrency = concurrency
        self.consume_from = consume_from
        self.consume_timestamp = consume_timestamp
        self.max_inflight_per_queue = max_inflight_per_queue
        self.pull_batch_size = pull_batch_size
        self.long_poll_timeout = long_poll_timeout
        self.rebalance_interval = rebalance_interval
        self.offset_commit_interval = offset_commit_interval
        self.lock_interval = lock_interval
        self.max_reconsume_times = max_reconsume_times
        self.retry_delay_level = retry_delay_level
        self.orderly_retry_delay = orderly_retry_delay
        self.shutdown_timeout = shutdown_timeout
        self.subscriptions: dict[str, str] = dict(subs)
        if not broadcasting:
            self.subscriptions[m.RETRY_GROUP_TOPIC_PREFIX + group] = "*"
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._sub_version = self._clock.now_ms()
        self._instance = ClientInstance(namesrv, instance_name=instance_name, request_timeout=request_timeout,
                                        heartbeat_interval=heartbeat_interval,
                                        route_refresh_interval=route_refresh_interval,
                                        request_handler=self._on_server_request)
        self._instance.heartbeat_body = self._heartbeat_body
        self._pqs: dict[MessageQueue, ProcessQueue] = {}
        self._offsets: dict[MessageQueue, int] = {}
        self._committed: dict[MessageQueue, int] = {}
        self._workers: list[asyncio.Task[None]] = []
        # concurrent consumption: pulled messages wait in _ready; the `concurrency` workers take them one
        # at a time (so a listener that awaits never holds up the others); a worker with nothing to do
        # sleeps on its own future in _sleepers; _waking counts workers woken but not yet running, so a
        # burst wakes one more worker at a time instead of one per message
        self._ready: collections.deque[tuple[ProcessQueue, ReceivedMessage]] = collections.deque()
        self._sleepers: collections.deque[asyncio.Future[None]] = collections.deque()
        self._waking = 0
        self._busy = 0
        self._idle: asyncio.Event | None = None
        self._sem: asyncio.Semaphore | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._rebalance_now: asyncio.Event | None = None
        self._known_brokers: set[str] = set()
        self._need_heartbeat = False
        self._started = False
        self._closed = False
        self._stopping = False
        self.stats_consumed = 0
        self.stats_failed = 0

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this consumer was closed; create a new one")
        if self._started:
            return
        if self.listener is None:
            raise ClientError("set a listener before starting the consumer")
        self._sem = asyncio.Semaphore(self.concurrency)
        self._idle = asyncio.Event()
        self._idle.set()
        if not self.orderly:
            # a fixed pool of consume workers fed by one deque (cheaper than a task per message)
            loop = asyncio.get_running_loop()
            self._workers = [loop.create_task(self._worker(), name="chronomq-consume")
                             for _ in range(self.concurrency)]
        self._rebalance_now = asyncio.Event()
        if not inspect.iscoroutinefunction(self.listener):
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.concurrency, thread_name_prefix=f"chronomq-consume-{self.group}")
        await self._instance.start()
        self._started = True
        try:
            for topic in self.subscriptions:
                with contextlib.suppress(ClientError):
                    await self._instance.get_route(topic)
            await self._heartbeat()
            await self._rebalance()  # errors here are retried by the rebalance loop
        except ClientError as e:
            log.warning("%s: first rebalance failed (retrying every %.1fs): %s", self.group,
                        self.rebalance_interval, e)
        except BaseException:
            await self.close()
            raise
        self._instance.spawn(self._rebalance_loop(), "rebalance")
        self._instance.spawn(self._commit_loop(), "offset-commit")
        if self.orderly and not self.broadcasting:
            self._instance.spawn(self._lock_loop(), "lock")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            await self._instance.close()
            return
        self._stopping = True
        pqs = list(self._pqs.values())
        for pq in pqs:
            pq.dropped = True
            pq.space.set()
            pq.arrived.set()
            if pq.puller is not None:
                pq.puller.cancel()
        await asyncio.gather(*(pq.puller for pq in pqs if pq.puller is not None), return_exceptions=True)
        # let running listeners finish (bounded; queued messages are not started and stay uncommitted),
        # then stop the workers
        stuck = False
        assert self._idle is not None
        pending = [pq.worker for pq in pqs if pq.worker is not None and not pq.worker.done()]
        deadline = asyncio.get_running_loop().time() + self.shutdown_timeout
        try:
            await asyncio.wait_for(self._idle.wait(), self.shutdown_timeout)
        except TimeoutError:
            stuck = True
        if pending:
            remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            _done, not_done = await asyncio.wait(pending, timeout=remaining)
            stuck = stuck or bool(not_done)
        if stuck:
            log.warning("%s: listener call(s) still running after %.1fs; their messages will be delivered "
                        "again", self.group, self.shutdown_timeout)
        for t in [*self._workers, *pending]:
            t.cancel()
        await asyncio.gather(*self._workers, *pending, return_exceptions=True)
        self._workers = []
        try:
            await asyncio.wait_for(self.commit_offsets(), 5.0)
        except (TimeoutError, Exception) as e:
            log.warning("%s: final offset commit failed: %s", self.group, e)
        if self.orderly and not self.broadcasting:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._unlock([pq.mq for pq in pqs]), 3.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._instance.unregister(consumer_group=self.group), 3.0)
        await self._instance.close()
        if self._executor is not None:
            # a listener thread that never returns cannot be stopped: do not hang on it
            self._executor.shutdown(wait=not stuck, cancel_futures=True)
        self._pqs.clear()

    # --- introspection --------------------------------------------------------------------------------
    def assigned_queues(self) -> list[MessageQueue]:
        return sorted(self._pqs)

    def offsets(self) -> dict[MessageQueue, int]:
        """The next offset to consume per assigned queue (what the next commit will store)."""
        return dict(self._offsets)

    # --- server requests ------------------------------------------------------------------------------
    async def _on_server_request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand | None:
        if cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            if self._rebalance_now is not None:
                self._rebalance_now.set()
            return None
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                            remark=f"request code {cmd.code} not supported by chronomq.client")

    # --- heartbeat ------------------------------------------------------------------------------------
    def _heartbeat_body(self) -> dict[str, Any]:
        subs = []
        for topic, expr in self.subscriptions.items():
            tags = tag_set(expr)
            subs.append({"topic": topic, "subString": expr, "classFilterMode": False,
                         "tagsSet": sorted(tags or []), "codeSet": sorted(m.tags_code(t) for t in tags or []),
                         "subVersion": self._sub_version, "expressionType": "TAG"})
        where = {"last": "CONSUME_FROM_LAST_OFFSET", "first": "CONSUME_FROM_FIRST_OFFSET",
                 "timestamp": "CONSUME_FROM_TIMESTAMP"}[self.consume_from]
        return {"clientID": self.client_id, "producerDataSet": [],
                "consumerDataSet": [{"groupName": self.group, "consumeType": "CONSUME_PASSIVELY",
                                     "messageModel": "BROADCASTING" if self.broadcasting else "CLUSTERING",
                                     "consumeFromWhere": where, "unitMode": False,
                                     "subscriptionDataSet": subs}]}

    async def _heartbeat(self) -> None:
        self._known_brokers = {a for addrs in self._instance.broker_addrs.values() for a in addrs.values()}
        self._need_heartbeat = False
        await self._instance.send_heartbeat()

    # --- rebalance ------------------------------------------------------------------------------------
    async def _rebalance_loop(self) -> None:
        assert self._rebalance_now is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rebalance_now.wait(), self.rebalance_interval)
            self._rebalance_now.clear()
            try:
                await self._rebalance()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: rebalance failed: %s", self.group, e)

    async def _rebalance(self) -> None:
        brokers = {a for addrs in self._instance.broker_addrs.values() for a in addrs.values()}
        if self._need_heartbeat or brokers - self._known_brokers:
            await self._heartbeat()
        for topic, expr in list(self.subscriptions.items()):
            if self._stopping:
                return
            try:
                route = await self._instance.get_route(topic, refresh=topic not in self._instance.routes)
            except NoRouteError:
                continue
            except ClientError as e:
                log.debug("%s: route of %s unavailable: %s", self.group, topic, e)
                continue
            if brokers != {a for addrs in self._instance.broker_addrs.values() for a in addrs.values()}:
                await self._heartbeat()
            mqs = route.read_queues()
            if self.broadcasting:
                mine = mqs
            else:
                cids = await self._consumer_ids(route)
                if cids is None:
                    continue
                mine = allocate_average(mqs, cids, self.client_id)
            await self._apply(topic, expr, set(mine))

    async def _consumer_ids(self, route: TopicRoute) -> list[str] | None:
        addrs = sorted({a for addrs in route.broker_addrs.values() for bid, a in addrs.items() if bid == 0})
        for addr in addrs:
            try:
                cids = await ops.consumer_ids(self._instance, self.group, addr)
                if self.client_id not in cids:
                    await self._heartbeat()
                    cids = await ops.consumer_ids(self._instance, self.group, addr)
                if self.client_id in cids:
                    return cids
            except ClientError as e:
                log.debug("%s: consumer list from %s failed: %s", self.group, addr, e)
        return None

    async def _apply(self, topic: str, expr: str, mine: set[MessageQueue]) -> None:
        current = {mq for mq in self._pqs if mq.topic == topic}
        for mq in sorted(current - mine):
            await self._drop(mq)
        for mq in sorted(mine - current):
            if self._stopping:
                return
            try:
                if self.orderly and not self.broadcasting:
                    addr = await self._instance.broker_addr(mq.broker_name, mq.topic)
                    if mq not in await ops.lock_queues(self._instance, self.group, addr, [mq]):
                        log.debug("%s: %s is still locked by another consumer", self.group, mq)
                        continue
                start = await self._start_offset(mq)
            except ClientError as e:
                log.debug("%s: cannot take %s yet: %s", self.group, mq, e)
                continue
            pq = ProcessQueue(mq=mq, expression=expr, next_offset=start, high=start,
                              locked=self.orderly and not self.broadcasting, tags=tag_set(expr))
            pq.space.set()
            self._pqs[mq] = pq
            self._offsets[mq] = start
            pq.puller = self._instance.spawn(self._pull_loop(pq), f"pull-{mq}")
            if self.orderly:
                pq.worker = self._instance.spawn(self._orderly_worker(pq), f"orderly-{mq}")
            log.info("%s: %s now consumes %s from offset %d", self.group, self.client_id, mq, start)

    async def _drop(self, mq: MessageQueue) -> None:
        pq = self._pqs.pop(mq, None)
        if pq is None:
            return
        pq.dropped = True
        pq.space.set()
        pq.arrived.set()
        for t in (pq.puller, pq.worker):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (pq.puller, pq.worker) if t is not None), return_exceptions=True)
        offset = self._offsets.pop(mq, None)
        if offset is not None and not self.broadcasting:
            with contextlib.suppress(ClientError):
                await ops.update_consumer_offset(self._instance, self.group, mq, pq.commit_offset())
        self._committed.pop(mq, None)
        if self.orderly and not self.broadcasting:
            with contextlib.suppress(ClientError):
                await self._unlock([mq])
        log.info("%s: %s released %s", self.group, self.client_id, mq)

    async def _start_offset(self, mq: MessageQueue) -> int:
        if not self.broadcasting:
            stored = await ops.query_consumer_offset(self._instance, self.group, mq)
            if stored is not None and stored >= 0:
                return stored
        if mq.topic.startswith(m.RETRY_GROUP_TOPIC_PREFIX) or self.consume_from == "first":
            return await ops.min_offset(self._instance, mq)
        if self.consume_from == "timestamp":
            assert self.consume_timestamp is not None
            return await ops.offset_for_timestamp(self._instance, mq, self.consume_timestamp)
        return await ops.max_offset(self._instance, mq)

    # --- pulling --------------------------------------------------------------------------------------
    async def _pull_loop(self, pq: ProcessQueue) -> None:
        backoff = 0.05
        while not pq.dropped:
            if len(pq.msgs) >= self.max_inflight_per_queue:
                pq.space.clear()
                await pq.space.wait()
                continue
            commit = None if self.broadcasting else self._offsets.get(pq.mq)
            count = self.pull_batch_size
            if pq.backlog > count:  # catching up: ask for more, within the in-flight limit
                room = self.max_inflight_per_queue - len(pq.msgs)
                count = max(count, min(pq.backlog, MAX_BACKLOG_PULL, room))
            try:
                res = await self._pull(pq, count, commit)
            except ClientClosed:
                return
            except ClientError as e:
                if pq.dropped:
                    return
                log.debug("%s: pull %s failed: %s", self.group, pq.mq, e)
                self._need_heartbeat = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if pq.dropped:
                return
            pq.backlog = max(0, res.max_offset - res.next_offset)
            if res.status == ops.PullStatus.FOUND:
                fresh = [msg for msg in res.messages
                         if msg.queue_offset >= pq.next_offset and msg.queue_offset not in pq.msgs]
                for msg in fresh:
                    pq.add(msg)
                if not self.orderly:
                    self._ready.extend([(pq, msg) for msg in fresh])
                    self._wake()
                pq.next_offset = max(res.next_offset, pq.next_offset)
                pq.high = pq.next_offset
                if self.orderly:
                    pq.arrived.set()
            elif res.status == ops.PullStatus.OFFSET_ILLEGAL:
                log.warning("%s: offset %d of %s is illegal; moving to %d", self.group, pq.next_offset, pq.mq,
                            res.next_offset)
                pq.next_offset = pq.high = res.next_offset
                if not pq.msgs:
                    self._offsets[pq.mq] = pq.next_offset
                    if not self.broadcasting:
                        with contextlib.suppress(ClientError):
                            await ops.update_consumer_offset(self._instance, self.group, pq.mq,
                                                             pq.next_offset)
            else:
                pq.next_offset = res.next_offset
                pq.high = res.next_offset
            if not pq.msgs:
                self._offsets[pq.mq] = pq.high

    async def _pull(self, pq: ProcessQueue, count: int, commit: int | None) -> ops.PullResult:
        """ops.pull for the pull loop, with the queue's tag set computed once."""
        mq = pq.mq
        inst = self._instance
        addr = await inst.broker_addr(mq.broker_name, mq.topic)
        offset = pq.next_offset
        req = ops.pull_request(inst, mq, offset, count, self.group, pq.expression,
                               int(self.long_poll_timeout * 1000), commit)
        what = f"pull {mq} at offset {offset}"
        resp = await inst.invoke(addr, req, self.long_poll_timeout + 15, what)
        return ops.pull_result(resp, mq, offset, pq.tags, what, addr)

    # --- consuming ------------------------------------------------------------------------------------
    def _spawn_consume(self, pq: ProcessQueue, msg: ReceivedMessage) -> None:
        self._ready.append((pq, msg))
        self._wake()

    def _wake(self) -> None:
        """Wake one sleeping worker, unless one is already on its way (it wakes the next if work is left
        when it takes a message)."""
        if self._waking == 0 and self._ready:
            sleepers = self._sleepers
            while sleepers:
                fut = sleepers.popleft()
                if not fut.done():
                    fut.set_result(None)
                    self._waking += 1
                    return

    async def _call_listener(self, msg: ReceivedMessage) -> bool:
        listener = self.listener
        assert listener is not None
        try:
            if self._executor is not None:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._executor, listener, msg)
            else:
                result = listener(msg)
                if inspect.isawaitable(result):
                    result = await result
            if result is None or result is True:
                return True
            return _is_success(result)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("%s: listener failed on message %s (%s): %r", self.group, msg.id, msg.queue, e)
            return False

    async def _worker(self) -> None:
        assert self._idle is not None
        loop = asyncio.get_running_loop()
        ready = self._ready
        listener = self.listener
        direct = self._executor is None and inspect.iscoroutinefunction(listener)
        busy = False  # counted in self._busy from the first message taken until the worker sleeps again
        try:
            while True:
                if not ready or self._stopping:
                    while ready and self._stopping:
                        ready.popleft()  # not started: stays uncommitted, delivered again
                    if busy:
                        busy = False
                        self._busy -= 1
                        if self._busy == 0:
                            self._idle.set()
                    fut = loop.create_future()
                    self._sleepers.append(fut)
                    try:
                        await fut
                    except asyncio.CancelledError:
                        if fut.done() and not fut.cancelled():
                            self._waking -= 1
                        raise
                    self._waking -= 1
                    continue
                pq, msg = ready.popleft()
                if ready:
                    self._wake()  # more work: let another worker take the next message if this one awaits
                if pq.dropped and pq.mq not in self._pqs:
                    continue  # not started: stays uncommitted, delivered again (to the queue's new owner)
                if not busy:
                    busy = True
                    self._busy += 1
                    self._idle.clear()
                if direct:  # a coroutine listener, called here (one coroutine less per message)
                    try:
                        result = await listener(msg)
                        ok = result is None or result is True or _is_success(result)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        log.warning("%s: listener failed on message %s (%s): %r", self.group, msg.id,
                                    msg.queue, e)
                        ok = False
                    if ok:
                        self.stats_consumed += 1
                        self._done(pq, msg)
                    else:
                        await self._consume_one(pq, msg, False)
                else:
                    await self._consume_one(pq, msg)
        finally:
            if busy:
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    async def _consume_one(self, pq: ProcessQueue, msg: ReceivedMessage, ok: bool | None = None) -> None:
        """Call the listener (unless ``ok`` already says how it went) and settle the message."""
        if ok is None:
            ok = await self._call_listener(msg)
        if ok:
            self.stats_consumed += 1
        else:
            self.stats_failed += 1
            if self.broadcasting:
                log.warning("%s: broadcasting: dropping failed message %s", self.group, msg.id)
            elif not await self._send_back(pq, msg):
                # send-back failed: consume it again locally a little later (it stays in flight)
                asyncio.get_running_loop().call_later(1.0, self._spawn_consume, pq, msg)
                return
        self._done(pq, msg)

    def _done(self, pq: ProcessQueue, msg: ReceivedMessage) -> None:
        msgs = pq.msgs
        offset = msg.queue_offset
        msgs.pop(offset, None)
        pq.consumed += 1
        if not pq.dropped:
            order = pq.order
            if order and order[0] == offset:  # the oldest in flight: the commit offset moves
                self._offsets[pq.mq] = pq.commit_offset()
            elif not msgs:
                self._offsets[pq.mq] = pq.high
        if len(msgs) < self.max_inflight_per_queue and not pq.space.is_set():
            pq.space.set()

    async def _send_back(self, pq: ProcessQueue, msg: ReceivedMessage) -> bool:
        try:
            addr = await self._instance.broker_addr(pq.mq.broker_name, pq.mq.topic)
        except ClientError:
            addr = f"{msg.store_host[0]}:{msg.store_host[1]}"
        ext = {"offset": msg.commit_log_offset, "group": self.group, "delayLevel": self.retry_delay_level,
               "originMsgId": msg.id, "originTopic": msg.topic, "unitMode": "false"}
        if self.max_reconsume_times is not None:  # else the broker's maxReconsumeTimes applies
            ext["maxReconsumeTimes"] = self.max_reconsume_times
        try:
            cmd = self._instance.request(RequestCode.CONSUMER_SEND_MSG_BACK, ext)
            await self._instance.invoke_ok(addr, cmd, 3.0, f"send back message {msg.id}")
            return True
        except ClientError as e:
            log.warning("%s: send-back of %s failed (will consume it again locally): %s", self.group,
                        msg.id, e)
            return False

    async def _orderly_worker(self, pq: ProcessQueue) -> None:
        while not pq.dropped:
            if not pq.msgs:
                pq.arrived.clear()
                await pq.arrived.wait()
                continue
            if not pq.locked:
                await asyncio.sleep(0.2)
                continue
            offset = pq.first()
            assert offset is not None
            msg = pq.msgs[offset]
            assert self._sem is not None
            async with self._sem:
                ok = await self._call_listener(msg)
            if ok:
                self.stats_consumed += 1
                self._done(pq, msg)
            else:
                self.stats_failed += 1
                msg.reconsume_times += 1
                await asyncio.sleep(self.orderly_retry_delay)

    # --- offsets and locks ----------------------------------------------------------------------------
    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.offset_commit_interval)
            try:
                await self.commit_offsets()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("%s: offset commit failed: %s", self.group, e)

    async def commit_offsets(self) -> None:
        """Store the consumed offsets now (also runs every offset_commit_interval and on close)."""
        if self.broadcasting:
            return  # broadcasting offsets stay in this process
        items = list(self._offsets.items())

        async def one(mq: MessageQueue, offset: int) -> None:
            await ops.update_consumer_offset(self._instance, self.group, mq, offset)
            self._committed[mq] = offset

        results = await asyncio.gather(*(one(mq, o) for mq, o in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._need_heartbeat = True
            raise errors[0]

    async def _lock_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lock_interval)
            by_broker: dict[str, list[MessageQueue]] = {}
            for mq in list(self._pqs):
                by_broker.setdefault(mq.broker_name, []).append(mq)
            for broker, mqs in by_broker.items():
                try:
                    addr = await self._instance.broker_addr(broker)
                    ok = await ops.lock_queues(self._instance, self.group, addr, mqs)
                except ClientError as e:
                    log.debug("%s: lock renewal failed: %s", self.group, e)
                    continue
                for mq in mqs:
                    pq = self._pqs.get(mq)
                    if pq is not None:
                        pq.locked = mq in ok

    async def _unlock(self, mqs: list[MessageQueue]) -> None:
        by_broker: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            by_broker.setdefault(mq.broker_name, []).append(mq)
        for broker, qs in by_broker.items():
            addr = self._instance.master_addr(broker)
            if addr is not None:
                await ops.unlock_queues(self._instance, self.group, addr, qs)

