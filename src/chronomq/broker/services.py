"""The services a broker's request processors work with, built whole by ``build_services``.

``BrokerServices`` holds the store, the delay and timer services, the topic, offset, subscription-group
and client managers, the long-poll hold service, transactions, de-duplication, the put and traffic
counters, the configuration, the clock and the store host, plus three narrow controller actions
(``notify_consumer_ids_changed``, ``runtime_info``, ``promote``). The processors (``BrokerProcessor``,
``TimerProcessor``) and the gRPC endpoint take this object, not the controller.

Rules: frozen once built. Three members follow the broker's run and are set only through their setters:
``loop`` (``bind_loop``, at start), ``ha`` (``set_ha``, when a master starts listening for slaves) and
``stopping`` (``mark_stopping``, at shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronomq.clock import Clock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.delay import DelayService
from chronomq.delay.histogram import Histogram
from chronomq.delay.timer import TimerError, TimerService
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


@dataclass(frozen=True, eq=False)
class BrokerServices:
    config: BrokerConfig
    clock: Clock
    store_host: tuple[str, int]
    store: MessageStore
    delay: DelayService  # the one way in for sent messages: admit / admit_batch
    timer: TimerService
    topics: TopicConfigManager
    offsets: ConsumerOffsetManager
    subgroups: SubscriptionGroupManager  # config/subscriptionGroup.json
    consumers: ConsumerManager
    producers: ProducerManager
    locks: QueueLockManager
    hold: PullHoldService
    transactions: TransactionService  # half messages, END_TRANSACTION and the check
    notify_consumer_ids_changed: Callable[[str], None]
    runtime_info: Callable[[], dict[str, Any]]
    put_stats: PutStats = field(default_factory=PutStats)
    traffic: TrafficStats = field(default_factory=TrafficStats)
    dedup: SendDedup | None = None  # sends asking for it stored once per (topic, UNIQ_KEY); None: off
    promote: Callable[[str], Awaitable[None]] | None = None  # a slave's promotion (the controller's)
    # the broker's run: set through the setters below only
    loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    ha: HAService | None = field(default=None, init=False)  # on a master: the slaves' link, SYNC_MASTER wait
    stopping: bool = field(default=False, init=False)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the broker runs on (deferred answers are posted to it). Late-bound: the services
        are built in the controller's constructor, before any loop runs; ``start`` binds it."""
        object.__setattr__(self, "loop", loop)

    def set_ha(self, ha: HAService) -> None:
        """A master's end of the slaves' link. Late-bound: it is built when the broker starts as a master
        (it listens on a port), or when a slave is promoted."""
        object.__setattr__(self, "ha", ha)

    def mark_stopping(self) -> None:
        """The broker is shutting down: held pulls and receives answer at once. Late-bound by nature."""
        object.__setattr__(self, "stopping", True)

    def subscription_group(self, name: str) -> SubscriptionGroupConfig | None:
        """The subscription group's config (``consumeMessageOrderly``, ``retryMaxTimes``, ...), or None
        when this broker has no such group."""
        return self.subgroups.get(name)


def build_services(
    config: BrokerConfig,
    clock: Clock,
    store_host: tuple[str, int],
    *,
    notify_consumer_ids_changed: Callable[[str], None],
    runtime_info: Callable[[], dict[str, Any]],
    promote: Callable[[str], Awaitable[None]] | None = None,
) -> BrokerServices:
    """A broker's services, each built from ``config`` (its data under ``storePathRootDir``), ``clock``
    and ``store_host`` (the (ip, port) stamped on stored records); the three callables are the
    controller's. Raises ConfigError when the timer store refuses its settings."""
    root = Path(config.storePathRootDir)
    store = MessageStore(config, clock, store_host)
    delay = DelayService(store, config, clock)
    try:  # the timer store (its settings are broker keys: timerMaxDelaySec, ...)
        timer = TimerService(store, config, clock, store_host=store_host)
    except TimerError as e:
        raise ConfigError(str(e)) from None
    topics = TopicConfigManager(
        root / "config",
        config.defaultTopicQueueNums,
        config.autoCreateTopicEnable,
        delay.schedule_topic_queue_nums,
        clock.now_ms,
        cluster_name=config.brokerClusterName,
        broker_name=config.brokerName,
        cluster_topic_enable=config.clusterTopicEnable,
        broker_topic_enable=config.brokerTopicEnable,
    )
    offsets = ConsumerOffsetManager(root / "config")
    producers = ProducerManager(config.clientChannelMaxIdleTimeSeconds * 1000)
    return BrokerServices(
        config=config,
        clock=clock,
        store_host=store_host,
        store=store,
        delay=delay,
        timer=timer,
        topics=topics,
        offsets=offsets,
        subgroups=SubscriptionGroupManager(root / "config", clock.now_ms,
                                           lambda: config.autoCreateSubscriptionGroup),
        consumers=ConsumerManager(config.clientChannelMaxIdleTimeSeconds * 1000),
        producers=producers,
        locks=QueueLockManager(),
        hold=PullHoldService(clock),
        transactions=TransactionService(config, clock, store, delay, timer, offsets, producers, store_host),
        notify_consumer_ids_changed=notify_consumer_ids_changed,
        runtime_info=runtime_info,
        dedup=SendDedup(store, timer, config, clock, store_host) if config.dedupWindowSec > 0 else None,
        promote=promote,
    )
