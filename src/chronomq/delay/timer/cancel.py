"""Cancel and reschedule for TimerStore (``Cancellation``, which the store holds and delegates to), and a
slave's completions from the journal. Rules: under the store's lock; one answer per message found; a
reschedule writes a new index entry first and makes it live by bumping the record's generation; a cancel
writes a checkpoint so the pending counters cannot resurrect it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .records import (
    _I32,
    _I64,
    CANCELLED,
    DELIVERED,
    FAILED,
    OFF_DELIVER,
    OFF_GEN,
    PENDING,
)
from .types import OpResult, Outcome, TimerError

if TYPE_CHECKING:
    from .store import TimerStore

# the answer for a message already done, with its done time
_DONE_OUTCOMES = {DELIVERED: Outcome.ALREADY_DELIVERED, FAILED: Outcome.FAILED,
                  CANCELLED: Outcome.ALREADY_CANCELLED}


class Cancellation:
    def __init__(self, store: TimerStore) -> None:
        self.store = store

    def cancel(self, ident: str, by_key: bool = False) -> list[OpResult]:
        """Cancel every pending message with this id (UNIQ_KEY or timer offset msgId) or key."""
        s = self.store
        with s.lock:
            s._require_open()
            now = s.clock.now_ms()
            found = s._queries.find(ident, by_key)
            if not found:
                return [OpResult(Outcome.UNKNOWN, ident)]
            out = []
            changed = False
            for pos, h, msg in found:
                uid = msg.uniq_key or ident
                if h.state == PENDING:
                    s._write_done(pos, h, CANCELLED, now)
                    s.pending[h.topic_id] -= 1
                    s.cancelled += 1
                    changed = True
                    out.append(OpResult(Outcome.CANCELLED, uid, h.deliver_ms, msg.topic))
                elif h.state in _DONE_OUTCOMES:
                    out.append(OpResult(_DONE_OUTCOMES[h.state], uid, h.done_ms, msg.topic))
            if changed:
                s._write_checkpoint(clean=False)  # the pending counts must not resurrect it
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    def reschedule(self, ident: str, deliver_ms: int, by_key: bool = False) -> list[OpResult]:
        """Move every pending message with this id or key to ``deliver_ms``."""
        s = self.store
        with s.lock:
            s._require_open()
            now = s.clock.now_ms()
            if not isinstance(deliver_ms, int) or deliver_ms < 0:
                raise TimerError(f"deliver time {deliver_ms!r} is not a non-negative integer (epoch ms)")
            s.check_deliver_ms(deliver_ms, now)
            out = []
            for pos, h, msg in s._queries.find(ident, by_key):
                uid = msg.uniq_key or ident
                if h.state == PENDING:
                    gen = h.gen + 1
                    s._add_index_entries([(deliver_ms, pos, gen, h.topic_id, h.size)], s._floor_slot())
                    # The new entry is live once the record carries its generation.
                    s.data.patch(pos + OFF_GEN, _I32.pack(gen))
                    s.data.patch(pos + OFF_DELIVER, _I64.pack(deliver_ms))
                    s.rescheduled += 1
                    s.dirty = True
                    out.append(OpResult(Outcome.RESCHEDULED, uid, deliver_ms, msg.topic))
                elif h.state in _DONE_OUTCOMES:
                    out.append(OpResult(_DONE_OUTCOMES[h.state], uid, h.done_ms, msg.topic))
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    def mark_done(self, uniq: str) -> int:
        """A slave's copy of a completion its master journaled: every pending record with this UNIQ_KEY
        becomes DELIVERED and is never delivered from here. Returns how many changed."""
        s = self.store
        with s.lock:
            s._require_open()
            now = s.clock.now_ms()
            n = 0
            for pos, h, _msg in s._queries.find(uniq, False):
                if h.state == PENDING:
                    s._write_done(pos, h, DELIVERED, now)
                    s.pending[h.topic_id] -= 1
                    s.delivered += 1
                    n += 1
            if n:
                s.dirty = True
            return n

    def is_parked(self, uniq: str, origin: int) -> bool:
        """Whether the record parked from the journal record at commit-log offset ``origin`` is here
        already, in any state (a slave replaying its master's journal skips it)."""
        s = self.store
        with s.lock:
            s._require_open()
            return any(h.origin == origin for _pos, h, _m in s._queries.find(uniq, False))
