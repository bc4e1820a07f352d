"""The queue locks of an orderly PushConsumer, as RocketMQ's RebalanceImpl.lockAll/unlock: the broker-side
locks of the assigned queues are renewed every ``interval``, per broker in one request, and released on
drop and close. Rules: a queue whose renewal the broker refuses is not consumed (pq.locked) until a
renewal succeeds; clustering only.
"""

from __future__ import annotations

import asyncio
import logging

from . import ops
from .errors import ClientError
from .instance import ClientInstance
from .model import MessageQueue
from .process_queue import ProcessQueue

log = logging.getLogger("chronomq.client")


def _by_broker(mqs: list[MessageQueue]) -> dict[str, list[MessageQueue]]:
    out: dict[str, list[MessageQueue]] = {}
    for mq in mqs:
        out.setdefault(mq.broker_name, []).append(mq)
    return out


class QueueLocks:
    """The locks of ``pqs`` (the consumer's assigned queues, shared) for ``group``."""

    def __init__(self, instance: ClientInstance, group: str, pqs: dict[MessageQueue, ProcessQueue],
                 interval: float) -> None:
        self._instance = instance
        self._group = group
        self._pqs = pqs
        self.interval = interval

    async def lock(self, mq: MessageQueue) -> bool:
        """Ask ``mq``'s broker for its lock; False while another consumer holds it."""
        addr = await self._instance.broker_addr(mq.broker_name, mq.topic)
        return mq in await ops.lock_queues(self._instance, self._group, addr, [mq])

    async def run(self) -> None:
        """Renew the locks of the assigned queues every ``interval`` (until cancelled)."""
        while True:
            await asyncio.sleep(self.interval)
            for broker, mqs in _by_broker(list(self._pqs)).items():
                try:
                    addr = await self._instance.broker_addr(broker)
                    ok = await ops.lock_queues(self._instance, self._group, addr, mqs)
                except ClientError as e:
                    log.debug("%s: lock renewal failed: %s", self._group, e)
                    continue
                for mq in mqs:
                    pq = self._pqs.get(mq)
                    if pq is not None:
                        pq.locked = mq in ok

    async def unlock(self, mqs: list[MessageQueue]) -> None:
        for broker, qs in _by_broker(mqs).items():
            addr = self._instance.master_addr(broker)
            if addr is not None:
                await ops.unlock_queues(self._instance, self._group, addr, qs)
