"""TimerStore: the synchronous, thread-safe core of the timer (on-disk format: docs/timer.md).

The asyncio delivery loop lives in ``service.py``; everything here can also be driven by hand
(``poll`` / ``deliver``), which is what the virtual-clock tests do. This module is the facade:
construction and the summaries (stats, disk bytes, footprint). The rest lives in base classes that
share this object's state (state.py): the schedule path (append.py), cancel and reschedule
(cancel.py), queries and counts (query.py), the delivery window with its marks (window.py), opening,
recovery and closing (recovery.py), flush and checkpoint (flush.py) and retention (retention.py). As
bases rather than delegating objects they add no call per message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chronomq.clock import Clock

from ..histogram import Histogram
from .append import AppendPath
from .cancel import CancelPath
from .flush import FlushPath
from .query import QueryPath
from .records import (  # the layouts, for tests and tools that read the files
    DATA_HDR,
    DATA_HDR_SIZE,
    DATA_MAGIC,
    IDX,
    IDX_SIZE,
    PENDING,
    TIMER_OFFSET_FLAG,
    Item,
    _pack_index,
    _pos_of,
    _unpack_index,
)
from .recovery import Recovery
from .retention import Retention
from .types import TimerConfig, TimerError
from .window import WindowPath

__all__ = [
    "DATA_HDR", "DATA_HDR_SIZE", "DATA_MAGIC", "IDX", "IDX_SIZE", "PENDING", "TIMER_OFFSET_FLAG", "Item",
    "TimerStore", "_pack_index", "_pos_of", "_unpack_index",
]


class TimerStore(Recovery, FlushPath, AppendPath, CancelPath, QueryPath, WindowPath, Retention):
    def __init__(self, root: str | Path, clock: Clock, config: TimerConfig | None = None,
                 store_host: tuple[str, int] = ("127.0.0.1", 10911)) -> None:
        self.root = Path(root)
        self.clock = clock
        self.cfg = config or TimerConfig()
        self.cfg.validate()
        self.store_host = store_host
        self.lock = threading.RLock()
        self._ckpt_lock = threading.Lock()
        self._ckpt_seq = 0
        self._ckpt_written = 0
        self.on_done: Callable[[list[str]], None] | None = None  # completions, for a journal
        self.wakeup: Callable[[int], None] | None = None  # called with a deliver time that may be earlier
        # the message store's end (commit-log offset): a checkpoint records it, so that after a crash the
        # copies delivered since can be found there (recover_delivered)
        self.store_end: Callable[[], int] | None = None
        self.scan_from: int | None = None  # after a crash: where those copies start, until recovered
        self._opened = False
        self._id_prefix: str | None = None
        self.scan_chunk = 4 << 20  # bytes per read when retention scans a data segment
        self._scan_buf: bytearray | None = None  # the scan's buffer, kept (see Retention)
        self._scan_lock = threading.Lock()

    def _require_open(self) -> None:
        if not self._opened:
            raise TimerError("the timer store is not open")

    def stats(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock.now_ms()
            head = self.cur.peek() if self.cur is not None else None
            return {
                "pending": max(0, sum(self.pending.values())),
                "pending_by_topic": {self.topic_name(t): n for t, n in self.pending.items() if n > 0},
                "due_undelivered": self.due_undelivered(now),
                "delivered": self.delivered,
                "cancelled": self.cancelled,
                "rescheduled": self.rescheduled,
                "failed": self.failed,
                "put_retries": self.put_retries,
                "early_deliveries": self.early,
                "stale_entries_skipped": self.stale_skipped,
                "next_due_ms": head[0] if head else None,
                "watermark_ms": (self.watermark + 1) * self.slot_ms,
                "lateness_ms": Histogram.merged(self.hist.values()).summary(),
                "lateness_ms_by_topic": {self.topic_name(t): h.summary() for t, h in self.hist.items()},
                "max_delay_ms": self.cfg.max_delay_ms,
                "slot_ms": self.slot_ms,
                "disk_bytes": self.disk_bytes(),
                "recovered_clean": self.recovered_clean,
            }

    def disk_bytes(self) -> dict[str, int]:
        d = {"data": self.data.disk_bytes(), "index": self.index.disk_bytes(),
             "wheel": self.wheel.disk_bytes(), "hash": self.hash.disk_bytes()}
        d["total"] = sum(d.values())
        return d

    def footprint(self) -> dict[str, int]:
        """Sizes of every in-memory structure (what must not grow with the number pending)."""
        with self.lock:
            return {
                "window_entries": sum(w.entries() for w in (self.cur, self.nxt) if w is not None),
                "unapplied_marks": len(self._marks),  # deliveries since the last flush
                "topics": len(self.topics),
                "pending_counters": len(self.pending),
                "index_segments_tracked": len(self.idx_seg_max),
                "data_segments_tracked": len(self.data_recheck) + len(self.data.starts),
                "wheel_files": self.wheel.files,
                "hash_generations": len(self.hash.gens),
                "histogram_buckets": sum(h.buckets for h in self.hist.values()),
            }
