"""The consume services of PushConsumer (a base class of it, sharing its state), as RocketMQ's
ConsumeMessageConcurrentlyService / ConsumeMessageOrderlyService: the listener's contract
(ConsumeResult), the pool of concurrent workers fed by one deque, settling a message (done, or sent back
to %RETRY%<group>), and the orderly worker of one locked queue. Rules: nothing per message beyond the
listener call and the settling; a message not started when its queue is dropped or the consumer stops
stays uncommitted (delivered again); a failed send-back is consumed again locally, never lost.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from chronomq.remoting.codes import RequestCode

from .consumer_state import ConsumerState
from .errors import ClientError
from .model import ReceivedMessage
from .process_queue import ProcessQueue

log = logging.getLogger("chronomq.client")


class ConsumeResult(StrEnum):
    SUCCESS = "success"
    LATER = "later"


SUCCESS = ConsumeResult.SUCCESS
LATER = ConsumeResult.LATER

Listener = Callable[[ReceivedMessage], Any]


def _is_success(result: Any) -> bool:
    if result is None or result is True:
        return True
    if result is False:
        return False
    if isinstance(result, str):
        r = result.lower()
        if r in ("success", "consume_success", "ok"):
            return True
        if r in ("later", "reconsume_later", "retry"):
            return False
    raise ClientError(f"a listener must return success/None/True or 'later'/False, not {result!r}")


class ConsumeService(ConsumerState):
    def _spawn_consume(self, pq: ProcessQueue, msg: ReceivedMessage) -> None:
        self._ready.append((pq, msg))
        self._wake()

    def _wake(self) -> None:
        """Wake one sleeping worker, unless one is already on its way (it wakes the next if work is left
        when it takes a message)."""
        if self._waking == 0 and self._ready:
            sleepers = self._sleepers
            while sleepers:
                fut = sleepers.popleft()
                if not fut.done():
                    fut.set_result(None)
                    self._waking += 1
                    return

    async def _call_listener(self, msg: ReceivedMessage) -> bool:
        listener = self.listener
        assert listener is not None
        try:
            if self._executor is not None:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._executor, listener, msg)
            else:
                result = listener(msg)
                if inspect.isawaitable(result):
                    result = await result
            if result is None or result is True:
                return True
            return _is_success(result)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("%s: listener failed on message %s (%s): %r", self.group, msg.id, msg.queue, e)
            return False

    async def _worker(self) -> None:
        assert self._idle is not None
        loop = asyncio.get_running_loop()
        ready = self._ready
        listener = self.listener
        assert listener is not None  # start() refuses a consumer without one
        direct = self._executor is None and inspect.iscoroutinefunction(listener)
        busy = False  # counted in self._busy from the first message taken until the worker sleeps again
        try:
            while True:
                if not ready or self._stopping:
                    while ready and self._stopping:
                        ready.popleft()  # not started: stays uncommitted, delivered again
                    if busy:
                        busy = False
                        self._busy -= 1
                        if self._busy == 0:
                            self._idle.set()
                    fut = loop.create_future()
                    self._sleepers.append(fut)
                    try:
                        await fut
                    except asyncio.CancelledError:
                        if fut.done() and not fut.cancelled():
                            self._waking -= 1
                        raise
                    self._waking -= 1
                    continue
                pq, msg = ready.popleft()
                if ready:
                    self._wake()  # more work: let another worker take the next message if this one awaits
                if pq.dropped and self._pqs.get(pq.mq) is not pq:
                    continue  # not started: stays uncommitted, delivered again (by the queue's new owner
                    # or, after an offset reset, from the reset point)
                if not busy:
                    busy = True
                    self._busy += 1
                    self._idle.clear()
                if direct:  # a coroutine listener, called here (one coroutine less per message)
                    try:
                        result = await listener(msg)
                        ok = result is None or result is True or _is_success(result)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        log.warning("%s: listener failed on message %s (%s): %r", self.group, msg.id,
                                    msg.queue, e)
                        ok = False
                    if ok:
                        self.stats_consumed += 1
                        self._done(pq, msg)
                    else:
                        await self._consume_one(pq, msg, False)
                else:
                    await self._consume_one(pq, msg)
        finally:
            if busy:
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    async def _consume_one(self, pq: ProcessQueue, msg: ReceivedMessage, ok: bool | None = None) -> None:
        """Call the listener (unless ``ok`` already says how it went) and settle the message."""
        if ok is None:
            ok = await self._call_listener(msg)
        if ok:
            self.stats_consumed += 1
        else:
            self.stats_failed += 1
            if self.broadcasting:
                log.warning("%s: broadcasting: dropping failed message %s", self.group, msg.id)
            elif not await self._send_back(pq, msg):
                # send-back failed: consume it again locally a little later (it stays in flight)
                asyncio.get_running_loop().call_later(1.0, self._spawn_consume, pq, msg)
                return
        self._done(pq, msg)

    def _done(self, pq: ProcessQueue, msg: ReceivedMessage) -> None:
        msgs = pq.msgs
        offset = msg.queue_offset
        msgs.pop(offset, None)
        pq.consumed += 1
        # Dropped for good only once rebalance gave the queue away (it leaves _pqs); a closing consumer
        # keeps its queues until the final commit, so a listener that finishes meanwhile is committed.
        if not pq.dropped or self._pqs.get(pq.mq) is pq:
            order = pq.order
            if order and order[0] == offset:  # the oldest in flight: the commit offset moves
                self._offsets[pq.mq] = pq.commit_offset()
            elif not msgs:
                self._offsets[pq.mq] = pq.high
        if len(msgs) < self.max_inflight_per_queue and not pq.space.is_set():
            pq.space.set()

    async def _send_back(self, pq: ProcessQueue, msg: ReceivedMessage) -> bool:
        try:
            addr = await self._instance.broker_addr(pq.mq.broker_name, pq.mq.topic)
        except ClientError:
            addr = f"{msg.store_host[0]}:{msg.store_host[1]}"
        ext = {"offset": msg.commit_log_offset, "group": self.group, "delayLevel": self.retry_delay_level,
               "originMsgId": msg.id, "originTopic": msg.topic, "unitMode": "false"}
        if self.max_reconsume_times is not None:  # else the broker's maxReconsumeTimes applies
            ext["maxReconsumeTimes"] = self.max_reconsume_times
        try:
            cmd = self._instance.request(RequestCode.CONSUMER_SEND_MSG_BACK, ext)
            await self._instance.invoke_ok(addr, cmd, 3.0, f"send back message {msg.id}")
            return True
        except ClientError as e:
            log.warning("%s: send-back of %s failed (will consume it again locally): %s", self.group,
                        msg.id, e)
            return False

    async def _orderly_worker(self, pq: ProcessQueue) -> None:
        while not pq.dropped:
            if not pq.msgs:
                pq.arrived.clear()
                await pq.arrived.wait()
                continue
            if not pq.locked:
                await asyncio.sleep(0.2)
                continue
            offset = pq.first()
            assert offset is not None
            msg = pq.msgs[offset]
            assert self._sem is not None
            async with self._sem:
                ok = await self._call_listener(msg)
            if ok:
                self.stats_consumed += 1
                self._done(pq, msg)
            else:
                self.stats_failed += 1
                msg.reconsume_times += 1
                await asyncio.sleep(self.orderly_retry_delay)
