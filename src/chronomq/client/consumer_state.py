"""The state PushConsumer's parts share: an annotations-only base class of its hot-path parts (pull.py,
consume.py) and the type the rebalance (rebalance.py) works on, naming the attributes they read and
write and the entry points they call on each other. No behaviour and no values live here;
``PushConsumer.__init__`` and ``start`` set them. Everything runs on the consumer's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .consume import Listener
    from .instance import ClientInstance
    from .locks import QueueLocks
    from .model import MessageQueue, ReceivedMessage
    from .offsets import OffsetCommit
    from .process_queue import ProcessQueue


class ConsumerState:
    # settings
    group: str

    @property
    def client_id(self) -> str:  # read-only: PushConsumer's client instance's id
        raise NotImplementedError

    subscriptions: dict[str, str]
    listener: Listener | None
    broadcasting: bool
    orderly: bool
    consume_from: str
    consume_timestamp: int | None
    max_inflight_per_queue: int
    max_reconsume_times: int | None
    retry_delay_level: int
    orderly_retry_delay: float
    pull_batch_size: int
    long_poll_timeout: float
    rebalance_interval: float
    offset_commit_interval: float
    lock_interval: float
    # queues, offsets and the consume workers
    _instance: ClientInstance
    _pqs: dict[MessageQueue, ProcessQueue]
    _offsets: dict[MessageQueue, int]
    _committed: dict[MessageQueue, int]
    _ready: collections.deque[tuple[ProcessQueue, ReceivedMessage]]
    _sleepers: collections.deque[asyncio.Future[None]]
    _waking: int
    _busy: int
    _idle: asyncio.Event | None
    _sem: asyncio.Semaphore | None
    _executor: concurrent.futures.ThreadPoolExecutor | None
    _locks: QueueLocks
    _offset_commit: OffsetCommit
    _known_brokers: set[str]
    _need_heartbeat: bool
    _stopping: bool
    stats_consumed: int
    stats_failed: int
    # entry points one part calls on another
    _heartbeat: Callable[[], Coroutine[Any, Any, None]]
    _pull_loop: Callable[[ProcessQueue], Coroutine[Any, Any, None]]
    _orderly_worker: Callable[[ProcessQueue], Coroutine[Any, Any, None]]
    _wake: Callable[[], None]
