"""Lateness of delayed delivery: in-process MessageStore + DelayService + a consumer that reads
the real topic (arrival listener + store.get_message), on the system clock.

Scenarios (each on a fresh store in a temporary directory):
  window  N messages (default 100,000) whose deliver times are spread evenly over a 10 s window
          (10,000 due msgs/s);
  burst   N messages all due in the same millisecond.

To give messages exact deliver times without pacing the producer in real time, the store's clock is
"scripted" while the messages are loaded (store timestamp of message i = T0 + offset_i); after loading it
is the system clock again, so deliveries and receipts use real time. Lateness = consumer receipt time -
deliver time (float ms). "early" counts receipts before the deliver time (must be 0).

Usage: .venv/bin/python bench/delay_lateness.py [--count 100000] [--window-s 10] [--only window|burst]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.delay import DelayService
from chronomq.message import POS_BODY, POS_BODYLENGTH, PROPERTY_DELAY_TIME_LEVEL, MessageExt
from chronomq.store import MessageStore

TOPIC = "BenchDelay"
QUEUES = 4


class ScriptedClock(SystemClock):
    """The system clock, except that while ``script`` is set now_ms() returns script() (loading phase)."""

    def __init__(self) -> None:
        self.script = None

    def now_ms(self) -> int:
        s = self.script
        return s() if s is not None else time.time_ns() // 1_000_000


def pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = max(0, min(len(sorted_vals) - 1, round(p / 100 * len(sorted_vals) + 0.5) - 1))
    return sorted_vals[k]


async def run(scenario: str, count: int, window_ms: int) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"chronomq-bench-{scenario}-")
    # the delay must exceed the loading time (loading runs at the store's put rate)
    delay_ms = 60_000
    cfg, _ = BrokerConfig.load(overrides={
        "storePathRootDir": tmp, "messageDelayLevel": f"{delay_ms // 1000}s",
        "mappedFileSizeCommitLog": str(256 * 1024 * 1024)})
    clock = ScriptedClock()
    store = MessageStore(cfg, clock)
    store.start()
    svc = DelayService(store, cfg, clock)
    loop = asyncio.get_running_loop()

    t0 = clock.now_ms() + 1000  # scripted store time of the first message
    due: list[int] = [0] * count
    if scenario == "window":
        for i in range(count):
            due[i] = t0 + (i * window_ms) // count + delay_ms
    else:
        for i in range(count):
            due[i] = t0 + delay_ms
    # consumer state
    received = [0.0] * count
    got = 0
    done = asyncio.Event()
    offsets = [0] * QUEUES
    wake = asyncio.Event()
    pending_wake = threading.Event()

    def on_arrival(topic: str, qid: int, max_offset: int, ts: int) -> None:
        if topic == TOPIC and not pending_wake.is_set():
            pending_wake.set()
            loop.call_soon_threadsafe(wake.set)

    async def consumer() -> None:
        nonlocal got
        while got < count:
            await wake.wait()
            wake.clear()
            pending_wake.clear()
            for q in range(QUEUES):
                while True:
                    r = store.get_message(TOPIC, q, offsets[q], 1024)
                    if not r.messages:
                        break
                    now = time.time() * 1000.0
                    for raw in r.messages:  # only the body (the index) is needed: no full decode
                        blen = int.from_bytes(raw[POS_BODYLENGTH:POS_BODY], "big")
                        received[int(raw[POS_BODY:POS_BODY + blen])] = now
                    got += len(r.messages)
                    offsets[q] = r.next_begin_offset
        done.set()

    store.add_arrival_listener(on_arrival)
    await svc.start()

    # load: scripted store timestamps
    idx = [0]
    if scenario == "window":
        clock.script = lambda: t0 + (idx[0] * window_ms) // count
    else:
        clock.script = lambda: t0
    born = ("127.0.0.1", 50000)
    t_load = time.perf_counter()
    for i in range(count):
        idx[0] = i
        m = MessageExt(topic=TOPIC, body=str(i).encode(), queue_id=i % QUEUES,
                       properties={PROPERTY_DELAY_TIME_LEVEL: "1"}, born_timestamp=t0, born_host=born)
        res = store.put_message(svc.prepare_put(m))
        if not res.ok:
            raise SystemExit(f"put failed: {res}")
        if i % 5000 == 4999:
            await asyncio.sleep(0)
    load_s = time.perf_counter() - t_load
    clock.script = None
    first_due = min(due)
    if clock.now_ms() >= first_due:
        raise SystemExit(f"loading took {load_s:.1f}s, longer than the {delay_ms} ms delay; lower --count")
    store.wait_dispatched(store.max_phy_offset, 60)
    ctask = asyncio.create_task(consumer())
    cpu0 = time.process_time()  # from here until the first deliver time the process is idle
    await asyncio.wait_for(done.wait(), timeout=delay_ms / 1000 + window_ms / 1000 + 120)
    await ctask
    cpu_us = (time.process_time() - cpu0) / count * 1e6
    last = max(received)
    stats = svc.stats()
    await svc.shutdown()
    store.shutdown()
    lat = sorted(received[i] - due[i] for i in range(count))
    early = sum(1 for x in lat if x < 0)
    return {
        "scenario": scenario, "count": count, "load_s": load_s,
        "p50": pct(lat, 50), "p99": pct(lat, 99), "max": lat[-1], "mean": statistics.fmean(lat),
        "early": early, "service_early": stats["early_deliveries"],
        "reput_lateness": stats["levels"][0]["lateness_ms"],
        "all_delivered_after_last_due_ms": last - max(due), "tmp": tmp, "cpu_us": cpu_us,
        "loadavg": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--only", choices=("window", "burst"))
    args = ap.parse_args()
    try:
        import uvloop  # the server uses it when present
        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    print(f"chronomq delay lateness bench ({loop_name}, pid {os.getpid()})")
    for scenario in ("window", "burst"):
        if args.only and scenario != args.only:
            continue
        r = asyncio.run(run(scenario, args.count, int(args.window_s * 1000)))
        what = (f"{r['count']} msgs due over {args.window_s:g} s ({r['count'] / args.window_s:,.0f}/s)"
                if scenario == "window" else f"{r['count']} msgs due in the same ms")
        print(f"\n[{scenario}] {what}; loaded in {r['load_s']:.1f} s")
        print(f"  lateness deliver->consumer ms: p50 {r['p50']:.2f}  p99 {r['p99']:.2f}  max {r['max']:.2f}"
              f"  mean {r['mean']:.2f}")
        print(f"  early deliveries: {r['early']} (service counter {r['service_early']})")
        print(f"  last message received {r['all_delivered_after_last_due_ms']:.0f} ms after the last was due")
        print(f"  service re-put lateness (store time - deliver time, ms): {r['reput_lateness']}")
        print(f"  store put rate while loading: {r['count'] / r['load_s']:,.0f} msgs/s (single puts)")
        print(f"  process CPU per message (re-put + dispatch + consumer): {r['cpu_us']:.1f} us;"
              f" machine load average {r['loadavg']:.1f} on {os.cpu_count()} CPUs")
        if scenario == "burst":
            drain_s = max(r["reput_lateness"]["max"], 1) / 1000
            print(f"  burst drained (all re-put) in {drain_s:.2f} s = {r['count'] / drain_s:,.0f} msgs/s")
        import shutil
        shutil.rmtree(r["tmp"], ignore_errors=True)


if __name__ == "__main__":
    main()
