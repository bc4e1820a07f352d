"""AllocateMappedFileService: keeps the active commit-log segment's disk allocated (zeros written) ahead
of the writer, so a put is never the one to allocate a page's disk block (see store.mapped and
docs/store.md). How far ahead follows the write rate (``AheadSizer``): about two windows' worth of the
recent writes, from MIN_AHEAD up to ALLOCATE_AHEAD, so a store that writes little holds little disk it
has not used. Woken by the put path through ``wake``; a put that outruns it allocates what it needs
itself. Never takes the commit-log lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from chronomq.store.mapped import ALLOC_CHUNK

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")

# The most the allocator keeps written with zeros ahead of the write position (a heavy load: 8 MB/s
# and more); the put path wakes the allocator once it is within half of this.
ALLOCATE_AHEAD = 16 * 1024 * 1024
# The least (an idle or lightly written store), and the step the distance is rounded up to.
MIN_AHEAD = 1024 * 1024
# The write rate is measured over windows of this many seconds of the store's clock; the distance is
# AHEAD_WINDOWS windows of writes at the rate of the busier of the last full window and the current one.
AHEAD_WINDOW_S = 1.0
AHEAD_WINDOWS = 2
# Zeros are written this much at a time at the least (a small distance), ALLOC_CHUNK at the most.
MIN_CHUNK = 256 * 1024
# A round that found nothing to allocate is followed by this pause (seconds) before the next one: at a
# low rate every put wakes the allocator, and this bounds those wake-ups to a hundred a second.
IDLE_ROUND_S = 0.01


class AheadSizer:
    """How far ahead of the writer to allocate, from the bytes written per window of clock time.

    ``update(now, wrote)`` returns the distance: AHEAD_WINDOWS times the bytes of the busier of the last
    full window and the current one (so a rising rate is followed within the window), rounded up to a
    multiple of ``least``, between ``least`` and ``most``. It grows at once and shrinks by half at most
    per window, so a pause between two bursts keeps most of it."""

    __slots__ = ("_last", "_start", "_start_wrote", "ahead", "least", "most", "window_s")

    def __init__(self, now: float, wrote: int, least: int = MIN_AHEAD, most: int = ALLOCATE_AHEAD,
                 window_s: float = AHEAD_WINDOW_S) -> None:
        self.least = least
        self.most = max(least, most)
        self.window_s = window_s
        self.ahead = least
        self._start = now
        self._start_wrote = wrote
        self._last = 0  # bytes written per window over the windows that closed last

    def update(self, now: float, wrote: int) -> int:
        elapsed = now - self._start
        closed = elapsed >= self.window_s
        if closed:
            self._last = int(max(0, wrote - self._start_wrote) * self.window_s / elapsed)
            self._start, self._start_wrote = now, wrote
        recent = max(self._last, wrote - self._start_wrote)
        want = min(self.most, max(self.least, -(-AHEAD_WINDOWS * recent // self.least) * self.least))
        if want > self.ahead:
            self.ahead = want
        elif want < self.ahead and closed:
            self.ahead = max(want, self.ahead // 2 // self.least * self.least)
        return self.ahead

    @property
    def chunk(self) -> int:
        """How much zeros one write of the allocator covers at the present distance."""
        return min(ALLOC_CHUNK, max(MIN_CHUNK, self.ahead // 4))


class AllocateMappedFileService:
    """RocketMQ's AllocateMappedFileService, reduced to what matters here; it also makes the first file
    of a consume queue that records are about to reach (``prepare_queue``)."""

    def __init__(self, store: MessageStore) -> None:
        self._store = store
        self.wake = threading.Event()
        self.sizer: AheadSizer | None = None  # made when the thread starts (the log's end is known then)
        self._queues: deque[tuple[str, int]] = deque()  # consume queues to make ahead, in turn
        self._asked: set[tuple[str, int]] = set()  # ... each once

    def prepare_queue(self, topic: str, qid: int) -> None:
        """Have the thread make the consume queue of ``topic``/``qid`` and its first file soon (the
        timer asks when it stages the first records due to a queue that has none)."""
        key = (topic, qid)
        if key not in self._asked:
            self._asked.add(key)
            self._queues.append(key)
            self.wake.set()

    def _prepare_queues(self) -> None:
        while self._queues:
            key = self._queues.popleft()
            try:
                self._store.prepare_queue(*key)
            except (OSError, ValueError) as e:  # the first put to it reports a full disk itself
                log.warning("consume queue %s/%d: its first file could not be made ahead: %s", *key, e)
            finally:
                self._asked.discard(key)

    def run(self) -> None:
        """Thread chronomq-store-allocate: keep the sizer's distance of the active segment allocated
        ahead of the writer, a chunk at a time so a put that needs space itself never waits long for
        the lock."""
        store = self._store
        stop = store._stop
        clock = store.clock
        sizer = self.sizer = AheadSizer(clock.monotonic(), store._cl.wrote)
        while not stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            if self._queues:
                self._prepare_queues()
            seg = store._cur_seg
            wrote = store._cl.wrote
            ahead = sizer.update(clock.monotonic(), wrote)
            if seg is None or stop.is_set():
                continue
            target = min(wrote - seg.start + ahead, seg.file_size)
            if seg.allocated >= target:
                stop.wait(IDLE_ROUND_S)
                continue
            try:
                while seg.allocated < target and not seg.closed and not stop.is_set():
                    seg.allocate(seg.allocated + 1, sizer.chunk)
            except (OSError, ValueError) as e:  # the put that needs the space reports it (disk full)
                log.warning("commit-log allocation ahead of the writer failed: %s", e)
                stop.wait(1.0)
