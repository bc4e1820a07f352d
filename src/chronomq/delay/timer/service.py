"""TimerService: the TimerStore plus its asyncio delivery loop (the API the broker wires in)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chronomq.clock import Clock, SystemClock
from chronomq.delay.background import in_background
from chronomq.message import PROPERTY_TIMER_DELIVER_MS, PROPERTY_UNIQ_KEY, MessageExt
from chronomq.store.types import records_put_of

from ..delivery import StorePuts
from .journal import TimerJournal
from .props import timed_deliver_ms
from .store import TimerStore
from .types import OpResult, PendingInfo, QueryPage, ScheduleResult, TimerConfig

log = logging.getLogger(__name__)
_NEVER = 1 << 62
# The first batch after a wake-up is small so the first due messages reach their consumers at once; the
# batches then double up to deliver_batch, where the per-batch costs are spread thin. 64 rather than 16:
# a 1,000-message burst's median 0.8 ms sooner, its first message 0.1-0.3 ms later (docs/latency.md).
_FIRST_BATCH = 64


async def _hand_over() -> None:
    """Three loop turns after a delivered batch, before the next one: in the first the store writes the
    batch's queue entries and wakes the held pulls, in the second those pulls build their answers, in
    the third the connections write them out (the remoting server writes the answers of one turn with
    one syscall, in the turn after). With two, each answer left only after the next batch's put."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("timer retention failed (retried at the next interval): %r", fut.exception())


class TimerService:
    """Any-millisecond delayed delivery, persisted in ``<storePathRootDir>/timer``.

    ``store`` is anything with ``put_message(MessageExt) -> PutResult`` (the MessageStore); delivered
    messages are put there as new messages of their real topic and queue through the delay package's
    one delivery path (chronomq.delay.delivery): the store's ``put_records`` when it has one, else
    ``put_messages``, else ``put_message``."""

    def __init__(self, store: Any, config: Any = None, clock: Clock | None = None, *,
                 timer_config: TimerConfig | None = None, root_dir: str | Path | None = None,
                 store_host: tuple[str, int] | None = None) -> None:
        self.store = store
        self.clock: Clock = clock or SystemClock()
        timer_cfg = timer_config or (TimerConfig.from_broker_config(config) if config is not None
                                     else TimerConfig())
        if root_dir is None:
            root_dir = Path(getattr(config, "storePathRootDir", "./data")) / "timer"
        if store_host is None:
            store_host = ((getattr(config, "brokerIP1", "127.0.0.1"), getattr(config, "listenPort", 10911))
                          if config is not None else ("127.0.0.1", 10911))
        self.sync_flush = bool(getattr(config, "sync_flush", False))
        self.timer = TimerStore(root_dir, self.clock, timer_cfg, store_host)
        self._opened = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._event: asyncio.Event | None = None
        self._stopping = False
        self._sleeping = False
        self._sleep_target = _NEVER
        self._delivering = False  # a batch was handed over since the loop last went to sleep
        self._version = 0
        self._flush_soon = False  # flush_entries were parked since the last checkpoint: flush now
        self._retain_soon = False  # a flush made completed records reclaimable: run retention now
        # SYNC_FLUSH group commit: fsync rounds run one at a time; a schedule is acknowledged once a round
        # that started after its write has completed, so concurrent requests share fsyncs
        self._sync_lock = threading.Lock()
        self._write_seq = 0
        self._synced_seq = 0
        self._sync_round_fut: asyncio.Future[None] | None = None
        self.sync_rounds = 0
        self.journal: TimerJournal | None = None  # a master that replicates its timer (journal.py)

    def enable_journal(self, journal: TimerJournal) -> None:
        """Append every park, cancel, reschedule and completion to the commit log from now on, for slaves."""
        self.journal = journal
        self.timer.on_done = journal.done

    # --- lifecycle --------------------------------------------------------------------------------------
    def open(self) -> None:
        """Recover the timer files (also done by start); schedule/cancel/query work once open."""
        if not self._opened:
            if hasattr(self.store, "max_phy_offset"):
                self.timer.store_end = lambda: self.store.max_phy_offset
            if hasattr(self.store, "sync_commit_log"):
                self.timer.store_sync = self.store.sync_commit_log
            self.timer.open()
            self._recover_delivered()
            self.timer.wakeup = self._on_wakeup
            self._opened = True

    def _recover_delivered(self) -> None:
        """After a crash, find the copies delivered since the last checkpoint in the message store, so
        that a delivery whose mark did not reach the disk is not made twice."""
        start = self.timer.scan_from
        if start is None or not hasattr(self.store, "iter_messages"):
            return
        start = max(start, self.store.min_phy_offset)
        copies = ((m.properties[PROPERTY_UNIQ_KEY], int(m.properties[PROPERTY_TIMER_DELIVER_MS]))
                  for m in self.store.iter_messages(start)
                  if PROPERTY_TIMER_DELIVER_MS in m.properties and PROPERTY_UNIQ_KEY in m.properties
                  and m.properties[PROPERTY_TIMER_DELIVER_MS].isdigit())
        self.timer.recover_delivered(copies)

    async def start(self) -> None:
        self.open()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._event = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="chronomq-timer")

    async def shutdown(self) -> None:
        """Stop delivering and close the files cleanly (pending messages stay on disk)."""
        self._stopping = True
        if self._task is not None:
            if self._event is not None:
                self._event.set()
            try:
                async with asyncio.timeout(30):
                    await self._task
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None
        if self._opened:
            self.timer.close()
            self._opened = False

    # --- the API ----------------------------------------------------------------------------------------
    def schedule(self, msg: MessageExt, deliver_ms: int) -> ScheduleResult:
        """Park ``msg`` (its real topic/queue) until ``deliver_ms`` (epoch ms). Raises TimerRefused
        beyond the maximum delay, TimerError for a bad message. Durable against a process crash on
        return; also fsynced under SYNC_FLUSH (which blocks the caller: from an event loop, prefer
        ``schedule_async``). Adds UNIQ_KEY (when missing) and TIMER_DELIVER_MS to ``msg.properties``."""
        r = self.timer.schedule(msg, deliver_ms)
        if self.journal is not None:
            self.journal.parked([msg])
        if self.sync_flush:
            self._sync_files()
        self._flush_if_many()
        return r

    def schedule_batch(self, items: Iterable[tuple[MessageExt, int]]) -> list[ScheduleResult]:
        """Like ``schedule`` for many messages at once (all validated before anything is written)."""
        items = list(items)
        r = self.timer.schedule_batch(items)
        if self.journal is not None:
            self.journal.parked([m for m, _ in items])
        if self.sync_flush:
            self._sync_files()
        self._flush_if_many()
        return r

    async def schedule_async(self, msg: MessageExt, deliver_ms: int) -> ScheduleResult:
        """``schedule`` for event-loop callers: under SYNC_FLUSH the fsync runs in a worker thread
        instead of stalling the loop, shared with the requests that arrive meanwhile (group commit)."""
        r = self.timer.schedule(msg, deliver_ms)
        if self.journal is not None:
            self.journal.parked([msg])
        if self.sync_flush:
            await self._durable()
        self._flush_if_many()
        return r

    async def schedule_batch_async(self, items: Iterable[tuple[MessageExt, int]]) -> list[ScheduleResult]:
        items = list(items)
        r = self.timer.schedule_batch(items)
        if self.journal is not None:
            self.journal.parked([m for m, _ in items])
        if self.sync_flush:
            await self._durable()
        self._flush_if_many()
        return r

    def _sync_files(self) -> None:
        """One fsync round at a time: the store hands each dirty file to one round only, so a second
        caller running alongside could otherwise return before the round holding its data has finished."""
        with self._sync_lock:
            self.timer.sync_files()
            self.sync_rounds += 1

    async def _durable(self) -> None:
        """Group commit (event-loop callers, after their write): wait for an fsync round that started
        after the write; start one if none is running. A failed round raises to every waiter."""
        self._write_seq += 1
        want = self._write_seq
        while self._synced_seq < want:
            fut = self._sync_round_fut
            if fut is None or fut.done():
                fut = self._sync_round_fut = asyncio.ensure_future(self._sync_round())
            await asyncio.shield(fut)

    async def _sync_round(self) -> None:
        covers = self._write_seq  # every write counted so far happened before this round takes its files
        await in_background(self._sync_files)
        self._synced_seq = max(self._synced_seq, covers)

    def maybe_schedule(self, msg: MessageExt) -> ScheduleResult | None:
        """Schedule ``msg`` if the broker's rule for sent messages (``props.timed_deliver_ms``, the one
        ``DelayService.admit`` applies) makes it timed, and return the handle; otherwise None (put it
        now). Raises TimerError for a bad value or a refused time."""
        deliver_ms = timed_deliver_ms(msg, self.clock.now_ms())
        return None if deliver_ms is None else self.schedule(msg, deliver_ms)

    def cancel(self, ident: str, by_key: bool = False) -> list[OpResult]:
        results = self.timer.cancel(ident, by_key)
        if self.journal is not None:
            self.journal.cancelled(results)
        return results

    def reschedule(self, ident: str, deliver_ms: int, by_key: bool = False) -> list[OpResult]:
        results = self.timer.reschedule(ident, deliver_ms, by_key)
        if self.journal is not None:
            self.journal.rescheduled(results, deliver_ms)
        return results

    def query(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None, limit: int = 100,
              cursor: str | None = None) -> QueryPage:
        return self.timer.query(topic, key, tag, start_ms, end_ms, limit, cursor)

    def count(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None) -> int:
        return self.timer.count(topic, key, tag, start_ms, end_ms)

    def records_of(self, uniq_key: str) -> list[PendingInfo]:
        return self.timer.records_of(uniq_key)

    def stats(self) -> dict[str, Any]:
        return self.timer.stats()

    def min_needed_offset(self) -> int | None:
        """The timer keeps its own copy of every pending message: it never pins the commit log."""
        return None

    def flush(self) -> None:
        self.timer.flush()

    def _flushed(self, fut: asyncio.Future[None]) -> None:
        """A flush ended: its failure logged; more may have been parked meanwhile. A flush asked for by
        count while this one ran (the loop does not start a second one) is started now: the loop is woken,
        not left asleep until the interval. So is retention when the flush made enough completed records
        reclaimable."""
        if not fut.cancelled() and fut.exception() is not None:
            log.error("timer flush failed (retried at the next interval): %r", fut.exception())
        elif not self._retain_soon and self.timer.reclaim_candidates():
            self._retain_soon = True  # the loop, woken, runs retention at its next turn
            if self._event is not None:
                self._event.set()
        if self._flush_soon and self._event is not None:
            self._event.set()  # a done callback: on the loop's thread
        else:
            self._flush_if_many()

    def _flush_if_many(self) -> None:
        """Wake the delivery loop to flush now when ``flush_entries`` entries were parked since the last
        checkpoint: what a crash's recovery re-reads stays bounded under a heavy load."""
        t = self.timer
        if (not self._flush_soon and t.index_end - t.snapshot_index_end >= t.cfg.flush_entries
                and self._event is not None and self._loop is not None):
            self._flush_soon = True
            if threading.get_ident() == self._loop_thread:
                self._event.set()
            else:
                self._loop.call_soon_threadsafe(self._event.set)

    # --- delivery loop ----------------------------------------------------------------------------------
    def _on_wakeup(self, deliver_ms: int) -> None:
        self._version += 1
        # a message falling due within the staging window (at its widest) wakes the loop in time to
        # stage it
        cfg = self.timer.cfg
        lead = cfg.stage_ahead_ms + cfg.stage_limit * cfg.stage_item_us // 1000 if cfg.stage_ahead_ms else 0
        if (deliver_ms - lead < self._sleep_target and self._event is not None
                and self._loop is not None):
            if threading.get_ident() == self._loop_thread:
                self._event.set()
            else:
                self._loop.call_soon_threadsafe(self._event.set)

    async def _run(self) -> None:
        t = self.timer
        cfg = t.cfg
        put = self.store.put_message
        put_many = getattr(self.store, "put_messages", None)  # one call per (topic, queue) of a batch
        put_raw = records_put_of(self.store)  # the same, re-putting the parked bytes (no re-encode)
        # Staging: the messages about to fall due are read, checked and encoded ahead (store
        # prepare_records), and put with put_prepared at their moment; a store without them does not stage
        # (its class must define them, as put_records: see records_put_of).
        staging = put_raw is not None and hasattr(type(self.store), "prepare_records")
        stage_ahead = cfg.stage_ahead_ms if staging else 0
        if stage_ahead:
            prepare = self.store.prepare_records
            # no fdatasync of their own under SYNC_FLUSH: nothing waits for them, and the checkpoint
            # syncs the commit log before their marks (TimerStore.flush)
            staged_puts = StorePuts(put, None, functools.partial(self.store.put_prepared, with_ids=False,
                                                                 flush=False))
            fallback = StorePuts(put, put_many, put_raw)
        now = self.clock.now_ms()
        next_flush = now + cfg.flush_interval_ms
        next_retention = now + cfg.retention_interval_ms
        backoff_until = 0
        batch = _FIRST_BATCH
        flushing: asyncio.Future[None] | None = None
        retaining: asyncio.Future[dict[str, int]] | None = None
        while not self._stopping:
            try:
                now = self.clock.now_ms()
                if now >= next_flush or self._flush_soon:
                    if t.dirty and (flushing is None or flushing.done()):
                        # fsync in a worker thread: deliveries go on meanwhile
                        flushing = asyncio.ensure_future(in_background(t.flush))
                        flushing.add_done_callback(self._flushed)
                        self._flush_soon = False
                    next_flush = now + cfg.flush_interval_ms
                if now >= next_retention or self._retain_soon:
                    if retaining is None or retaining.done():
                        # scans whole data segments: in a worker thread, deliveries go on meanwhile
                        retaining = asyncio.ensure_future(in_background(t.run_retention, now))
                        retaining.add_done_callback(_log_failure)
                        self._retain_soon = False
                    next_retention = now + cfg.retention_interval_ms
                version = self._version
                if now >= backoff_until:
                    if stage_ahead:
                        taken, busy = t.deliver_staged(now, batch, staged_puts, fallback)
                        if taken:
                            self._delivering = True
                            if busy:
                                backoff_until = self.clock.now_ms() + cfg.retry_backoff_ms
                            await _hand_over()
                            batch = min(batch * 2, cfg.deliver_batch)
                            continue
                    items, wake = t.poll(now, batch)
                    if items:
                        if "retry" in t.deliver_many(items, put, put_many, put_raw=put_raw):
                            backoff_until = self.clock.now_ms() + cfg.retry_backoff_ms
                        self._delivering = True
                        await _hand_over()
                        batch = min(batch * 2, cfg.deliver_batch)
                        continue
                    batch = _FIRST_BATCH
                    if stage_ahead and t.stage(now, stage_ahead, cfg.stage_limit, cfg.deliver_batch, prepare):
                        await asyncio.sleep(0)  # let the loop breathe between staging steps
                        continue
                    if stage_ahead and wake is not None and wake > now and t.stage_room():
                        # wake up in time to stage it
                        wake = max(wake - t.stage_lead_ms(stage_ahead, cfg.stage_limit), now + 1)
                    staged = t.staged_due_ms()
                    if staged is not None and (wake is None or staged < wake):
                        wake = staged
                else:
                    wake = backoff_until
                if wake is not None and wake <= now:
                    await asyncio.sleep(0)  # more preloading to do
                    continue
                target = min(wake if wake is not None else _NEVER, next_flush if t.dirty else _NEVER)
                await self._sleep(target, version)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("timer delivery loop error; retrying")
                await self.clock.sleep(0.1)
        pending = {f for f in (flushing, retaining) if f is not None}
        if pending:
            await asyncio.wait(pending)

    @property
    def delivering(self) -> bool:
        """Whether the delivery loop is handing over due messages: it delivered a batch and has not gone
        to sleep since (a burst is being delivered). The store defers its key index writes meanwhile."""
        return self._delivering

    async def _sleep(self, target: int, version: int) -> None:
        assert self._event is not None
        self._delivering = False
        self._sleep_target = target
        self._event.clear()
        if self._version != version or self._stopping:
            self._sleep_target = -1
            return
        self._sleeping = True
        try:
            waiter = asyncio.ensure_future(self._event.wait())
            if target >= _NEVER:
                await waiter
                return
            sleeper = asyncio.ensure_future(self.clock.sleep_until_ms(target, precise=True))
            _done, pending = await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
        finally:
            self._sleeping = False
            self._sleep_target = -1

    async def settle(self, max_rounds: int = 10_000_000) -> None:
        """Return once the loop has delivered everything due and sleeps (tests and benchmarks)."""
        quiet = 0
        for _ in range(max_rounds):
            if (self._sleeping and self._sleep_target > self.clock.now_ms() and self._event is not None
                    and not self._event.is_set()):
                quiet += 1
                if quiet >= 3:  # and its clock sleeper has had the turn it needs to register
                    return
            else:
                quiet = 0
            if self._task is not None and self._task.done():
                self._task.result()
                return
            await asyncio.sleep(0)
        raise TimeoutError("the timer loop did not settle")
