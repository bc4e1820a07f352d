"""CleanCommitLogService: watches the disk and deletes expired commit-log segments (or the oldest ones
when the disk is nearly full), then consume-queue and index files wholly below the oldest commit-log
offset. Rules: never the segment being written, never one whose queue entries are not built yet, never
one holding data at or beyond the min-offset guard; runs under the store's ``_clean_lock`` (against the
checkpoint writer). The disk ladder is RocketMQ's (see docs/store.md "Full disk").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chronomq.store.periodic import run_every

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")


class CleanCommitLogService:
    def __init__(self, store: MessageStore) -> None:
        self._store = store
        # the lowest commit-log offset still needed (undelivered delayed messages), or None
        self.guard: Callable[[], int | None] | None = None

    def disk_usage_ratio(self) -> float:
        """Like df's Use%: used / (used + available to unprivileged users); the percentage in
        diskUsageProbeFile instead when that is set and readable."""
        probe = self._store.config.diskUsageProbeFile
        if probe:
            try:
                return float(Path(probe).read_text().strip()) / 100
            except (OSError, ValueError) as e:
                log.warning("diskUsageProbeFile %s unreadable (%s); using the file system's use", probe, e)
        st = os.statvfs(self._store.root)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        usable = used + st.f_bavail * st.f_frsize
        return 0.0 if usable <= 0 else used / usable

    def run(self) -> None:
        """Thread chronomq-store-clean: a pass every cleanResourceInterval ms of clock time."""
        run_every(self._store, self._store.config.cleanResourceInterval, self.run_once, "clean")

    def check_disk(self, ratio: float) -> bool:
        """Set or clear the store's disk-full state from a disk use ``ratio`` (0..1): full past
        diskSpaceWarningLevelRatio, writable again at or under diskSpaceCleanForciblyRatio (unchanged in
        between). Returns whether the oldest segments may go regardless of age now."""
        store = self._store
        config = store.config
        pct = ratio * 100
        if pct > config.diskSpaceWarningLevelRatio:
            if store.disk_full is None:
                log.error("disk use %.1f%% is over diskSpaceWarningLevelRatio=%d%%: refusing sends until it "
                          "is back at %d%% (diskSpaceCleanForciblyRatio)", pct,
                          config.diskSpaceWarningLevelRatio, config.diskSpaceCleanForciblyRatio)
            store.disk_full = (f"the disk is full: {pct:.1f}% used, over diskSpaceWarningLevelRatio="
                               f"{config.diskSpaceWarningLevelRatio}%")
        elif pct <= config.diskSpaceCleanForciblyRatio and store.disk_full is not None:
            log.warning("disk use %.1f%%: writable again", pct)
            store.disk_full = None
        return config.cleanFileForciblyEnable and pct > config.diskSpaceCleanForciblyRatio

    def run_once(self, force: bool = False) -> int:
        """See MessageStore.run_clean_once."""
        store = self._store
        config = store.config
        with store._clean_lock:
            now = store.clock.now_ms()
            hour = time.localtime(now / 1000).tm_hour
            hours = {int(h) for h in config.deleteWhen.split(";") if h.strip().isdigit()}
            try:
                ratio = store.disk_usage_ratio()
                forcibly = self.check_disk(ratio)  # the oldest segments go regardless of age
            except OSError as e:
                log.warning("cannot read the disk use: %s", e)
                ratio, forcibly = 0.0, False
            if not (force or forcibly or ratio * 100 > config.diskMaxUsedSpaceRatio or hour in hours):
                return 0
            reserved_ms = config.fileReservedTime * 3_600_000
            guard = None
            if self.guard is not None:
                try:
                    guard = self.guard()
                except Exception:
                    log.exception("min offset guard failed; not cleaning")
                    return 0
            deleted = 0
            cl = store._cl
            while True:
                segs = cl.segments
                if len(segs) < 2:
                    break
                seg, nxt = segs[0], segs[1]
                if nxt.start >= cl.wrote:
                    break  # seg is the one being written
                if seg.end > store._reput.recover_point():
                    break  # its queue or index entries are not written yet: they would name a deleted file
                if not forcibly:
                    newest = cl.store_time_at(nxt.start)  # >= every store time inside seg
                    if newest is None or newest + reserved_ms > now:
                        break
                if guard is not None and seg.end > guard:
                    log.info("clean: keeping commit-log segment %020d and later: undelivered delayed "
                             "messages from offset %d are still needed", seg.start, guard)
                    break
                with cl.seg_lock:
                    cl.segments = cl.segments[1:]
                seg.destroy()
                deleted += 1
                log.info("clean: deleted commit-log segment %020d (%s)", seg.start,
                         "disk use %.0f%%" % (ratio * 100) if forcibly else "expired")
            min_phys = cl.min_offset
            with store._queues_lock:
                queues = list(store._queues.values())
            for cq in queues:
                cq.clean_below(min_phys)
            store._index.clean_below(min_phys)
            return deleted
