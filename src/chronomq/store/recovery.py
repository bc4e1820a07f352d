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

from chronomq.message import MessageFormatError, decode_record, validate_topic
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.commitlog import check_record
from chronomq.store.consumequeue import ConsumeQueue
from chronomq.store.reput import request_of

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")


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
        if any(seg.was_short for seg in cl.segments):
            log.warning("recovery: a commit-log segment is shorter than mappedFileSizeCommitLog; verifying")
            abnormal = True
            store.recovered_abnormally = True
        if ckpt is not None and not abnormal and ckpt.commit_log_end:
            # clean shutdown: the end is known; confirm nothing valid follows it
            start = ckpt.commit_log_end
            check_crc = False
        else:
            start = ckpt.recover_from if ckpt is not None else cl.segments[0].start
            check_crc = store.config.checkCRCOnRecover
        start = max(start, cl.segments[0].start)
        seg = cl.segment_for(start)
        if seg is None:  # the checkpoint points past the files we have: verify the last one fully
            seg = cl.segments[-1]
            start = seg.start
        if abnormal or ckpt is None or not ckpt.commit_log_end:
            start = seg.start  # re-verify from the start of the segment holding the checkpoint
        end = self.scan_end(start, check_crc)
        self.truncate_log(end)
        dispatch_from = min(ckpt.recover_from if ckpt is not None else 0, end)
        dispatch_from = max(dispatch_from, cl.min_offset)
        if not abnormal and ckpt is not None and ckpt.commit_log_end and end == ckpt.commit_log_end:
            dispatch_from = min(max(ckpt.recover_from, cl.min_offset), end)
        self.finish_recovery(dispatch_from, end)

    def scan_end(self, start: int, check_crc: bool) -> int:
        """Walk valid records from ``start`` (a record boundary); return the offset where they stop."""
        cl = self._store._cl
        off = start
        while True:
            seg = cl.segment_for(off)
            if seg is None:
                return off
            r = off - seg.start
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

    def truncate_log(self, end: int) -> None:
        store = self._store
        cl = store._cl
        keep = []
        for seg in cl.segments:
            if seg.start > end or (seg.start == end and seg is not cl.segments[0]):
                log.warning("recovery: removing commit-log segment %020d past the recovered end", seg.start)
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
                last.zero_tail(r)
                last.written = last.flushed = r
            store._cur_seg = last
        else:
            store._cur_seg = None

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
        batch: list[tuple] = []
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
            if expect is None and key not in queues:
                if m.queue_offset > 0 and dispatch_from > cl.min_offset:
                    # Queue files lost (its earlier entries are not in any file): rebuild every queue
                    # from the oldest commit-log offset instead of only the tail.
                    log.warning("recovery: queue %s/%d has no files but the log has its offset %d; "
                                "rebuilding all queues from the start of the log", m.topic, m.queue_id,
                                m.queue_offset)
                    self.finish_recovery(cl.min_offset, end)
                    return
                expect = m.queue_offset  # the queue starts here (its older data was cleaned)
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
        Checkpoint(cl.wrote, cl.wrote, 0, store.clock.now_ms()).save(store._checkpoint_path)

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
