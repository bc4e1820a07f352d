"""Master-slave replication: what SYNC_MASTER costs a sender, and how far behind a slave runs.

Every broker is its own process (``chronomq namesrv`` and ``chronomq broker``) on loopback, with fresh
data directories; the client is chronomq.client in this process.

1. Send rate: 1 KiB messages, ``--window`` sends in flight, ``--count`` messages, against
   a. a single broker with flushDiskType=SYNC_FLUSH (the reference),
   b. a SYNC_MASTER (ASYNC_FLUSH) with its slave, and
   c. a SYNC_MASTER with SYNC_FLUSH and its slave;
   msgs/s and the ratio to (a). A SYNC_MASTER answers a send once the slave holds it.
2. Replication lag: an ASYNC_MASTER with its slave, sends paced at ``--rate`` msgs/s for ``--seconds``;
   the master's time from each append to the slave's ack that covered it (p50/p99/max over the last
   4,096 appends, from GET_BROKER_RUNTIME_INFO) and its lag in bytes, sampled every 50 ms.
3. Promotion: ``--promotion`` delayed messages (deliver-at and delay level) pending on a SYNC_MASTER,
   the master SIGKILLed while it delivers them, its slave promoted: lost, early and duplicated
   deliveries as a consumer saw them.

    .venv/bin/python bench/ha.py [--count 20000] [--window 64] [--rate 10000] [--seconds 5] [--promotion N]

Bounded: every load loop by its count or duration, every wait by a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.compat.harness import CliProcess, RawClient, free_port

from chronomq.client import Message, Producer
from chronomq.remoting.codes import RequestCode

BODY = os.urandom(512).hex().encode()  # 1 KiB, not compressible


def runtime(addr: str) -> dict[str, str]:
    with RawClient(addr) as c:
        return json.loads(c.call(RequestCode.GET_BROKER_RUNTIME_INFO).body)["table"]


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


class Cluster:
    """A name server, a master and (optionally) a slave, each a process."""

    def __init__(self, work: Path, master_sets: list[str], slave: bool) -> None:
        self.work = work
        ns_port, m_port, ha_port = free_port(), free_port(), free_port()
        self.ns = f"127.0.0.1:{ns_port}"
        self.master_addr = f"127.0.0.1:{m_port}"
        common = ["-n", self.ns, "--set", "brokerName=bench-ha", "--set", "metricsPort=-1",
                  "--set", "grpcListenPort=-1"]
        self.procs = [CliProcess(work / "ns.log", "namesrv", "--port", str(ns_port), "--metrics-port", "-1"),
                      CliProcess(work / "master.log", "broker", *common, "--data-dir", str(work / "m"),
                                 "--broker-port", str(m_port), "--set", f"haListenPort={ha_port}",
                                 *[x for s in master_sets for x in ("--set", s)])]
        self.slave_addr = ""
        if slave:
            s_port = free_port()
            self.slave_addr = f"127.0.0.1:{s_port}"
            self.procs.append(CliProcess(work / "slave.log", "broker", *common, "--data-dir", str(work / "s"),
                                         "--broker-port", str(s_port), "--set", "brokerRole=SLAVE",
                                         "--set", "brokerId=1"))
        self.slave = slave

    def __enter__(self) -> Cluster:
        try:
            for p in self.procs:
                p.start()
            if self.slave:
                wait_until(lambda: runtime(self.master_addr).get("haSlaves") == "1", 30, "slave connected")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()


async def send_rate(ns: str, count: int, window: int) -> tuple[float, dict[str, int]]:
    statuses: dict[str, int] = {}
    async with Producer("PG_bench_ha", ns, send_timeout=10.0) as p:
        await p.send(Message("BenchHA", BODY))  # route and connection
        sem = asyncio.Semaphore(window)

        async def one() -> None:
            async with sem:
                r = await p.send(Message("BenchHA", BODY))
                statuses[r.status.name] = statuses.get(r.status.name, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(count)))
        return count / (time.monotonic() - t0), statuses


async def paced(ns: str, master: str, rate: int, seconds: float) -> dict[str, Any]:
    lags: list[int] = []
    async with Producer("PG_bench_ha_paced", ns) as p:
        await p.send(Message("BenchHA", BODY))
        stop = time.monotonic() + seconds
        sent = 0
        inflight: set[asyncio.Task[Any]] = set()
        t0 = time.monotonic()
        next_sample = t0
        while time.monotonic() < stop:
            due = int((time.monotonic() - t0) * rate)
            while sent < due and len(inflight) < 512:
                t = asyncio.ensure_future(p.send(Message("BenchHA", BODY)))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
                sent += 1
            if time.monotonic() >= next_sample:
                info = await asyncio.to_thread(runtime, master)
                lags.append(int(info.get("haLagBytes", "-1")))
                next_sample += 0.05
            await asyncio.sleep(0.001)
        await asyncio.gather(*inflight, return_exceptions=True)
        achieved = sent / (time.monotonic() - t0)
    info = runtime(master)
    return {"sent": sent, "rate": achieved, "lag_bytes_samples": lags, "info": info}


async def promotion(work: Path, count: int, kill_after_s: float = 2.0, spread_s: float = 10.0,
                    lead_s: float = 6.0) -> dict[str, Any]:
    """A SYNC_MASTER (its timer journaled) with its slave: ``count`` delayed messages, half with a deliver
    time spread over ``spread_s`` from ``lead_s`` ahead, half at delay level 3 (10 s); a consumer running
    throughout; the master SIGKILLed ``kill_after_s`` after the first deliver time, the slave promoted
    with Admin.promote. Returns what was acknowledged and received: lost (acknowledged, never received),
    early (received before its time), duplicates (received more than once) and timings."""
    from chronomq.client import Admin, PushConsumer

    c = Cluster(work, ["brokerRole=SYNC_MASTER"], True)
    received: dict[str, list[int]] = {}
    early: list[str] = []

    def listener(m: Any) -> None:
        now = int(time.time() * 1000)
        key = m.body.decode()
        received.setdefault(key, []).append(now)
        kind, _, due = key.split("|")
        # a level message falls due 10 s after the master stored it, which is after it was born
        if now < (int(due) if kind == "t" else m.born_timestamp + 10_000):
            early.append(key)

    with c:
        t0 = int(time.time() * 1000)
        first_due = t0 + int(lead_s * 1000)
        acked: dict[str, str] = {}
        async with Producer("PG_promo", c.ns, send_timeout=10.0) as p:
            sem = asyncio.Semaphore(64)

            async def one(i: int) -> None:
                async with sem:
                    if i % 2:
                        due = first_due + int(spread_s * 1000 * i / count)
                        key = f"t|{i}|{due}"
                        r = await p.send(Message("PromoTopic", key.encode(), deliver_at=due))
                    else:  # level 3: 10 s after the master stored it
                        key = f"L|{i}|0"
                        r = await p.send(Message("PromoTopic", key.encode(), delay_level=3))
                    if r.status == "SEND_OK":
                        acked[key] = r.msg_id

            await asyncio.gather(*(one(i) for i in range(count)))
        sent_s = time.time() - t0 / 1000
        async with PushConsumer("CG_promo", "PromoTopic", listener, c.ns, consume_from="first",
                                rebalance_interval=1.0, route_refresh_interval=1.0, long_poll_timeout=2.0,
                                offset_commit_interval=0.5):
            await asyncio.sleep(max(0.0, (first_due - time.time() * 1000) / 1000 + kill_after_s))
            before_kill = sum(len(v) for v in received.values())
            c.procs[1].stop(signal.SIGKILL)
            killed = time.time()
            async with Admin(c.ns) as admin:
                answer = await admin.promote(c.slave_addr)
            promoted_s = time.time() - killed
            deadline = time.monotonic() + spread_s + lead_s + 60
            while time.monotonic() < deadline and not set(acked) <= set(received):
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # late duplicates, if any, arrive now
    lost = sorted(set(acked) - set(received))
    dups = {k: len(v) - 1 for k, v in received.items() if len(v) > 1}
    return {"sent": count, "acked": len(acked), "received": len(received), "lost": lost,
            "duplicates": sum(dups.values()), "early": early, "received_before_kill": before_kill,
            "send_s": sent_s, "promote_s": promoted_s, "answer": answer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--rate", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--promotion", type=int, default=10_000, metavar="N",
                    help="delayed messages pending when the master is killed (0: skip)")
    args = ap.parse_args()
    if not (1 <= args.count <= 2_000_000 and 1 <= args.window <= 4096 and 1 <= args.rate <= 200_000
            and 0 < args.seconds <= 600 and 0 <= args.promotion <= 200_000):
        ap.error("counts out of range")
    print(f"bench/ha.py: {args.count:,} sends, {args.window} in flight; lag at {args.rate:,}/s for "
          f"{args.seconds:g} s; load average {os.getloadavg()[0]:.1f}")
    runs = [("single broker, SYNC_FLUSH", ["flushDiskType=SYNC_FLUSH"], False),
            ("SYNC_MASTER + slave, ASYNC_FLUSH", ["brokerRole=SYNC_MASTER"], True),
            ("SYNC_MASTER + slave, SYNC_FLUSH", ["brokerRole=SYNC_MASTER", "flushDiskType=SYNC_FLUSH"], True)]
    rates = []
    for name, sets, slave in runs:
        with tempfile.TemporaryDirectory(prefix="chronomq-bench-ha-") as d, \
                Cluster(Path(d), sets, slave) as c:
            rate, statuses = asyncio.run(send_rate(c.ns, args.count, args.window))
        rates.append(rate)
        ratio = f"x{rate / rates[0]:.2f}" if rates[0] else "-"
        print(f"  {name:36s} {rate:10,.0f} msgs/s  {ratio:>6s}   answers {statuses}")
    with tempfile.TemporaryDirectory(prefix="chronomq-bench-ha-") as d, \
            Cluster(Path(d), ["brokerRole=ASYNC_MASTER"], True) as c:
        res = asyncio.run(paced(c.ns, c.master_addr, args.rate, args.seconds))
    info, lags = res["info"], [x for x in res["lag_bytes_samples"] if x >= 0]
    print(f"replication at {res['rate']:,.0f} msgs/s (ASYNC_MASTER, {res['sent']:,} sent): "
          f"append -> slave ack p50 {info.get('haReplicationP50Ms', '-')} ms, "
          f"p99 {info.get('haReplicationP99Ms', '-')} ms, max {info.get('haReplicationMaxMs', '-')} ms; "
          f"lag in bytes every 50 ms: "
          f"median {statistics.median(lags) if lags else '-'}, max {max(lags) if lags else '-'}")
    if args.promotion:
        with tempfile.TemporaryDirectory(prefix="chronomq-bench-ha-") as d:
            r = asyncio.run(promotion(Path(d), args.promotion))
        print(f"promotion: {r['acked']:,} of {r['sent']:,} delayed messages acknowledged (half deliver-at "
              f"over 10 s, half level 3), master SIGKILLed with {r['received_before_kill']:,} delivered, "
              f"slave promoted in {r['promote_s']:.2f} s: lost {len(r['lost'])}, early {len(r['early'])}, "
              f"duplicates {r['duplicates']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
