"""The timer's disk under a stream of short delays with a few long ones among them.

A TimerStore on a virtual clock (in process, nothing here is a test) takes ``--rate`` 1 KiB messages a
simulated second for ``--seconds``; a fraction ``--long`` of them is due in 7 days, the rest in 1-10 s.
Every simulated second it delivers what is due (into a sink), flushes, and runs retention as the broker's
loop does after a flush; then it prints what the timer's data log holds on disk against what its pending
messages need, with completed runs reclaimed inside the segments the long ones pin, and without (runs
never long enough: the store as it was before reclaiming).

    .venv/bin/python bench/timer_disk.py [--rate 1000] [--seconds 300] [--long 0.01] [--segment-mib 64]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from chronomq.clock import VirtualClock
from chronomq.delay.timer import TimerConfig, TimerStore, retention
from chronomq.message import MessageExt
from chronomq.store.types import PutResult, PutStatus

DAY = 86_400_000


def sink(_msg: MessageExt) -> PutResult:
    return PutResult(PutStatus.PUT_OK)


def run(root: Path, rate: int, seconds: int, long_share: float, segment: int,
        reclaim: bool) -> dict[str, float]:
    saved = retention.RECLAIM_MIN
    if not reclaim:
        retention.RECLAIM_MIN = 1 << 62
    try:
        clock = VirtualClock()
        t = TimerStore(root, clock, TimerConfig(data_segment_bytes=segment))
        t.open()
        rnd = random.Random(7)
        body = b"x" * 1024
        n = reclaimed = 0
        started = time.perf_counter()
        for _ in range(seconds):
            now = clock.now_ms()
            batch = []
            for _ in range(rate):
                long = rnd.random() < long_share
                due = now + (7 * DAY if long else rnd.randint(1000, 10_000))
                batch.append((MessageExt(topic="T", body=body, properties={"UNIQ_KEY": f"m{n}"}), due))
                n += 1
            t.schedule_batch(batch)
            end = now + 1000
            while True:
                items, wake = t.poll(clock.now_ms())
                if items:
                    for it in items:
                        t.deliver(it, sink)
                    continue
                if wake is None or wake > end:
                    break
                clock.advance_sync(max(0, wake - clock.now_ms()))
            clock.advance_sync(end - clock.now_ms())
            t.flush()
            if t.reclaim_candidates():
                reclaimed += t.run_retention()["reclaimed_bytes"]
        t.run_retention()
        pending = t.count()
        disk = t.data.disk_bytes()
        written = t.data_end
        elapsed = time.perf_counter() - started
        t.close()
        return {"scheduled": n, "pending": pending, "written_mib": written / 2**20, "disk_mib": disk / 2**20,
                "pending_mib": pending * (written / n) / 2**20, "reclaimed_mib": reclaimed / 2**20,
                "wall_s": elapsed}
    finally:
        retention.RECLAIM_MIN = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000, help="messages a simulated second")
    ap.add_argument("--seconds", type=int, default=300, help="simulated seconds")
    ap.add_argument("--long", type=float, default=0.01, help="share of messages due in 7 days")
    ap.add_argument("--segment-mib", type=int, default=64, help="timerDataSegmentSize, MiB")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="chronomq-timer-disk-"))
    try:
        for reclaim in (True, False):
            r = run(tmp / str(reclaim), a.rate, a.seconds, a.long, a.segment_mib << 20, reclaim)
            print(f"{'reclaimed' if reclaim else 'not reclaimed':>13}: {r['scheduled']:,} scheduled, "
                  f"{r['pending']:,} pending ({r['pending_mib']:.1f} MiB of records); data log written "
                  f"{r['written_mib']:.1f} MiB, on disk {r['disk_mib']:.1f} MiB "
                  f"(x{r['disk_mib'] / max(r['pending_mib'], 1e-9):.1f} the pending); reclaimed "
                  f"{r['reclaimed_mib']:.1f} MiB; {r['wall_s']:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
