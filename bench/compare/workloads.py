"""Pure workload logic shared by every system: the plans (counts per mode), payloads, due times,
delay-level quantization, the receipt recorder and the lateness statistics.

Nothing here touches a socket or a process, so tests can check it cheaply.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PAYLOAD_SIZE = 1024
HOUR_MS = 3_600_000


def now_ms() -> int:
    """Wall-clock milliseconds: the one clock every system and every client in a run is measured with
    (all processes run on this machine, so they share it)."""
    return time.time_ns() // 1_000_000


# --- plans ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """How big each of the six workloads is. Every load loop is bounded by a count and by a time cap."""

    mode: str
    schedule_count: int        # 1. schedule N delayed messages as fast as possible
    spread_count: int          # 2. N messages due over spread_window_ms
    spread_window_ms: int
    burst_count: int           # 3. N messages due in the same second
    hol_short_count: int       # 4. one hol_long_ms message then N of hol_short_ms, same destination
    hol_long_ms: int
    hol_short_ms: int
    pending_count: int         # 5. RSS and disk with N pending
    restart_count: int         # 6. kill -9 with N pending
    restart_window_ms: int
    load_cap_s: float          # time cap of any single load loop
    grace_ms: int              # how long after the last due time a workload keeps waiting for receipts
    batch: int = 1000          # messages per pipeline / confirm batch / concurrent-send window
    payload_size: int = PAYLOAD_SIZE
    far_delay_ms: int = 2 * HOUR_MS  # delay of the messages that must stay pending (workloads 1 and 5)
    lead_floor_ms: int = 2_000     # least time between the start of a load and its first due time
    restart_extra_lead_ms: int = 3_000  # workload 6: extra lead so the kill lands before the first due time
    settle_s: float = 2.0          # workload 5: pause after loading before RSS/disk are read
    restart_grace_ms: int = 30_000  # workload 6: wait after the last due time or the restart (the later)
    java_count: int = 10_000       # the official Java client's runs (timed, levels): messages in each

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Plan(mode="quick", schedule_count=10_000, spread_count=10_000, spread_window_ms=10_000,
             burst_count=10_000, hol_short_count=1_000, hol_long_ms=60_000, hol_short_ms=1_000,
             pending_count=50_000, restart_count=5_000, restart_window_ms=5_000, load_cap_s=60,
             grace_ms=15_000)
FULL = Plan(mode="full", schedule_count=1_000_000, spread_count=100_000, spread_window_ms=10_000,
            burst_count=100_000, hol_short_count=1_000, hol_long_ms=60_000, hol_short_ms=1_000,
            pending_count=10_000_000, restart_count=100_000, restart_window_ms=10_000, load_cap_s=1_500,
            grace_ms=60_000, restart_grace_ms=120_000, java_count=100_000)
# a seconds-long plan for the end-to-end test
TINY = Plan(mode="tiny", schedule_count=300, spread_count=200, spread_window_ms=2_000, burst_count=200,
            hol_short_count=50, hol_long_ms=8_000, hol_short_ms=1_000, pending_count=500, restart_count=100,
            restart_window_ms=1_000, load_cap_s=30, grace_ms=8_000, batch=100, lead_floor_ms=500,
            restart_extra_lead_ms=500, settle_s=0.2, restart_grace_ms=8_000, java_count=200)

PLANS = {p.mode: p for p in (QUICK, FULL, TINY)}


# --- payloads ------------------------------------------------------------------------------------------
# Incompressible padding (a fixed pseudo-random block, a different window of it per message): a run of
# one repeated byte would let a store that compresses (Redis's RDB preamble in its AOF) look unfairly small.
_PAD = random.Random(20_260_101).randbytes(16_384)


def make_payload(run: str, wl: str, seq: int, due_ms: int, size: int = PAYLOAD_SIZE) -> bytes:
    """``cmq|run|workload|seq|due_ms|`` padded with pseudo-random bytes to exactly ``size`` bytes: the
    consumer learns the due time from the message itself, so nothing is shared between producer and
    consumer."""
    head = f"cmq|{run}|{wl}|{seq}|{due_ms}|".encode()
    if len(head) > size:
        raise ValueError(f"payload header {len(head)} bytes exceeds the payload size {size}")
    n = size - len(head)
    if n > len(_PAD):
        return head + (_PAD * (n // len(_PAD) + 1))[:n]
    start = (seq * 997) % (len(_PAD) - n + 1)
    return head + _PAD[start:start + n]


def parse_payload(body: bytes) -> tuple[str, str, int, int] | None:
    """(run, workload, seq, due_ms) or None if the body is not one of ours."""
    parts = bytes(body[:200]).split(b"|", 5)
    if len(parts) < 6 or parts[0] != b"cmq":
        return None
    try:
        return parts[1].decode(), parts[2].decode(), int(parts[3]), int(parts[4])
    except ValueError:
        return None


# --- due times -----------------------------------------------------------------------------------------
def spread_dues(n: int, start_ms: int, window_ms: int) -> list[int]:
    """n due times spaced evenly over [start_ms, start_ms + window_ms)."""
    if n <= 0:
        return []
    return [start_ms + (i * window_ms) // n for i in range(n)]


def quantize_to_level(levels_ms: Sequence[int], send_ms: int, due_ms: int) -> tuple[int, int]:
    """For a broker that only has fixed delay levels (RocketMQ 4.x): the 1-based level whose delay is the
    smallest one reaching ``due_ms`` from ``send_ms`` (the largest level if none does), and the due time
    that level really gives (``send_ms + level delay``; never earlier than intended unless the intended
    delay exceeds the largest level)."""
    if not levels_ms:
        raise ValueError("no delay levels")
    want = due_ms - send_ms
    reaching = [(d, i) for i, d in enumerate(levels_ms, start=1) if d >= want]
    delay, level = min(reaching) if reaching else max((d, i) for i, d in enumerate(levels_ms, start=1))
    return level, send_ms + delay


def lead_ms_for(count: int, rate_per_s: float | None, floor_ms: int = 2_000) -> int:
    """Time to leave before the first due time so that loading ``count`` messages at the measured
    scheduling rate finishes first (x2 + 1 s margin: loading is slower while the server also delivers)."""
    rate = rate_per_s if rate_per_s and rate_per_s > 0 else 2_000.0
    return max(floor_ms, int(count / rate * 2000) + 1_000)


# --- statistics ----------------------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside 0..100")
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def lateness_stats(lateness_ms: Iterable[float]) -> dict[str, Any]:
    values = sorted(lateness_ms)
    return {"count": len(values), "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
            "max_ms": values[-1] if values else None, "min_ms": values[0] if values else None,
            "early": sum(1 for v in values if v < 0)}


# --- receipts ------------------------------------------------------------------------------------------
@dataclass
class Recorder:
    """Collects what a consumer received for one workload of one run. ``sink`` is thread-safe and cheap;
    bodies of other runs/workloads are counted as ``foreign`` and otherwise ignored."""

    run: str
    wl: str
    first: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> (due_ms, first recv_ms)
    receipts: int = 0
    duplicates: int = 0
    early: int = 0  # every receipt (duplicates included) before its due time
    foreign: int = 0

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        # what a wait_for waits for: the seqs still missing, or a count of distinct messages; the sink
        # wakes it once, when that is reached (a wake and a check per receipt cost the consumer's CPU)
        self._missing: set[int] | None = None
        self._count_goal: int | None = None

    def sink(self, body: bytes, recv_ms: int) -> None:
        parsed = parse_payload(body)
        with self._cond:
            if parsed is None or parsed[0] != self.run or parsed[1] != self.wl:
                self.foreign += 1
                return
            _, _, seq, due = parsed
            self.receipts += 1
            if recv_ms < due:
                self.early += 1
            if seq in self.first:
                self.duplicates += 1
            else:
                self.first[seq] = (due, recv_ms)
                missing = self._missing
                if missing is not None:
                    missing.discard(seq)
                    if not missing:
                        self._cond.notify_all()
                elif self._count_goal is not None and len(self.first) >= self._count_goal:
                    self._cond.notify_all()

    def distinct(self) -> int:
        with self._cond:
            return len(self.first)

    def wait_for(self, seqs: set[int] | int, deadline_mono: float) -> bool:
        """Block until every seq in ``seqs`` (or that many distinct messages) arrived, or the monotonic
        deadline passes. Returns whether it completed."""
        with self._cond:
            if isinstance(seqs, int):
                self._count_goal = seqs
            else:
                self._missing = {s for s in seqs if s not in self.first}
            try:
                while (len(self.first) < seqs if isinstance(seqs, int) else self._missing):
                    left = deadline_mono - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.5))
                return True
            finally:
                self._missing = self._count_goal = None

    def summary(self, sent: dict[int, int] | None = None, only: set[int] | None = None) -> dict[str, Any]:
        """Lateness of first receipts (restricted to ``only`` when given), plus lost against ``sent``
        (seq -> due of every acknowledged message)."""
        with self._cond:
            items = {s: v for s, v in self.first.items() if only is None or s in only}
            out = lateness_stats(recv - due for due, recv in items.values())
            out.update(received=len(items), receipts=self.receipts, duplicates=self.duplicates,
                       early_receipts=self.early, foreign=self.foreign)
            if items:
                out["first_recv_ms"] = min(r for _, r in items.values())
                out["last_recv_ms"] = max(r for _, r in items.values())
            if sent is not None:
                expected = set(sent) if only is None else set(sent) & only
                out["lost"] = len(expected - set(self.first))
                out["sent"] = len(expected)
            return out
