"""The rebalance of PushConsumer (an object the consumer holds, working on its state), as RocketMQ's
RebalanceImpl with AllocateMessageQueueAveragely: every rebalance_interval (or at once when the broker
says the group changed) each subscribed topic's read queues are split among the group's consumer ids;
queues no longer this consumer's are dropped (their offset stored, their lock released), new ones are
taken from the stored offset (else per consume_from); the broker's offset reset
(RESET_CONSUMER_CLIENT_OFFSET) restarts the queues it names at their new offsets. Rules: broadcasting
takes every queue and stores no offsets; an orderly consumer takes a queue only once the broker has
locked it for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from chronomq import message as m

from . import ops
from .errors import ClientError, NoRouteError
from .model import MessageQueue, TopicRoute, tag_set
from .process_queue import ProcessQueue

if TYPE_CHECKING:
    from .consumer_state import ConsumerState

log = logging.getLogger("chronomq.client")


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


class Rebalancer:
    """Which queues ``consumer`` consumes: it takes and drops them in the consumer's queue table (its
    ``_pqs`` and ``_offsets``), through the consumer's queue locks and offset commit."""

    def __init__(self, consumer: ConsumerState) -> None:
        self.consumer = consumer
        self._now = asyncio.Event()  # set: rebalance at once (the broker said the group changed)
        # a rebalance pass and an offset reset never interleave: a pass that took a queue the reset had
        # just stopped would be replaced by the reset's own take, its pull task left running unseen
        # (every later message of the queue handed on twice), as RocketMQ's client suspends its
        # rebalance while it resets
        self._queues_lock = asyncio.Lock()

    def wake(self) -> None:
        """Rebalance now rather than at the next interval."""
        self._now.set()

    async def run(self) -> None:
        """Rebalance every rebalance_interval, or when woken (until cancelled)."""
        c = self.consumer
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(c.rebalance_interval):
                    await self._now.wait()
            self._now.clear()
            try:
                await self.rebalance()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: rebalance failed: %s", c.group, e)

    async def rebalance(self) -> None:
        async with self._queues_lock:
            await self._rebalance()

    async def _rebalance(self) -> None:
        c = self.consumer
        brokers = {a for addrs in c._instance.broker_addrs.values() for a in addrs.values()}
        if c._need_heartbeat or brokers - c._known_brokers:
            await c._heartbeat()
        for topic, expr in list(c.subscriptions.items()):
            if c._stopping:
                return
            try:
                route = await c._instance.get_route(topic, refresh=topic not in c._instance.routes)
            except NoRouteError:
                continue
            except ClientError as e:
                log.debug("%s: route of %s unavailable: %s", c.group, topic, e)
                continue
            if brokers != {a for addrs in c._instance.broker_addrs.values() for a in addrs.values()}:
                await c._heartbeat()
            mqs = route.read_queues()
            if c.broadcasting:
                mine = mqs
            else:
                cids = await self._consumer_ids(route)
                if cids is None:
                    continue
                mine = allocate_average(mqs, cids, c.client_id)
            await self._apply(topic, expr, set(mine))

    async def _consumer_ids(self, route: TopicRoute) -> list[str] | None:
        c = self.consumer
        # each broker's master, or its slave while the master is down (it knows the group from heartbeats)
        addrs = sorted({a for name in route.broker_addrs
                        if (a := c._instance.read_target(name)[0]) is not None})
        for addr in addrs:
            try:
                cids = await ops.consumer_ids(c._instance, c.group, addr)
                if c.client_id not in cids:
                    await c._heartbeat()
                    cids = await ops.consumer_ids(c._instance, c.group, addr)
                if c.client_id in cids:
                    return cids
            except ClientError as e:
                log.debug("%s: consumer list from %s failed: %s", c.group, addr, e)
        return None

    async def _apply(self, topic: str, expr: str, mine: set[MessageQueue]) -> None:
        c = self.consumer
        current = {mq for mq in c._pqs if mq.topic == topic}
        for mq in sorted(current - mine):
            await self._drop(mq)
        for mq in sorted(mine - current):
            if c._stopping:
                return
            try:
                if c.orderly and not c.broadcasting and not await c._locks.lock(mq):
                    log.debug("%s: %s is still locked by another consumer", c.group, mq)
                    continue
                start = await self._start_offset(mq)
            except ClientError as e:
                log.debug("%s: cannot take %s yet: %s", c.group, mq, e)
                continue
            self._take(mq, expr, start)

    def _take(self, mq: MessageQueue, expr: str, start: int) -> None:
        """Start consuming ``mq`` at ``start`` (a fresh ProcessQueue, its pull task and orderly worker)."""
        c = self.consumer
        pq = ProcessQueue(mq=mq, expression=expr, next_offset=start, high=start,
                          locked=c.orderly and not c.broadcasting, tags=tag_set(expr))
        pq.space.set()
        c._pqs[mq] = pq
        c._offsets[mq] = start
        pq.puller = c._instance.spawn(c._pull_loop(pq), f"pull-{mq}")
        if c.orderly:
            pq.worker = c._instance.spawn(c._orderly_worker(pq), f"orderly-{mq}")
        log.info("%s: %s now consumes %s from offset %d", c.group, c.client_id, mq, start)

    async def _stop_queue(self, mq: MessageQueue) -> ProcessQueue | None:
        """Stop consuming ``mq``: its pull task and orderly worker end; messages not yet started are not."""
        pq = self.consumer._pqs.pop(mq, None)
        if pq is None:
            return None
        pq.dropped = True
        pq.space.set()
        pq.arrived.set()
        for t in (pq.puller, pq.worker):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (pq.puller, pq.worker) if t is not None), return_exceptions=True)
        return pq

    async def reset_offsets(self, topic: str, offsets: dict[MessageQueue, int]) -> list[MessageQueue]:
        """PushConsumer.reset_offsets."""
        async with self._queues_lock:
            return await self._reset_offsets(topic, offsets)

    async def _reset_offsets(self, topic: str, offsets: dict[MessageQueue, int]) -> list[MessageQueue]:
        c = self.consumer
        moved = []
        for mq, offset in sorted(offsets.items()):
            if mq.topic != topic or mq not in c._pqs or c._stopping:
                continue
            pq = await self._stop_queue(mq)
            if pq is None:
                continue
            c._offsets[mq] = offset
            if not c.broadcasting:
                with contextlib.suppress(ClientError):
                    await c._offset_commit.store(mq, offset)
                c._committed[mq] = offset
            self._take(mq, pq.expression, offset)
            moved.append(mq)
        if moved:
            log.info("%s: offsets of %s reset by the broker: %s", c.group, topic,
                     {str(mq): offsets[mq] for mq in moved})
        return moved

    async def _drop(self, mq: MessageQueue) -> None:
        c = self.consumer
        pq = await self._stop_queue(mq)
        if pq is None:
            return
        offset = c._offsets.pop(mq, None)
        if offset is not None and not c.broadcasting:
            with contextlib.suppress(ClientError):
                await c._offset_commit.store(mq, pq.commit_offset())
        c._committed.pop(mq, None)
        if c.orderly and not c.broadcasting:
            with contextlib.suppress(ClientError):
                await c._locks.unlock([mq])
        log.info("%s: %s released %s", c.group, c.client_id, mq)

    async def _start_offset(self, mq: MessageQueue) -> int:
        c = self.consumer
        if not c.broadcasting:
            stored = await ops.query_consumer_offset(c._instance, c.group, mq)
            if stored is not None and stored >= 0:
                return stored
        if mq.topic.startswith(m.RETRY_GROUP_TOPIC_PREFIX) or c.consume_from == "first":
            return await ops.min_offset(c._instance, mq)
        if c.consume_from == "timestamp":
            assert c.consume_timestamp is not None
            return await ops.offset_for_timestamp(c._instance, mq, c.consume_timestamp)
        return await ops.max_offset(c._instance, mq)
