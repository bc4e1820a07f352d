"""Recovery at start: load the commit log, queues and index; find the log's valid end (trusted from the
checkpoint after a clean shutdown, re-verified record by record after a crash), cut everything past it,
then rebuild queue entries from the checkpoint's recover-from offset and write a fresh checkpoint.
Rules: the commit log is the single source of truth; the first bad record (or queue offset that does
not follow its queue) ends the log. Runs once, before any service thread starts. See docs/store.md.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING

from chronomq.message import MessageExt, MessageFormatError, decode_record, validate_topic
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.commitlog import BLANK_HEAD, BLANK_MAGIC, check_record
from chronomq.store.consumequeue import ConsumeQueue
from chronomq.store.index import ENTRY, ENTRY_SIZE, key_hash
from chronomq.store.mapped import MappedFile, first_hole
from chronomq.store.reput import request_of
from chronomq.store.types import DispatchRequest

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")

# After a clean shutdown the last VERIFY_TAIL bytes of the log are re-verified (RocketMQ's normal
# recovery re-checks its last files): a tail damaged after the shutdown is cut, not served.
VERIFY_TAIL = 4 << 20


class StoreRecovery:
    """Sets the store's put-side state (``_cur_seg``, ``_queue_table``, ``_last_ts``), the dispatched
    and flushed offsets and ``recovered_abnormally``."""

    def __init__(self, store: MessageStore) -> None:
        self._store = store

    def recover(self, abnormal: bool) -> None:
        store = self._store
        cl = store._cl
        cl.load()
        ckpt = Checkpoint.load(store._checkpoint_path)
        self.load_queues()
        store._index.load()
        store.recovered_abnormally = abnormal or ckpt is None
        if not cl.segments:
            cl.wrote = 0
            store._cur_seg = None
            self.finish_recovery(0, 0)
            return
        short = next((seg for seg in cl.segments if seg.was_short), None)
        if short is not None:
            log.warning("recovery: commit-log segment %s is shorter than mappedFileSizeCommitLog; verifying "
                        "the log from it", short.path)
            abnormal = True
            store.recovered_abnormally = True
        check_crc = store.config.checkCRCOnRecover
        clean_end = ckpt.commit_log_end if ckpt is not None and not abnormal else 0
        if clean_end:
            # clean shutdown: the end is known; re-verify the last bytes before it
            start = self.tail_boundary(clean_end)
        else:
            # re-verify from the checkpoint's recover-from offset (a record boundary below which every
            # byte was fsynced before the checkpoint was written), so a crash costs what was written
            # since it, not the whole segment; from the first cut segment when there is one
            ck_from = max(ckpt.recover_from if ckpt is not None else 0, cl.segments[0].start)
            start = ck_from if cl.segment_for(ck_from) is not None else cl.segments[-1].start
            if short is not None:
                start = min(start, short.start)
        end = self.scan_end(start, check_crc)
        if clean_end and end < clean_end:
            log.warning("recovery: the commit log ends at %d, before its clean-shutdown end %d: the "
                        "records in between are damaged and dropped", end, clean_end)
            store.recovered_abnormally = True
        self.truncate_log(end)
        dispatch_from = min(ckpt.recover_from if ckpt is not None else 0, end)
        dispatch_from = max(dispatch_from, cl.min_offset)
        if not abnormal and ckpt is not None and ckpt.commit_log_end and end == ckpt.commit_log_end:
            dispatch_from = min(max(ckpt.recover_from, cl.min_offset), end)
        dispatch_from = min(dispatch_from, self.check_queues(end), self.check_index(end))
        if clean_end:  # a queue whose newest records in the verified tail have no entries was torn
            dispatch_from = min(dispatch_from, self.queues_behind(start, end))
        self.finish_recovery(dispatch_from, end)

    def queues_behind(self, start: int, end: int) -> int:
        """The commit-log offset from which to rebuild the queues that lack entries for records in
        [start, end) (``end`` when none does)."""
        last: dict[tuple[str, int], int] = {}
        for _, data in self._store._cl.iter_records(start):
            try:
                m = decode_record(data, read_body=False)
            except MessageFormatError:
                break
            if m.commit_log_offset >= end:
                break
            last[(m.topic, m.queue_id)] = m.queue_offset
        rebuild = end
        for key, qo in last.items():
            cq = self._store._queues.get(key)
            if cq is not None and cq.max_offset <= qo:
                u = cq._unit(cq.max_offset - 1) if cq.max_offset > cq.min_offset else None
                frm = u[0] + u[1] if u is not None else self._store._cl.min_offset
                log.warning("recovery: queue %s/%d ends at queue offset %d but the commit log holds its "
                            "offset %d (torn queue file); it is rebuilt from commit-log offset %d", key[0],
                            key[1], cq.max_offset, qo, frm)
                rebuild = min(rebuild, frm)
        return rebuild

    def scan_end(self, start: int, check_crc: bool) -> int:
        """Walk valid records from ``start`` (a record boundary); return the offset where they stop."""
        cl = self._store._cl
        off = start
        holes: dict[int, int] = {}
        while True:
            seg = cl.segment_for(off)
            if seg is None:
                return off
            r = off - seg.start
            hole = holes.get(seg.start)
            if hole is None:
                hole = holes[seg.start] = first_hole(seg.fd, seg.file_size)
            if hole < seg.file_size:  # never read a hole through the mapping (a full tmpfs: SIGBUS)
                if r + 8 > hole:
                    return off  # nothing was ever written here
                total, magic = BLANK_HEAD.unpack_from(seg.mm, r)
                if magic != BLANK_MAGIC and total > hole - r:
                    log.warning("recovery: torn record at commit-log offset %d (size %d, the file's data "
                                "ends %d bytes on); the log is truncated there", off, total, hole - r)
                    return off
            n = check_record(seg.mm, r, seg.start, seg.file_size, check_crc)
            if n > 0:
                off += n
            elif n == -1:
                off = seg.end
            else:
                if n == -2:
                    log.warning("recovery: invalid or torn record at commit-log offset %d; the log is "
                                "truncated there", off)
                return off

    def tail_boundary(self, end: int) -> int:
        """A record boundary at most VERIFY_TAIL bytes before ``end`` (a clean-shutdown end): the first
        segment's start when the log is shorter, else the nearest queue entry at or after
        ``end - VERIFY_TAIL`` that points at a whole record of its queue, else the start of the
        segment holding ``end - VERIFY_TAIL``."""
        cl = self._store._cl
        floor = max(end - VERIFY_TAIL, cl.segments[0].start)
        seg = cl.segment_for(floor)
        if seg is None:  # the files end before it: verify the last one
            return cl.segments[-1].start
        if floor == seg.start:
            return floor
        best = end
        for cq in self._store._queues.values():
            lo = cq.first_at_or_after(floor)
            u = cq._unit(lo) if lo < cq.max_offset else None
            if u is None or not floor <= u[0] < best:
                continue
            m = self.record_of(u[0], end)
            if m is not None and (m.topic, m.queue_id, m.queue_offset) == (cq.topic, cq.queue_id, lo):
                best = u[0]
        return best if best < end else seg.start

    def truncate_log(self, end: int) -> None:
        store = self._store
        cl = store._cl
        keep = []
        for seg in cl.segments:
            if seg.start > end or (seg.start == end and seg is not cl.segments[0]):
                log.warning("recovery: removing commit-log segment %s past the recovered end %d (%d bytes "
                            "of data dropped)", seg.path, end, _data_extent(seg, 0))
                seg.destroy()
                continue
            keep.append(seg)
        cl.segments = keep
        for seg in keep:
            seg.written = seg.flushed = seg.file_size
        cl.wrote = end
        if keep:
            last = keep[-1]
            r = end - last.start
            if r < last.file_size:
                dropped = _data_extent(last, r)
                if dropped:
                    log.warning("recovery: commit log cut at offset %d (segment %s, position %d): %d bytes "
                                "of torn or invalid data after it dropped", end, last.path, r, dropped)
                last.zero_tail(r)
                last.written = last.flushed = r
            store._cur_seg = last
        else:
            store._cur_seg = None

    def record_of(self, phys: int, end: int) -> MessageExt | None:
        """The whole, well-formed record starting at ``phys`` below ``end`` (body CRC not checked), or
        None."""
        cl = self._store._cl
        seg = cl.segment_for(phys) if 0 <= phys < end else None
        if seg is None:
            return None
        r = phys - seg.start
        n = check_record(seg.mm, r, seg.start, seg.file_size, False)
        if n <= 0 or phys + n > end:
            return None
        try:
            return decode_record(seg.mm[r : r + n])
        except MessageFormatError:
            return None

    def check_queues(self, end: int) -> int:
        """Cut the entries at each queue's end that do not point at their own record below ``end``: a torn
        queue file, or records lost with the log's tail. Returns the commit-log offset from which the
        queues must be rebuilt (``end`` when no queue lost an entry whose record is still there)."""
        rebuild = end
        levels = self._store._delay_levels
        for (topic, qid), cq in sorted(self._store._queues.items()):
            k = cq.max_offset
            good = None
            units = []
            while k > cq.min_offset:
                u = cq._unit(k - 1)
                if u is None:
                    break
                phys, size, tags_code = u
                m = self.record_of(phys, end) if size > 0 else None
                if m is not None:  # the entry is good when it is the one its record's dispatch writes
                    req = request_of(phys, m, levels)
                    if (req.size, req.topic, req.queue_id, req.queue_offset, req.tags_code) == (
                            size, topic, qid, k - 1, tags_code):
                        good = u
                        break
                units.append(u)
                k -= 1
            if not units:
                continue
            with cq.lock:
                cq.truncate_from(k)
            units.reverse()
            good_end = good[0] + good[1] if good is not None else self._store._cl.min_offset
            if _lost_past(units, good_end, end):
                log.warning("recovery: queue %s/%d had %d entries (queue offsets %d..%d) at or past the "
                            "recovered end %d of the commit log: their records are lost; dropped", topic, qid,
                            len(units), k, k + len(units) - 1, end)
                continue
            log.warning("recovery: queue %s/%d (%s): %d entries from queue offset %d on do not point at "
                        "their records (torn queue file); dropped, the queue is rebuilt from commit-log "
                        "offset %d",
                        topic, qid, cq.dir, len(units), k, good_end)
            rebuild = min(rebuild, good_end)
        return rebuild

    def check_index(self, end: int) -> int:
        """Cut the entries at the end of the newest index file that do not name a key of a record below
        ``end`` (torn file), rebuild its slot table from the entries kept. Returns the commit-log offset
        from which the index must be filled again (``end`` when nothing was cut)."""
        index = self._store._index
        if not index.files:
            return end
        f = index.files[-1]
        n = f.count if f.header_intact else 1
        k = n - 1
        m = None
        while k >= 1:
            h, phys, tdiff, prev = ENTRY.unpack_from(f.mm, f.entries_at + k * ENTRY_SIZE)
            m = self.record_of(phys, end) if 0 <= prev < k else None
            if m is not None and tdiff == min(max((m.store_timestamp - f.begin_ts) // 1000, 0), 0x7FFFFFFF) \
                    and h in {key_hash(f"{m.topic}#{w}") for w in (m.uniq_key, *m.keys) if w}:
                break
            k -= 1
        if f.header_intact and k == n - 1:
            return end
        if k >= 1 and m is not None:
            frm = m.commit_log_offset
        elif f.header_intact and f.begin_phy >= 0:
            frm = f.begin_phy
        else:
            frm = index.files[-2].end_phy if len(index.files) > 1 else self._store._cl.min_offset
        frm = max(min(frm, end), self._store._cl.min_offset)
        if f.header_intact:
            log.warning("recovery: index file %s: %d entries at its end are torn or name no record; "
                        "dropped, the index is filled again from commit-log offset %d", f.mf.path,
                        f.count - 1 - k, frm)
        else:
            log.warning("recovery: index file %s: its header is torn (or it never took an entry); its "
                        "entries are dropped, the index is filled again from commit-log offset %d", f.mf.path,
                        frm)
        f.truncate_entries(k, m.store_timestamp if m is not None else 0)
        return frm

    def load_queues(self) -> None:
        store = self._store
        cq_root = store._cq_root
        if not os.path.isdir(cq_root):
            return
        for topic in os.listdir(cq_root):
            tdir = os.path.join(cq_root, topic)
            if not os.path.isdir(tdir) or validate_topic(topic) is not None:
                continue
            for q in os.listdir(tdir):
                if not q.isdigit():
                    continue
                cq = ConsumeQueue(cq_root, topic, int(q), store.config.mappedFileSizeConsumeQueue)
                cq.load()
                if not cq.files:
                    shutil.rmtree(os.path.join(tdir, q), ignore_errors=True)
                    continue
                store._queues[(topic, int(q))] = cq

    def finish_recovery(self, dispatch_from: int, end: int) -> None:
        """Cut queue entries at or beyond ``dispatch_from``, then rebuild them from the log up to ``end``,
        checking each record's queue offset against its queue (a mismatch ends the log there)."""
        store = self._store
        cl = store._cl
        queues = store._queues
        for cq in queues.values():
            cq.truncate_from_phys(dispatch_from)
            cq.clean_below(cl.min_offset)
        qt = {k: cq.max_offset for k, cq in queues.items()}
        levels = store._delay_levels
        dispatch = store._reput.dispatch
        batch: list[DispatchRequest] = []
        last_ts = 0
        off = dispatch_from
        for off, data in cl.iter_records(dispatch_from):
            if off >= end:
                break
            try:
                m = decode_record(data)
            except MessageFormatError:
                end = off
                break
            key = (m.topic, m.queue_id)
            expect = qt.get(key)
            if expect is None:  # a queue with no files (qt has every queue that has them, and each new one)
                if m.queue_offset > 0 and dispatch_from > cl.min_offset:
                    # Queue files lost (its earlier entries are not in any file): rebuild every queue
                    # from the oldest commit-log offset instead of only the tail.
                    log.warning("recovery: queue %s/%d has no files but the log has its offset %d; "
                                "rebuilding all queues from the start of the log", m.topic, m.queue_id,
                                m.queue_offset)
                    self.finish_recovery(cl.min_offset, end)
                    return
                expect = m.queue_offset  # the queue starts here (its older data was cleaned)
            if m.queue_offset > expect and (queue := queues.get(key)) is not None:
                u = queue._unit(queue.max_offset - 1) if queue.max_offset > queue.min_offset else None
                frm = max(u[0] + u[1] if u is not None else cl.min_offset, cl.min_offset)
                if frm < dispatch_from:
                    # the queue lost entries below where the rebuild started (a torn queue file)
                    log.warning("recovery: queue %s/%d ends at queue offset %d but the record at %d has "
                                "offset %d (torn queue file); rebuilding the queues from commit-log offset "
                                "%d", m.topic, m.queue_id, expect, off, m.queue_offset, frm)
                    self.finish_recovery(frm, end)
                    return
            if m.queue_offset != expect:
                log.warning("recovery: record at %d has queue offset %d, expected %d; the log is truncated "
                            "there", off, m.queue_offset, expect)
                end = off
                break
            qt[key] = expect + 1
            batch.append(request_of(off, m, levels))
            last_ts = max(last_ts, m.store_timestamp)
            if len(batch) >= 4096:
                dispatch(batch)
                batch = []
        if batch:
            dispatch(batch)
        self._settle(end, qt, last_ts)

    def _settle(self, end: int, qt: dict[tuple[str, int], int], last_ts: int) -> None:
        """After the rebuild: cut the log at ``end`` if the rebuild ended it early, set the put side's
        state and the dispatched and flushed offsets, flush everything and write the checkpoint."""
        store = self._store
        cl = store._cl
        if end < cl.wrote:
            self.truncate_log(end)
            for cq in store._queues.values():
                cq.truncate_from_phys(end)
            qt = {k: cq.max_offset for k, cq in store._queues.items()}
        store._queue_table = qt
        store._reput.dispatched = cl.wrote
        store._flusher.flushed = cl.wrote
        if last_ts == 0 and cl.wrote > cl.min_offset:
            last_ts = self.last_store_time()
        if last_ts > store.clock.now_ms() + 86_400_000:
            log.warning("recovery: the newest store time is more than a day ahead of the clock; ignoring it")
            last_ts = 0
        store._last_ts = last_ts
        for seg in cl.segments:
            seg.flush()
        with store._queues_lock:
            for cq in store._queues.values():
                cq.dirty = True
                cq.flush()
        store._index.flush()
        try:
            Checkpoint(cl.wrote, cl.wrote, 0, store.clock.now_ms()).save(store._checkpoint_path)
        except OSError as e:  # a full disk: start anyway; the abort file stays, so the next start verifies
            log.warning("recovery: cannot write the checkpoint (%s); the next start verifies the log as "
                        "after a crash", e)

    def last_store_time(self) -> int:
        store = self._store
        best = 0
        for cq in store._queues.values():
            if cq.max_offset > cq.min_offset:
                u = cq.units(cq.max_offset - 1, 1)
                if u:
                    t = store._store_time_of(u[0][0])
                    if t is not None:
                        best = max(best, t)
        return best


def _data_extent(seg: MappedFile, pos: int, chunk: int = 1 << 20) -> int:
    """How many bytes from ``pos`` on hold data: up to the last non-zero byte before the first chunk
    that is all zeros (a segment's unwritten end). Read with pread: a hole read through the mapping
    faults on a full tmpfs."""
    end = pos
    off = pos
    size = seg.file_size
    while off < size:
        block = os.pread(seg.fd, min(size, off + chunk) - off, off)
        data = len(block.rstrip(b"\0"))
        if data == 0:
            break
        end = off + data
        off += len(block)
    return end - pos


def _lost_past(units: list[tuple[int, int, int]], after: int, end: int) -> bool:
    """The cut ``units`` are entries of records written after ``after`` and lost with the log's tail past
    ``end`` (in order, not overlapping, plausible sizes), not garbage from a torn queue file."""
    prev = after
    for phys, size, _ in units:
        if phys < max(prev, end) or not 0 < size <= 1 << 26:
            return False
        prev = phys + size
    return True
