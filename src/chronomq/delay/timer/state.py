"""The state TimerStore's parts share: an annotations-only base class of every part (window.py,
recovery.py, flush.py, append.py, query.py, cancel.py, retention.py), so each part names the
attributes it reads and writes. No behaviour and no attribute values live here; ``TimerStore.__init__``
and ``Recovery._open`` set them. Everything mutable is guarded by ``lock`` (``_ckpt_lock``: writing
the checkpoint file).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chronomq.clock import Clock

    from ..histogram import Histogram
    from .files import HashIndex, SegmentedFile, Wheel
    from .records import _Staged
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
    scan_chunk: int
    _scan_buf: bytearray | None
    _scan_lock: threading.Lock
    store_end: Callable[[], int] | None  # the message store's end, for the checkpoint
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
    data_end: int
    pending: Counter[int]
    idx_seg_max: dict[int, int]
    done_seq: int
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
    # delivery marks and the done logs
    _marks: dict[int, tuple[int, int, int, bytes]]
    _mark_buf: bytearray
    _staged: list[_Staged]
    _staged_changes: int
    _done_fds: list[int]
    _done_fd: int
    _done_end: int
