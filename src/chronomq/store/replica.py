"""The slave's side of the store: commit-log bytes received from the master are written at the same
offsets, and each record, once whole, is dispatched to consume queues and index like a put.

Rules: bytes arrive in order (an offset other than the write position is refused, except that an empty
store may start at a segment boundary: a master whose oldest segments were cleaned); a chunk may end
inside a record, which is dispatched when its rest arrives; segment boundaries are the master's, so both
must use the same ``mappedFileSizeCommitLog`` (a record that would cross one is refused as corrupt).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from chronomq.message import (
    BLANK_MAGIC,
    MAGIC_V1,
    MessageFormatError,
    decode_record,
)
from chronomq.store.commitlog import BLANK_HEAD, check_record
from chronomq.store.reput import request_of

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")


class ReplicaError(Exception):
    """The bytes cannot be appended: wrong offset, corrupt record, or the store is not running."""


class ReplicaAppend:
    def __init__(self, store: MessageStore) -> None:
        self._store = store
        self.parsed = -1  # the offset up to which whole records have been dispatched (-1: not started)

    def append(self, offset: int, data: bytes | memoryview) -> int:
        """Write ``data`` at ``offset`` (which must be the write position), dispatch the records it
        completes, and return the new write position. Raises ReplicaError."""
        store = self._store
        cl = store._cl
        if not store._running:
            raise ReplicaError("the message store is not running")
        view = memoryview(data)
        with cl.lock:
            if offset != cl.wrote:
                if cl.wrote != 0 or cl.segments or offset % store._seg_size:
                    raise ReplicaError(f"offset {offset} is not this store's write position {cl.wrote}")
                # an empty store copying a master whose oldest segments were cleaned starts where the
                # master's log starts
                log.info("replica: this empty commit log starts at the master's offset %d", offset)
                cl.wrote = offset
                self.parsed = offset
            if self.parsed < 0:
                self.parsed = cl.wrote
            pos = offset
            while view:
                seg = cl.segment_for(pos)
                if seg is None:
                    if cl.segments and pos != cl.segments[-1].end:
                        raise ReplicaError(f"offset {pos} is not the start of the next segment")
                    if pos % store._seg_size:
                        raise ReplicaError(f"offset {pos} is inside a segment this store does not have")
                    seg = cl.new_segment(pos)
                r = pos - seg.start
                n = min(len(view), seg.file_size - r)
                if r + n > seg.allocated:
                    try:
                        seg.allocate(r + n)
                    except OSError as e:
                        raise ReplicaError(f"cannot allocate commit-log space: {e}") from e
                seg.mm[r : r + n] = view[:n]
                seg.written = r + n
                pos += n
                view = view[n:]
            cl.wrote = pos
            store._cur_seg = cl.segment_for(pos - 1) if pos > 0 else None
            self._parse_locked(pos)
        store._signal_dispatch()
        return pos

    def end(self) -> int:
        """Stop being a replica (a promotion): the bytes of a record whose rest never arrived are zeroed
        and the write position moves back to the end of the last whole record, so puts follow it.
        Returns how many bytes were dropped."""
        store = self._store
        cl = store._cl
        with cl.lock:
            keep = self.parsed
            if keep < 0 or keep >= cl.wrote:
                self.parsed = -1
                return 0
            dropped = cl.wrote - keep
            pos = keep
            while pos < cl.wrote:
                seg = cl.segment_for(pos)
                if seg is None:
                    break
                r = pos - seg.start
                n = min(cl.wrote, seg.end) - pos
                seg.mm[r : r + n] = bytes(n)
                seg.written = min(seg.written, r)
                pos += n
            cl.wrote = keep
            # the segment that now ends at ``keep``: one emptied by the drop if the torn record began it
            store._cur_seg = cl.segment_for(keep) or (cl.segment_for(keep - 1) if keep > 0 else None)
            self.parsed = -1
        log.warning("replication ended: %d bytes of a record that never arrived whole were dropped at %d",
                    dropped, keep)
        return dropped

    def chunk(self, offset: int, max_bytes: int) -> bytes:
        """The master's side: up to ``max_bytes`` of the commit log from ``offset``, never past the write
        position or the end of its segment; b"" when there is nothing new. Raises ReplicaError when the
        offset is outside the log (cleaned, or ahead of it)."""
        cl = self._store._cl
        wrote = cl.wrote
        if offset > wrote:
            raise ReplicaError(f"offset {offset} is ahead of this log's end {wrote}")
        if offset == wrote:
            return b""
        seg = cl.segment_for(offset)
        if seg is None:
            raise ReplicaError(f"offset {offset} is below this log's oldest offset {cl.min_offset}")
        r = offset - seg.start
        end = min(seg.file_size, r + max_bytes, wrote - seg.start)
        try:
            return seg.mm[r:end]
        except ValueError as e:  # the segment was cleaned meanwhile
            raise ReplicaError(f"offset {offset} was cleaned meanwhile") from e

    def _parse_locked(self, end: int) -> None:
        """Dispatch requests for every whole record in [parsed, end); under the commit-log lock."""
        store = self._store
        cl = store._cl
        qt = store._queue_table
        levels = store._delay_levels
        off = self.parsed
        while off < end:
            seg = cl.segment_for(off)
            if seg is None:
                break
            r = off - seg.start
            if r + 8 > seg.file_size:
                off = seg.end  # the tail of a segment too short for a blank header
                continue
            if off + 8 > end:
                break  # the header has not arrived yet
            total, magic = BLANK_HEAD.unpack_from(seg.mm, r)
            if magic == BLANK_MAGIC:
                if total != seg.file_size - r:
                    raise ReplicaError(f"blank filler at {off} does not end its segment: different "
                                       "mappedFileSizeCommitLog on master and slave?")
                off = seg.end
                continue
            if magic != MAGIC_V1 or total <= 0:
                raise ReplicaError(f"no record at commit-log offset {off}")
            if off + total > end:
                break  # the rest of this record comes with the next chunk
            if check_record(seg.mm, r, seg.start, seg.file_size, True) != total:
                raise ReplicaError(f"corrupt record at commit-log offset {off}")
            try:
                m = decode_record(seg.mm[r : r + total])
            except MessageFormatError as e:
                raise ReplicaError(f"undecodable record at commit-log offset {off}: {e}") from e
            req = request_of(off, m, levels)
            qt[(m.topic, m.queue_id)] = m.queue_offset + 1
            if m.store_timestamp > store._last_ts:
                store._last_ts = m.store_timestamp
            store._pending.append(req)
            off += total
        self.parsed = off
