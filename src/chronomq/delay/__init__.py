"""chronomq.delay: RocketMQ 4.x delayed delivery (levels), the retry ladder and the DLQ.

The broker uses ``DelayService`` (contract B): ``prepare_put`` parks a message whose DELAY > 0 under
SCHEDULE_TOPIC_XXXX (queue level-1, REAL_TOPIC/REAL_QID kept); ``build_send_back`` builds the
%RETRY%/%DLQ% message of CONSUMER_SEND_MSG_BACK; ``start``/``shutdown`` run the schedule service;
``stats`` feeds ``chronomq admin delay-stats``; ``min_needed_offset`` guards cleaning.

How it works (schedule.py): one asyncio task per level reads its schedule queue (tagsCode = deliver
time) and sleeps on the injected clock exactly until the head is due (or, when drained, until the
store's arrival listener wakes it). Due entries are delivered in batches through ``DeliveryPath``
(delivery.py: the parked record re-put under its real topic, one store.put_records per real queue),
so a backlog drains at the store's put rate. Nothing is put before clock.now_ms() >= its deliver time.

Guarantees:
- Clean restart: offsets are persisted at shutdown (delayOffset.json, tmp + fsync + rename, after a
  store flush) and every flushDelayOffsetInterval: no duplicates, nothing lost.
- Crash (SIGKILL): every re-put carries ``__CHRONOMQ_DELAY_SRC`` = "level:queueOffset:parkedPhyOffset";
  on start the commit log beyond the snapshot's ``scanFromPhyOffset`` is scanned and entries whose
  re-put is already in the log are skipped: zero duplicates, whatever the age of the offsets file.
  The window that remains is an OS crash / power loss under ASYNC_FLUSH: re-puts not yet on disk are
  lost with the page cache and delivered again after recovery (a consumer that already pulled one
  from the page cache sees it twice); at most flushIntervalCommitLog (500 ms) of deliveries.
- A backward step of the system clock delays parked messages by the step (never early); a forward
  step is followed within 1 s (SystemClock sleeps at most 1 s per timer).

"Deliver at any millisecond" can reuse ``DeliveryPath.deliver_many``: it takes (parked commit-log
offset, source marker) pairs; the marker's first field names the source (a level number here).
"""

from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, DeliveryPath, restore_real
from chronomq.delay.histogram import Histogram
from chronomq.delay.levels import DelayLevels
from chronomq.delay.service import DelayService

__all__ = ["PROPERTY_DELAY_SOURCE", "DelayLevels", "DelayService", "DeliveryPath", "Histogram",
           "restore_real"]
