"""The read path of MessageStore (a base class of it, sharing its state): get_message for pulls,
records and messages by commit-log offset, queue offsets (by time too), key queries, the store's
extent. Rules: reads take no commit-log lock; data below the commit log's min offset (cleaned) is
never returned; a record that does not decode is treated as absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from chronomq.message import MessageExt, MessageFormatError, decode_record
from chronomq.store.consumequeue import UNIT
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import CQUnit, GetResult, GetStatus

if TYPE_CHECKING:
    from chronomq.store.commitlog import CommitLog
    from chronomq.store.consumequeue import ConsumeQueue
    from chronomq.store.flush import FlushCommitLogService, FlushTimes
    from chronomq.store.index import IndexService
    from chronomq.store.reput import ReputMessageService

DEFAULT_MAX_BYTES = 256 * 1024


def _units_in_steps(cq: ConsumeQueue, offset: int, first: int, limit: int) -> Iterator[tuple[int, int, int]]:
    """The queue entries from ``offset``, ``limit`` at most, read ``first`` then 4 times more each step."""
    got, step = 0, first
    while got < limit:
        chunk = cq.units(offset + got, min(step, limit - got))
        if not chunk:
            return
        yield from chunk
        got += len(chunk)
        step *= 4


@pure_twin("read_units")
def read_units_py(units: bytes, cl: CommitLog, min_phys: int, max_msgs: int, max_bytes: int
                  ) -> tuple[list[bytes], int, int]:
    """The records that the packed queue ``units`` point at in ``cl``, as a pull without filters reads
    them: up to ``max_msgs``, and past ``max_bytes`` only for the first; an empty unit is passed over, one
    below ``min_phys`` or no longer readable counted as removed. Returns the records, how many units were
    used and how many of those were removed."""
    out: list[bytes] = []
    nbytes = used = removed = 0
    for phys, size, _tags_code in UNIT.iter_unpack(units):
        if size > 0 and phys >= min_phys:
            if out and nbytes + size > max_bytes:
                break
            data = cl.read(phys, size)
            if data is not None:
                out.append(data)
                nbytes += size
                used += 1
                if len(out) >= max_msgs:
                    break
                continue
        if size > 0:
            removed += 1
        used += 1
    return out, used, removed


# the compiled kernel when built (chronomq.store.speedups chooses); read_units_py is its twin
read_units = kernels.read_units


def _get_result(out: list[bytes], next_off: int, lo: int, hi: int, removed: int, filtered: int) -> GetResult:
    if out:
        status = GetStatus.FOUND
    elif removed and not filtered:
        status = GetStatus.MESSAGE_WAS_REMOVING
    elif filtered:
        status = GetStatus.NO_MATCHED_MESSAGE
    else:
        status = GetStatus.OFFSET_FOUND_NULL
    return GetResult(status, next_off, lo, hi, out)


class ReadPath:
    _cl: CommitLog
    _queues: dict[tuple[str, int], ConsumeQueue]
    _index: IndexService
    _reput: ReputMessageService
    _flusher: FlushCommitLogService

    def get_message(self, topic: str, queue_id: int, offset: int, max_msgs: int,
                    max_bytes: int = DEFAULT_MAX_BYTES, tag_filter: Callable[[int], bool] | None = None,
                    record_filter: Callable[[bytes], bool] | None = None) -> GetResult:
        """Up to ``max_msgs`` records from ``offset``. ``tag_filter`` sees each queue entry's tags code,
        ``record_filter`` each record read (RocketMQ's isMatchedByConsumeQueue / isMatchedByCommitLog);
        what either refuses is skipped and counted in ``next_begin_offset``, as RocketMQ's getMessage."""
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
        lo, hi = cq.min_offset, cq.max_offset
        if hi == 0:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
        if offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        if offset == hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, offset, lo, hi)
        if offset > hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, 0 if lo == 0 else hi, lo, hi)
        max_msgs = max(1, max_msgs)
        cl = self._cl
        min_phys = cl.min_offset
        if tag_filter is None and record_filter is None:  # a pull of everything: one compiled pass
            units = cq.raw_units(offset, max_msgs)
            records, used, gone = read_units(units, cl, min_phys, max_msgs, max_bytes)
            return _get_result(records, offset + used, lo, hi, gone, 0)
        unpacked: Iterator[tuple[int, int, int]] | list[tuple[int, int, int]]
        if record_filter is None:
            unpacked = cq.units(offset, max(max_msgs, 800))
        else:  # most records may match: read the queue entries in growing steps, not 800 at once
            unpacked = _units_in_steps(cq, offset, 2 * max_msgs, max(max_msgs, 800))
        out: list[bytes] = []
        nbytes = 0
        next_off = offset
        removed = filtered = 0
        for phys, size, tags_code in unpacked:
            if size <= 0:
                next_off += 1
                continue
            if phys < min_phys:
                removed += 1
                next_off += 1
                continue
            if tag_filter is not None and not tag_filter(tags_code):
                filtered += 1
                next_off += 1
                continue
            if out and nbytes + size > max_bytes:
                break
            data = cl.read(phys, size)
            if data is None:
                removed += 1
                next_off += 1
                continue
            if record_filter is not None and not record_filter(data):
                filtered += 1
                next_off += 1
                continue
            out.append(data)
            nbytes += size
            next_off += 1
            if len(out) >= max_msgs:
                break
        return _get_result(out, next_off, lo, hi, removed, filtered)

    def read_record(self, commit_log_offset: int) -> bytes | None:
        if commit_log_offset < self._cl.min_offset:
            return None
        return self._cl.record_at(commit_log_offset)

    def look_message_by_offset(self, commit_log_offset: int) -> MessageExt | None:
        data = self.read_record(commit_log_offset)
        if data is None:
            return None
        try:
            return decode_record(data)
        except MessageFormatError:
            return None

    def get_cq_units(self, topic: str, queue_id: int, offset: int, max_count: int) -> list[CQUnit]:
        cq = self._queues.get((topic, queue_id))
        if cq is None or max_count <= 0:
            return []
        return cq.cq_units(offset, max_count)

    def get_max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        return cq.max_offset if cq is not None else 0

    def get_min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        return cq.min_offset if cq is not None else 0

    def get_offset_in_queue_by_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return 0
        return cq.offset_by_time(timestamp_ms, self._store_time_of)

    def _store_time_of(self, phys: int) -> int | None:
        if phys < self._cl.min_offset:
            return None
        return self._cl.store_time_at(phys)

    def get_earliest_message_time(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return -1
        for phys, size, _ in cq.units(cq.min_offset, 16):
            if size > 0:
                t = self._store_time_of(phys)
                if t is not None:
                    return t
        return -1

    def query_message(self, topic: str, key: str, max_num: int, begin_ts: int, end_ts: int
                      ) -> list[MessageExt]:
        """Messages of ``topic`` whose KEYS contain ``key`` or whose UNIQ_KEY is ``key``, stored within
        [begin_ts, end_ts]; at most ``max_num``, the newest ones, returned in commit-log order."""
        return self.query_messages(topic, (key,), max_num, begin_ts, end_ts).get(key, [])

    def query_messages(self, topic: str, keys: Iterable[str], max_num: int, begin_ts: int, end_ts: int
                       ) -> dict[str, list[MessageExt]]:
        """``query_message`` for several keys of one topic (the dispatcher's pending index entries written
        once for all): key -> its messages, for the keys that have any."""
        if max_num <= 0:
            return {}
        self._reput.index_pending()  # a key query sees every message dispatched before it
        found = self._index.query_many(topic, [k for k in keys if k], max_num * 2 + 16, begin_ts, end_ts)
        result: dict[str, list[MessageExt]] = {}
        for key, cands in found.items():
            out: dict[int, MessageExt] = {}
            for phys in sorted(set(cands), reverse=True):
                if len(out) >= max_num:
                    break
                m = self.look_message_by_offset(phys)
                if m is None or m.topic != topic or not (begin_ts <= m.store_timestamp <= end_ts):
                    continue
                if m.uniq_key == key or key in m.keys:
                    out[phys] = m
            if out:
                result[key] = [out[p] for p in sorted(out)]
        return result

    def iter_messages(self, from_commit_log_offset: int) -> Iterator[MessageExt]:
        for _, data in self._cl.iter_records(from_commit_log_offset):
            try:
                yield decode_record(data)
            except MessageFormatError:
                return

    @property
    def max_phy_offset(self) -> int:
        return self._cl.wrote

    @property
    def min_phy_offset(self) -> int:
        return self._cl.min_offset

    @property
    def dispatched_offset(self) -> int:
        return self._reput.dispatched

    @property
    def flushed_offset(self) -> int:
        """The commit-log offset known durable (fsynced)."""
        return self._flusher.flushed

    @property
    def flush_times(self) -> FlushTimes:
        return self._flusher.times

    def topics(self) -> list[str]:
        return sorted({t for t, _ in list(self._queues)})

    def queue_ids(self, topic: str) -> list[int]:
        return sorted(q for t, q in list(self._queues) if t == topic)
