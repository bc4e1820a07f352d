"""PushConsumer: subscriptions with tag expressions, a listener (sync function or coroutine) returning
success or "later"; clustering (average allocation, takeover on membership change) or broadcasting;
bounded concurrency; offsets committed every 5 s and on close; automatic %RETRY%<group> subscription
and send-back of failed messages; orderly consumption with queue locks; flow control per queue.

This module is the facade, as RocketMQ's DefaultMQPushConsumerImpl: construction, start/close, the
heartbeat and server requests (NOTIFY_CONSUMER_IDS_CHANGED, RESET_CONSUMER_CLIENT_OFFSET,
GET_CONSUMER_RUNNING_INFO). The hot path is two base classes sharing its state: the pull loop (pull.py)
and the consume services (consume.py). The rest are objects it holds: the rebalance (rebalance.py), the
offset commit (offsets.py) and the queue locks (locks.py); ProcessQueue is in process_queue.py."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from chronomq import __version__
from chronomq import message as m
from chronomq.clock import Clock, SystemClock
from chronomq.remoting import fastjson
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import (
    RequestCode,
    ResponseCode,
)
from chronomq.remoting.tls import TlsOption

from .blocking import SyncContextMixin
from .consume import LATER, SUCCESS, ConsumeResult, ConsumeService, Listener
from .errors import ClientClosed, ClientError
from .instance import ClientInstance
from .locks import QueueLocks
from .model import MessageQueue, ReceivedMessage, tag_set
from .offsets import OffsetCommit
from .process_queue import ProcessQueue
from .pull import MAX_BACKLOG_PULL, PullPath
from .rebalance import Rebalancer, allocate_average

__all__ = ["LATER", "MAX_BACKLOG_PULL", "SUCCESS", "ConsumeResult", "Listener", "ProcessQueue",
           "PushConsumer", "allocate_average"]

log = logging.getLogger("chronomq.client")


def _checked_subscriptions(group: str, subscriptions: Mapping[str, str] | Sequence[str] | str,
                           consume_from: str, consume_timestamp: int | None, concurrency: int,
                           max_inflight_per_queue: int, pull_batch_size: int) -> dict[str, str]:
    """PushConsumer's argument checks (ValueError); the subscriptions as {topic: tag expression}."""
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
    return subs


class PushConsumer(PullPath, ConsumeService, SyncContextMixin):
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
                 clock: Clock | None = None, credentials: tuple[str, str] | None = None,
                 tls: TlsOption = None) -> None:
        subs = _checked_subscriptions(group, subscriptions, consume_from, consume_timestamp, concurrency,
                                      max_inflight_per_queue, pull_batch_size)
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
        self._instance = ClientInstance(namesrv, credentials=credentials, instance_name=instance_name,
                                        tls=tls, request_timeout=request_timeout,
                                        heartbeat_interval=heartbeat_interval,
                                        route_refresh_interval=route_refresh_interval,
                                        request_handler=self._on_server_request, clock=self._clock)
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
        self._known_brokers: set[str] = set()
        self._need_heartbeat = False
        self._locks = QueueLocks(self._instance, group, self._pqs, lock_interval)
        self._offset_commit = OffsetCommit(self._instance, group, self._offsets, self._committed,
                                           offset_commit_interval, broadcasting, self._ask_heartbeat)
        self._rebalancer = Rebalancer(self)
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
            await self._rebalancer.rebalance()  # errors here are retried by the rebalance loop
        except ClientError as e:
            log.warning("%s: first rebalance failed (retrying every %.1fs): %s", self.group,
                        self.rebalance_interval, e)
        except BaseException:
            await self.close()
            raise
        self._instance.spawn(self._rebalancer.run(), "rebalance")
        self._instance.spawn(self._offset_commit.run(), "offset-commit")
        if self.orderly and not self.broadcasting:
            self._instance.spawn(self._locks.run(), "lock")

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
            async with asyncio.timeout(self.shutdown_timeout):
                await self._idle.wait()
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
            async with asyncio.timeout(5.0):
                await self._offset_commit.commit()
        except (TimeoutError, Exception) as e:
            log.warning("%s: final offset commit failed: %s", self.group, e)
        if self.orderly and not self.broadcasting:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3.0):
                    await self._locks.unlock([pq.mq for pq in pqs])
        with contextlib.suppress(Exception):
            async with asyncio.timeout(3.0):
                await self._instance.unregister(consumer_group=self.group)
        await self._instance.close()
        if self._executor is not None:
            # a listener thread that never returns cannot be stopped: do not hang on it
            self._executor.shutdown(wait=not stuck, cancel_futures=True)
        self._pqs.clear()

    # --- offsets ---------------------------------------------------------------------------------------
    async def commit_offsets(self) -> None:
        """Store the consumed offsets now (also runs every offset_commit_interval and on close)."""
        await self._offset_commit.commit()

    async def reset_offsets(self, topic: str, offsets: dict[MessageQueue, int]) -> list[MessageQueue]:
        """The broker's RESET_CONSUMER_CLIENT_OFFSET: each queue of ``topic`` this consumer holds starts
        again at its new offset (stored on the broker first); messages pulled and not yet started are
        dropped, listener calls already running finish uncommitted. Returns the queues moved."""
        return await self._rebalancer.reset_offsets(topic, offsets)

    # --- introspection --------------------------------------------------------------------------------
    def assigned_queues(self) -> list[MessageQueue]:
        return sorted(self._pqs)

    def offsets(self) -> dict[MessageQueue, int]:
        """The next offset to consume per assigned queue (what the next commit will store)."""
        return dict(self._offsets)

    # --- server requests ------------------------------------------------------------------------------
    async def _on_server_request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand | None:
        if cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            self._rebalancer.wake()
            return None
        if cmd.code == RequestCode.RESET_CONSUMER_CLIENT_OFFSET:
            self._on_reset_offset(addr, cmd)
            return None
        if cmd.code == RequestCode.GET_CONSUMER_RUNNING_INFO:
            return cmd.response(body=json.dumps(self.running_info(), separators=(",", ":")).encode())
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                            remark=f"request code {cmd.code} not supported by chronomq.client")

    def _on_reset_offset(self, addr: str, cmd: RemotingCommand) -> None:
        """RESET_CONSUMER_CLIENT_OFFSET (oneway): ResetOffsetBody {"offsetTable": {queue: offset}}, or the
        list form a broker sends C++ clients; the queues named are restarted at their offsets."""
        topic, group = cmd.ext_str("topic") or "", cmd.ext_str("group") or ""
        if group != self.group or not self._started or self._stopping:
            return
        try:
            table = fastjson.loads(cmd.body).get("offsetTable") or {}
            rows = ([(json.loads(k), v) for k, v in table.items()] if isinstance(table, dict)
                    else [(r, r.get("offset")) for r in table])
            offsets = {MessageQueue(str(q["topic"]), str(q["brokerName"]), int(q["queueId"])): int(v)
                       for q, v in rows}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning("%s: offset reset from %s not understood: %s", self.group, addr, e)
            return
        self._instance.spawn(self.reset_offsets(topic, offsets), "offset-reset")

    def running_info(self) -> dict[str, Any]:
        """What GET_CONSUMER_RUNNING_INFO answers (RocketMQ's ConsumerRunningInfo): properties, the
        subscriptions and, per assigned queue, its ProcessQueueInfo."""
        hb = self._heartbeat_body()["consumerDataSet"][0]
        now = self._clock.now_ms()
        mq_table = {}
        for mq, pq in sorted(self._pqs.items()):
            offsets = sorted(pq.msgs)
            key = json.dumps(mq.to_json(), separators=(",", ":"))
            mq_table[key] = {
                "commitOffset": self._committed.get(mq, self._offsets.get(mq, pq.next_offset)),
                "cachedMsgMinOffset": offsets[0] if offsets else 0,
                "cachedMsgMaxOffset": offsets[-1] if offsets else 0, "cachedMsgCount": len(offsets),
                "cachedMsgSizeInMiB": sum(len(msg.body) for msg in pq.msgs.values()) >> 20,
                "transactionMsgMinOffset": 0, "transactionMsgMaxOffset": 0, "transactionMsgCount": 0,
                "locked": pq.locked, "tryUnlockTimes": 0, "lastLockTimestamp": 0, "droped": pq.dropped,
                "lastPullTimestamp": now, "lastConsumeTimestamp": now,
            }
        props = {"PROP_NAMESERVER_ADDR": ";".join(self._instance.namesrv_addrs),
                 "PROP_THREADPOOL_CORE_SIZE": str(self.concurrency),
                 "PROP_CONSUMEORDERLY": "true" if self.orderly else "false",
                 "PROP_CONSUME_TYPE": hb["consumeType"], "PROP_CLIENT_VERSION": f"chronomq {__version__}",
                 "PROP_CONSUMER_START_TIMESTAMP": str(self._sub_version),
                 "consumerGroup": self.group, "messageModel": hb["messageModel"],
                 "consumeFromWhere": hb["consumeFromWhere"]}
        return {"properties": props, "subscriptionSet": hb["subscriptionDataSet"], "mqTable": mq_table,
                "mqPopTable": {}, "statusTable": {}, "userConsumerInfo": {}, "jstack": None}

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

    def _ask_heartbeat(self) -> None:
        self._need_heartbeat = True  # the next rebalance sends one first

    async def _heartbeat(self) -> None:
        self._known_brokers = {a for addrs in self._instance.broker_addrs.values() for a in addrs.values()}
        self._need_heartbeat = False
        await self._instance.send_heartbeat()
