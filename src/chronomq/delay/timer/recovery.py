"""Opening and closing TimerStore (``Recovery``, which the store holds and delegates to): read the
checkpoint and topics, open the files, after a crash validate the index tail and re-link the wheel (or
rebuild it), apply the done logs and find deliveries whose mark was lost, then close cleanly or abandon
(tests). Rules: the geometry already on disk wins over the configuration; all of it runs under the
store's lock.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import struct
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from chronomq.message import PROPERTY_KEYS, PROPERTY_UNIQ_KEY, MessageFormatError
from chronomq.store.atomicfile import read_with_backup

from ..delivery import record_to_put
from .files import HashIndex, SegmentedFile, Wheel, add_key_items
from .records import (
    _DONE_ENTRY,
    _SEQ_JUMP,
    _STATE_BLOCK,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    DELIVERED,
    IDX,
    IDX_SIZE,
    OFF_STATE,
    PENDING,
    IndexEntry,
    _new,
    _pack_index,
    _unpack_index,
    unpack_header,
)

if TYPE_CHECKING:
    from .store import TimerStore

log = logging.getLogger("chronomq.delay.timer.store")
_MAGIC = struct.Struct("<i")  # a data record's first field
_POSITION = operator.itemgetter(1)  # of a (key hash, data position) item


def _index_entries(s: TimerStore, first: int, end: int, chunk: int = 1 << 13
                   ) -> Iterator[tuple[int, IndexEntry | None]]:
    """(position, entry or None when unreadable) of the index entries in [first, end), read a chunk at a
    time (one pread per chunk, never across a segment): a crash's recovery reads its tail in bulk."""
    per_seg = s.idx_seg_entries
    crc32 = zlib.crc32
    body = IDX_SIZE - 4
    idx = first
    while idx < end:
        n = min(chunk, end - idx, per_seg - idx % per_seg)
        raw = s.index.read(idx * IDX_SIZE, n * IDX_SIZE)
        whole = len(raw) // IDX_SIZE
        view = memoryview(raw)
        for k, fields in enumerate(IDX.iter_unpack(view[:whole * IDX_SIZE])):  # as _unpack_index reads one
            at = k * IDX_SIZE
            ok = crc32(view[at:at + body]) - (1 << 31) == fields[7]
            yield idx + k, _new(IndexEntry, fields[:7]) if ok else None
        for k in range(whole, n):  # past the file's end
            yield idx + k, None
        idx += n


class _DataWindow:
    """Reads of the data log through a window of WINDOW bytes read at once (never across a segment):
    recovery reads the records of a crash's tail in the order they were written, so most reads are
    served from the window."""

    WINDOW = 1 << 20

    def __init__(self, data: SegmentedFile) -> None:
        self.data = data
        self.start = 0
        self.buf = b""

    def read(self, pos: int, n: int) -> bytes | memoryview:
        off = pos - self.start
        if off < 0 or off + n > len(self.buf):
            self.start, self.buf = pos, self.data.read(pos, max(n, self.WINDOW))
            off = 0
        return memoryview(self.buf)[off:off + n]


class Recovery:
    def __init__(self, store: TimerStore) -> None:
        self.store = store

    def open(self) -> None:
        with self.store.lock:
            self._open()

    def _open(self) -> None:
        s = self.store
        cfg = s.cfg
        s.root.mkdir(parents=True, exist_ok=True)
        s.slot_ms = cfg.slot_ms
        ckpt_path = s.root / "checkpoint.json"
        abort_path = s.root / "abort"
        # A damaged checkpoint falls back to the previous one (.bak), read as after a crash; with no
        # readable copy the store refuses to open: starting fresh would cut the index to nothing.
        got = read_with_backup(ckpt_path, _checkpoint_of, strict=True)
        ckpt, from_backup = (None, False) if got is None else got
        fresh = ckpt is None
        clean = ckpt is not None and not abort_path.exists() and not from_backup
        if ckpt is None:
            ckpt = {"watermark": s.clock.now_ms() // cfg.slot_ms - 1, "index_end": 0, "data_end": 0,
                    "done_seq": 0, "pending": {}, "idx_seg_max": {}, "slot_ms": cfg.slot_ms,
                    "data_segment_bytes": cfg.data_segment_bytes,
                    "index_segment_entries": cfg.index_segment_entries}
        # Geometry of existing files wins over the configuration (it is baked into the files).
        s.data_seg = int(ckpt.get("data_segment_bytes", cfg.data_segment_bytes))
        s.idx_seg_entries = int(ckpt.get("index_segment_entries", cfg.index_segment_entries))
        old_slot_ms = int(ckpt.get("slot_ms", cfg.slot_ms))

        s.topics = {}
        got_topics = read_with_backup(s.root / "topics.json", _topics_of, strict=True)
        if got_topics is not None:
            s.topics = got_topics[0]
        s.topic_names = {v: k for k, v in s.topics.items()}
        s.data = SegmentedFile(s.root / "data", s.data_seg)
        s.index = SegmentedFile(s.root / "index", s.idx_seg_entries * IDX_SIZE)
        s.wheel = Wheel(s.root / "wheel", cfg.slot_ms)
        s.hash = HashIndex(s.root / "hash", cfg.hash_buckets, cfg.hash_generation_entries)

        s._ckpt_seq = s._ckpt_written = int(ckpt.get("seq", 0))
        s.watermark = int(ckpt["watermark"])
        if old_slot_ms != cfg.slot_ms:
            s.watermark = (s.watermark + 1) * old_slot_ms // cfg.slot_ms - 1
        s.persisted_watermark = s.watermark
        s.pending = Counter({int(k): v for k, v in ckpt.get("pending", {}).items()})
        s.idx_seg_max = {int(k): v for k, v in ckpt.get("idx_seg_max", {}).items()}
        recovered_seq = int(ckpt.get("done_seq", 0))
        s.done_seq = recovered_seq + (1 if clean else _SEQ_JUMP)
        s.persisted_done_seq = recovered_seq
        # Sequence ranges of completions that happened after a checkpoint and before a crash: their
        # records are subtracted from the pending counters when their slots are walked again. A range
        # stays open (and persisted) until the watermark passes every slot that crashed run touched.
        s.open_ranges = [list(r) for r in ckpt.get("open_ranges", [])]
        if not clean and not fresh:
            frontier = (s.clock.now_ms() + cfg.preload_ms) // cfg.slot_ms + 1
            s.open_ranges.append([recovered_seq, s.done_seq, frontier])
        s.recovered_clean = clean or fresh
        end = ckpt.get("store_end")
        s.scan_from = None if s.recovered_clean or end is None else int(end)

        ck_index_end = int(ckpt["index_end"])
        ck_data_end = int(ckpt["data_end"])
        file_idx_end = s.index.file_end() // IDX_SIZE
        if clean:
            s.index_end = ck_index_end
            s.data_end = ck_data_end
            if file_idx_end > ck_index_end or s.data.file_end() > ck_data_end:
                clean = False  # files longer than the checkpoint says: treat as a crash
        if not clean:
            tail_start = min(ck_index_end, file_idx_end)
            kept = self._recover_tail(tail_start, ck_data_end)
            self._recover_hash(ckpt, kept, ck_data_end)
        if s.wheel.cut:
            log.warning("timer: wheel files %s are not a day of slots long (torn)", ", ".join(s.wheel.cut))
        elif s.wheel.max_value() > s.index_end:
            log.warning("timer: the wheel names index entries beyond the index's end (%d)", s.index_end)
        if old_slot_ms != cfg.slot_ms or s.wheel.cut or s.wheel.max_value() > s.index_end:
            self._rebuild_wheel()

        s._reset_window()
        # what completed in each segment since retention last scanned it survives a restart (a crash
        # loses what came after the checkpoint): a store restarted before retention ran still reclaims
        s.done_since_scan = {int(k): int(v) for k, v in ckpt.get("done_since_scan", {}).items()
                             if int(k) in s.data.starts}
        # Two logs: the flush swaps them, applies the full one and empties it.
        s._done_fds = [os.open(s.root / f"done.{k}.log", os.O_RDWR | os.O_CREAT, 0o644) for k in (0, 1)]
        s._done_fd = s._done_fds[0]
        self._apply_done_log()
        s.dirty = True
        abort_path.write_bytes(b"")
        s._opened = True
        try:
            s._write_checkpoint(clean=False)
        except OSError as e:  # a full disk: open anyway; the periodic flush writes it once there is room
            log.warning("timer: cannot write the checkpoint at open (%s); the flush tries again", e)

    def _recover_tail(self, tail_start: int, ck_data_end: int) -> list[IndexEntry]:
        """After a crash: validate index entries written since the checkpoint, cut torn tails, re-link
        entries the wheel missed, recount schedules, and drop message bytes no entry names. Returns the
        entries kept from ``tail_start`` on, in order. The wheel is read and written once per slot the
        tail touches, and the counters once at the end (a crash's tail can be tens of thousands)."""
        s = self.store
        idx = tail_start
        data_end = ck_data_end
        file_end_idx = s.index.file_end() // IDX_SIZE
        data_file_end = s.data.file_end()
        data = _DataWindow(s.data)
        magic = _MAGIC.pack(DATA_MAGIC)
        kept: list[IndexEntry] = []
        keep = kept.append
        by_slot: dict[int, list[tuple[int, int]]] = {}  # slot -> (entry number, prev) in order
        for idx, e in _index_entries(s, tail_start, file_end_idx):
            if e is None:
                break
            pos, size = e.pos, e.size
            if (pos + size > data_file_end or size < DATA_HDR_SIZE or e.prev > idx
                    or data.read(pos, 4) != magic):
                break
            chain = by_slot.get(e.slot)
            if chain is None:
                by_slot[e.slot] = [(idx, e.prev)]
            else:
                chain.append((idx, e.prev))
            if pos + size > data_end:
                data_end = pos + size
            keep(e)
        else:  # every entry up to the file's end is whole (or there was none past the checkpoint)
            idx = max(tail_start, file_end_idx)
        relinked = self._relink(by_slot)
        pending = s.pending
        for e in kept:
            if e.gen == 0:
                pending[e.topic_id] += 1
        per_seg, seg_max = s.idx_seg_entries, s.idx_seg_max
        for slot, chain in by_slot.items():
            for seg in {n // per_seg for n, _prev in chain}:
                seg_max[seg] = max(seg_max.get(seg, slot), slot)
        s.index_end = idx
        s.index.truncate(idx * IDX_SIZE)
        s.data_end = data_end
        s.data.truncate(data_end)
        if relinked:
            log.info("timer recovery re-linked %d index entries", relinked)
        return kept

    def _relink(self, by_slot: dict[int, list[tuple[int, int]]]) -> int:
        """Point each slot's wheel head at its newest entry when the crash lost that move: the entries of
        a slot, in order, whose number is past the head are linked in (one read and at most one write per
        slot; a link that does not continue the head is logged). Returns how many were linked."""
        wheel = self.store.wheel
        relinked = 0
        for slot, chain in by_slot.items():
            head = first = wheel.get(slot)
            for n, prev in chain:
                if head < n + 1:
                    if head != prev:
                        log.warning("timer wheel slot %d inconsistent after crash; rebuilding", slot)
                    head = n + 1
                    relinked += 1
            if head != first:
                wheel.set(slot, head)
        return relinked

    def _recover_hash(self, ckpt: dict[str, Any], tail: list[IndexEntry], ck_data_end: int) -> None:
        """After a crash: the key hash is synced by the periodic flush, not by a SYNC_FLUSH round (as
        RocketMQ syncs its commit log but not its index file), so any of its pages written since the
        checkpoint may be lost, stale or ahead of the others. It is cut back to the extent the checkpoint
        recorded (its bucket heads recomputed if they moved on), then the keys of the records the index
        names from the checkpoint's data end on are added again, and it is synced."""
        s = self.store
        ext = ckpt.get("hash_extent")
        if isinstance(ext, list) and len(ext) == 2:
            fixed = s.hash.cut_back(int(ext[0]), int(ext[1]))
        else:  # a checkpoint from before the extent was recorded: keep the entries, recompute the heads
            fixed = s.hash.gens[-1].rebuild_buckets()
        items: list[tuple[int, int]] = []
        seen: set[int] = set()
        data = _DataWindow(s.data)
        for e in tail:  # the index entries kept past the checkpoint (_recover_tail)
            pos, size = e.pos, e.size
            if pos < ck_data_end or pos in seen:  # in the hash as the checkpoint left it
                continue
            seen.add(pos)
            try:  # checked and parsed as delivery parses it (the compiled kernel when built)
                _topic, _qid, props = record_to_put(data.read(pos, size), DATA_HDR_SIZE, size - DATA_HDR_SIZE)
            except (struct.error, IndexError, MessageFormatError):
                continue  # a damaged record is never handed out; its keys do not matter
            add_key_items(items, props.get(PROPERTY_UNIQ_KEY) or "", props.get(PROPERTY_KEYS), pos)
        items.sort(key=_POSITION)
        s.hash.add_many(items)
        s.hash.sync()
        if fixed or items:
            log.info("timer recovery: %d key hash heads recomputed, keys of %d records added", fixed,
                     len(seen))

    def _rebuild_wheel(self) -> None:
        """Rebuild every slot chain from the retained index entries (slot size changed, or damage)."""
        s = self.store
        log.warning("timer: rebuilding the time wheel from the index")
        s.wheel.clear()
        floor = s.watermark + 1
        heads: dict[int, int] = {}
        seg_max: dict[int, int] = {}
        start = s.index.min_pos // IDX_SIZE
        buf = bytearray()
        for idx in range(start, s.index_end):
            e = _unpack_index(s.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                continue
            slot = max(e.deliver_ms // s.slot_ms, floor)
            prev = heads.get(slot, 0)
            buf = bytearray(_pack_index(e.deliver_ms, e.pos, prev, slot, e.gen, e.topic_id, e.size))
            s.index.write(idx * IDX_SIZE, buf)
            heads[slot] = idx + 1
            seg = idx // s.idx_seg_entries
            seg_max[seg] = max(seg_max.get(seg, slot), slot)
        for slot, head in heads.items():
            s.wheel.set(slot, head)
        s.idx_seg_max = seg_max

    def _apply_done_log(self) -> None:
        """At open: write every mark of both done logs into its record (idempotent: a delivered
        record never changes again), then empty the logs."""
        s = self.store
        n = 0
        sizes = [os.fstat(fd).st_size for fd in s._done_fds]
        for k, (fd, size) in enumerate(zip(s._done_fds, sizes, strict=True)):
            raw = os.pread(fd, size, 0) if size else b""
            whole = len(raw) - len(raw) % _DONE_ENTRY.size
            for off in range(0, whole, _DONE_ENTRY.size):
                pos, block = _DONE_ENTRY.unpack_from(raw, off)
                if not s.data.min_pos <= pos < s.data_end or s.data.in_hole(pos):
                    continue  # its record was deleted or reclaimed by retention: nothing to mark
                if not self._mark_fits(pos, block):
                    log.warning("timer: done.%d.log is torn at byte %d: %d of its marks dropped (their "
                                "messages may be delivered again)", k, off, (whole - off) // _DONE_ENTRY.size)
                    break
                if s.data.write_existing(pos + OFF_STATE, block):
                    n += 1
        if any(sizes):
            s.data.sync()
            for fd in s._done_fds:
                os.ftruncate(fd, 0)
                os.fsync(fd)
            log.info("timer: applied %d delivery marks from the done logs", n)
        s._done_end = 0

    def recover_delivered(self, copies: Iterable[tuple[str, int]]) -> int:
        """After a crash: ``copies`` are (UNIQ_KEY, TIMER_DELIVER_MS) of the messages the message store
        holds from ``scan_from`` on. A pending record one of them matches was delivered before the crash
        and its mark was lost (a torn done log): it is marked delivered, not delivered again. Returns how
        many; ``scan_from`` is cleared."""
        s = self.store
        n = 0
        with s.lock:
            s._require_open()
            now = s.clock.now_ms()
            for uniq, deliver_ms in copies:
                for pos, h, msg in s._queries.find(uniq, False):
                    if h.state == PENDING and h.deliver_ms == deliver_ms and msg.uniq_key == uniq:
                        s._write_done(pos, h, DELIVERED, now)
                        s.pending[h.topic_id] -= 1
                        n += 1
            s.scan_from = None
            s.dirty = True
        if n:
            log.warning("timer: %d messages were delivered before the crash without their mark on disk; "
                        "marked delivered from their copies in the store", n)
        return n

    def _mark_fits(self, pos: int, block: bytes) -> bool:
        """A done-log mark names a data record that exists and is the one it was written for (same
        generation, deliver and creation time): a torn or overwritten log never rewrites a header."""
        s = self.store
        hdr = s.data.read(pos, DATA_HDR_SIZE)
        if len(hdr) < DATA_HDR_SIZE:
            return False
        h = unpack_header(hdr)
        state, gen, deliver, _done, created, _origin, _seq = _STATE_BLOCK.unpack(block)
        return (h.magic == DATA_MAGIC and state == DELIVERED and gen == h.gen and deliver == h.deliver_ms
                and created == h.created_ms)

    def close(self) -> None:
        """Flush everything and write a clean checkpoint."""
        s = self.store
        with s.lock:
            if not s._opened:
                return
            # Whatever was taken into memory but not delivered stays pending on disk; make sure the
            # watermark never passes a slot still held in memory.
            s.flush(clean=True)
            self._close_files()
            (s.root / "abort").unlink(missing_ok=True)
            s._opened = False

    def _close_files(self) -> None:
        s = self.store
        for fd in s._done_fds:
            os.close(fd)
        s.data.close()
        s.index.close()
        s.wheel.close()
        s.hash.close()

    def abandon(self) -> None:
        """Drop the store without flushing (tests: a simulated process crash)."""
        s = self.store
        with s.lock:
            self._close_files()
            s._opened = False


def _checkpoint_of(raw: bytes) -> dict[str, Any]:
    ckpt = json.loads(raw)
    if not isinstance(ckpt, dict):
        raise ValueError("not a timer checkpoint")
    for key in ("watermark", "index_end", "data_end"):
        int(ckpt[key])  # a missing or non-numeric field is a damaged file
    return ckpt


def _topics_of(raw: bytes) -> dict[str, int]:
    topics = json.loads(raw)
    if not isinstance(topics, dict) or not all(isinstance(v, int) for v in topics.values()):
        raise ValueError("not a topic id table")
    return topics
