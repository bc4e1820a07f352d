"""Lateness histogram: log-linear buckets (exact below 32 ms, < 6.25 % relative error above), so its
size is bounded (< 1,000 buckets for any 64-bit value) whatever the number of samples."""

from __future__ import annotations

from collections.abc import Iterable

_SUB_BITS = 4
_SUB = 1 << _SUB_BITS
_EXACT = 2 * _SUB


def bucket_index(value: int) -> int:
    if value < _EXACT:
        return max(0, value)
    shift = value.bit_length() - (_SUB_BITS + 1)
    return _SUB * shift + (value >> shift)


def bucket_upper(index: int) -> int:
    if index < _EXACT:
        return index
    shift = index // _SUB - 1
    return ((index - _SUB * shift + 1) << shift) - 1


class Histogram:
    """Counts of non-negative integer samples. Percentiles are the upper bound of the bucket holding
    the ranked sample (never below the true value), capped at the exact maximum."""

    __slots__ = ("_counts", "count", "max", "total")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.max = 0

    def record(self, value: int) -> None:
        value = max(0, int(value))
        idx = bucket_index(value)
        self._counts[idx] = self._counts.get(idx, 0) + 1
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value

    def percentile(self, p: float) -> int:
        if not self.count:
            return 0
        rank = max(1, -(-self.count * p // 100))
        seen = 0
        for idx in sorted(self._counts):
            seen += self._counts[idx]
            if seen >= rank:
                return min(bucket_upper(idx), self.max)
        return self.max

    @classmethod
    def merged(cls, hists: Iterable[Histogram]) -> Histogram:
        out = cls()
        for h in hists:
            for idx, n in h._counts.items():
                out._counts[idx] = out._counts.get(idx, 0) + n
            out.count += h.count
            out.total += h.total
            out.max = max(out.max, h.max)
        return out

    @property
    def buckets(self) -> int:
        return len(self._counts)

    def summary(self) -> dict[str, int]:
        return {"count": self.count, "p50": self.percentile(50), "p99": self.percentile(99), "max": self.max}
