"""The level schedule service: one asyncio task per delay level.

Each task reads its level's SCHEDULE_TOPIC_XXXX queue from its offset (consume-queue tagsCode = deliver
time). While the head is due (deliver time <= clock.now_ms()) it delivers it through the DeliveryPath,
in batches (no per-message yield, so a backlog drains at the store's put rate). When the head is not due
it sleeps exactly until its deliver time; when the queue is drained it waits for the store's arrival
listener to wake it. Offsets are persisted atomically every flushDelayOffsetInterval and at shutdown,
after a store flush, so a persisted offset never claims a delivery that could still be lost.

After a crash the commit log beyond the last snapshot's ``scanFromPhyOffset`` is scanned for re-puts
(they carry PROPERTY_DELAY_SOURCE) and the level offsets are moved past them: no duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chronomq.clock import Clock
from chronomq.delay.background import in_background
from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, DeliveryPath, make_source, parse_source
from chronomq.delay.histogram import Histogram
from chronomq.delay.levels import DelayLevels
from chronomq.delay.offsets import OffsetFile, OffsetSnapshot
from chronomq.message import SCHEDULE_TOPIC

if TYPE_CHECKING:
    from chronomq.store import MessageStore

log = logging.getLogger(__name__)

READ_BATCH = 256  # consume-queue units read per step
RETRY_BACKOFF_MS = 1000  # after a transient put failure (store busy / not available)


@dataclass
class LevelState:
    level: int
    delay_ms: int | None  # None for a schedule queue beyond the configured table (old data dir)
    offset: int = 0  # next schedule-queue offset to deliver
    head_phy: int | None = None  # commit-log offset of the first undelivered entry, if known
    head_deliver_ms: int | None = None
    state: str = "new"  # new | idle (drained) | sleeping (head not due) | delivering | backoff | stopped
    delivered: int = 0
    dropped: int = 0
    early: int = 0
    recovered_skips: int = 0
    # Entries beyond ``offset`` whose re-put is already in the commit log (queue offset -> commit-log
    # offset of that re-put): found by the crash scan, or left by a batch that failed part-way.
    ahead: dict[int, int] = field(default_factory=dict)
    lateness: Histogram = field(default_factory=Histogram)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    wake_scheduled: bool = False

    @property
    def queue_id(self) -> int:
        return self.level - 1


class ScheduleService:
    def __init__(self, store: MessageStore, levels: DelayLevels, clock: Clock, store_root: str,
                 flush_interval_ms: int = 10_000) -> None:
        self.store = store
        self.levels = levels
        self.clock = clock
        self.flush_interval_ms = max(1, flush_interval_ms)
        self.offset_file = OffsetFile(store_root)
        self.path = DeliveryPath(store, clock)
        self.states: dict[int, LevelState] = {
            lv: LevelState(lv, levels.delays_ms[lv - 1]) for lv in range(1, levels.max_level + 1)
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._persist_lock = asyncio.Lock()

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._running:
            return
        self._loop = asyncio.get_running_loop()
        snap = self.offset_file.load()
        level_nums = set(range(1, self.levels.max_level + 1))
        with contextlib.suppress(Exception):
            level_nums.update(q + 1 for q in self.store.queue_ids(SCHEDULE_TOPIC) if q >= 0)
        for level in sorted(level_nums):
            delay = self.levels.delays_ms[level - 1] if level <= self.levels.max_level else None
            st = LevelState(level, delay)
            st.offset = snap.offsets.get(level, 0) if snap else 0
            self.states[level] = st
        self._clamp_offsets()
        # Crash recovery (a no-op after a clean shutdown: the snapshot's scan position is the log's end).
        scan_from = snap.scan_from_phy if snap else 0
        found = await asyncio.to_thread(self._scan_reputs, scan_from)
        if found:
            log.info("delay service: %d entries were delivered after the last offset snapshot (crash);"
                     " they will not be delivered again", found)
        for st in self.states.values():
            self._read_head(st)
        self.store.add_arrival_listener(self._on_arrival)
        self._running = True
        for st in self.states.values():
            self._tasks.append(asyncio.create_task(self._run_level(st), name=f"delay-level-{st.level}"))
        self._tasks.append(asyncio.create_task(self._persist_loop(), name="delay-offset-flush"))

    async def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for st in self.states.values():
            st.state = "stopped"
        await self.persist()

    # --- offsets ----------------------------------------------------------------------------------------
    def snapshot(self) -> OffsetSnapshot:
        # Read the log end before the offsets: every re-put of an entry at or beyond a snapshotted offset
        # happens later (puts run on this loop thread), so it lies at or beyond scan_from -- except the
        # re-puts already made for entries ahead of a level's offset, so start the scan at those.
        scan_from = self.store.max_phy_offset
        for st in self.states.values():
            if st.ahead:
                scan_from = min(scan_from, min(st.ahead.values()))
        return OffsetSnapshot({lv: st.offset for lv, st in self.states.items()}, scan_from,
                              self.clock.now_ms())

    async def persist(self) -> None:
        async with self._persist_lock:
            snap = self.snapshot()
            await in_background(self._flush_and_save, snap)

    def _flush_and_save(self, snap: OffsetSnapshot) -> None:
        # The re-puts a snapshot counts as done must be durable before the snapshot is.
        self.store.flush()
        self.offset_file.save(snap)

    async def _persist_loop(self) -> None:
        while True:
            await self.clock.sleep(self.flush_interval_ms / 1000)
            try:
                await self.persist()
            except Exception:
                log.exception("delay service: persisting delay offsets failed")

    def _clamp_offsets(self) -> None:
        for st in self.states.values():
            lo = self.store.get_min_offset_in_queue(SCHEDULE_TOPIC, st.queue_id)
            hi = self.store.get_max_offset_in_queue(SCHEDULE_TOPIC, st.queue_id)
            if st.offset > hi:
                log.warning("delay level %d: offset %d beyond the queue end %d (store replaced?); using %d",
                            st.level, st.offset, hi, hi)
                st.offset = hi
            if st.offset < lo:
                log.warning("delay level %d: offset %d below the queue start %d; using %d",
                            st.level, st.offset, lo, lo)
                st.offset = lo

    def _scan_reputs(self, scan_from: int) -> int:
        """Find re-puts newer than the snapshot (they carry PROPERTY_DELAY_SOURCE) and mark their
        entries as delivered; returns how many were found."""
        start = max(scan_from, self.store.min_phy_offset)
        if start >= self.store.max_phy_offset:
            return 0
        n = 0
        for msg in self.store.iter_messages(start):
            if msg.topic == SCHEDULE_TOPIC:
                continue
            src = parse_source(msg.properties.get(PROPERTY_DELAY_SOURCE))
            if src is None:
                continue
            level, qoff, parked_phy = src
            st = self.states.get(level)
            if st is None or qoff < st.offset or qoff in st.ahead:
                continue
            units = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id, qoff, 1)
            if units and units[0].commit_log_offset == parked_phy:  # it really is that entry's re-put
                st.ahead[qoff] = msg.commit_log_offset
                st.recovered_skips += 1
                n += 1
        for st in self.states.values():
            while st.offset in st.ahead:
                del st.ahead[st.offset]
                st.offset += 1
        return n

    # --- cleaning guard ---------------------------------------------------------------------------------
    def min_needed_offset(self) -> int | None:
        heads = [st.head_phy for st in list(self.states.values()) if st.head_phy is not None]
        return min(heads) if heads else None

    # --- the level tasks --------------------------------------------------------------------------------
    def _on_arrival(self, topic: str, queue_id: int, max_offset: int, store_timestamp: int) -> None:
        # Called where the store dispatches (the broker's loop, or the store's dispatcher thread): only
        # wake a task that is waiting for new entries.
        if topic != SCHEDULE_TOPIC or not self._running:
            return
        st = self.states.get(queue_id + 1)
        if st is None or st.state != "idle" or st.wake_scheduled or self._loop is None:
            return
        st.wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake, st)
        except RuntimeError:  # loop closed
            st.wake_scheduled = False

    @staticmethod
    def _wake(st: LevelState) -> None:
        st.wake_scheduled = False
        st.wake.set()

    def _read_head(self, st: LevelState) -> None:
        units = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id, st.offset, 1)
        if units:
            st.head_phy, st.head_deliver_ms = units[0].commit_log_offset, units[0].tags_code
        else:
            st.head_phy = st.head_deliver_ms = None

    async def _run_level(self, st: LevelState) -> None:
        while True:
            try:
                await self._level_loop(st)
            except asyncio.CancelledError:
                st.state = "stopped"
                raise
            except Exception:  # a store error must not kill the level for good
                log.exception("delay level %d: schedule loop failed; retrying in %d ms", st.level,
                              RETRY_BACKOFF_MS)
                st.state = "backoff"
                await self.clock.sleep_until_ms(self.clock.now_ms() + RETRY_BACKOFF_MS)

    async def _level_loop(self, st: LevelState) -> None:
        units: list = []  # read-ahead buffer of consume-queue units starting at st.offset
        at_end = False  # the buffer reaches the end of the queue (as it was when read)
        try:
            while True:
                if units and units[0].queue_offset != st.offset:
                    skip = st.offset - units[0].queue_offset
                    units = units[skip:] if 0 < skip < len(units) else []
                if not units:
                    units = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id, st.offset, READ_BATCH)
                    at_end = len(units) < READ_BATCH
                if not units:
                    if st.offset < self.store.get_min_offset_in_queue(SCHEDULE_TOPIC, st.queue_id):
                        self._clamp_offsets()
                        continue
                    # Drained: announce idleness first, then look again, so an arrival is never missed.
                    st.wake.clear()
                    st.state = "idle"
                    st.head_phy = st.head_deliver_ms = None
                    units = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id, st.offset, READ_BATCH)
                    at_end = len(units) < READ_BATCH
                    if not units:
                        await st.wake.wait()
                        continue
                head = units[0]
                st.head_phy, st.head_deliver_ms = head.commit_log_offset, head.tags_code
                now = self.clock.now_ms()
                if head.tags_code > now:
                    st.state = "sleeping"
                    # Entries behind the head are due no earlier (same delay, later store time), so
                    # nothing can overtake it: sleep exactly until it is due.
                    await self.clock.sleep_until_ms(head.tags_code, precise=True)
                    room = READ_BATCH - len(units)
                    if at_end and room > 0:  # entries that arrived meanwhile go out with the head
                        more = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id,
                                                       units[-1].queue_offset + 1, room)
                        if more:
                            units = units + more
                        at_end = len(more) < room
                    continue
                st.state = "delivering"
                if not self._deliver_due(st, units, now):
                    units = []
                    st.state = "backoff"
                    await self.clock.sleep_until_ms(self.clock.now_ms() + RETRY_BACKOFF_MS)
                    continue
                await asyncio.sleep(0)  # let the broker breathe between batches
        finally:
            if st.state == "delivering":
                st.state = "backoff"

    def _deliver_due(self, st: LevelState, units: list, now: int) -> bool:  # list[CQUnit]
        """Deliver the due prefix of ``units`` in one batch; returns False after a transient failure
        (the entries not written stay pending and are tried again)."""
        due = []
        for u in units:
            if u.tags_code > now:
                break
            due.append(u)
        level = st.level
        todo = [u for u in due if u.queue_offset not in st.ahead]
        outcomes = self.path.deliver_many(
            [(u.commit_log_offset, make_source(level, u.queue_offset, u.commit_log_offset)) for u in todo])
        if not st.ahead and all(d.written for d in outcomes):  # the common case: everything written
            lateness: dict[int, int] = {}
            for u, d in zip(due, outcomes, strict=True):
                late = d.store_timestamp - u.tags_code
                lateness[late] = lateness.get(late, 0) + 1
            for late, n in lateness.items():
                if late < 0:
                    st.early += n
                st.lateness.record(late, n)
            st.delivered += len(due)
            st.offset = due[-1].queue_offset + 1
            return True
        done: set[int] = set()
        ok = True
        record = st.lateness.record
        for u, d in zip(todo, outcomes, strict=True):
            if d.written:
                late = d.store_timestamp - u.tags_code
                if late < 0:
                    st.early += 1
                record(late)
                st.delivered += 1
                done.add(u.queue_offset)
                if d.result is not None and d.result.append is not None:
                    st.ahead[u.queue_offset] = d.result.append.wrote_offset
            elif d.retry:
                if ok:
                    log.warning("delay level %d: put failed (%s); retrying from offset %d later",
                                level, d.error, u.queue_offset)
                ok = False
            else:
                st.dropped += 1
                done.add(u.queue_offset)
                log.error("delay level %d: dropping schedule entry %d: %s", level, u.queue_offset, d.error)
        # advance over the contiguous prefix of finished entries (delivered now, before a crash, or
        # dropped); entries finished beyond a failed one stay in ``ahead`` so they are not repeated
        for u in due:
            q = u.queue_offset
            if q != st.offset or not (q in done or q in st.ahead):
                break
            st.ahead.pop(q, None)
            st.offset = q + 1
        for q in done:
            if q >= st.offset and q not in st.ahead:
                st.ahead[q] = self.store.max_phy_offset  # dropped: nothing in the log; keep it skipped
        return ok

    # --- introspection ---------------------------------------------------------------------------------
    def is_settled(self) -> bool:
        """True when every level is drained (and has seen every dispatched entry) or asleep until a head
        that is not yet due. Tests use it before moving a virtual clock."""
        now = self.clock.now_ms()
        for st in self.states.values():
            if st.state == "idle":
                if self.store.get_max_offset_in_queue(SCHEDULE_TOPIC, st.queue_id) > st.offset:
                    return False
            elif st.state == "sleeping":
                if st.head_deliver_ms is None or st.head_deliver_ms <= now:
                    return False
            elif st.state not in ("stopped", "backoff"):  # backoff: asleep until its retry time
                return False
        return True

    def level_stats(self, st: LevelState) -> dict:
        hi = self.store.get_max_offset_in_queue(SCHEDULE_TOPIC, st.queue_id)
        units = self.store.get_cq_units(SCHEDULE_TOPIC, st.queue_id, st.offset, 1) if hi > st.offset else []
        return {
            "level": st.level,
            "delay_ms": st.delay_ms,
            "pending": max(0, hi - st.offset),
            "oldest_pending_deliver_ms": units[0].tags_code if units else None,
            "delivered": st.delivered,
            "lateness_ms": st.lateness.summary(),
            "dropped": st.dropped,
            "offset": st.offset,
            "state": st.state,
        }
