"""Cancel and reschedule in TimerStore (a base class of it, sharing its state), and the in-place
completion write they share with the delivery path. Rules: under ``self.lock``; one answer per message
found; a reschedule writes a new index entry first and makes it live by bumping the record's
generation; a cancel writes a checkpoint so the pending counters cannot resurrect it.
"""

from __future__ import annotations

from .records import (
    _I32,
    _I64,
    _STATE_BLOCK,
    CANCELLED,
    DELIVERED,
    FAILED,
    OFF_DELIVER,
    OFF_GEN,
    OFF_STATE,
    PENDING,
)
from .state import TimerState
from .types import OpResult, Outcome, TimerError

# the answer for a message already done, with its done time (a MOVED record gets none)
_DONE_OUTCOMES = {DELIVERED: Outcome.ALREADY_DELIVERED, FAILED: Outcome.FAILED,
                  CANCELLED: Outcome.ALREADY_CANCELLED}


class CancelPath(TimerState):
    def _write_done(self, pos: int, h: tuple[int, ...], state: int, now: int) -> int:
        # One pwrite of state..done_seq (a process crash cannot split a pwrite).
        self.done_seq += 1
        self.data.patch(pos + OFF_STATE, _STATE_BLOCK.pack(state, h[3], h[4], now, h[6], h[7], self.done_seq))
        return self.done_seq

    def cancel(self, ident: str, by_key: bool = False) -> list[OpResult]:
        """Cancel every pending message with this id (UNIQ_KEY or timer offset msgId) or key."""
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            found = self._find(ident, by_key)
            if not found:
                return [OpResult(Outcome.UNKNOWN, ident)]
            out = []
            changed = False
            for pos, h, msg in found:
                uid = msg.uniq_key or ident
                state = h[2]
                if state == PENDING:
                    self._write_done(pos, h, CANCELLED, now)
                    self.pending[h[10]] -= 1
                    self.cancelled += 1
                    changed = True
                    out.append(OpResult(Outcome.CANCELLED, uid, h[4], msg.topic))
                elif state in _DONE_OUTCOMES:
                    out.append(OpResult(_DONE_OUTCOMES[state], uid, h[5], msg.topic))
            if changed:
                self._write_checkpoint(clean=False)  # the pending counts must not resurrect it
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    def reschedule(self, ident: str, deliver_ms: int, by_key: bool = False) -> list[OpResult]:
        """Move every pending message with this id or key to ``deliver_ms``."""
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            if not isinstance(deliver_ms, int) or deliver_ms < 0:
                raise TimerError(f"deliver time {deliver_ms!r} is not a non-negative integer (epoch ms)")
            self.check_deliver_ms(deliver_ms, now)
            found = self._find(ident, by_key)
            out = []
            for pos, h, msg in found:
                uid = msg.uniq_key or ident
                state = h[2]
                if state == PENDING:
                    gen = h[3] + 1
                    self._add_index_entries([(deliver_ms, pos, gen, h[10], h[1])], self._floor_slot())
                    # The new entry is live once the record carries its generation.
                    self.data.patch(pos + OFF_GEN, _I32.pack(gen))
                    self.data.patch(pos + OFF_DELIVER, _I64.pack(deliver_ms))
                    self.rescheduled += 1
                    self.dirty = True
                    out.append(OpResult(Outcome.RESCHEDULED, uid, deliver_ms, msg.topic))
                elif state in _DONE_OUTCOMES:
                    out.append(OpResult(_DONE_OUTCOMES[state], uid, h[5], msg.topic))
            return out or [OpResult(Outcome.UNKNOWN, ident)]

    def mark_done(self, uniq: str) -> int:
        """A slave's copy of a completion its master journaled: every pending record with this UNIQ_KEY
        becomes DELIVERED and is never delivered from here. Returns how many changed."""
        with self.lock:
            self._require_open()
            now = self.clock.now_ms()
            n = 0
            for pos, h, _msg in self._find(uniq, False):
                if h[2] == PENDING:
                    self._write_done(pos, h, DELIVERED, now)
                    self.pending[h[10]] -= 1
                    self.delivered += 1
                    n += 1
            if n:
                self.dirty = True
            return n

    def is_parked(self, uniq: str, origin: int) -> bool:
        """Whether the record parked from the journal record at commit-log offset ``origin`` is here
        already, in any state (a slave replaying its master's journal skips it)."""
        with self.lock:
            self._require_open()
            return any(h[7] == origin for _pos, h, _m in self._find(uniq, False))
