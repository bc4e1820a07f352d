"""Opening and closing TimerStore (a base class of it, sharing its state): read the checkpoint and
topics, open the files, after a crash validate the index tail and re-link the wheel (or rebuild it),
apply the done logs, then close cleanly or abandon (tests). Rules: the geometry already on disk wins
over the configuration; all of it runs under ``self.lock``.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from chronomq.message import PROPERTY_KEYS, MessageFormatError, decode_record
from chronomq.store.atomicfile import read_with_backup

from ..histogram import Histogram
from .files import HashIndex, SegmentedFile, Wheel, add_key_items
from .records import (
    _DONE_ENTRY,
    _SEQ_JUMP,
    _STATE_BLOCK,
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    DELIVERED,
    IDX_SIZE,
    OFF_STATE,
    PENDING,
    _pack_index,
    _Staged,
    _unpack_index,
)
from .state import TimerState
from .window import _Slot

log = logging.getLogger("chronomq.delay.timer.store")


class Recovery(TimerState):
    def open(self) -> None:
        with self.lock:
            self._open()

    def _open(self) -> None:
        cfg = self.cfg
        self.root.mkdir(parents=True, exist_ok=True)
        self.slot_ms = cfg.slot_ms
        ckpt_path = self.root / "checkpoint.json"
        abort_path = self.root / "abort"
        # A damaged checkpoint falls back to the previous one (.bak), read as after a crash; with no
        # readable copy the store refuses to open: starting fresh would cut the index to nothing.
        got = read_with_backup(ckpt_path, _checkpoint_of, strict=True)
        ckpt: dict[str, Any] | None = None if got is None else got[0]
        fresh = ckpt is None
        clean = ckpt is not None and not abort_path.exists() and not got[1]
        if ckpt is None:
            ckpt = {"watermark": self.clock.now_ms() // cfg.slot_ms - 1, "index_end": 0, "data_end": 0,
                    "done_seq": 0, "pending": {}, "idx_seg_max": {}, "slot_ms": cfg.slot_ms,
                    "data_segment_bytes": cfg.data_segment_bytes,
                    "index_segment_entries": cfg.index_segment_entries}
        # Geometry of existing files wins over the configuration (it is baked into the files).
        self.data_seg = int(ckpt.get("data_segment_bytes", cfg.data_segment_bytes))
        self.idx_seg_entries = int(ckpt.get("index_segment_entries", cfg.index_segment_entries))
        old_slot_ms = int(ckpt.get("slot_ms", cfg.slot_ms))

        self.topics: dict[str, int] = {}
        got_topics = read_with_backup(self.root / "topics.json", _topics_of, strict=True)
        if got_topics is not None:
            self.topics = got_topics[0]
        self.topic_names = {v: k for k, v in self.topics.items()}
        self.data = SegmentedFile(self.root / "data", self.data_seg)
        self.index = SegmentedFile(self.root / "index", self.idx_seg_entries * IDX_SIZE)
        self.wheel = Wheel(self.root / "wheel", cfg.slot_ms)
        self.hash = HashIndex(self.root / "hash", cfg.hash_buckets, cfg.hash_generation_entries)

        self._ckpt_seq = self._ckpt_written = int(ckpt.get("seq", 0))
        self.watermark = int(ckpt["watermark"])
        if old_slot_ms != cfg.slot_ms:
            self.watermark = (self.watermark + 1) * old_slot_ms // cfg.slot_ms - 1
        self.persisted_watermark = self.watermark
        self.pending: Counter[int] = Counter({int(k): v for k, v in ckpt.get("pending", {}).items()})
        self.idx_seg_max: dict[int, int] = {int(k): v for k, v in ckpt.get("idx_seg_max", {}).items()}
        recovered_seq = int(ckpt.get("done_seq", 0))
        self.done_seq = recovered_seq + (1 if clean else _SEQ_JUMP)
        # Sequence ranges of completions that happened after a checkpoint and before a crash: their
        # records are subtracted from the pending counters when their slots are walked again. A range
        # stays open (and persisted) until the watermark passes every slot that crashed run touched.
        self.open_ranges: list[list[int]] = [list(r) for r in ckpt.get("open_ranges", [])]
        if not clean and not fresh:
            frontier = (self.clock.now_ms() + cfg.preload_ms) // cfg.slot_ms + 1
            self.open_ranges.append([recovered_seq, self.done_seq, frontier])
        self.recovered_clean = clean or fresh
        end = ckpt.get("store_end")
        self.scan_from = None if self.recovered_clean or end is None else int(end)

        ck_index_end = int(ckpt["index_end"])
        ck_data_end = int(ckpt["data_end"])
        file_idx_end = self.index.file_end() // IDX_SIZE
        if clean:
            self.index_end = ck_index_end
            self.data_end = ck_data_end
            if file_idx_end > ck_index_end or self.data.file_end() > ck_data_end:
                clean = False  # files longer than the checkpoint says: treat as a crash
        if not clean:
            tail_start = min(ck_index_end, file_idx_end)
            self._recover_tail(tail_start, ck_data_end)
            self._recover_hash(ckpt, tail_start, ck_data_end)
        if self.wheel.cut:
            log.warning("timer: wheel files %s are not a day of slots long (torn)", ", ".join(self.wheel.cut))
        elif self.wheel.max_value() > self.index_end:
            log.warning("timer: the wheel names index entries beyond the index's end (%d)", self.index_end)
        if old_slot_ms != cfg.slot_ms or self.wheel.cut or self.wheel.max_value() > self.index_end:
            self._rebuild_wheel()

        self._init_window_state()
        # Two logs: the flush swaps them, applies the full one and empties it.
        self._done_fds = [os.open(self.root / f"done.{k}.log", os.O_RDWR | os.O_CREAT, 0o644) for k in (0, 1)]
        self._done_fd = self._done_fds[0]
        self._apply_done_log()
        self.dirty = True
        abort_path.write_bytes(b"")
        self._opened = True
        try:
            self._write_checkpoint(clean=False)
        except OSError as e:  # a full disk: open anyway; the periodic flush writes it once there is room
            log.warning("timer: cannot write the checkpoint at open (%s); the flush tries again", e)

    def _init_window_state(self) -> None:
        """The in-memory state that starts empty at every open: the window, the counters, the marks."""
        self.cur: _Slot | None = None
        self.nxt: _Slot | None = None
        self.scan_empty_from: int | None = None
        self.hist: dict[int, Histogram] = {}
        self.delivered = 0
        self.cancelled = 0
        self.rescheduled = 0
        self.failed = 0
        self.put_retries = 0
        self.early = 0
        self.stale_skipped = 0
        self.data_recheck: dict[int, int] = {}
        # Deliveries are recorded in memory (an overlay on the record headers) and appended to
        # done.log once per batch; the flush thread later writes them into the records and truncates
        # the log. Marking each record in place at delivery cost an ext4 journal transaction per
        # message (dirtying a clean page), 50-100 us under I/O contention.
        self._marks: dict[int, tuple[int, int, int, bytes]] = {}  # pos -> state, done_ms, seq, block
        self._mark_buf = bytearray()
        # Items taken ahead of their time with their store entries prepared (see WindowPath.stage),
        # sorted by (deliver time, index entry), and the data file's change count when they were read.
        self._staged: list[_Staged] = []
        self._staged_changes = 0

    def _recover_tail(self, tail_start: int, ck_data_end: int) -> None:
        """After a crash: validate index entries written since the checkpoint, cut torn tails, re-link
        entries the wheel missed, recount schedules, and drop message bytes no entry names."""
        idx = tail_start
        data_end = ck_data_end
        file_end_idx = self.index.file_end() // IDX_SIZE
        data_file_end = self.data.file_end()
        relinked = 0
        while idx < file_end_idx:
            e = _unpack_index(self.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                break
            _deliver, pos, prev, slot, gen, topic, size = e
            if pos + size > data_file_end or prev > idx:
                break
            hdr = self.data.read(pos, DATA_HDR_SIZE)
            if len(hdr) < DATA_HDR_SIZE or DATA_HDR.unpack(hdr)[0] != DATA_MAGIC:
                break
            head = self.wheel.get(slot)
            if head < idx + 1:
                if head != prev:
                    log.warning("timer wheel slot %d inconsistent after crash; rebuilding", slot)
                self.wheel.set(slot, idx + 1)
                relinked += 1
            if gen == 0:
                self.pending[topic] += 1
            seg = idx // self.idx_seg_entries
            self.idx_seg_max[seg] = max(self.idx_seg_max.get(seg, slot), slot)
            data_end = max(data_end, pos + size)
            idx += 1
        self.index_end = idx
        self.index.truncate(idx * IDX_SIZE)
        self.data_end = data_end
        self.data.truncate(data_end)
        if relinked:
            log.info("timer recovery re-linked %d index entries", relinked)

    def _recover_hash(self, ckpt: dict[str, Any], tail_start: int, ck_data_end: int) -> None:
        """After a crash: the key hash is synced by the periodic flush, not by a SYNC_FLUSH round (as
        RocketMQ syncs its commit log but not its index file), so any of its pages written since the
        checkpoint may be lost, stale or ahead of the others. It is cut back to the extent the checkpoint
        recorded (its bucket heads recomputed if they moved on), then the keys of the records the index
        names from the checkpoint's data end on are added again, and it is synced."""
        ext = ckpt.get("hash_extent")
        if isinstance(ext, list) and len(ext) == 2:
            fixed = self.hash.cut_back(int(ext[0]), int(ext[1]))
        else:  # a checkpoint from before the extent was recorded: keep the entries, recompute the heads
            fixed = self.hash.gens[-1].rebuild_buckets()
        items: list[tuple[int, int]] = []
        seen: set[int] = set()
        for idx in range(tail_start, self.index_end):
            e = _unpack_index(self.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                continue
            pos, size = e[1], e[6]
            if pos < ck_data_end or pos in seen:  # in the hash as the checkpoint left it
                continue
            seen.add(pos)
            try:
                msg = decode_record(self.data.read(pos, size), DATA_HDR_SIZE, read_body=False)
            except MessageFormatError:
                continue  # a damaged record is never handed out; its keys do not matter
            add_key_items(items, msg.uniq_key or "", msg.properties.get(PROPERTY_KEYS), pos)
        items.sort(key=lambda it: it[1])
        self.hash.add_many(items)
        self.hash.sync()
        if fixed or items:
            log.info("timer recovery: %d key hash heads recomputed, keys of %d records added", fixed,
                     len(seen))

    def _rebuild_wheel(self) -> None:
        """Rebuild every slot chain from the retained index entries (slot size changed, or damage)."""
        log.warning("timer: rebuilding the time wheel from the index")
        self.wheel.clear()
        floor = self.watermark + 1
        heads: dict[int, int] = {}
        seg_max: dict[int, int] = {}
        start = self.index.min_pos // IDX_SIZE
        buf = bytearray()
        for idx in range(start, self.index_end):
            e = _unpack_index(self.index.read(idx * IDX_SIZE, IDX_SIZE))
            if e is None:
                continue
            deliver, pos, _prev, _slot, gen, topic, size = e
            slot = max(deliver // self.slot_ms, floor)
            prev = heads.get(slot, 0)
            buf = bytearray(_pack_index(deliver, pos, prev, slot, gen, topic, size))
            self.index.write(idx * IDX_SIZE, buf)
            heads[slot] = idx + 1
            seg = idx // self.idx_seg_entries
            seg_max[seg] = max(seg_max.get(seg, slot), slot)
        for slot, head in heads.items():
            self.wheel.set(slot, head)
        self.idx_seg_max = seg_max

    def _apply_done_log(self) -> None:
        """At open: write every mark of both done logs into its record (idempotent: a delivered
        record never changes again), then empty the logs."""
        n = 0
        sizes = [os.fstat(fd).st_size for fd in self._done_fds]
        for k, (fd, size) in enumerate(zip(self._done_fds, sizes, strict=True)):
            raw = os.pread(fd, size, 0) if size else b""
            whole = len(raw) - len(raw) % _DONE_ENTRY.size
            for off in range(0, whole, _DONE_ENTRY.size):
                pos, block = _DONE_ENTRY.unpack_from(raw, off)
                if not self.data.min_pos <= pos < self.data_end:
                    continue  # its record was deleted by retention: nothing to mark
                if not self._mark_fits(pos, block):
                    log.warning("timer: done.%d.log is torn at byte %d: %d of its marks dropped (their "
                                "messages may be delivered again)", k, off, (whole - off) // _DONE_ENTRY.size)
                    break
                if self.data.write_existing(pos + OFF_STATE, block):
                    n += 1
        if any(sizes):
            self.data.sync()
            for fd in self._done_fds:
                os.ftruncate(fd, 0)
                os.fsync(fd)
            log.info("timer: applied %d delivery marks from the done logs", n)
        self._done_end = 0

    def recover_delivered(self, copies: Iterable[tuple[str, int]]) -> int:
        """After a crash: ``copies`` are (UNIQ_KEY, TIMER_DELIVER_MS) of the messages the message store
        holds from ``scan_from`` on. A pending record one of them matches was delivered before the crash
        and its mark was lost (a torn done log): it is marked delivered, not delivered again. Returns how
        many; ``scan_from`` is cleared."""
        n = 0
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            for uniq, deliver_ms in copies:
                for pos, h, msg in self._find(uniq, False):
                    if h[2] == PENDING and h[4] == deliver_ms and msg.uniq_key == uniq:
                        self._write_done(pos, h, DELIVERED, now)
                        self.pending[h[10]] -= 1
                        n += 1
            self.scan_from = None
            self.dirty = True
        if n:
            log.warning("timer: %d messages were delivered before the crash without their mark on disk; "
                        "marked delivered from their copies in the store", n)
        return n

    def _mark_fits(self, pos: int, block: bytes) -> bool:
        """A done-log mark names a data record that exists and is the one it was written for (same
        generation, deliver and creation time): a torn or overwritten log never rewrites a header."""
        hdr = self.data.read(pos, DATA_HDR_SIZE)
        if len(hdr) < DATA_HDR_SIZE:
            return False
        h = DATA_HDR.unpack(hdr)
        state, gen, deliver, _done, created, _origin, _seq = _STATE_BLOCK.unpack(block)
        return (h[0] == DATA_MAGIC and state == DELIVERED and gen == h[3] and deliver == h[4]
                and created == h[6])

    def close(self) -> None:
        """Flush everything and write a clean checkpoint."""
        with self.lock:
            if not self._opened:
                return
            # Whatever was taken into memory but not delivered stays pending on disk; make sure the
            # watermark never passes a slot still held in memory.
            self.flush(clean=True)
            self._close_files()
            (self.root / "abort").unlink(missing_ok=True)
            self._opened = False

    def _close_files(self) -> None:
        for fd in self._done_fds:
            os.close(fd)
        self.data.close()
        self.index.close()
        self.wheel.close()
        self.hash.close()

    def abandon(self) -> None:
        """Drop the store without flushing (tests: a simulated process crash)."""
        with self.lock:
            self._close_files()
            self._opened = False


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
