"""The timer's journal in the commit log, from which a slave rebuilds its timer store (docs/ha.md).

A master that replicates its timer appends, under the system topic ``JOURNAL_TOPIC`` (queue 0), one
record per fact, in the order the timer made them: each parked message itself (real topic and queue in
REAL_TOPIC / REAL_QID), and small records naming by UNIQ_KEY the messages cancelled, rescheduled (with
the new time) and done (delivered, or refused for good by the store). Keys and offset handles are resolved
on the master, so a slave never re-evaluates them. ``TimerFollower`` applies the records to a slave's
timer store, which parks without delivering; applying a record twice changes nothing, so the follower's
position is saved only after a timer flush (and at shutdown): a replay after a crash is harmless.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from chronomq.message import (
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    PROPERTY_TIMER_DELIVER_MS,
    MessageExt,
    MessageFormatError,
    decode_record,
)
from chronomq.store.atomicfile import write_atomic
from chronomq.store.types import GetStatus

from ..delivery import WRITTEN
from .types import Outcome, TimerError

log = logging.getLogger(__name__)

JOURNAL_TOPIC = "CHRONOMQ_SYS_TIMER_JOURNAL"
P_OP = "CMQ_TIMER_OP"
P_DELIVER = "CMQ_TIMER_DELIVER_MS"
OP_PARK, OP_CANCEL, OP_RESCHEDULE, OP_DONE = "park", "cancel", "reschedule", "done"


def _note(op: str, ids: list[str], store_host: tuple[str, int], now_ms: int,
          extra: dict[str, str] | None = None) -> MessageExt:
    props = {P_OP: op, **(extra or {})}
    return MessageExt(JOURNAL_TOPIC, "\n".join(ids).encode(), props, 0, 0, 0, now_ms, store_host, 0,
                      store_host, 0, 0, 0, 0, 0)


class TimerJournal:
    """A master's side: appends the journal records to the message store. ``end`` is the commit-log
    offset after the last record written, what a SYNC_MASTER waits for its slave to hold. A put the
    store refuses is logged and counted in ``failures`` (the slave then lacks that fact)."""

    def __init__(self, store: Any, clock: Any, store_host: tuple[str, int]) -> None:
        self.store = store
        self.clock = clock
        self.store_host = store_host
        self.end = 0
        self.records = 0
        self.failures = 0

    def _put(self, msgs: list[MessageExt], what: str) -> bool:
        res = self.store.put_messages(msgs) if len(msgs) > 1 else self.store.put_message(msgs[0])
        if res.status not in WRITTEN or res.append is None:
            self.failures += 1
            log.error("timer journal: the store refused %s (%s: %s); a slave will lack it", what,
                      res.status.name, res.error)
            return False
        self.end = max(self.end, res.append.wrote_offset + res.append.wrote_bytes)
        self.records += len(msgs)
        return True

    def parked(self, msgs: list[MessageExt]) -> bool:
        """The messages the timer has just parked (their properties as the timer stored them)."""
        copies = []
        for m in msgs:
            c = copy.copy(m)
            c.properties = {**m.properties, PROPERTY_REAL_TOPIC: m.topic,
                            PROPERTY_REAL_QUEUE_ID: str(m.queue_id), P_OP: OP_PARK}
            c.topic, c.queue_id = JOURNAL_TOPIC, 0
            copies.append(c)
        return bool(copies) and self._put(copies, f"{len(copies)} parked messages")

    def _ids_note(self, op: str, ids: list[str], extra: dict[str, str] | None = None) -> bool:
        if not ids:
            return True
        return self._put([_note(op, ids, self.store_host, self.clock.now_ms(), extra)], f"a {op} record")

    def cancelled(self, results: list[Any]) -> bool:
        return self._ids_note(OP_CANCEL, [r.msg_id for r in results if r.outcome is Outcome.CANCELLED])

    def rescheduled(self, results: list[Any], deliver_ms: int) -> bool:
        return self._ids_note(OP_RESCHEDULE, [r.msg_id for r in results if r.outcome is Outcome.RESCHEDULED],
                              {P_DELIVER: str(deliver_ms)})

    def done(self, ids: list[str]) -> None:
        self._ids_note(OP_DONE, [i for i in ids if i])


class TimerFollower:
    """A slave's side: applies the journal, from its saved position on, to ``timer`` (a TimerService that
    is open but does not deliver). ``apply_available`` is called whenever the journal's queue grows;
    ``save`` persists a position whose records the timer's files hold durably (after a timer flush)."""

    def __init__(self, store: Any, timer: Any, root: Path) -> None:
        self.store = store
        self.timer = timer
        self.path = Path(root) / "timer" / "journal.offset"
        self.offset = self._load()
        self.applied = 0
        self.skipped = 0

    def _load(self) -> int:
        try:
            return max(0, int(json.loads(self.path.read_text())["offset"]))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("timer journal: unreadable position %s (%s); replaying from the start", self.path, e)
            return 0

    def save(self, offset: int | None = None) -> None:
        """Persist the position (or ``offset``, a position whose records the timer files already hold
        durably), atomically."""
        write_atomic(self.path, json.dumps({"offset": self.offset if offset is None else offset}).encode())

    def apply_available(self, limit: int = 100_000) -> int:
        """Apply what the journal holds past the position (at most ``limit`` records); returns how many."""
        done = 0
        while done < limit:
            res = self.store.get_message(JOURNAL_TOPIC, 0, self.offset, 256)
            if not res.messages:
                if res.next_begin_offset > self.offset:
                    log.error("timer journal: records %d..%d were cleaned before this slave applied them",
                              self.offset, res.next_begin_offset)
                    self.offset = res.next_begin_offset
                    continue
                if res.status is GetStatus.OFFSET_OVERFLOW_BADLY:
                    log.warning("timer journal: the saved position %d is past the journal's end %d; "
                                "replaying from %d", self.offset, res.max_offset, res.next_begin_offset)
                    self.offset = res.next_begin_offset
                    continue
                break
            for raw in res.messages:
                self._apply_raw(raw)
                done += 1
            self.offset = res.next_begin_offset
        return done

    def _apply_raw(self, raw: bytes) -> None:
        try:
            self._apply(decode_record(raw))
            self.applied += 1
        except (MessageFormatError, TimerError, ValueError, KeyError) as e:
            self.skipped += 1
            log.error("timer journal: a record could not be applied (%s: %s); skipped", type(e).__name__, e)

    def _apply(self, m: MessageExt) -> None:
        props = m.properties
        op = props.get(P_OP)
        if op == OP_PARK:
            deliver_ms = int(props[PROPERTY_TIMER_DELIVER_MS])
            origin = m.commit_log_offset  # the same on master and slave: one identity per park
            uniq = m.uniq_key
            if uniq and self.timer.timer.is_parked(uniq, origin):
                return  # applied before the last saved position
            m.topic = props.pop(PROPERTY_REAL_TOPIC)
            m.queue_id = int(props.pop(PROPERTY_REAL_QUEUE_ID))
            del props[P_OP]
            self.timer.timer.schedule_batch([(m, deliver_ms)], origin)
            return
        ids = [i for i in m.body.decode().split("\n") if i]
        if op == OP_CANCEL:
            for i in ids:
                self.timer.cancel(i)
        elif op == OP_RESCHEDULE:
            ms = int(props[P_DELIVER])
            for i in ids:
                self.timer.reschedule(i, ms)
        elif op == OP_DONE:
            for i in ids:
                self.timer.timer.mark_done(i)
        else:
            raise ValueError(f"unknown journal operation {op!r}")
