"""The timer store: deliver a message at any millisecond (issue 7).

API (all synchronous and thread-safe except start/shutdown/settle)::

    svc = TimerService(message_store, broker_config, clock)   # files in <storePathRootDir>/timer
    await svc.start()                       # recover, then run the delivery loop on this event loop
    r = svc.schedule(msg, deliver_ms)       # -> ScheduleResult(msg_id=UNIQ_KEY, offset_msg_id, ...)
    svc.maybe_schedule(msg)                 # send path: parse the timer properties, schedule or None
    svc.cancel(msg_id_or_key, by_key=False)             # -> [OpResult(CANCELLED | ALREADY_... | UNKNOWN)]
    svc.reschedule(msg_id_or_key, deliver_ms, by_key=False)   # -> [OpResult(RESCHEDULED ...)]
    svc.query(topic=, key=, tag=, start_ms=, end_ms=, limit=, cursor=)   # -> QueryPage (paged)
    svc.count(...) ; svc.stats() ; svc.min_needed_offset() (always None) ; await svc.shutdown()
    deliver_ms_from_properties(props, now_ms)  # TIMER_DELAY_SEC / TIMER_DELAY_MS / TIMER_DELIVER_MS /
                                               # __STARTDELIVERTIME -> epoch ms or None

A message id is the UNIQ_KEY (generated when missing) or the returned ``offset_msg_id``; a key is a
word of KEYS. A delivered message is put into ``message_store`` as a new message of its real topic and
queue, with TIMER_DELIVER_MS = its deliver time and the other timer properties removed: a due batch
goes as one ``put_messages`` per real (topic, queue) when the store has it, else ``put_message`` each.

On-disk format (``<root>/timer``) and why
-----------------------------------------
The pending set can be far larger than memory (10 M messages of 1 KiB), so nothing in memory may be
proportional to it. Everything per message lives on disk; memory holds at most two slots' entries
(the one being delivered and the one being preloaded), counters per topic, and small per-file tables.

* ``data/<20-digit start>``: append-only segments (64 MiB) of data records, one per scheduled
  message: a 64-byte little-endian header ``magic "TIMR", total size, state (PENDING, DELIVERED,
  CANCELLED, FAILED), generation, deliver_ms, done_ms, created_ms, origin, done_seq, payload crc,
  topic id`` followed by the message in RocketMQ's stored V1 record layout (message.encode_record).
  The message's bytes are *copied here*, so a long delay never pins commit-log segments; the store's
  commit log only ever sees the delivered copy. Appended with pwrite; state, generation and deliver
  time are updated in place through a shared mapping whose pages are dropped from the page tables
  every 64 updates (``SegmentedFile.patch``), so resident memory stays flat.
* ``index/<20-digit start>``: append-only segments of 48-byte index entries ``deliver_ms, data
  position, prev entry + 1, slot, generation, topic id, record size, crc32``: one per schedule and one
  per reschedule. An entry is live only while its generation equals the record's (a reschedule bumps
  the record's generation, which makes older entries stale; a cancel sets the state).
* ``wheel/<day number>``: an absolute time wheel, one file per day, one 8-byte slot per
  ``timerPrecisionMs`` (default 1 s -> 675 KiB a day, memory-mapped). A slot holds the newest index
  entry linked into it; entries chain backwards through ``prev``. An entry is linked into the slot of
  its deliver time, or into the slot being delivered when that time is already reached (so no entry
  ever lands behind the delivery watermark). Days wholly processed are deleted.
* ``hash/<gen>.buckets|.entries``: a key index for cancel/reschedule/query by UNIQ_KEY and by each
  KEYS word (bucket table + chained 20-byte entries; candidates are verified against the record).
* ``done.0.log`` / ``done.1.log``: deliveries (data position + the 48-byte state block for the
  record), appended once per batch. The flush thread swaps the logs, writes the full one's marks into
  the records, fsyncs and empties it; until then an in-memory overlay answers for those records.
  (Marking each record in place at delivery dirtied a clean page per message: an ext4 journal
  transaction, 50-100 us under I/O contention; this halved the CPU per delivery.)
* ``checkpoint.json`` (atomic), ``topics.json`` (topic ids), ``abort`` (present while running).

Delivery: the loop finds the next non-empty slot, reads its chain (in steps, from ``preload_ms``
before the slot falls due; one slot at most), sorts it by (deliver_ms, entry number) and hands out
entries whose time has come, oldest-due first, in batches, as fast as the store takes them (a batch
under one lock hold: its records read in a few large preads, one put per real queue; after a
transient put failure every item not yet stored goes back to the window). It sleeps
on the clock until exactly the next deliver time: never early (``poll`` only returns due entries).
Millisecond resolution comes from sorting within the slot; the slot size only sets how much is read
at once. When a slot is finished, the watermark advances past it.

Crash safety: every write reaches the OS before schedule/cancel/reschedule return (pwrite; fsynced
every ``timerFlushIntervalMs`` and, under SYNC_FLUSH, before a schedule returns). Writes are ordered
data -> hash -> index -> wheel head, so after a crash recovery validates index entries written since
the checkpoint (crc, data present), re-links any the wheel missed, trims unreferenced data, and
applies the done logs, and replays slots from the checkpoint's watermark; re-walked slots skip records
marked DELIVERED. Duplicate window: messages whose copy the store accepted but whose mark was lost:
after a process crash, the batch being delivered (at most deliver_batch = 256, marks not yet appended
to the done log); after a machine crash, the messages delivered since the last fsync
(timerFlushIntervalMs). No window ever delivers early or loses a
pending message that was acknowledged (after a machine crash: acknowledged and fsynced).

Retention: wheel days and index segments go once the persisted watermark passes them; a data segment
goes once no record in it is pending (checked again when its latest pending deliver time has
passed); hash generations go when all data they name is gone.
"""

from .props import SECONDS_THRESHOLD, deliver_ms_from_properties, has_timer_property
from .service import TimerService
from .store import TimerStore
from .types import (
    OpResult,
    Outcome,
    PendingInfo,
    QueryPage,
    ScheduleResult,
    TimerConfig,
    TimerError,
    TimerPropertyError,
    TimerRefused,
)

__all__ = [
    "SECONDS_THRESHOLD",
    "OpResult",
    "Outcome",
    "PendingInfo",
    "QueryPage",
    "ScheduleResult",
    "TimerConfig",
    "TimerError",
    "TimerPropertyError",
    "TimerRefused",
    "TimerService",
    "TimerStore",
    "deliver_ms_from_properties",
    "has_timer_property",
]
