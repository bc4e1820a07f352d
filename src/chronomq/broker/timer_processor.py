"""The broker side of the timer store: parking what the send path found timed, and request codes
9001-9004.

Send path (SEND_MESSAGE 10, SEND_MESSAGE_V2 310, SEND_BATCH_MESSAGE 320): ``DelayService.admit`` decides
(chronomq.delay.admission: TIMER_* wins over DELAY); what it finds timed is parked here with ``schedule``.
The answer is SUCCESS with ext ``msgId`` = the timer offset msg id, ``queueId``, ``queueOffset`` "0",
``uniqKey`` = the UNIQ_KEY (the handle for cancel/reschedule) and ``deliverMs`` = the deliver time (epoch
ms); for a batch (all-or-nothing) the ext values are comma-separated, one per item, in item order. A
time beyond timerMaxDelaySec (TimerRefused) or a message the timer store cannot hold -> MESSAGE_ILLEGAL
with the reason as remark; a full disk (the store's disk_full, or a write that failed) ->
SERVICE_NOT_AVAILABLE with RocketMQ's remark, as for a send. Under SYNC_FLUSH the answer is sent once
the timer files are fsynced (in a worker thread: the event loop never waits on the disk); on a
SYNC_MASTER that journals its timer, once a slave holds the park too (else FLUSH_SLAVE_TIMEOUT /
SLAVE_NOT_AVAILABLE, as for a send).

Request codes (every ext value a string, bodies UTF-8 JSON):
- 9002 CHRONOMQ_CANCEL_SCHEDULED ext {id, byKey "true"|"false"} -> {"results": [OpResult...]}
- 9003 CHRONOMQ_RESCHEDULE ext {id, byKey, deliverMs} -> {"results": [...]}
  (the list is never empty: an UNKNOWN result when nothing matched)
- 9004 CHRONOMQ_QUERY_PENDING ext optional {topic, key, tag, startMs, endMs, limit (default 100, 1..1000),
  cursor, countOnly} -> {"items": [PendingInfo...], "next_cursor": str|null} (+ "count" with countOnly)
- 9001 CHRONOMQ_DELAY_STATS: the delay service's stats plus "timer": TimerService.stats().
A malformed argument is answered SYSTEM_ERROR "bad request header: ..." (HeaderError); a value the timer
store refuses (time beyond the maximum delay, bad cursor) MESSAGE_ILLEGAL with the reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from chronomq.config import SYNC_MASTER
from chronomq.delay.histogram import Histogram
from chronomq.delay.timer import ScheduleResult, TimerError, TimerService, TimerUnavailable
from chronomq.ha.service import SlaveWait
from chronomq.message import MessageExt
from chronomq.metrics import LATENESS_BUCKETS_MS
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED

from .dedup import TIMED, Original
from .processors.base import Handler, RequestConnection, dump_json, not_available_remark, send_result_fields

if TYPE_CHECKING:
    import asyncio

    from .services import BrokerServices

log = logging.getLogger("chronomq.broker.timer")

DEFAULT_QUERY_LIMIT = 100
MAX_QUERY_LIMIT = 1000
MAX_IDENT_LEN = 4096

# --- request parsing (pure functions, unit-tested) ------------------------------------------------------
def parse_bool(req: RemotingCommand, name: str) -> bool:
    v = req.ext_str(name)
    if v is None or v == "":
        return False
    low = v.strip().lower()
    if low == "true":
        return True
    if low == "false":
        return False
    raise HeaderError(f"{name} must be \"true\" or \"false\", got {v!r}")


def parse_int(req: RemotingCommand, name: str, *, minimum: int = 0, maximum: int | None = None,
              required: bool = False) -> int | None:
    v = req.ext_str(name)
    if v is None or v.strip() == "":
        if required:
            raise HeaderError(f"the request header lacks the field {name!r}")
        return None
    try:
        n = int(v.strip())
    except ValueError:
        raise HeaderError(f"{name} must be an integer, got {v!r}") from None
    if n < minimum or (maximum is not None and n > maximum):
        hi = f"..{maximum}" if maximum is not None else " or more"
        raise HeaderError(f"{name} must be {minimum}{hi}, got {n}")
    return n


def parse_ident(req: RemotingCommand) -> tuple[str, bool]:
    ident = req.ext_str("id")
    if ident is None or not ident.strip():
        raise HeaderError("the request header lacks the field 'id' (a message id or key)")
    if len(ident) > MAX_IDENT_LEN:
        raise HeaderError(f"id is longer than {MAX_IDENT_LEN} characters")
    return ident, parse_bool(req, "byKey")


def parse_query(req: RemotingCommand) -> dict[str, Any]:
    """The filters of a QUERY_PENDING request (keyword arguments of TimerService.query/count)."""
    q: dict[str, Any] = {}
    for name in ("topic", "key", "tag"):
        v = req.ext_str(name)
        if v is not None and v != "":
            q[name] = v
    start = parse_int(req, "startMs")
    end = parse_int(req, "endMs")
    if start is not None and end is not None and end < start:
        raise HeaderError(f"endMs ({end}) is before startMs ({start})")
    q["start_ms"] = start
    q["end_ms"] = end
    return q


def _replies(keys: list[tuple[str, str] | None], answers: list[Original]) -> list[ScheduleResult]:
    """A timed send's per-message answers (de-duplication's Originals) as ScheduleResults."""
    return [ScheduleResult(o.uniq_key or (key[1] if key else ""), o.offset_msg_id, o.deliver_ms or 0, -1)
            for key, o in zip(keys, answers, strict=True)]


class TimerProcessor:
    """Codes 9001-9004 and the parking of timed sends, answered from the broker's services
    (``services.timer`` is the TimerService)."""

    def __init__(self, services: BrokerServices) -> None:
        self.services = services
        self.timer: TimerService = services.timer
        self.delay = services.delay
        self.scheduled = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.CHRONOMQ_CANCEL_SCHEDULED: self.cancel,
            RequestCode.CHRONOMQ_RESCHEDULE: self.reschedule,
            RequestCode.CHRONOMQ_QUERY_PENDING: self.query_pending,
            RequestCode.CHRONOMQ_DELAY_STATS: self.delay_stats,
        }

    # --- send path ---------------------------------------------------------------------------------------
    def schedule(self, req: RemotingCommand, conn: RequestConnection, timed: list[tuple[MessageExt, int]]
                 ) -> RemotingCommand:
        """Park what ``DelayService.admit`` / ``admit_batch`` found timed, and answer for it. A message that
        asks for de-duplication and was parked before is answered as it was then, and not parked again."""
        queue_id = timed[0][0].queue_id
        full = getattr(self.services.store, "disk_full", None)
        if full is not None:  # the timer's files are on the store's disk: refused as a send is
            return self._unavailable(req, full)
        dedup = self.services.dedup
        plan = None if dedup is None else dedup.plan([m for m, _ in timed], timed[0][0].topic, TIMED)
        if plan is not None:
            timed = plan.keep(timed)
            if not timed:
                return self._answer(req, queue_id, _replies(plan.keys, plan.settle([])))
        msgs = [m for m, _ in timed]

        def answer(results: list[ScheduleResult]) -> RemotingCommand:
            self.scheduled += len(results)
            self.services.traffic.produce(msgs[0].topic, "Delay", len(msgs), sum(len(m.body) for m in msgs))
            if plan is not None:
                stored = [Original(r.offset_msg_id, queue_id, 0, r.deliver_ms, r.msg_id) for r in results]
                results = _replies(plan.keys, plan.settle(stored))
            return self._answer(req, queue_id, results)

        loop = self.services.loop
        journal = self.timer.journal
        failures = journal.failures if journal is not None else 0
        if not self.timer.sync_flush or loop is None:
            try:
                results = self.timer.schedule_batch(timed)
            except TimerUnavailable as e:
                return self._unavailable(req, str(e))
            except TimerError as e:
                return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
            resp = answer(results)
            if not self._waits_for_slave():
                return resp
            assert loop is not None, "requests are served once the broker started: its loop is bound"

            async def after_slave() -> None:
                conn.reply(req, await self._slave_holds(resp, failures))

            self._spawn(loop, after_slave())
            return DEFERRED

        # SYNC_FLUSH: the fsync runs off the event loop; answer when it is done (tasks run in creation
        # order, so records are written in the order the requests arrived)
        async def run() -> None:
            try:
                resp = answer(await self.timer.schedule_batch_async(timed))
                if self._waits_for_slave():
                    resp = await self._slave_holds(resp, failures)
            except TimerUnavailable as e:
                resp = self._unavailable(req, str(e))
            except TimerError as e:
                resp = req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
            except Exception as e:  # an fsync failure: not acknowledged
                log.error("timer schedule failed: %s: %s", type(e).__name__, e)
                resp = req.response(ResponseCode.SYSTEM_ERROR,
                                    remark=f"timer store: {type(e).__name__}: {e}"[:500])
            conn.reply(req, resp)

        self._spawn(loop, run())
        return DEFERRED

    def _unavailable(self, req: RemotingCommand, cause: str) -> RemotingCommand:
        return req.response(ResponseCode.SERVICE_NOT_AVAILABLE,
                            remark=not_available_remark(self.services.store, cause))

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Any) -> None:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _waits_for_slave(self) -> bool:
        """SYNC_MASTER with the timer journaled: a timed send is answered once a slave holds its park."""
        return (self.timer.journal is not None and self.services.ha is not None
                and self.services.config.brokerRole == SYNC_MASTER)

    async def _slave_holds(self, resp: RemotingCommand, failures: int) -> RemotingCommand:
        """The answer once a slave holds the journal up to this park, or why not, as a send is answered:
        FLUSH_SLAVE_TIMEOUT or SLAVE_NOT_AVAILABLE (the message is parked on this master either way)."""
        journal, ha = self.timer.journal, self.services.ha
        assert journal is not None and ha is not None
        if journal.failures != failures:  # the store refused the journal record: no slave can hold it
            resp.code = ResponseCode.SLAVE_NOT_AVAILABLE
            return resp
        waited = await ha.wait_slave(journal.end, self.services.config.syncFlushTimeout)
        if waited == SlaveWait.TIMEOUT:
            resp.code = ResponseCode.FLUSH_SLAVE_TIMEOUT
        elif waited == SlaveWait.NO_SLAVE:
            resp.code = ResponseCode.SLAVE_NOT_AVAILABLE
        return resp

    def _answer(self, req: RemotingCommand, queue_id: int, results: list[ScheduleResult]) -> RemotingCommand:
        config = self.services.config
        return req.response(ext_fields=send_result_fields(
            ",".join(r.offset_msg_id for r in results), queue_id, 0, config.regionId,
            "true" if config.traceOn else "false",
            uniqKey=",".join(r.msg_id for r in results),
            deliverMs=",".join(str(r.deliver_ms) for r in results)))

    # --- 9002 / 9003 / 9004 ---------------------------------------------------------------------------------
    def cancel(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        ident, by_key = parse_ident(req)
        try:
            results = self.timer.cancel(ident, by_key)
        except TimerError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        return req.response(body=dump_json({"results": [r.to_dict() for r in results]}))

    def reschedule(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        ident, by_key = parse_ident(req)
        deliver_ms = parse_int(req, "deliverMs", required=True)
        assert deliver_ms is not None
        try:
            results = self.timer.reschedule(ident, deliver_ms, by_key)
        except TimerError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        return req.response(body=dump_json({"results": [r.to_dict() for r in results]}))

    def query_pending(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        q = parse_query(req)
        limit = parse_int(req, "limit", minimum=1, maximum=MAX_QUERY_LIMIT)
        cursor = req.ext_str("cursor") or None
        try:
            if parse_bool(req, "countOnly"):
                return req.response(body=dump_json({"items": [], "next_cursor": None,
                                                     "count": self.timer.count(**q)}))
            page = self.timer.query(limit=limit or DEFAULT_QUERY_LIMIT, cursor=cursor, **q)
        except TimerError as e:
            return req.response(ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        return req.response(body=dump_json({"items": [i.to_dict() for i in page.items],
                                             "next_cursor": page.next_cursor}))

    def delay_stats(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        stats = dict(self.delay.stats())
        try:
            stats["timer"] = self.timer.stats()
            lateness = Histogram.merged(self.timer.timer.hist.values())
            stats["timer"]["lateness_buckets_ms"] = lateness.cumulative(LATENESS_BUCKETS_MS)
        except TimerError as e:  # not open (shutting down)
            stats["timer"] = {"error": str(e)}
        return req.response(body=dump_json(stats))
