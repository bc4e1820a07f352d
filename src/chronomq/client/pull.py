"""The pull loop of PushConsumer (a base class of it, sharing its state): one long-polling pull task per
assigned queue, up to MAX_BACKLOG_PULL messages per request (at least pull_batch_size) asked as a bulk read,
which chronomq answers with what the queue holds, flow control by max_inflight_per_queue, the
consumed offset piggybacked as the commit offset. While the backlog is more than the broker gives in one
answer (Apache RocketMQ caps an answer at 32 by default), up to MAX_PIPELINE pulls of consecutive ranges go
out together, without the suspend flag, and their answers are taken in order (one that does not start
where the previous ended is dropped and pulled again).
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

# a pull asks for up to this many messages, as a bulk read (chronomq answers what the queue holds up to its
# maxTransferCountOnBulkRead; Apache RocketMQ at most its maxTransferCountOnMessageInMemory, 32)
MAX_BACKLOG_PULL = 256
# pulls in flight for one queue while its backlog is more than one answer holds: a burst reaches the
# consumer in fewer round trips
MAX_PIPELINE = 8

log = logging.getLogger("chronomq.client")


class PullPath(ConsumerState):
    async def _pull_loop(self, pq: ProcessQueue) -> None:
        backoff = 0.05
        cap = 0  # what the broker gave in an answer that held fewer than asked (its cap); 0: unknown
        while not pq.dropped:
            if len(pq.msgs) >= self.max_inflight_per_queue:
                pq.space.clear()
                await pq.space.wait()
                continue
            commit = None if self.broadcasting else self._offsets.get(pq.mq)
            room = self.max_inflight_per_queue - len(pq.msgs)
            # Every pull asks for up to MAX_BACKLOG_PULL (within the in-flight limit) as a bulk read: a
            # queue catching up gets one large answer from chronomq, and a held pull woken by a burst takes
            # all that is there, not pull_batch_size of it with the rest one round trip later.
            count = max(self.pull_batch_size, min(MAX_BACKLOG_PULL, room))
            pipelined = bool(cap) and pq.tags is None and pq.backlog > cap and room > cap
            if not pipelined:
                cap = 0  # learnt again from this pull's answer
            results: list[tuple[int, ops.PullResult | BaseException]]
            try:
                if pipelined:
                    results = await self._pull_ranges(pq, cap, min(pq.backlog, room, MAX_PIPELINE * cap),
                                                      commit)
                else:
                    results = [(pq.next_offset, await self._pull(pq, count, commit, True))]
            except ClientClosed:
                return
            except ClientError as e:
                results = [(pq.next_offset, e)]
            failed: BaseException | None = None
            asked = cap if pipelined else count
            for k, (offset, res) in enumerate(results):
                if isinstance(res, BaseException):
                    failed = res
                    break
                if pq.dropped:
                    return
                if k and (offset != pq.next_offset or res.status != ops.PullStatus.FOUND):
                    break  # a gap before it, or nothing there: pulled again from next_offset
                got = len(res.messages)
                if (res.status == ops.PullStatus.FOUND and 0 < got < asked
                        and res.max_offset > res.next_offset):
                    cap = got  # the broker had more and gave fewer: what one answer holds
                await self._take(pq, res)
                if res.status != ops.PullStatus.FOUND:
                    break
            if failed is not None:
                if isinstance(failed, ClientClosed):
                    return
                if not isinstance(failed, ClientError):
                    raise failed
                if pq.dropped:
                    return
                log.debug("%s: pull %s failed: %s", self.group, pq.mq, failed)
                self._need_heartbeat = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05

    async def _take(self, pq: ProcessQueue, res: ops.PullResult) -> None:
        """Hand on what one pull answer brought and move the queue's offsets."""
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

    async def _pull(self, pq: ProcessQueue, count: int, commit: int | None, bulk: bool = False
                    ) -> ops.PullResult:
        """ops.pull for the pull loop, with the queue's tag set computed once."""
        mq = pq.mq
        inst = self._instance
        addr, slave = await inst.read_addr(mq.broker_name, mq.topic, pq.suggested_broker)
        if slave:
            commit = None  # offsets are committed to the master only
        offset = pq.next_offset
        req = ops.pull_request(inst, mq, offset, count, self.group, pq.expression,
                               int(self.long_poll_timeout * 1000), commit, bulk)
        what = f"pull {mq} at offset {offset}"
        resp = await inst.invoke(addr, req, self.long_poll_timeout + 15, what)
        res = ops.pull_result(resp, mq, offset, pq.tags, what, addr)
        pq.suggested_broker = res.suggest_broker_id  # the next pull goes where the broker says
        return res

    async def _pull_ranges(self, pq: ProcessQueue, step: int, total: int, commit: int | None
                           ) -> list[tuple[int, ops.PullResult | BaseException]]:
        """Pulls of ``step`` messages for the ``total`` from next_offset on, sent together (one write)
        and not held by the broker (the backlog says they are there); the answers in request order,
        each with its offset, a failed one as its exception."""
        mq = pq.mq
        inst = self._instance
        addr, slave = await inst.read_addr(mq.broker_name, mq.topic, pq.suggested_broker)
        start = pq.next_offset
        offsets = list(range(start, start + total, step))
        timeout = self.long_poll_timeout + 15

        async def one(offset: int) -> ops.PullResult:
            req = ops.pull_request(inst, mq, offset, step, self.group, pq.expression, 0,
                                   commit if offset == start and not slave else None)
            what = f"pull {mq} at offset {offset}"
            return ops.pull_result(await inst.invoke(addr, req, timeout, what), mq, offset, pq.tags, what,
                                   addr)

        answers = await asyncio.gather(*(one(o) for o in offsets), return_exceptions=True)
        for a in answers:
            if isinstance(a, ops.PullResult):
                pq.suggested_broker = a.suggest_broker_id
        return list(zip(offsets, answers, strict=True))
