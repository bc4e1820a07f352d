"""The offset commit of PushConsumer (a base class of it, sharing its state), as RocketMQ's
RemoteBrokerOffsetStore: the next offset to consume per assigned queue (kept by the consume services)
is stored on the broker every offset_commit_interval, on close and when a queue is released. Rules:
broadcasting offsets stay in the process; a failed commit is retried by the next one and asks for a
heartbeat; commits of different queues run concurrently.
"""

from __future__ import annotations

import asyncio
import logging

from . import ops
from .consumer_state import ConsumerState
from .model import MessageQueue

log = logging.getLogger("chronomq.client")


class OffsetCommit(ConsumerState):
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
