"""The services a broker's request processors work with, built once by the controller.

``BrokerServices`` holds the store, the delay and timer services, the topic, offset and client
managers, the long-poll hold service, the put counters, the configuration, the clock and the store host,
plus two narrow controller actions (``notify_consumer_ids_changed``, ``runtime_info``). The processors
(``BrokerProcessor``, ``TimerProcessor``) take this object, not the controller, so another endpoint
(HA, transactions, ACL checks, a gRPC service) can be given the same services without reaching into one
class. ``loop`` and ``stopping`` are the broker's run state: set by the controller when it starts and
shuts down, read by the processors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.delay import DelayService
from chronomq.delay.histogram import Histogram
from chronomq.delay.timer import TimerService
from chronomq.ha import HAService
from chronomq.store import MessageStore
from chronomq.store.types import PutResult

from .clients import ConsumerManager, ProducerManager, QueueLockManager
from .dedup import SendDedup
from .longpoll import PullHoldService
from .offsets import ConsumerOffsetManager
from .subgroups import SubscriptionGroupConfig, SubscriptionGroupManager
from .topics import TopicConfigManager
from .transaction import TransactionService


class PromoteError(Exception):
    """A promotion that cannot be done: not a slave, or the role asked for is not a master's."""


@dataclass
class PutStats:
    """Counters of the puts made for SEND requests (GET_BROKER_RUNTIME_INFO)."""

    count: int = 0
    failures: int = 0

    def record(self, result: PutResult) -> None:
        if result.ok:
            self.count += result.append.msg_count if result.append else 1
        else:
            self.failures += 1


MAX_TRAFFIC_KEYS = 100_000  # (topic, type) and (topic, group) pairs counted; beyond it new ones are not


class TrafficStats:
    """Messages and bytes in (per topic and message type: Normal, Delay, Transaction) and out (per topic
    and consumer group), and the lateness of timed messages at the pull that hands them to a consumer:
    counters for /metrics, bounded in the pairs they keep."""

    def __init__(self) -> None:
        self.produced: dict[tuple[str, str], list[int]] = {}
        self.consumed: dict[tuple[str, str], list[int]] = {}
        self.pull_lateness = Histogram()

    @staticmethod
    def _add(table: dict[tuple[str, str], list[int]], key: tuple[str, str], msgs: int, size: int) -> None:
        row = table.get(key)
        if row is None:
            if len(table) >= MAX_TRAFFIC_KEYS:
                return
            row = table[key] = [0, 0]
        row[0] += msgs
        row[1] += size

    def produce(self, topic: str, kind: str, msgs: int, size: int) -> None:
        self._add(self.produced, (topic, kind), msgs, size)

    def consume(self, topic: str, group: str, msgs: int, size: int) -> None:
        self._add(self.consumed, (topic, group), msgs, size)


@dataclass(eq=False)
class BrokerServices:
    config: BrokerConfig
    clock: Clock
    store_host: tuple[str, int]
    store: MessageStore
    delay: DelayService  # the one way in for sent messages: admit / admit_batch
    timer: TimerService
    topics: TopicConfigManager
    offsets: ConsumerOffsetManager
    consumers: ConsumerManager
    producers: ProducerManager
    locks: QueueLockManager
    hold: PullHoldService
    notify_consumer_ids_changed: Callable[[str], None]
    runtime_info: Callable[[], dict[str, Any]]
    put_stats: PutStats = field(default_factory=PutStats)
    traffic: TrafficStats = field(default_factory=TrafficStats)
    dedup: SendDedup | None = None  # sends asking for it stored once per (topic, UNIQ_KEY); None: off
    ha: HAService | None = None  # on a master: the slaves' link and the SYNC_MASTER wait
    promote: Callable[[str], Awaitable[None]] | None = None  # a slave's promotion (the controller's)
    transactions: TransactionService | None = None  # half messages, END_TRANSACTION and the check
    loop: asyncio.AbstractEventLoop | None = None
    stopping: bool = False
    subgroups: SubscriptionGroupManager | None = None  # BrokerProcessor's (config/subscriptionGroup.json)

    def subscription_group(self, name: str) -> SubscriptionGroupConfig | None:
        """The subscription group's config (``consumeMessageOrderly``, ``retryMaxTimes``, ...), or None
        when this broker has no such group."""
        return self.subgroups.get(name) if self.subgroups is not None else None
