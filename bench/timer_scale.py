"""Timer store at scale.

1. Schedule N pending 1 KiB messages with deliver times spread over 7 days (default 1,000,000;
   --full: 10,000,000): scheduling rate, process RSS, disk used.
2. Steady load: 10,000 messages due per second for 5 s: lateness p50/p99 (deliver time -> put into
   the store).
3. A burst of 500,000 messages due within the same second (``--burst-spread-ms``; 0: the same ms):
   time until all are delivered, CPU time of the process meanwhile, lateness.

Delivery goes into the real MessageStore (``--store real``, default) or a no-op sink
(``--store null``: the timer's own cost only). Real clock; nothing here is a test.

    .venv/bin/python bench/timer_scale.py [--n 1000000 | --full] [--burst 500000] [--store real|null]
    .venv/bin/python bench/timer_scale.py --n 0 --steady-rate 0 --burst 100000 --burst-spread-ms 0
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.delay.timer import TimerService
from chronomq.message import MessageExt
from chronomq.store.types import PutResult, PutStatus

DAY = 86_400_000


class NullStore:
    def __init__(self) -> None:
        self.count = 0

    def put_message(self, msg: MessageExt) -> PutResult:
        self.count += 1
        return PutResult(PutStatus.PUT_OK)

    def put_messages(self, msgs: list[MessageExt]) -> PutResult:
        self.count += len(msgs)
        return PutResult(PutStatus.PUT_OK)

    def put_records(self, topic: str, queue_id: int, records: list) -> PutResult:  # type: ignore[type-arg]
        self.count += len(records)  # the timer's raw path, as with the real MessageStore
        return PutResult(PutStatus.PUT_OK)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def schedule(svc: TimerService, topic: str, n: int, deliver, batch: int = 2000, prefix: str = "") -> float:  # type: ignore[no-untyped-def]
    body = b"x" * 1024
    t0 = time.perf_counter()
    i = 0
    while i < n:
        k = min(batch, n - i)
        items = []
        for j in range(i, i + k):
            m = MessageExt(topic=topic, body=body, queue_id=j & 3,
                           properties={"UNIQ_KEY": f"{prefix}{j:012d}", "KEYS": f"k{j}"})
            items.append((m, deliver(j)))
        svc.schedule_batch(items)
        i += k
    return time.perf_counter() - t0


async def wait_delivered(svc: TimerService, topic: str, n: int, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while True:
        hist = svc.timer.hist.get(svc.timer.topics.get(topic, -1))  # cheap: no stats() while measuring
        done = hist.count if hist is not None else 0
        if done >= n:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            print(f"  timed out: {done}/{n} delivered", flush=True)
            return float("nan")
        await asyncio.sleep(0.05)


async def steady(svc: TimerService, clock: SystemClock, args: argparse.Namespace, k: int,
                 sched_rate: float) -> None:
    t0 = clock.now_ms() + 3000 + int(k / sched_rate * 1500)  # room to schedule them first
    schedule(svc, "Steady", k, lambda j: t0 + j * 1000 // args.steady_rate, prefix="s")
    if clock.now_ms() > t0:
        print("  (scheduling the steady load took longer than its lead time; its head is late)")
    await wait_delivered(svc, "Steady", k, timeout_s=args.steady_seconds + 120)
    lat = svc.stats()["lateness_ms_by_topic"]["Steady"]
    print(f"steady {args.steady_rate:,}/s for {args.steady_seconds} s: lateness p50 {lat['p50']} ms, "
          f"p99 {lat['p99']} ms, max {lat['max']} ms", flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--full", action="store_true", help="10,000,000 pending")
    ap.add_argument("--burst", type=int, default=500_000)
    ap.add_argument("--burst-spread-ms", type=int, default=1000,
                    help="the burst's deliver times spread over this many ms (0: all due at the same ms)")
    ap.add_argument("--steady-rate", type=int, default=10_000)
    ap.add_argument("--steady-seconds", type=int, default=5)
    ap.add_argument("--store", choices=["real", "null"], default="real")
    ap.add_argument("--dir", default=None, help="data directory (default: a temporary one, removed)")
    args = ap.parse_args()
    n = 10_000_000 if args.full else args.n
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="chronomq-timer-bench-"))
    clock = SystemClock()
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(root)})
    store: object
    if args.store == "real":
        from chronomq.store import MessageStore

        store = MessageStore(cfg, clock)
        store.start()  # type: ignore[attr-defined]
    else:
        store = NullStore()
    svc = TimerService(store, cfg, clock)
    svc.open()
    print(f"timer_scale: {n:,} pending over 7 days, burst {args.burst:,}, store={args.store}, dir={root}")
    try:
        # 1. the pending mass, due from one hour on
        start = clock.now_ms() + 3_600_000
        span = 7 * DAY
        cpu0 = time.process_time()
        el = schedule(svc, "Pending", n, lambda j: start + (j * 7919 % n) * span // n)
        cpu = time.process_time() - cpu0
        st = svc.stats()
        disk = st["disk_bytes"]["total"] / 2**20
        print(f"schedule: {n:,} in {el:.1f} s = {n / max(el, 1e-9):,.0f} msgs/s wall, "
              f"{n / max(cpu, 1e-9):,.0f} msgs/s per CPU s; load average {os.getloadavg()[0]:.1f}")
        print(f"  RSS {rss_mb():.0f} MB; "
              f"timer disk {disk:,.0f} MiB; pending {st['pending']:,}", flush=True)
        fp = svc.timer.footprint()
        print(f"  in-memory structures: {fp}")
        await svc.start()

        # 2. steady: rate/s due for a few seconds
        k = args.steady_rate * args.steady_seconds
        sched_rate = n / el if n else 50_000.0  # --n 0: a guess, only used for lead times
        if k:
            await steady(svc, clock, args, k, sched_rate)
        # 3. the burst: all due within one second
        if args.burst:
            est = args.burst / sched_rate
            t_burst = clock.now_ms() + int(est * 3000) + 10_000  # generous: the rate varies under load
            spread = max(1, args.burst_spread_ms)
            sched_el = schedule(svc, "Burst", args.burst, lambda j: t_burst + (j * 7 % spread), prefix="b")
            lead = t_burst - clock.now_ms()
            print(f"burst: scheduled {args.burst:,} in {sched_el:.1f} s (due in {lead} ms)", flush=True)
            await clock.sleep_until_ms(t_burst)
            t_start = time.perf_counter()
            cpu0 = time.process_time()
            await wait_delivered(svc, "Burst", args.burst, timeout_s=600)
            took = time.perf_counter() - t_start
            cpu = time.process_time() - cpu0
            print(f"  delivery: {args.burst / took:,.0f} msgs/s wall, {args.burst / cpu:,.0f} per CPU s "
                  f"({cpu:.2f} CPU s, all threads); "
                  f"load average {os.getloadavg()[0]:.1f}")
            lat = svc.stats()["lateness_ms_by_topic"]["Burst"]
            print(f"burst: {args.burst:,} due within {args.burst_spread_ms} ms, all delivered {took:.1f} s "
                  f"after the first due; "
                  f"lateness p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms", flush=True)
        st = svc.stats()
        print(f"end: RSS {rss_mb():.0f} MB; early deliveries {st['early_deliveries']}; "
              f"pending {st['pending']:,}; disk {st['disk_bytes']['total'] / 2**20:,.0f} MiB")
    finally:
        await svc.shutdown()
        if args.store == "real":
            store.shutdown()  # type: ignore[attr-defined]
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
