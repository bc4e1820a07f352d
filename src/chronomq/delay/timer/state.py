"""``TimerState``: the state of a TimerStore, declared once with its types, and its two smallest readers.
It is the base of window.py's ``WindowPath``, the store's base; the parts the store holds (cancel.py,
query.py, retention.py, recovery.py) read and write these attributes through the store. No attribute
values live here: ``TimerStore.__init__``, ``Recovery._open`` and ``WindowPath._reset_window`` set them.
Everything mutable is guarded by ``lock`` (``_ckpt_lock``: writing the checkpoint file).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .types import TimerError

if TYPE_CHECKING:
    from chronomq.clock import Clock

    from ..histogram import Histogram
    from .files import HashIndex, SegmentedFile, Wheel
    from .records import Mark, Staged
    from .types import TimerConfig
    from .window import _Slot


class TimerState:
    # set by TimerStore.__init__
    root: Path
    clock: Clock
    cfg: TimerConfig
    store_host: tuple[str, int]
    lock: threading.RLock
    _ckpt_lock: threading.Lock
    _ckpt_seq: int
    _ckpt_written: int
    on_done: Callable[[list[str]], None] | None  # UNIQ_KEYs delivered or failed for good (a journal)
    wakeup: Callable[[int], None] | None
    _opened: bool
    _id_prefix: str | None
    store_end: Callable[[], int] | None  # the message store's end, for the checkpoint
    store_sync: Callable[[], object] | None  # makes the message store's records durable
    scan_from: int | None  # after a crash: where the store's copies of unmarked deliveries start
    # set by Recovery._open: files and geometry
    slot_ms: int
    data_seg: int
    idx_seg_entries: int
    topics: dict[str, int]
    topic_names: dict[int, str]
    data: SegmentedFile
    index: SegmentedFile
    wheel: Wheel
    hash: HashIndex
    # positions, watermark and counters
    watermark: int
    persisted_watermark: int
    index_end: int
    snapshot_index_end: int  # index_end when the last checkpoint was taken (flush_entries counts from it)
    data_end: int
    pending: Counter[int]
    idx_seg_max: dict[int, int]
    done_seq: int
    persisted_done_seq: int  # done_seq of the newest checkpoint on disk (its marks are in their records)
    open_ranges: list[list[int]]
    recovered_clean: bool
    dirty: bool
    # the window
    cur: _Slot | None
    nxt: _Slot | None
    scan_empty_from: int | None
    hist: dict[int, Histogram]
    delivered: int
    cancelled: int
    rescheduled: int
    failed: int
    put_retries: int
    early: int
    stale_skipped: int
    data_recheck: dict[int, int]
    done_since_scan: dict[int, int]  # records completed per data segment since retention last scanned it
    appended_bytes: int  # data records appended since the open (their mean size: reclaim_candidates)
    appended_records: int
    # delivery marks and the done logs
    _marks: dict[int, Mark]  # by data position
    _mark_buf: bytearray  # the marks of the batch being delivered, for the done log
    _staged: list[Staged]
    _staged_bytes: int
    _stage_full: bool
    _staged_changes: int
    _done_fds: list[int]
    _done_fd: int  # the done log taking marks
    _done_end: int

    def _require_open(self) -> None:
        if not self._opened:
            raise TimerError("the timer store is not open")

    def topic_name(self, tid: int) -> str:
        return self.topic_names.get(tid, f"#{tid}")
