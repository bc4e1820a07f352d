"""Finding and listing pending messages for TimerStore (``Queries``, which the store holds and delegates
to): reading a record (with the unapplied delivery marks over it), finding records by id or key, the
paged query (by key through the hash index, else by time through the wheel) and counts. Rules:
read-only; under the store's lock; a page examines at most ``max_query_scan`` entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from chronomq.message import MessageExt, MessageFormatError, decode_offset_msg_id, decode_record

from .records import (
    DATA_HDR_SIZE,
    DATA_MAGIC,
    PENDING,
    TIMER_OFFSET_FLAG,
    TimerHeader,
    _pos_of,
    unpack_header,
)
from .types import PendingInfo, QueryPage, TimerError
from .window import _Slot

if TYPE_CHECKING:
    from .store import TimerStore

# what a query keeps: called with a pending record's header and message
Keep = Callable[[TimerHeader, MessageExt], bool]


class Queries:
    def __init__(self, store: TimerStore) -> None:
        self.store = store

    def read_record(self, pos: int) -> tuple[TimerHeader, bytes] | None:
        """The header (with its unapplied delivery mark) and the bytes of the record at ``pos``, or None
        when there is no whole record there."""
        s = self.store
        if s.data.in_hole(pos):
            return None  # reclaimed by retention, as if its segment were deleted
        hdr = s.data.read(pos, DATA_HDR_SIZE)
        if len(hdr) < DATA_HDR_SIZE:
            return None
        h = unpack_header(hdr)
        if h.magic != DATA_MAGIC or h.size < DATA_HDR_SIZE:
            return None
        raw = s.data.read(pos, h.size)
        if len(raw) < h.size:
            return None
        return s._overlay(pos, h), raw

    def find(self, ident: str, by_key: bool) -> list[tuple[int, TimerHeader, MessageExt]]:
        """Records named by ``ident``: a key (by_key), or an id that is a UNIQ_KEY or one of this
        store's own handles (offset_msg_id). A UNIQ_KEY has the same 32-hex shape as a handle, so the
        id is read as a handle only when its host part is this broker's, and the key index (verified
        against the record's UNIQ_KEY) is consulted in every case."""
        s = self.store
        found: dict[int, bool] = {}  # position -> needs verification against the record
        if not by_key and len(ident) == 32 and s.offset_id_prefix() == ident[:16].upper():
            try:
                _, off = decode_offset_msg_id(ident)
            except ValueError:
                off = -1
            if off >= 0 and off & TIMER_OFFSET_FLAG:
                found[off & ~TIMER_OFFSET_FLAG] = False  # a handle names the record itself
        for pos in s.hash.lookup(("k:" if by_key else "u:") + ident):
            found.setdefault(pos, True)
        out = []
        for pos in sorted(found):
            if pos < s.data.min_pos or pos >= s.data_end:
                continue
            r = self.read_record(pos)
            if r is None:
                continue
            h, raw = r
            try:
                msg = decode_record(raw, DATA_HDR_SIZE, read_body=False)
            except MessageFormatError:
                continue
            if found[pos] and (ident not in msg.keys if by_key else msg.uniq_key != ident):
                continue
            out.append((pos, h, msg))
        return out

    def records_of(self, uniq_key: str) -> list[PendingInfo]:
        """Every record of this store whose UNIQ_KEY is ``uniq_key``, whatever its state (pending,
        delivered, cancelled), oldest first."""
        s = self.store
        with s.lock:
            s._require_open()
            return [self._info(pos, h, m) for pos, h, m in self.find(uniq_key, False)
                    if m.uniq_key == uniq_key]

    def _info(self, pos: int, h: TimerHeader, m: MessageExt) -> PendingInfo:
        return PendingInfo(msg_id=m.uniq_key or "", offset_msg_id=self.store.offset_msg_id(pos),
                           topic=m.topic, queue_id=m.queue_id, tags=m.tags, keys=m.keys,
                           deliver_ms=h.deliver_ms, created_ms=h.created_ms, body_size=len(m.body))

    def query(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None, limit: int = 100,
              cursor: str | None = None) -> QueryPage:
        """Pending messages ordered by deliver time, filtered, one page at a time. ``key`` matches a
        KEYS word or the UNIQ_KEY. A page examines at most max_query_scan entries; ``next_cursor`` is
        set whenever there may be more (pages can be short or empty then)."""
        if limit <= 0:
            raise TimerError("limit must be positive")
        s = self.store
        with s.lock:
            s._require_open()

            def keep(h: TimerHeader, m: MessageExt) -> bool:
                return ((topic is None or m.topic == topic) and (tag is None or m.tags == tag)
                        and (start_ms is None or h.deliver_ms >= start_ms)
                        and (end_ms is None or h.deliver_ms <= end_ms))

            if key is not None:
                return self._query_key(key, keep, limit, cursor)
            return self._query_time(keep, start_ms, end_ms, limit, cursor)

    def _query_key(self, key: str, keep: Keep, limit: int, cursor: str | None) -> QueryPage:
        seen: dict[int, tuple[TimerHeader, MessageExt]] = {}
        for pos, h, m in self.find(key, True) + self.find(key, False):
            if h.state == PENDING and keep(h, m):
                seen[pos] = (h, m)
        rows = sorted(seen.items(), key=lambda kv: (kv[1][0].deliver_ms, kv[0]))
        after = None
        if cursor:
            try:
                a, b = cursor.lstrip("k").split(":")
                after = (int(a), int(b))
            except ValueError:
                raise TimerError(f"bad query cursor {cursor!r}") from None
        page = QueryPage(scanned=len(rows))
        for pos, (h, m) in rows:
            if after is not None and (h.deliver_ms, pos) <= after:
                continue
            if len(page.items) == limit:
                last = page.items[-1]
                page.next_cursor = f"k{last.deliver_ms}:{_pos_of(last.offset_msg_id)}"
                break
            page.items.append(self._info(pos, h, m))
        return page

    def _query_time(self, keep: Keep, start_ms: int | None, end_ms: int | None, limit: int,
                    cursor: str | None) -> QueryPage:
        st = self.store
        floor = st._floor_slot()
        s_from = max(st.watermark + 1, (start_ms // st.slot_ms) if start_ms is not None else 0)
        after_slot, after = -1, (-1, -1)
        if cursor:
            try:
                a, b, c = cursor.lstrip("s").split(":")
                after_slot, after = int(a), (int(b), int(c))
            except ValueError:
                raise TimerError(f"bad query cursor {cursor!r}") from None
            s_from = max(s_from, after_slot)
        end_slot = None if end_ms is None else max(end_ms // st.slot_ms, floor)
        page = QueryPage()
        while True:
            s = st.wheel.next_nonempty(s_from)
            if s is None or (end_slot is not None and s > end_slot):
                return page
            w = _Slot(s)
            w.start(st.wheel.get(s))
            while not w.ready:
                w.step(st.index, 1 << 30)
            last = (-1, -1)
            for k in range(len(w.d)):
                d, idx = w.d[k], w.i[k]
                if s == after_slot and (d, idx) <= after:
                    continue
                if len(page.items) == limit or page.scanned >= st.cfg.max_query_scan:
                    page.next_cursor = f"s{s}:{last[0]}:{last[1]}"
                    return page
                page.scanned += 1
                last = (d, idx)
                pos, gen = w.p[k], w.g[k]
                r = self.read_record(pos) if pos >= st.data.min_pos else None
                if r is None:
                    continue
                h, raw = r
                if h.gen != gen or h.state != PENDING:
                    continue
                try:
                    m = decode_record(raw, DATA_HDR_SIZE)
                except MessageFormatError:
                    continue
                if keep(h, m):
                    page.items.append(self._info(pos, h, m))
            s_from = s + 1

    def count(self, topic: str | None = None, key: str | None = None, tag: str | None = None,
              start_ms: int | None = None, end_ms: int | None = None) -> int:
        """Number of pending messages matching; by topic alone (or nothing) from counters, else a scan."""
        s = self.store
        if key is None and tag is None and start_ms is None and end_ms is None:
            with s.lock:
                if topic is None:
                    return max(0, sum(s.pending.values()))
                tid = s.topics.get(topic)
                return max(0, s.pending.get(tid, 0)) if tid else 0
        total = 0
        cursor = None
        while True:
            page = self.query(topic, key, tag, start_ms, end_ms, limit=10_000, cursor=cursor)
            total += len(page.items)
            if page.next_cursor is None:
                return total
            cursor = page.next_cursor
