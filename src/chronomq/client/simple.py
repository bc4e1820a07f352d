"""SimpleConsumer: the pull API (what the Spark connector builds on). You choose the queue and the
offset; the consumer never commits anything unless you call commit_offset."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from chronomq.remoting.tls import TlsOption

from . import ops
from .blocking import SyncContextMixin
from .errors import ClientClosed, NoRouteError
from .instance import ClientInstance
from .model import MessageQueue
from .ops import PullResult, PullStatus

__all__ = ["PullResult", "PullStatus", "SimpleConsumer"]


class SimpleConsumer(SyncContextMixin):
    def __init__(self, group: str = "DEFAULT_PULL_CONSUMER", namesrv: str | Sequence[str] = "127.0.0.1:9876",
                 *, request_timeout: float = 3.0, instance_name: str | None = None,
                 credentials: tuple[str, str] | None = None, tls: TlsOption = None) -> None:
        if not group:
            raise ValueError("the consumer group must not be empty")
        self.group = group
        self._instance = ClientInstance(namesrv, credentials=credentials, instance_name=instance_name,
                                        request_timeout=request_timeout, tls=tls)
        self._started = False
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this consumer was closed; create a new one")
        await self._instance.start()
        self._started = True

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._instance.close()

    async def queues(self, topic: str, refresh: bool = False) -> list[MessageQueue]:
        """The readable queues of a topic, sorted."""
        route = await self._instance.get_route(topic, refresh=refresh)
        qs = route.read_queues()
        if not qs:
            raise NoRouteError(f"topic {topic!r} has no readable queue")
        return qs

    async def pull(self, queue: MessageQueue, offset: int, max_count: int = 32, *, timeout: float = 0.0,
                   expression: str = "*", raw: bool | Literal["bytes"] = False,
                   bulk: bool = False) -> PullResult:
        """Messages of ``queue`` from ``offset`` (at most ``max_count``). With ``timeout`` > 0 the broker
        holds the request up to that many seconds when there is nothing new (long polling). ``raw``: the
        records come column by column in ``records`` (RecordColumns), not as messages, and are not checked
        against the expression's tags (the broker's filter compares tag hash codes only); ``raw="bytes"``:
        undecoded in ``body`` (``chronomq.client.model.record_columns`` splits them). ``bulk``: a chronomq
        broker answers up to its bulk-read caps (``maxTransferCountOnBulkRead`` messages, 1024 by default)
        rather than RocketMQ's 32, for a reader going through a backlog; other brokers ignore it."""
        return await ops.pull(self._instance, queue, offset, max_count, group=self.group,
                              expression=expression, suspend_ms=int(timeout * 1000), raw=raw, bulk=bulk)

    async def min_offset(self, queue: MessageQueue) -> int:
        return await ops.min_offset(self._instance, queue)

    async def max_offset(self, queue: MessageQueue) -> int:
        """The next offset to be written (= number of messages ever written to the queue)."""
        return await ops.max_offset(self._instance, queue)

    async def offset_for_timestamp(self, queue: MessageQueue, timestamp_ms: int) -> int:
        """The first offset whose store time is >= timestamp_ms (as the broker finds it)."""
        return await ops.offset_for_timestamp(self._instance, queue, timestamp_ms)

    async def earliest_store_time(self, queue: MessageQueue) -> int:
        return await ops.earliest_store_time(self._instance, queue)

    async def committed_offset(self, queue: MessageQueue) -> int | None:
        """This group's committed offset on the queue, or None if it has none."""
        return await ops.query_consumer_offset(self._instance, self.group, queue)

    async def commit_offset(self, queue: MessageQueue, offset: int) -> None:
        await ops.update_consumer_offset(self._instance, self.group, queue, offset)
