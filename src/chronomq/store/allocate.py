"""AllocateMappedFileService: keeps the active commit-log segment's disk allocated (zeros written)
ALLOCATE_AHEAD bytes ahead of the writer, so a put is never the one to allocate a page's disk block
(see store.mapped and docs/store.md). Woken by the put path through ``wake``; a put that outruns it
allocates what it needs itself. Never takes the commit-log lock.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")

# The allocator thread keeps this much of the active commit-log segment written with zeros ahead of the
# write position (see store.mapped: a put must not be the one to allocate a page's disk block).
ALLOCATE_AHEAD = 16 * 1024 * 1024


class AllocateMappedFileService:
    """RocketMQ's AllocateMappedFileService, reduced to what matters here."""

    def __init__(self, store: MessageStore) -> None:
        self._store = store
        self.wake = threading.Event()

    def run(self) -> None:
        """Thread chronomq-store-allocate: keep ALLOCATE_AHEAD bytes of the active segment allocated
        ahead of the writer, a chunk at a time so a put that needs space itself never waits long for
        the lock."""
        store = self._store
        stop = store._stop
        while not stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            seg = store._cur_seg
            if seg is None or stop.is_set():
                continue
            target = min(store._cl.wrote - seg.start + ALLOCATE_AHEAD, seg.file_size)
            try:
                while seg.allocated < target and not seg.closed and not stop.is_set():
                    seg.allocate(seg.allocated + 1)
            except (OSError, ValueError) as e:  # the put that needs the space reports it (disk full)
                log.warning("commit-log allocation ahead of the writer failed: %s", e)
                stop.wait(1.0)
