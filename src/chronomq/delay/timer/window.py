"""The delivery window, TimerStore's hot path (``WindowPath``, its base class): ``_Slot`` (one wheel slot's
entries in memory, sorted, plus a heap of late arrivals), ``poll`` (hand out due items), advancing and
preloading the window, the wake time, ``deliver_many`` (read, check and put a batch), staging ahead of
the due time, the in-place completion write, and the delivery marks with their done log. Rules: nothing
is handed out before its deliver time; at most two slots are in memory; every method that reads or
changes the window takes the store's lock (``staged_count`` and ``staged_due_ms`` only peek); a batch
costs one lock hold and nothing per message beyond the loop itself.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageFormatError,
)
from chronomq.store.speedups import crc32 as fast_crc32
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import PutResult

from ..delivery import PutRaw, StorePuts, decode_to_put, put_groups, record_to_put
from ..histogram import Histogram
from .files import SegmentedFile
from .props import TIMER_PROPERTIES
from .records import (
    _DONE_BLOCK,
    _I64,
    _STATE_BLOCK,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    DELIVERED,
    FAILED,
    IDX_SIZE,
    OFF_DONE,
    OFF_STATE,
    PENDING,
    Item,
    Mark,
    Staged,
    Taken,
    TimerHeader,
    _new,
    _unpack_index,
)
from .state import TimerState

log = logging.getLogger("chronomq.delay.timer.store")


def _uniq_of(m: Any) -> str:
    """The UNIQ_KEY of a taken entry's message: a put_records entry (buffer, position, size, properties),
    a prepared entry of the store (record, tagsCode, delay, keys, UNIQ_KEY) or a MessageExt."""
    if m.__class__ is tuple:
        return (m[3].get(PROPERTY_UNIQ_KEY) if len(m) == 4 else m[4]) or ""
    return m.uniq_key or ""


def _staged_key(s: Staged) -> tuple[int, int]:
    return s.item.deliver_ms, s.item.entry


def _staged_due(s: Staged) -> int:
    return s.item.deliver_ms


class _Slot:
    """One slot's entries in memory: the chain read from disk (sorted) plus late arrivals (a heap)."""

    __slots__ = ("cursor", "d", "g", "head", "i", "inflight", "late", "p", "ready", "s", "slot", "started",
                 "t", "walk")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.started = False
        self.ready = False
        self.walk = 0
        self.head = 0
        self.d = array("q")
        self.i = array("q")
        self.p = array("q")
        self.g = array("i")
        self.t = array("i")
        self.s = array("i")
        self.cursor = 0
        self.late: list[Item] = []
        self.inflight = 0

    def start(self, head: int) -> None:
        self.started = True
        self.head = head
        self.walk = head

    def step(self, index: SegmentedFile, budget: int) -> None:
        d, i, p, g, t, s = self.d, self.i, self.p, self.g, self.t, self.s
        cur = self.walk
        # A chain written by one schedule_batch runs through adjacent entries: after a link to the
        # entry just before, read the next up-to-256 entries (same index segment) in one pread.
        blk = b""
        blk_lo = blk_n = 0
        seg_entries = index.segment_size // IDX_SIZE
        adjacent = False
        while cur and budget > 0:
            budget -= 1
            e_no = cur - 1
            rel = e_no - blk_lo
            if 0 <= rel < blk_n:
                raw = blk[rel * IDX_SIZE : (rel + 1) * IDX_SIZE]
            elif adjacent:
                blk_lo = max(e_no - 255, e_no - e_no % seg_entries)
                blk = index.read(blk_lo * IDX_SIZE, (e_no - blk_lo + 1) * IDX_SIZE)
                blk_n = len(blk) // IDX_SIZE
                rel = e_no - blk_lo
                raw = blk[rel * IDX_SIZE : (rel + 1) * IDX_SIZE]
            else:
                raw = index.read(e_no * IDX_SIZE, IDX_SIZE)
            e = _unpack_index(raw)
            if e is None or e.slot != self.slot or e.prev >= cur:
                log.error("timer index chain of slot %d broken at entry %d; rest of the chain skipped",
                          self.slot, cur - 1)
                cur = 0
                break
            d.append(e.deliver_ms)
            i.append(cur - 1)
            p.append(e.pos)
            g.append(e.gen)
            t.append(e.topic_id)
            s.append(e.size)
            adjacent = e.prev == cur - 1
            cur = e.prev
        self.walk = cur
        if cur == 0:
            n = len(d)
            # The chain runs newest first: reversed, entry numbers ascend, and a stable sort by deliver
            # time then orders by (deliver time, entry number) with plain int keys (no tuples).
            for arr in (d, i, p, g, t, s):
                arr.reverse()
            order = sorted(range(n), key=d.__getitem__)
            self.d = array("q", (d[k] for k in order))
            self.i = array("q", (i[k] for k in order))
            self.p = array("q", (p[k] for k in order))
            self.g = array("i", (g[k] for k in order))
            self.t = array("i", (t[k] for k in order))
            self.s = array("i", (s[k] for k in order))
            self.ready = True

    def peek(self) -> tuple[int, int] | None:
        a = (self.d[self.cursor], self.i[self.cursor]) if self.cursor < len(self.d) else None
        b = (self.late[0].deliver_ms, self.late[0].entry) if self.late else None
        if a is None:
            return b
        if b is None:
            return a
        return min(a, b)

    def pop(self) -> Item:
        c = self.cursor
        late = self.late
        if late and (c >= len(self.d) or (late[0].deliver_ms, late[0].entry) < (self.d[c], self.i[c])):
            return heapq.heappop(late)
        self.cursor = c + 1
        return _new(Item, (self.d[c], self.i[c], self.p[c], self.g[c], self.t[c], self.s[c]))

    def exhausted(self) -> bool:
        return self.cursor >= len(self.d) and not self.late

    def entries(self) -> int:
        return len(self.d) - self.cursor + len(self.late)


class WindowPath(TimerState):
    def _reset_window(self) -> None:
        """The in-memory state that starts empty at every open: the window, the counters, the marks."""
        self.cur = None
        self.nxt = None
        self.scan_empty_from = None
        self.hist = {}
        self.delivered = 0
        self.cancelled = 0
        self.rescheduled = 0
        self.failed = 0
        self.put_retries = 0
        self.early = 0
        self.stale_skipped = 0
        self.data_recheck = {}
        self.done_since_scan = {}
        self.appended_bytes = self.appended_records = 0
        # Deliveries are recorded in memory (an overlay on the record headers) and appended to a done log
        # once per batch; the flush later writes them into the records and empties the log (docs/timer.md).
        self._marks = {}
        self._mark_buf = bytearray()
        # Items taken ahead of their time with their store entries prepared (see ``stage``), sorted by
        # (deliver time, index entry), and the data file's change count when they were read.
        self._staged = []
        self._staged_bytes = 0  # the data records' sizes of what is staged (stage_bytes bounds it)
        self._stage_full = False  # the next record did not fit in stage_bytes: none staged until a put
        self._staged_changes = 0

    def _commit_marks(self) -> None:
        """Append the marks of the last batch to done.log (one pwrite): from here a process crash
        no longer loses them. ``deliver_many`` calls it for each batch it delivered."""
        if self._mark_buf:
            os.pwrite(self._done_fd, self._mark_buf, self._done_end)
            self._done_end += len(self._mark_buf)
            self._mark_buf = bytearray()

    def _overlay(self, pos: int, h: TimerHeader) -> TimerHeader:
        """The header ``h`` of the record at ``pos`` with its delivery mark, if one is still only in
        memory (the flush writes it into the record)."""
        m = self._marks.get(pos)
        if m is None:
            return h
        state, done_ms, done_seq, _block = m
        return h._replace(state=state, done_ms=done_ms, done_seq=done_seq)

    def _write_done(self, pos: int, h: TimerHeader, state: int, now: int) -> int:
        """Complete the record at ``pos`` (header ``h``) in place: ``state`` at ``now`` with the next
        done_seq, in one pwrite of state..done_seq (a process crash cannot split a pwrite)."""
        self.done_seq += 1
        self.data.patch(pos + OFF_STATE, _STATE_BLOCK.pack(state, h.gen, h.deliver_ms, now, h.created_ms,
                                                           h.origin, self.done_seq))
        self._count_done(pos)
        return self.done_seq

    def _count_done(self, pos: int, n: int = 1) -> None:
        """``n`` records completed in the segment of ``pos`` (what decides when retention reclaims)."""
        start = self.data.seg_start(pos)
        self.done_since_scan[start] = self.done_since_scan.get(start, 0) + n

    def _floor_slot(self) -> int:
        return self.cur.slot if self.cur is not None else self.watermark + 1

    def poll(self, now: int, max_items: int | None = None) -> tuple[list[Item], int | None]:
        """Due items (taken: the caller must ``deliver`` each), or none and the time to call again
        (None: nothing pending at all; a new schedule calls ``wakeup``)."""
        n = max_items or self.cfg.deliver_batch
        with self.lock:
            self._advance_window(now)
            cur = self.cur
            if cur is not None:
                out: list[Item] = []
                if not cur.late:  # the common case: a slice of the sorted chain, no per-item peek/pop
                    c = cur.cursor
                    end = min(bisect.bisect_right(cur.d, now, lo=c), c + n)
                    if end > c:
                        out = [_new(Item, f) for f in zip(cur.d[c:end], cur.i[c:end], cur.p[c:end],
                                                          cur.g[c:end], cur.t[c:end], cur.s[c:end],
                                                          strict=True)]
                        cur.cursor = end
                while len(out) < n:
                    head = cur.peek()
                    if head is None or head[0] > now:
                        break
                    out.append(cur.pop())
                if out:
                    cur.inflight += len(out)
                    return out, None
            return [], self._wake_ms(now)

    def _advance_window(self, now: int) -> None:
        for _ in range(8):
            cur = self.cur
            if cur is not None and cur.exhausted() and cur.inflight == 0:
                self.watermark = max(self.watermark, cur.slot)
                self.cur = None
                self.dirty = True
                continue
            if cur is None and self.nxt is not None and self.nxt.ready and \
                    now >= self.nxt.slot * self.slot_ms - self.cfg.promote_ms:
                self.cur, self.nxt = self.nxt, None
                continue
            if self.nxt is None:
                frm = (cur.slot if cur is not None else self.watermark) + 1
                if self.scan_empty_from is None or frm < self.scan_empty_from:
                    s = self.wheel.next_nonempty(frm)
                    if s is None:
                        self.scan_empty_from = frm
                    else:
                        self.nxt = _Slot(s)
            nxt = self.nxt
            if nxt is not None and not nxt.ready and now >= nxt.slot * self.slot_ms - self.cfg.preload_ms:
                if not nxt.started:
                    nxt.start(self.wheel.get(nxt.slot))
                nxt.step(self.index, self.cfg.preload_step)
                if nxt.ready and self.cur is None:
                    continue
            break

    def _wake_ms(self, now: int) -> int | None:
        cands = []
        if self.cur is not None:
            head = self.cur.peek()
            if head is not None:
                cands.append(head[0])
            elif self.cur.inflight == 0:
                cands.append(now)
        nxt = self.nxt
        if nxt is not None and not nxt.ready:
            t = nxt.slot * self.slot_ms - self.cfg.preload_ms
            cands.append(now if (nxt.started or now >= t) else t)
        elif nxt is not None and self.cur is None:
            cands.append(max(now, nxt.slot * self.slot_ms - self.cfg.promote_ms))
        return min(cands) if cands else None

    def deliver(self, item: Item, put: Callable[[MessageExt], PutResult], now: int | None = None) -> str:
        """Deliver one taken item through ``put`` (the MessageStore's put_message). Returns 'delivered',
        'skipped' (cancelled, rescheduled, already delivered), 'failed' (the store refused it for good)
        or 'retry' (the store could not take it now; the item is back in the window)."""
        return self.deliver_many([item], put, None, now)[0]

    def deliver_many(self, items: list[Item], put: Callable[[MessageExt], PutResult],
                     put_many: Callable[[list[MessageExt]], PutResult] | None = None,
                     now: int | None = None, put_raw: PutRaw | None = None) -> list[str]:
        """Deliver taken items (a ``poll``'s batch) under one lock hold; one outcome per item, as for
        ``deliver``. The records are read in few large reads (a batch's records are mostly adjacent on
        disk), then go through the delivery path shared with the level service
        (chronomq.delay.delivery.put_groups): one put per real topic and queue, to ``put_raw`` (the
        MessageStore's put_records: the stored bytes re-put with the edited properties) when given, else
        ``put_many`` (put_messages), else ``put`` one by one. A group refused for good is isolated
        message by message. After a transient failure the items not stored go back to the window
        ('retry'). An item is marked delivered only once the store has accepted it; an exception leaves
        every item without an outcome pending in the window."""
        n = len(items)
        out: list[str] = [""] * n
        with self.lock:
            now = self.clock.now_ms() if now is None else now
            try:
                groups = self._prepare_batch(items, now, out, put_raw is not None)
                put_groups(groups, StorePuts(put, put_many, put_raw),
                           lambda g, _r: self._mark_delivered(g, out),
                           lambda g, r: self._refused(g, r, out), lambda g, _r: self._busy(g, out))
            finally:
                self._settle(items, out)
        return out

    def _settle(self, items: list[Item], out: list[str]) -> None:
        """After a batch: items without an outcome go back to the window ('retry'), the batch leaves
        the in-flight count, and its marks reach done.log now, not at the next poll: the timer may sleep
        long after its last batch, and a process killed meanwhile would deliver that batch again."""
        cur = self.cur
        if "" in out or "retry" in out:  # else every item has its outcome (a batch that went in whole)
            for k in range(len(items)):
                if not out[k]:
                    out[k] = "retry"
                if out[k] == "retry" and cur is not None:
                    heapq.heappush(cur.late, items[k])
        if cur is not None:
            cur.inflight -= len(items)
        self._commit_marks()

    # --- staging: the work of a delivery done before its moment ------------------------------------------
    def stage(self, now: int, ahead_ms: int, limit: int, max_items: int,
              prepare: Callable[[str, int, list[Any]], Any]) -> int:
        """Take up to ``max_items`` items falling due within ``stage_lead_ms`` of ``now`` (while fewer
        than ``limit`` are staged), read and check their records and have the store encode their copies
        (``prepare``: MessageStore.prepare_records), so that at their moment ``deliver_staged`` has only
        the append left. Items found done, stale or damaged get their outcome now. Returns how many
        were staged. Nothing is delivered here; a staged item stays pending on disk until its put."""
        with self.lock:
            room = min(max_items, limit - len(self._staged))
            if room <= 0:
                return 0
            if self._staged and self.data.changes != self._staged_changes:
                self._unstage()  # a cancel or reschedule since: read them again
            budget = self.cfg.stage_bytes - self._staged_bytes
            if budget <= 0 or self._stage_full:
                return 0
            horizon = now + self.stage_lead_ms(ahead_ms, limit)
            items, _wake = self.poll(horizon, room)
            if not items:
                return 0
            items = self._within(items, budget, not self._staged)
            if not items:
                return 0
            out: list[str] = [""] * len(items)
            slots: list[Staged | None] = [None] * len(items)  # in the window's order, as poll gave them
            try:
                groups = self._prepare_batch(items, now, out, True, due_by=horizon)
                for (topic, qid), members in groups.items():
                    entries = prepare(topic, qid, [m.put for m in members])
                    ok = entries.__class__ is list
                    for j, m in enumerate(members):
                        prepared = entries[j] if ok else None
                        slots[m.batch_index] = _new(Staged, (m.item, m.header, topic, qid, prepared,
                                                             None if ok else m.put))
                        out[m.batch_index] = "staged"
            finally:
                left = [k for k in range(len(items)) if out[k] != "staged"]
                self._settle([items[k] for k in left], [out[k] for k in left])
                staged = [s for s in slots if s is not None]
                if staged:
                    st = self._staged
                    # poll hands items out in (deliver time, entry) order: sort only when a late arrival
                    # falls due before what is already staged (a whole sort per step was quadratic)
                    resort = bool(st) and _staged_key(staged[0]) < _staged_key(st[-1])
                    st.extend(staged)
                    if resort:
                        st.sort(key=_staged_key)
                    self._staged_bytes += sum(s.item.size for s in staged)
                    self._staged_changes = self.data.changes
            return len(staged)

    def _within(self, items: list[Item], budget: int, one: bool) -> list[Item]:
        """The first of ``items`` (in poll's order) whose records fit in ``budget`` bytes (with ``one``, at
        least one: a record larger than the budget is staged alone); the others go back to the window, to
        be staged when room is made or taken at their time."""
        total = 0
        for k, it in enumerate(items):
            total += it.size
            if total > budget and (k or not one):
                self._stage_full = True
                rest = items[k:]
                self._settle(rest, ["retry"] * len(rest))
                return items[:k]
        return items

    def stage_lead_ms(self, ahead_ms: int, limit: int) -> int:
        """How long before its deliver time a message is staged: ``ahead_ms``, plus the configured
        allowance for each message of the delivering slot, staged or not (up to ``limit``), so that many
        due together (a burst at one instant) are all prepared by their moment, in one go."""
        cur = self.cur
        if cur is None:
            return ahead_ms
        return ahead_ms + min(cur.entries() + len(self._staged), limit) * self.cfg.stage_item_us // 1000

    def staged_count(self) -> int:
        return len(self._staged)

    def stage_room(self) -> bool:
        """Whether ``stage`` may take more now: fewer than stage_limit staged, and the last record it
        looked at did not overflow stage_bytes (that waits for a put to make room)."""
        return (len(self._staged) < self.cfg.stage_limit and self._staged_bytes < self.cfg.stage_bytes
                and not self._stage_full)

    def staged_due_ms(self) -> int | None:
        """The deliver time of the first staged item, or None."""
        st = self._staged
        return st[0].item.deliver_ms if st else None

    def deliver_staged(self, now: int, max_items: int, puts: StorePuts, fallback: StorePuts
                       ) -> tuple[int, bool]:
        """Put the staged items due by ``now`` (at most ``max_items``): the prepared ones through
        ``puts`` (MessageStore.put_prepared), any the store would not prepare through ``fallback``, with
        the outcomes, marks, retries and refusals of ``deliver_many``. If a record changed in place
        since the items were staged (a cancel, a reschedule), they all go back to the window first and
        this delivers nothing. Returns (how many were taken, whether the store was busy)."""
        with self.lock:
            st = self._staged
            if not st or st[0].item.deliver_ms > now:
                return 0, False
            if self.data.changes != self._staged_changes:
                self._unstage()
                return 0, False
            m = min(bisect.bisect_right(st, now, key=_staged_due), max_items)
            take = st[:m]
            del st[:m]
            self._staged_bytes -= sum(s.item.size for s in take)
            self._stage_full = False
            items = [s.item for s in take]
            out: list[str] = [""] * m
            try:
                last = take[-1].item.deliver_ms  # the staged list is sorted: the last is the latest
                if last > now:
                    self.early += 1  # never happens: only due items are taken
                    raise AssertionError(f"timer item due at {last} handed out at {now}")
                prepared: dict[tuple[str, int], list[Taken]] = {}
                raw: dict[tuple[str, int], list[Taken]] = {}
                for k, (item, header, topic, queue_id, prep, record) in enumerate(take):
                    grp = prepared if prep is not None else raw
                    key = (topic, queue_id)
                    taken = _new(Taken, (k, prep if prep is not None else record, header, item))
                    g = grp.get(key)
                    if g is None:
                        grp[key] = [taken]
                    else:
                        g.append(taken)
                busy = False
                for groups, via in ((prepared, puts), (raw, fallback)):
                    if groups and not busy:
                        busy = put_groups(groups, via, lambda g, _r: self._mark_delivered(g, out),
                                          lambda g, r: self._refused(g, r, out),
                                          lambda g, _r: self._busy(g, out))
            finally:
                self._settle(items, out)
            return m, "retry" in out

    def _unstage(self) -> None:
        """Give every staged item back to the window, to be read and checked again."""
        cur = self.cur
        st = self._staged
        if cur is not None:
            for s in st:
                heapq.heappush(cur.late, s.item)
            cur.inflight -= len(st)
        st.clear()
        self._staged_bytes = 0
        self._stage_full = False

    def _read_batch(self, items: list[Item]) -> list[tuple[bytes, int]]:
        """The records of ``items``, each as (buffer, offset in it): one pread per run of nearby records
        (same segment, gaps < 64 KiB, up to 1 MiB). An item below the oldest data segment gets
        (b"", 0)."""
        data = self.data
        seg = self.data_seg
        n = len(items)
        bufs: list[tuple[bytes, int]] = [(b"", 0)] * n
        order = sorted(range(n), key=lambda k: items[k].pos)
        min_pos = data.min_pos
        j = 0
        while j < n:
            k = order[j]
            lo = items[k].pos
            if lo < min_pos:
                j += 1
                continue
            hi = lo + items[k].size
            seg_lo = lo - lo % seg
            e = j + 1
            while e < n:
                nxt = items[order[e]]
                p2 = nxt.pos
                end2 = p2 + nxt.size
                if p2 - p2 % seg != seg_lo or p2 - hi > 65536 or end2 - lo > (1 << 20):
                    break
                if end2 > hi:
                    hi = end2
                e += 1
            raw = data.read(lo, hi - lo)
            for q in range(j, e):
                kk = order[q]
                bufs[kk] = (raw, items[kk].pos - lo)
            j = e
        return bufs

    def _prepare_batch(self, items: list[Item], now: int, out: list[str], as_records: bool = False,
                       due_by: int | None = None) -> dict[tuple[str, int], list[Taken]]:
        """Read and check the records of ``items`` and turn the live ones into the messages to put (with
        ``as_records``: the (buffer, position, size, properties) entries of put_records), grouped by real
        (topic, queue) in ``items`` order. Outcomes of the others go into ``out``. Every item must be
        due by ``now`` (by ``due_by`` when staging)."""
        n = len(items)
        limit = now if due_by is None else due_by
        for it in items:
            if it.deliver_ms > limit:
                self.early += 1  # never happens: poll only hands out due items
                raise AssertionError(f"timer item due at {it.deliver_ms} handed out at {now}")
        bufs = self._read_batch(items)
        # check and decode, in deliver order
        groups: dict[tuple[str, int], list[Taken]] = {}
        unpack_from = DATA_HDR.unpack_from
        marks = self._marks
        store_host = self.store_host
        strip = (*TIMER_PROPERTIES, PROPERTY_DELAY_TIME_LEVEL)
        decode = decode_to_put
        parse = record_to_put
        crc32 = fast_crc32
        raw_mode = as_records
        for k in range(n):
            item = items[k]
            deliver_ms, _idx, pos, gen, tid, size = item
            raw, off = bufs[k]
            if size < DATA_HDR_SIZE or off + size > len(raw):
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            h = _new(TimerHeader, unpack_from(raw, off))
            if h.magic != DATA_MAGIC or h.size != size:
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            if marks:
                h = self._overlay(pos, h)
            if h.gen != gen:
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            if h.state != PENDING:
                if h.state in (DELIVERED, FAILED) and self.open_ranges and \
                        any(lo < h.done_seq < hi for lo, hi, _ in self.open_ranges):
                    # Completed after the last checkpoint, before a crash: subtract it now, and give
                    # it a sequence number of this run so it is never subtracted twice.
                    self.pending[tid] -= 1
                    self.done_seq += 1
                    self.data.patch(pos + OFF_DONE, _DONE_BLOCK.pack(h.done_ms, h.created_ms, h.origin,
                                                                     self.done_seq))
                    self.dirty = True
                self.stale_skipped += 1
                out[k] = "skipped"
                continue
            if crc32(memoryview(raw)[off + DATA_HDR_SIZE:off + size]) - (1 << 31) != h.crc:
                # the bytes changed after they were written (a torn write, a damaged sector): never
                # hand them out
                log.error("timer record at %d is damaged (payload CRC mismatch); marked failed", pos)
                self._write_done(pos, h, FAILED, now)
                self.pending[tid] -= 1
                self.failed += 1
                out[k] = "failed"
                continue
            try:
                if raw_mode:
                    topic, qid, props = parse(raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE)
                    m: Any = (raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE, props)
                else:
                    m = decode(raw, off + DATA_HDR_SIZE, size - DATA_HDR_SIZE, store_host)
                    topic, qid, props = m.topic, m.queue_id, m.properties
            except MessageFormatError as e:
                log.error("timer record at %d is corrupt (%s); marked failed", pos, e)
                self._write_done(pos, h, FAILED, now)
                self.pending[tid] -= 1
                self.failed += 1
                out[k] = "failed"
                continue
            for key in strip:
                props.pop(key, None)
            props[PROPERTY_TIMER_DELIVER_MS] = str(deliver_ms)
            g = groups.get((topic, qid))
            if g is None:
                groups[(topic, qid)] = [_new(Taken, (k, m, h, item))]
            else:
                g.append(_new(Taken, (k, m, h, item)))
        return groups

    def _refused(self, taken: Taken, res: PutResult, out: list[str]) -> None:
        """The store refused one message for good: it is marked FAILED and never delivered."""
        uniq = _uniq_of(taken.put)
        log.error("timer: store refused message %s for good: %s", uniq, res.error)
        self._write_done(taken.item.pos, taken.header, FAILED, self.clock.now_ms())
        self.pending[taken.item.topic_id] -= 1
        self.failed += 1
        out[taken.batch_index] = "failed"
        if self.on_done is not None and uniq:
            self.on_done([uniq])

    def _busy(self, group: list[Taken], out: list[str]) -> None:
        self.put_retries += len(group)
        for g in group:
            out[g.batch_index] = "retry"

    def _mark_delivered(self, group: list[Taken], out: list[str]) -> None:
        t = self.clock.now_ms()
        lates: dict[tuple[int, int], int] = {}
        seq = mark_delivered_run(group, t, self.done_seq, self._marks, self._mark_buf, self.pending, lates,
                                 out)
        hists = self.hist
        for (tid, late), c in lates.items():  # a burst shares few distinct values
            hist = hists.get(tid)
            if hist is None:
                hist = hists[tid] = Histogram()
            hist.record(late, c)
        self.done_seq = seq
        self.delivered += len(group)
        self.dirty = True
        if self.on_done is not None:
            self.on_done([_uniq_of(g.put) for g in group])

    def due_undelivered(self, now: int) -> dict[str, int]:
        """Per topic: messages whose deliver time has passed and that are still in memory waiting."""
        with self.lock:
            c: Counter[int] = Counter()
            for w in (self.cur,):
                if w is None:
                    continue
                k = bisect.bisect_right(w.d, now, lo=w.cursor)
                c.update(w.t[w.cursor : k])
                c.update(it.topic_id for it in w.late if it.deliver_ms <= now)
            c.update(s.item.topic_id for s in self._staged if s.item.deliver_ms <= now)
            return {self.topic_name(t): n for t, n in c.items() if n}


@pure_twin("mark_delivered_run")
def mark_delivered_run_py(group: list[Taken], t: int, seq: int, marks: dict[int, Mark], buf: bytearray,
                          pending: Counter[int], lates: dict[tuple[int, int], int], out: list[str]) -> int:
    """The delivery marks of ``group`` at time ``t``, numbered on from ``seq``: each record's DELIVERED
    state block in ``marks`` (by data position) and in ``buf`` (the done log's entries), its topic's
    ``pending`` count down by one, its lateness counted in ``lates`` by (topic id, ms), and "delivered"
    in ``out``. Returns the last number."""
    pack = _STATE_BLOCK.pack
    i64 = _I64.pack
    for taken in group:
        h, item = taken.header, taken.item
        pos, tid = item.pos, item.topic_id
        seq += 1
        block = pack(DELIVERED, h.gen, h.deliver_ms, t, h.created_ms, h.origin, seq)
        marks[pos] = (DELIVERED, t, seq, block)
        buf += i64(pos)
        buf += block
        pending[tid] -= 1
        created = h.created_ms
        d = item.deliver_ms
        lk = (tid, t - (d if d > created else created))  # past when scheduled: not lateness
        lates[lk] = lates.get(lk, 0) + 1
        out[taken.batch_index] = "delivered"
    return seq


# the compiled kernel when built (chronomq.store.speedups chooses); mark_delivered_run_py is its twin
mark_delivered_run = kernels.mark_delivered_run
