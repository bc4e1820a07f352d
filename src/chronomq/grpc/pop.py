"""Pop-style consumption state for 5.x consumers: which messages of each (group, topic, queue) are in
flight (received, not yet acked) and until when they stay invisible, persisted in
config/popInflight.json.

Rules: per queue, every offset below ``committed`` is done; every offset in [committed, next) is either
in flight (``inflight``) or done (acked, filtered out, or dead-lettered); fresh messages are read from
``next``. ``committed`` is what the group's consume offset (consumerOffset.json) is set to, so it only
passes contiguous done offsets. Each delivery and each change of invisibility takes a new ``gen`` from
one table-wide sequence: a receipt handle names (queue, offset, gen), so a handle from an earlier
delivery is refused. The table is written atomically (tmp + fsync + rename) before a receive that
changed it is answered, so a restart neither loses an in-flight message nor shows it early. Single
threaded: used on the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronomq.broker.persist import read_json, write_json_atomic

FILE_NAME = "popInflight.json"
MAX_INFLIGHT_PER_QUEUE = 10_000  # a queue with this many messages in flight hands out no new ones


class AckOutcome(enum.StrEnum):
    """What an ack did."""

    OK = "ok"  # acked now or before
    STALE = "stale"  # the handle is not the current delivery's
    UNKNOWN = "unknown"  # never delivered


@dataclass
class Inflight:
    until_ms: int  # invisible until then
    attempt: int  # deliveries so far (the delivery_attempt of the last one)
    gen: int  # the current receipt handle's generation


@dataclass
class QueueState:
    committed: int
    next: int
    inflight: dict[int, Inflight] = field(default_factory=dict)

    def settle(self) -> int:
        """``committed`` moved up to the first offset still in flight (or ``next``); returns it."""
        self.committed = min(self.inflight) if self.inflight else self.next
        return self.committed

    def due(self, now_ms: int, limit: int) -> list[int]:
        """In-flight offsets whose invisibility has ended, oldest first."""
        return sorted(o for o, e in self.inflight.items() if e.until_ms <= now_ms)[:limit]

    def next_visible_ms(self) -> int | None:
        return min((e.until_ms for e in self.inflight.values()), default=None)


class PopTable:
    """``state(group, topic, queue, start)`` -> QueueState; ``deliver`` / ``ack`` / ``change`` /
    ``done``; ``await save()`` persists the whole table."""

    def __init__(self, config_dir: Path) -> None:
        self.path = config_dir / FILE_NAME
        self.queues: dict[tuple[str, str, int], QueueState] = {}
        self.seq = 0
        self._dirty = False
        self._saving: asyncio.Task[None] | None = None
        self._load()

    # --- the table --------------------------------------------------------------------------------------
    def state(self, group: str, topic: str, queue_id: int, start: int) -> QueueState:
        key = (group, topic, queue_id)
        st = self.queues.get(key)
        if st is None:
            st = self.queues[key] = QueueState(start, start)
            self._dirty = True
        return st

    def get(self, group: str, topic: str, queue_id: int) -> QueueState | None:
        return self.queues.get((group, topic, queue_id))

    def deliver(self, st: QueueState, offset: int, until_ms: int, attempt: int = 1) -> Inflight:
        """Hand out the message at ``offset`` (fresh when at or past ``next``, else a redelivery; one
        already acked is in flight again, as delivery ``attempt``)."""
        self.seq += 1
        e = st.inflight.get(offset)
        if e is None:
            e = st.inflight[offset] = Inflight(until_ms, attempt, self.seq)
        else:
            e.until_ms, e.attempt, e.gen = until_ms, e.attempt + 1, self.seq
        if offset >= st.next:
            st.next = offset + 1
        self._dirty = True
        return e

    def skip_to(self, st: QueueState, offset: int) -> None:
        """Fresh reads found nothing for the group below ``offset`` (filtered out, or cleaned)."""
        if offset > st.next:
            st.next = offset
            self._dirty = True

    def done(self, st: QueueState, offset: int) -> None:
        """The message at ``offset`` is finished with (acked, or dead-lettered)."""
        if st.inflight.pop(offset, None) is not None:
            self._dirty = True

    def ack(self, st: QueueState, offset: int, gen: int) -> AckOutcome:
        """The message at ``offset`` acked through the handle of delivery ``gen``."""
        e = st.inflight.get(offset)
        if e is None:
            return AckOutcome.OK if offset < st.next else AckOutcome.UNKNOWN
        if e.gen != gen:
            return AckOutcome.STALE
        self.done(st, offset)
        return AckOutcome.OK

    def change(self, st: QueueState, offset: int, gen: int, until_ms: int) -> Inflight | None:
        """A new invisibility end for the current delivery; None when ``gen`` is not current."""
        e = st.inflight.get(offset)
        if e is None or e.gen != gen:
            return None
        self.seq += 1
        e.until_ms, e.gen = until_ms, self.seq
        self._dirty = True
        return e

    # --- persistence ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "queues": [
                {
                    "group": g,
                    "topic": t,
                    "queue": q,
                    "committed": st.committed,
                    "next": st.next,
                    "inflight": [[o, e.until_ms, e.attempt, e.gen] for o, e in sorted(st.inflight.items())],
                }
                for (g, t, q), st in sorted(self.queues.items())
            ],
        }

    def _load(self) -> None:
        obj = read_json(self.path)
        if not isinstance(obj, dict):
            return
        self.seq = int(obj.get("seq", 0))
        for row in obj.get("queues") or []:
            st = QueueState(int(row["committed"]), int(row["next"]))
            for o, until, attempt, gen in row.get("inflight") or []:
                st.inflight[int(o)] = Inflight(int(until), int(attempt), int(gen))
            self.queues[(str(row["group"]), str(row["topic"]), int(row["queue"]))] = st

    async def save(self) -> None:
        """Persist every change made so far. One write at a time: a write already running may have
        started before the caller's change, so it is waited for and then, if needed, one more is made; a
        write another caller started meanwhile holds the change already. Raises OSError when the write
        fails (the changes stay to be written by the next call)."""
        if self._saving is not None and not self._saving.done():
            await asyncio.shield(self._saving)
            if self._saving is not None and not self._saving.done():
                await asyncio.shield(self._saving)
                return
        if not self._dirty:
            return
        self._dirty = False
        self._saving = asyncio.ensure_future(self._write(self.snapshot()))
        await asyncio.shield(self._saving)

    async def _write(self, snapshot: dict[str, Any]) -> None:
        try:
            await asyncio.to_thread(write_json_atomic, self.path, snapshot)
        except OSError:
            self._dirty = True
            raise

    def save_now(self) -> None:
        """Synchronous write (shutdown)."""
        if self._dirty:
            self._dirty = False
            write_json_atomic(self.path, self.snapshot())
