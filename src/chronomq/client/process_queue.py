"""ProcessQueue: the push consumer's state for one assigned queue (RocketMQ's ProcessQueue): the messages
pulled and not yet settled, keyed by queue offset, the next offset to pull and the pull/worker tasks.
Rules: offsets are added in increasing order; the commit offset is the smallest offset still in flight
(or, with none, the offset after the last pulled); a queue rebalance gave away is never consumed or
committed again (on close, listeners already running finish and are committed).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from .model import MessageQueue, ReceivedMessage


@dataclass(eq=False)
class ProcessQueue:
    mq: MessageQueue
    expression: str
    next_offset: int
    high: int  # offset after the last pulled (or skipped) message
    msgs: dict[int, ReceivedMessage] = field(default_factory=dict)
    dropped: bool = False
    locked: bool = False
    space: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    puller: asyncio.Task[None] | None = None
    worker: asyncio.Task[None] | None = None
    consumed: int = 0
    backlog: int = 0  # messages beyond next_offset, as of the last pull (maxOffset - nextBeginOffset)
    tags: set[str] | None = None  # tag_set(expression), for the client-side filter of pulled messages
    suggested_broker: int = 0  # the broker id the last pull answer suggested for the next (0: master)

    order: collections.deque[int] = field(default_factory=collections.deque)

    def add(self, msg: ReceivedMessage) -> None:
        self.msgs[msg.queue_offset] = msg
        self.order.append(msg.queue_offset)  # offsets arrive in increasing order

    def first(self) -> int | None:
        """The smallest offset still in flight (amortised O(1); iterating a dict whose front entries
        were popped is O(popped) in CPython, hence the deque)."""
        order, msgs = self.order, self.msgs
        while order and order[0] not in msgs:
            order.popleft()
        return order[0] if order else None

    def commit_offset(self) -> int:
        first = self.first()
        return self.high if first is None else first

