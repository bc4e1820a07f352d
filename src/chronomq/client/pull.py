"""The pull loop of PushConsumer (a base class of it, sharing its state): one long-polling pull task per
assigned queue, pull_batch_size messages per request (up to MAX_BACKLOG_PULL while the broker reports a
backlog), flow control by max_inflight_per_queue, the consumed offset piggybacked as the commit offset.
Rules: a message is handed on once (offsets below next_offset or still in flight are skipped); a failed
pull backs off (50 ms doubling to 2 s) and asks for a heartbeat; nothing per message but the hand-on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from . import ops
from .consumer_state import ConsumerState
from .errors import ClientClosed, ClientError
from .process_queue import ProcessQueue

# while a queue has a backlog, a pull asks for up to this many messages (a broker answers at most its
# maxTransferCountOnMessageInMemory, 32 by default on chronomq as on Apache RocketMQ): fewer round trips
MAX_BACKLOG_PULL = 256

log = logging.getLogger("chronomq.client")


class PullPath(ConsumerState):
    async def _pull_loop(self, pq: ProcessQueue) -> None:
        backoff = 0.05
        while not pq.dropped:
            if len(pq.msgs) >= self.max_inflight_per_queue:
                pq.space.clear()
                await pq.space.wait()
                continue
            commit = None if self.broadcasting else self._offsets.get(pq.mq)
            count = self.pull_batch_size
            if pq.backlog > count:  # catching up: ask for more, within the in-flight limit
                room = self.max_inflight_per_queue - len(pq.msgs)
                count = max(count, min(pq.backlog, MAX_BACKLOG_PULL, room))
            try:
                res = await self._pull(pq, count, commit)
            except ClientClosed:
                return
            except ClientError as e:
                if pq.dropped:
                    return
                log.debug("%s: pull %s failed: %s", self.group, pq.mq, e)
                self._need_heartbeat = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if pq.dropped:
                return
            pq.backlog = max(0, res.max_offset - res.next_offset)
            if res.status == ops.PullStatus.FOUND:
                fresh = [msg for msg in res.messages
                         if msg.queue_offset >= pq.next_offset and msg.queue_offset not in pq.msgs]
                for msg in fresh:
                    pq.add(msg)
                if not self.orderly:
                    self._ready.extend([(pq, msg) for msg in fresh])
                    self._wake()
                pq.next_offset = max(res.next_offset, pq.next_offset)
                pq.high = pq.next_offset
                if self.orderly:
                    pq.arrived.set()
            elif res.status == ops.PullStatus.OFFSET_ILLEGAL:
                log.warning("%s: offset %d of %s is illegal; moving to %d", self.group, pq.next_offset, pq.mq,
                            res.next_offset)
                pq.next_offset = pq.high = res.next_offset
                if not pq.msgs:
                    self._offsets[pq.mq] = pq.next_offset
                    if not self.broadcasting:
                        with contextlib.suppress(ClientError):
                            await ops.update_consumer_offset(self._instance, self.group, pq.mq,
                                                             pq.next_offset)
            else:
                pq.next_offset = res.next_offset
                pq.high = res.next_offset
            if not pq.msgs:
                self._offsets[pq.mq] = pq.high

    async def _pull(self, pq: ProcessQueue, count: int, commit: int | None) -> ops.PullResult:
        """ops.pull for the pull loop, with the queue's tag set computed once."""
        mq = pq.mq
        inst = self._instance
        addr, slave = await inst.read_addr(mq.broker_name, mq.topic, pq.suggested_broker)
        if slave:
            commit = None  # offsets are committed to the master only
        offset = pq.next_offset
        req = ops.pull_request(inst, mq, offset, count, self.group, pq.expression,
                               int(self.long_poll_timeout * 1000), commit)
        what = f"pull {mq} at offset {offset}"
        resp = await inst.invoke(addr, req, self.long_poll_timeout + 15, what)
        res = ops.pull_result(resp, mq, offset, pq.tags, what, addr)
        pq.suggested_broker = res.suggest_broker_id  # the next pull goes where the broker says
        return res
