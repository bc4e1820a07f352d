"""The queue locks of an orderly PushConsumer (a base class of it, sharing its state), as RocketMQ's
RebalanceImpl.lockAll/unlock: the broker-side locks of the assigned queues are renewed every
lock_interval, per broker in one request, and released on drop and close. Rules: a queue whose renewal
the broker refuses is not consumed (pq.locked) until a renewal succeeds; clustering only.
"""

from __future__ import annotations

import asyncio
import logging

from . import ops
from .consumer_state import ConsumerState
from .errors import ClientError
from .model import MessageQueue

log = logging.getLogger("chronomq.client")


class QueueLocks(ConsumerState):
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
