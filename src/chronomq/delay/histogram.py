"""A small HDR-like latency histogram: log-linear buckets with 16 sub-buckets per power of two
(values below 32 are exact, above that the relative error is < 6.25 %), so memory is bounded
(< 1,000 buckets for any 64-bit value) whatever the number of samples."""

from __future__ import annotations

from collections.abc import Iterable

_SUB_BITS = 4
_SUB = 1 << _SUB_BITS  # 16 sub-buckets per power of two
_EXACT = 2 * _SUB  # values below 32 have their own bucket


def bucket_index(value: int) -> int:
    if value < _EXACT:
        return max(0, value)
    shift = value.bit_length() - (_SUB_BITS + 1)
    return _SUB * shift + (value >> shift)


def bucket_upper(index: int) -> int:
    """The highest value that falls into bucket ``index``."""
    if index < _EXACT:
        return index
    shift = index // _SUB - 1
    mantissa = index - _SUB * shift
    return ((mantissa + 1) << shift) - 1


class Histogram:
    """Counts of non-negative integer samples (milliseconds). Percentiles are reported as the upper
    bound of the bucket holding the sample (never below the true value), capped at the exact max."""

    __slots__ = ("_counts", "count", "max", "min", "total")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.max = 0
        self.min = 0

    def record(self, value: int, n: int = 1) -> None:
        if n <= 0:
            return
        value = max(0, int(value))
        idx = bucket_index(value)
        self._counts[idx] = self._counts.get(idx, 0) + n
        if self.count == 0 or value < self.min:
            self.min = value
        self.count += n
        self.total += value * n
        if value > self.max:
            self.max = value

    def percentile(self, p: float) -> int:
        if self.count == 0:
            return 0
        rank = max(1, -(-self.count * p // 100))  # ceil(count * p / 100), at least the first sample
        seen = 0
        for idx in sorted(self._counts):
            seen += self._counts[idx]
            if seen >= rank:
                return min(bucket_upper(idx), self.max)
        return self.max

    def cumulative(self, bounds: Iterable[int]) -> list[tuple[int, int]]:
        """(bound, samples at or below it) for each bound: a bucket counts once its upper value is within
        the bound, so a count is exact below 32 ms and never above the truth."""
        items = sorted((bucket_upper(idx), n) for idx, n in self._counts.items())
        out = []
        for b in bounds:
            out.append((b, sum(n for upper, n in items if upper <= b)))
        return out

    @classmethod
    def merged(cls, hists: Iterable[Histogram]) -> Histogram:
        """One histogram holding every sample of ``hists`` (e.g. per-topic lateness, all topics)."""
        out = cls()
        for h in hists:
            if not h.count:
                continue
            for idx, n in h._counts.items():
                out._counts[idx] = out._counts.get(idx, 0) + n
            out.min = h.min if out.count == 0 else min(out.min, h.min)
            out.count += h.count
            out.total += h.total
            out.max = max(out.max, h.max)
        return out

    @property
    def buckets(self) -> int:
        return len(self._counts)

    def summary(self) -> dict[str, int]:
        return {
            "count": self.count,
            "p50": self.percentile(50),
            "p99": self.percentile(99),
            "max": self.max,
        }
