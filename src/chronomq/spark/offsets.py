"""Offsets and partition planning for the ``chronomq`` data source (pure Python).

A queue is ``(topic, brokerName, queueId)``. Offsets are consume-queue (logical) offsets: offset ``n`` is
the n-th message of the queue, and a queue's *max offset* is the next offset to be written.

The offset JSON that Spark keeps in its checkpoint, and that ``startingOffsets``/``endingOffsets`` take,
is ``{"topic": {"brokerName": {"queueId": offset}}}`` (queue ids are JSON object keys, so strings).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

QueueKey = tuple[str, str, int]


class OffsetFormatError(ValueError):
    """A checkpointed offset that is not the source's JSON shape (the message shows what was found)."""


def offsets_to_json(offsets: Mapping[QueueKey, int]) -> dict[str, dict[str, dict[str, int]]]:
    """Per-queue offsets -> the nested JSON-able dict (sorted, so equal offsets serialise equally)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for topic, broker, qid in sorted(offsets):
        out.setdefault(topic, {}).setdefault(broker, {})[str(qid)] = int(offsets[(topic, broker, qid)])
    return out


def offsets_from_json(data: object) -> dict[QueueKey, int]:
    """The inverse of offsets_to_json; raises OffsetFormatError on anything else."""
    if not isinstance(data, dict):
        raise OffsetFormatError(f"chronomq offset must be a JSON object, got {data!r}")
    out: dict[QueueKey, int] = {}
    for topic, brokers in data.items():
        if not isinstance(topic, str) or not isinstance(brokers, dict):
            raise OffsetFormatError(f"chronomq offset: topic {topic!r} must map to brokers, got {brokers!r}")
        for broker, queues in brokers.items():
            if not isinstance(queues, dict):
                raise OffsetFormatError(f"chronomq offset: {topic}/{broker} must map queue ids to offsets")
            for qid, off in queues.items():
                try:
                    q = int(qid)
                except (TypeError, ValueError):
                    raise OffsetFormatError(f"chronomq offset: queue id {qid!r} is not an integer") from None
                if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                    raise OffsetFormatError(f"chronomq offset: {topic}/{broker}/{q} = {off!r} is not an "
                                            "offset >= 0")
                out[(topic, str(broker), q)] = off
    return out


def rate_limit(start: Mapping[QueueKey, int], latest: Mapping[QueueKey, int],
               limit: int) -> dict[QueueKey, int]:
    """End offsets that advance at most ``limit`` messages in total beyond ``start``, split over the queues
    in proportion to their backlog (largest remainder, so the total is exactly min(limit, backlog) and a
    small queue is not starved forever: its share grows while the others drain).

    Queues in ``latest`` but not in ``start`` are returned at their ``latest`` value (they are new and
    planned as empty ranges); queues with no backlog keep their latest value."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    backlog = {q: latest[q] - start[q] for q in latest if q in start and latest[q] > start[q]}
    total = sum(backlog.values())
    end = dict(latest)
    if total <= limit:
        return end
    shares: dict[QueueKey, int] = {}
    remainders: list[tuple[float, QueueKey]] = []
    for q in sorted(backlog):
        exact = limit * backlog[q] / total
        whole = math.floor(exact)
        shares[q] = whole
        remainders.append((exact - whole, q))
    left = limit - sum(shares.values())
    # biggest fractional part first; ties go to the queue with the bigger backlog, then to queue order
    remainders.sort(key=lambda rq: (-rq[0], -backlog[rq[1]], rq[1]))
    for _, q in remainders[:left]:
        shares[q] += 1
    for q, share in shares.items():
        end[q] = start[q] + min(share, backlog[q])
    return end


@dataclass(frozen=True, order=True)
class QueueRange:
    """Read ``[start, end)`` of one queue. ``part`` numbers the pieces of a split queue range."""

    topic: str
    broker: str
    queue_id: int
    start: int
    end: int
    part: int = 0

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)

    @property
    def key(self) -> QueueKey:
        return (self.topic, self.broker, self.queue_id)


def plan_ranges(start: Mapping[QueueKey, int], end: Mapping[QueueKey, int],
                min_partitions: int | None = None) -> list[QueueRange]:
    """One range per queue with something to read; with ``min_partitions`` larger than that count, big
    ranges are split (a range gets ceil(size / (total / minPartitions)) pieces, so there are at least
    minPartitions in all)."""
    ranges = [QueueRange(t, b, q, start[(t, b, q)], end[(t, b, q)])
              for (t, b, q) in sorted(end) if (t, b, q) in start and end[(t, b, q)] > start[(t, b, q)]]
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    return split_ranges(ranges, min_partitions)


def split_ranges(ranges: Iterable[QueueRange], min_partitions: int) -> list[QueueRange]:
    ranges = list(ranges)
    total = sum(r.size for r in ranges)
    if total == 0:
        return ranges
    out: list[QueueRange] = []
    for r in ranges:
        # ceil(size / (total / minPartitions)): the pieces add up to at least minPartitions
        parts = max(1, -(-r.size * min_partitions // total))
        parts = min(parts, r.size)
        base, extra = divmod(r.size, parts)
        pos = r.start
        for i in range(parts):
            n = base + (1 if i < extra else 0)
            out.append(QueueRange(r.topic, r.broker, r.queue_id, pos, pos + n, i))
            pos += n
        assert pos == r.end
    return out
