"""The offset commit of PushConsumer, as RocketMQ's RemoteBrokerOffsetStore: the next offset to consume
per assigned queue (kept by the consume services) is stored on the broker every ``interval``, on close
and when a queue is released. Rules: broadcasting offsets stay in the process; a failed commit is retried
by the next one and asks for a heartbeat; commits of different queues run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from . import ops
from .instance import ClientInstance
from .model import MessageQueue

log = logging.getLogger("chronomq.client")


class OffsetCommit:
    """Stores ``offsets`` (the consumer's next offsets, shared) for ``group``; ``committed`` (shared too)
    holds what the broker has; ``on_failure`` is called when a commit fails."""

    def __init__(self, instance: ClientInstance, group: str, offsets: dict[MessageQueue, int],
                 committed: dict[MessageQueue, int], interval: float, broadcasting: bool,
                 on_failure: Callable[[], None]) -> None:
        self._instance = instance
        self._group = group
        self._offsets = offsets
        self._committed = committed
        self.interval = interval
        self.broadcasting = broadcasting
        self._on_failure = on_failure

    async def run(self) -> None:
        """Commit every ``interval`` (until cancelled); a failure waits for the next round."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.commit()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("%s: offset commit failed: %s", self._group, e)

    async def store(self, mq: MessageQueue, offset: int) -> None:
        """Store one queue's offset on the broker now."""
        await ops.update_consumer_offset(self._instance, self._group, mq, offset)
        self._committed[mq] = offset

    async def commit(self) -> None:
        """Store every assigned queue's offset now (broadcasting: nothing, they stay in this process)."""
        if self.broadcasting:
            return
        items = list(self._offsets.items())
        results = await asyncio.gather(*(self.store(mq, o) for mq, o in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._on_failure()
            raise errors[0]
