"""The kill loop: a `chronomq start` under SYNC_FLUSH and load, SIGKILLed N times and restarted on its data.

Load (bench/workload.py): our client sends immediate messages, delay levels 1-2, deliver times with
cancels and reschedules, and batches; the official 4.x client (PyPI rocketmq 0.4.4, in .venv-compat)
sends immediate and delay-level messages; our push consumer reads everything. Small commit-log segments
and short persist intervals make the kills land in rolls and file writes. Some starts arm a fault point
(chronomq.store.faults) so the broker kills itself in the middle of a segment roll, a timer retention
pass, or a consumer-offset or delay-offset write. After the kills a clean restart (SIGTERM) with delayed
messages pending shows that neither the timer nor the level service stores a copy twice then.

A kill can cut the answer of a cancel, a reschedule or a send. After the kills, every cancel and
reschedule whose answer never came is asked again, and its definite answer settles it
(bench/workload.py); the verdict counts each answer. A
send whose answer never came was not acknowledged: when it was delivered all the same it is counted
apart (unacknowledged_delivered), neither as a loss nor as a duplicate.

Exits non-zero when an invariant breaks: an acknowledged message lost, a corrupt body, a delivery before
its time (a rescheduled one: before its new time), a cancelled message delivered, a cancel still
undecided after the settling, a copy stored twice after the clean restart. The last line holds the figures.

    .venv/bin/python bench/chaos.py --quick      # 10 kills (in the test suite)
    .venv/bin/python bench/chaos.py --full       # 100 kills (docs/reliability.md)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.workload import LEVEL_MS, Ledger, Mix, make_body, now_ms, read_official_acks, receipt_of  # noqa: E402

TOPIC = "ChaosTopic"
FAULTS = ("commitlog.roll=1", "timer.retention=1", "atomic.consumerOffset.json=1",
          "atomic.delayOffset.json=1")
CONFIG = {
    "flushDiskType": "SYNC_FLUSH",
    "mappedFileSizeCommitLog": str(256 * 1024),  # a roll every second or two under this load
    "flushConsumerOffsetInterval": "1000",
    "flushDelayOffsetInterval": "1000",
    "timerRetentionIntervalMs": "1000",
}


def official_producer(work: Path, ns: str, count: int, size: int, seconds: float) -> Any:
    """The official client's producer as a background driver; None when it cannot run here."""
    from tests.compat.harness import CompatUnavailable, start_driver

    specs = work / "official-messages.jsonl"
    with specs.open("w") as f:
        for i in range(count):
            level = (1, 0, 2, 0)[i % 4]
            kind = "level" if level else "now"
            f.write(json.dumps({"topic": TOPIC, "body": make_body("official", i, kind, 0, size).decode(),
                                **({"delay_level": level} if level else {})}) + "\n")
    try:
        d = start_driver("produce", {"namesrv": ns, "group": "chaos-official", "mode": "sync",
                                     "messages_file": str(specs), "interval_ms": 25, "deadline_s": seconds,
                                     "max_errors": 10**9, "timeout_ms": 2000,
                                     "out": str(work / "official-acks.jsonl")}, work)
    except CompatUnavailable as e:
        print(f"official client unavailable: {e}", flush=True)
        return None
    return d


def wait_for(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)  # polling a condition with a deadline
    return pred()


def _stop_quietly(proc: Any) -> None:
    """At exit: a driver the run did not stop (it failed midway) is stopped, whatever it says."""
    with contextlib.suppress(Exception):
        proc.stop(5)


async def chaos(args: argparse.Namespace) -> int:
    from tests.compat.harness import ChronomqProcess, DriverError

    from chronomq.client import Admin, Message, Producer, PushConsumer

    rng = random.Random(args.seed)
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="chronomq-chaos-"))
    server = ChronomqProcess(work / "data", CONFIG)
    atexit.register(server.stop, kill=True)  # a run that fails midway leaves no broker behind
    recoveries: list[float] = []
    faults_hit: dict[str, int] = {}
    faults_missed: dict[str, int] = {}

    def start(armed: str | None = None) -> bool:
        """Start on the data dir; False when an armed broker killed itself before it was ready (a fault
        point reached during recovery counts as reached)."""
        server.env = {"CHRONOMQ_FAULTS": armed} if armed else {}
        t = time.monotonic()
        try:
            server.start(timeout=120)
        except RuntimeError:
            if armed and not server.running and server.stop() == -9:
                return False
            raise
        recoveries.append(time.monotonic() - t)
        return True

    start()
    ns = server.namesrv_addr
    ledger = Ledger()
    kills = 0

    async def handle(message: object) -> None:
        receipt_of(ledger, message)

    official = None
    async with Admin(ns, request_timeout=5) as admin:
        await admin.create_topic(TOPIC, 4)
        est_seconds = args.kills * 4 + 60
        if not args.no_official:
            official = official_producer(work, ns, int(est_seconds * 40), args.size, est_seconds)
            if official is not None:
                atexit.register(_stop_quietly, official)
            if official is None and not args.allow_no_official:
                server.stop()
                return 2
        async with Producer("chaos-producer", namesrv=ns, send_timeout=3) as producer, \
                PushConsumer("chaos-consumer", TOPIC, handle, namesrv=ns, consume_from="first",
                             rebalance_interval=1, long_poll_timeout=2, offset_commit_interval=1):
            mix = Mix(ledger, ns, TOPIC, size=args.size, max_delay_s=8, cancel_every=5,
                      reschedule_every=7, seed=args.seed)
            stop = asyncio.Event()
            load = asyncio.create_task(mix.run(producer, admin, args.rate, 10**6, stop))
            for k in range(args.kills):
                armed = FAULTS[(k // 2) % len(FAULTS)] if k % 2 else None  # every other kill
                if armed:
                    # restart armed: the broker kills itself at the fault point (or we do, if not reached)
                    server.stop(kill=True)
                    up = await asyncio.to_thread(start, armed)
                    died = not up or await asyncio.to_thread(wait_for, lambda: not server.running,
                                                             args.fault_wait)
                    name = armed.split("=")[0] + ("" if up else " (during recovery)")
                    (faults_hit if died else faults_missed)[name] = \
                        (faults_hit if died else faults_missed).get(name, 0) + 1
                    server.stop(kill=True)
                else:
                    await asyncio.sleep(rng.uniform(0.5, args.max_run))
                    server.stop(kill=True)
                kills += 1
                await asyncio.to_thread(start)
                print(f"kill {kills}/{args.kills}{' at ' + armed if armed else ''}: restarted in "
                      f"{recoveries[-1]:.2f} s; acked {mix.stats.acked}, received {len(ledger.receipts)}",
                      flush=True)
            await asyncio.sleep(2)
            stop.set()
            await load
            official_sent = 0
            if official is not None:
                try:
                    result = await asyncio.to_thread(official.stop, 60)
                    official_sent = int(result.get("sent", 0))
                except DriverError as e:
                    # the C++ client can hang in its own shutdown after its sends (killed by stop): what
                    # it acknowledged is in its acks file all the same, and is checked like the rest
                    print(f"official producer: {str(e).splitlines()[0]}; its acks file is read as written",
                          flush=True)
                read_official_acks(work / "official-acks.jsonl", ledger, TOPIC, lambda i: 0)
            # the kills are over: every cancel or reschedule whose answer a kill cut gets its definite answer
            unsettled = await mix.settle(admin, args.settle)
            print(f"undecided cancels: {len(ledger.undecided)}, asked again: "
                  f"{dict(collections.Counter(ledger.settled.values())) or 'none'}; undecided reschedules: "
                  f"{len(ledger.reschedules_undecided)}, asked again: "
                  f"{dict(collections.Counter(ledger.reschedules_settled.values())) or 'none'}; "
                  f"still without an answer after {args.settle:g} s: {unsettled}", flush=True)
            # a clean restart with delayed messages pending: no copy may be stored twice across it
            final: set[str] = set()
            t0 = now_ms()
            for i in range(60):
                due = t0 + 3_000 + 40 * i
                body = make_body("final", i, "timed", due, args.size)
                res = await producer.send(Message(TOPIC, body, deliver_at=due))
                ledger.ack(res.msg_id, TOPIC, due)
                final.add(res.msg_id)
            for i in range(20):
                level = 1 + i % 2
                body = make_body("final", 100 + i, "level", now_ms() + LEVEL_MS[level], args.size)
                res = await producer.send(Message(TOPIC, body, delay_level=level))
                ledger.ack(res.msg_id, TOPIC, now_ms() + LEVEL_MS[level] - 50)
                final.add(res.msg_id)
            server.stop()
            await asyncio.to_thread(start)
            deadline = time.monotonic() + args.drain
            while ledger.outstanding and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # polling the ledger with a deadline
            await asyncio.sleep(2)  # a late second copy would arrive within this
    server.stop()
    v = ledger.verdict()
    clean = ledger.verdict(final)
    print(f"our sends: {mix.stats.attempts} attempted, {mix.stats.acked} acknowledged, errors "
          f"{mix.stats.errors or 'none'}; cancels asked {mix.stats.cancel_asked}; reschedules asked "
          f"{mix.stats.reschedule_asked}; official sends attempted "
          f"{official_sent}")
    print(f"fault points reached: {faults_hit or 'none'}; not reached in {args.fault_wait:g} s: "
          f"{faults_missed or 'none'}")
    print(f"clean restart: {clean.line()}")
    if v.examples:
        print(f"examples: {v.examples}")
    print(f"work dir {work}")
    good = v.ok and clean.restored == 0 and clean.ok
    print(f"chaos {'ok' if good else 'FAILED'}: kills={kills} {v.line()} "
          f"recovery_s(median/max)={statistics.median(recoveries):.2f}/{max(recoveries):.2f} "
          f"seconds={time.monotonic() - began:.0f}", flush=True)
    return 0 if good else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 kills (the default)")
    ap.add_argument("--full", action="store_true", help="100 kills")
    ap.add_argument("--kills", type=int)
    ap.add_argument("--rate", type=int, default=150, help="our client's messages per second")
    ap.add_argument("--size", type=int, default=300, help="body bytes")
    ap.add_argument("--max-run", type=float, default=3.0, help="longest run between kills, seconds")
    ap.add_argument("--fault-wait", type=float, default=20.0, help="seconds an armed broker has to die")
    ap.add_argument("--drain", type=float, default=90.0, help="seconds to wait for the last deliveries")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to get a definite answer to every cancel or reschedule a kill left "
                         "undecided")
    ap.add_argument("--seed", type=int, default=20261125)
    ap.add_argument("--no-official", action="store_true", help="our client only")
    ap.add_argument("--allow-no-official", action="store_true",
                    help="go on with our client only when the official one cannot run here")
    a = ap.parse_args()
    a.kills = a.kills or (100 if a.full else 10)
    return asyncio.run(chaos(a))


if __name__ == "__main__":
    sys.exit(main())
