"""End-to-end benchmark with the official RocketMQ 4.x client (PyPI rocketmq==0.4.4) against chronomq.

N producer processes send 1 KiB messages while one push consumer receives them; prints the aggregate
send throughput and the end-to-end latency (consumer receipt time - producer send time, same host) for
each scenario, under ASYNC_FLUSH and SYNC_FLUSH:

  sync     single-message sync sends from --producers (8) processes, unpaced   (target >= 20,000 msgs/s)
  batch    send_batch of --batch-size (64) messages from --producers processes (target >= 100,000 msgs/s)
  paced    --rate (5,000) msgs/s in total as async sends on a fixed schedule from --paced-producers (2)
           processes (open loop: a slow reply does not lower the offered load)  (target p99 e2e <= 10 ms)

Everything is bounded by message counts and by time (sync/batch send for --seconds, the paced run
lasts --paced-seconds; the consumer gets --drain-timeout to catch up). The default (--quick: 8 s
each) runs in about 2 minutes; --full sends for 30 s each. Run from the repository root:

  .venv/bin/python bench/e2e.py                 # quick, every scenario, both flush modes
  .venv/bin/python bench/e2e.py --full --scenario sync --flush SYNC_FLUSH --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from tests.compat.harness import ChronomqProcess, DriverProcess, run_driver, start_driver  # noqa: E402

TARGETS = {"sync": ("send_msgs_s", 20_000), "batch": ("send_msgs_s", 100_000), "paced": ("p99_ms", 10.0)}


def wait_until(pred: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (Linux /proc), to report CPU cost per message independent of how busy
    the machine is; 0.0 where /proc is not available."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def last_progress(consumer: DriverProcess) -> dict[str, Any]:
    recs = [r for r in consumer.records() if "count" in r]
    return recs[-1] if recs else {"count": 0, "warm": 0}


def run_scenario(server: ChronomqProcess, scenario: str, opts: argparse.Namespace,
                 work: Path) -> dict[str, Any]:
    topic, group = f"Bench_{scenario}_{uuid.uuid4().hex[:6]}", f"CG_bench_{uuid.uuid4().hex[:6]}"
    producers = opts.producers
    seconds = opts.seconds
    if scenario == "sync":
        per, mode, rate = opts.sync_count // producers, "sync", 0.0
    elif scenario == "batch":
        per, mode, rate = opts.batch_count // producers, "batch", 0.0
    else:
        # open-loop load: async sends on a fixed schedule, so a slow reply does not lower the offered rate
        producers = opts.paced_producers
        seconds = opts.paced_seconds
        per, mode, rate = int(opts.rate * seconds) // producers, "async", opts.rate / producers
    # create the topic, then have the consumer assigned and receiving before the measured sends
    warm = [{"topic": topic, "body": f"warm-{i}"} for i in range(8)]
    run_driver("produce", {"namesrv": server.namesrv_addr, "mode": "sync", "messages": warm}, timeout=60)
    consumer = start_driver("bench_consume", {"namesrv": server.namesrv_addr, "group": group, "topic": topic,
                                              "deadline_s": opts.seconds * 4 + 300, "thread_count": 4,
                                              "out": str(work / f"{topic}.progress.jsonl")}, work)
    try:
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: last_progress(consumer)["warm"] >= 8 or not consumer.alive(), 60,
                       "the consumer to receive the warm-up messages")
        if not consumer.alive() or last_progress(consumer)["warm"] < 8:
            raise RuntimeError(f"bench consumer (pid {consumer.pid}, alive={consumer.alive()}) did not"
                               f" get the warm-up messages; stderr: {consumer.stderr()[-1500:]};"
                               f" client logs in .venv-compat/home/logs/rocketmq-cpp/{consumer.pid}_*")
        cpu0 = cpu_seconds(server.pid)
        start_at = time.time() + 2.0  # all producer processes start sending together
        procs = [start_driver("bench_produce", {
            "namesrv": server.namesrv_addr, "topic": topic, "group": f"PG_bench_{i}", "mode": mode,
            "count": per, "batch_size": opts.batch_size, "body_size": opts.body_size, "rate": rate,
            "start_at": start_at, "deadline_s": seconds if mode != "async" else seconds * 1.5 + 5},
            work) for i in range(producers)]
        results = [p.wait(timeout=seconds * 2 + 60) for p in procs]
        acked = sum(r["acked"] for r in results)
        errors = sum(r["errors"] for r in results)
        t0 = min(r["t_start"] for r in results)
        t1 = max(r["t_end"] for r in results)
        try:
            wait_until(lambda: last_progress(consumer)["count"] >= acked, opts.drain_timeout,
                       f"the consumer to receive all {acked} messages")
            drained = True
        except TimeoutError:
            drained = False
        broker_cpu = cpu_seconds(server.pid) - cpu0
        c = consumer.stop(timeout=60)
    finally:
        if consumer.alive():
            consumer.kill()
    span = max(t1 - t0, 1e-9)
    out = {"scenario": scenario, "producers": producers, "mode": mode, "acked": acked, "errors": errors,
           "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
           "send_seconds": round(span, 3), "send_msgs_s": round(acked / span),
           "target_rate": opts.rate if scenario == "paced" else None,
           "received": c["count"], "drained": drained,
           "broker_cpu_s": round(broker_cpu, 2),
           "broker_cpu_us_per_msg": round(broker_cpu / max(c["count"], 1) * 1e6, 1),
           "p50_ms": c["p50_ms"], "p99_ms": c["p99_ms"], "p999_ms": c["p999_ms"], "max_ms": c["max_ms"]}
    if c["first_recv"] and c["last_recv"]:
        out["recv_msgs_s"] = round(c["count"] / max(c["last_recv"] - c["first_recv"], 1e-9))
    return out


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True, help="small counts (default), ~1-2 min")
    size.add_argument("--full", action="store_true", help="larger counts for steadier figures")
    ap.add_argument("--scenario", choices=["all", "sync", "batch", "paced"], default="all")
    ap.add_argument("--flush", choices=["both", "ASYNC_FLUSH", "SYNC_FLUSH"], default="both")
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--body-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rate", type=float, default=5000.0, help="paced scenario: total msgs/s")
    ap.add_argument("--paced-producers", type=int, default=2, help="producer processes of the paced run")
    ap.add_argument("--seconds", type=float, help="sending time of sync/batch runs (8 quick, 30 full)")
    ap.add_argument("--sync-count", type=int, default=2_000_000, help="bound on the sync run's messages")
    ap.add_argument("--batch-count", type=int, default=10_000_000, help="bound on the batch run's messages")
    ap.add_argument("--paced-seconds", type=float, help="length of the paced run (8 quick, 30 full)")
    ap.add_argument("--drain-timeout", type=float, default=60, help="bound on waiting for the consumer (s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra broker config")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    opts = ap.parse_args(argv)
    full = opts.full
    opts.seconds = opts.seconds or (30.0 if full else 8.0)
    opts.paced_seconds = opts.paced_seconds or (30.0 if full else 8.0)
    if opts.producers < 1 or opts.paced_producers < 1 or opts.body_size < 21:
        ap.error("need at least one producer and a body of at least 21 bytes")
    scenarios = ["sync", "batch", "paced"] if opts.scenario == "all" else [opts.scenario]
    flushes = ["ASYNC_FLUSH", "SYNC_FLUSH"] if opts.flush == "both" else [opts.flush]
    extra = dict(kv.split("=", 1) for kv in opts.set)

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chronomq-e2e-") as tmp:
        for flush in flushes:
            server = ChronomqProcess(Path(tmp) / f"data-{flush}", {"flushDiskType": flush, **extra})
            server.start()
            try:
                for sc in scenarios:
                    work = Path(tmp) / f"work-{flush}-{sc}"
                    t = time.monotonic()
                    try:
                        r = run_scenario(server, sc, opts, work)
                    except (RuntimeError, TimeoutError) as e:  # report it and go on with the others
                        print(f"{flush:11s} {sc:6s} FAILED: {e}", flush=True)
                        failures.append(f"{flush} {sc}: {e}")
                        continue
                    r["flush"] = flush
                    r["wall_s"] = round(time.monotonic() - t, 1)
                    rows.append(r)
                    print(f"{flush:11s} {sc:6s} sent {r['acked']:>8} ({r['errors']} errors) "
                          f"{r['send_msgs_s']:>8} msgs/s  e2e p50 {fmt(r['p50_ms'])} ms"
                          f"  p99 {fmt(r['p99_ms'])} ms"
                          f"  received {r['received']}{'' if r['drained'] else ' (NOT ALL)'}"
                          f"  broker CPU {r['broker_cpu_us_per_msg']} us/msg", flush=True)
            finally:
                server.stop(timeout=60)
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (other"
          " processes compete for the same cores); 'brk us/msg' = broker CPU time per message delivered"
          " (send + store + pull)")
    hdr = f"{'flush':11s} {'scenario':8s} {'producers':>9s} {'sent':>9s} {'msgs/s':>9s} {'p50 ms':>8s} " \
          f"{'p99 ms':>8s} {'max ms':>8s} {'brk us/msg':>10s}  target"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        key, goal = TARGETS[r["scenario"]]
        val = r[key]
        met = val is not None and (val >= goal if key == "send_msgs_s" else val <= goal)
        if r["scenario"] == "paced":
            goal_s = f"p99 <= {goal:g} ms at {r['target_rate']:g}/s"
        else:
            goal_s = f">= {goal:,} msgs/s"
        print(f"{r['flush']:11s} {r['scenario']:8s} {r['producers']:>9d} {r['acked']:>9d} "
              f"{r['send_msgs_s']:>9d} "
              f"{fmt(r['p50_ms']):>8s} {fmt(r['p99_ms']):>8s} {fmt(r['max_ms']):>8s} "
              f"{r['broker_cpu_us_per_msg']:>10} {goal_s}: "
              f"{'met' if met else 'NOT met'}")
    for f in failures:
        print(f"FAILED {f}")
    if opts.json:
        opts.json.write_text(json.dumps({"rows": rows, "failures": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
