"""The rebalance of PushConsumer (a base class of it, sharing its state), as RocketMQ's RebalanceImpl with
AllocateMessageQueueAveragely: every rebalance_interval (or at once when the broker says the group
changed) each subscribed topic's read queues are split among the group's consumer ids; queues no longer
this consumer's are dropped (their offset stored, their lock released), new ones are taken from the
stored offset (else per consume_from); the broker's offset reset (RESET_CONSUMER_CLIENT_OFFSET) restarts
the queues it names at their new offsets. Rules: broadcasting takes every queue and stores no offsets; an
orderly consumer takes a queue only once the broker has locked it for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from chronomq import message as m

from . import ops
from .consumer_state import ConsumerState
from .errors import ClientError, NoRouteError
from .model import MessageQueue, TopicRoute, tag_set
from .process_queue import ProcessQueue

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


class Rebalance(ConsumerState):
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
        # each broker's master, or its slave while the master is down (it knows the group from heartbeats)
        addrs = sorted({a for name in route.broker_addrs
                        if (a := self._instance.read_target(name)[0]) is not None})
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
            self._take(mq, expr, start)

    def _take(self, mq: MessageQueue, expr: str, start: int) -> None:
        """Start consuming ``mq`` at ``start`` (a fresh ProcessQueue, its pull task and orderly worker)."""
        pq = ProcessQueue(mq=mq, expression=expr, next_offset=start, high=start,
                          locked=self.orderly and not self.broadcasting, tags=tag_set(expr))
        pq.space.set()
        self._pqs[mq] = pq
        self._offsets[mq] = start
        pq.puller = self._instance.spawn(self._pull_loop(pq), f"pull-{mq}")
        if self.orderly:
            pq.worker = self._instance.spawn(self._orderly_worker(pq), f"orderly-{mq}")
        log.info("%s: %s now consumes %s from offset %d", self.group, self.client_id, mq, start)

    async def _stop_queue(self, mq: MessageQueue) -> ProcessQueue | None:
        """Stop consuming ``mq``: its pull task and orderly worker end; messages not yet started are not."""
        pq = self._pqs.pop(mq, None)
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
        """The broker's RESET_CONSUMER_CLIENT_OFFSET: each queue of ``topic`` this consumer holds starts
        again at its new offset (stored on the broker first); messages pulled and not yet started are
        dropped, listener calls already running finish uncommitted. Returns the queues moved."""
        moved = []
        for mq, offset in sorted(offsets.items()):
            if mq.topic != topic or mq not in self._pqs or self._stopping:
                continue
            pq = await self._stop_queue(mq)
            if pq is None:
                continue
            while mq in self._pqs:  # a rebalance took it again meanwhile
                await self._stop_queue(mq)
            self._offsets[mq] = offset
            if not self.broadcasting:
                with contextlib.suppress(ClientError):
                    await ops.update_consumer_offset(self._instance, self.group, mq, offset)
                self._committed[mq] = offset
            self._take(mq, pq.expression, offset)
            moved.append(mq)
        if moved:
            log.info("%s: offsets of %s reset by the broker: %s", self.group, topic,
                     {str(mq): offsets[mq] for mq in moved})
        return moved

    async def _drop(self, mq: MessageQueue) -> None:
        pq = await self._stop_queue(mq)
        if pq is None:
            return
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
