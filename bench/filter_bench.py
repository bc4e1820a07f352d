"""Server-side filter cost: PULL_MESSAGE rates over one queue of N messages with no filter, a TAG
filter and SQL92 filters (enablePropertyFilter=true), and the bare cost of one SQL92 evaluation.

An in-process BrokerController (real store in a temporary directory, nothing on the network): the queue
is filled first, then each scenario pulls it from offset 0 to the end, 32 per request, through the
broker's PULL_MESSAGE handler (topic checks, the filters, the store read, the answer's body), following
nextBeginOffset. Printed per scenario: pulls/s, messages scanned/s (the queue entries the pulls walked)
and messages delivered/s, and the ratio of scan rates to the unfiltered pull. Rates are per second of
the process's CPU time (the fastest of --repeat runs), so a machine busy with other work skews them
less than wall time would; the wall-clock rate of the same run is printed too.

    .venv/bin/python bench/filter_bench.py              # 20,000 messages
    .venv/bin/python bench/filter_bench.py --full       # 1,000,000 messages
    .venv/bin/python bench/filter_bench.py --count 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from chronomq.broker.controller import BrokerController
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.filter import compile_sql92
from chronomq.message import MessageExt
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

TOPIC = "FilterBench"
BODY = b"b" * 256
REGIONS = ("eu", "us", "ap", "sa")

# (name, expression type, expression): each pulls the whole queue
SCENARIOS = [
    ("no filter", "TAG", "*"),
    ("TAG TagA (1 in 2)", "TAG", "TagA"),
    ("SQL TRUE (all)", "SQL92", "TRUE"),
    ("SQL TAGS = 'TagA' (1 in 2)", "SQL92", "TAGS = 'TagA'"),
    ("SQL n < 10 (1 in 10)", "SQL92", "n < 10"),
    ("SQL 4 terms (~1 in 2)", "SQL92",
     "n BETWEEN 10 AND 59 AND region IN ('eu', 'us') OR (TAGS = 'TagB' AND n >= 95)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _message(i: int) -> MessageExt:
    props = {"TAGS": "TagA" if i % 2 == 0 else "TagB", "n": str(i % 100), "region": REGIONS[i % 4],
             "UNIQ_KEY": f"7F0000010000{i:020X}", "KEYS": f"k{i}"}
    return MessageExt(topic=TOPIC, body=BODY, queue_id=0, properties=props,
                      born_timestamp=1_700_000_000_000, born_host=("127.0.0.1", 40000))


def _fill(broker: BrokerController, count: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, count, 1000):
        r = broker.store.put_messages([_message(i) for i in range(start, min(count, start + 1000))])
        assert r.ok, r
    store = broker.store
    assert store.wait_dispatched(store.max_phy_offset, 120)
    return time.perf_counter() - t0


def _pull_all(broker: BrokerController, expression_type: str, expression: str,
              count: int) -> tuple[int, int, float, float]:
    pull = broker.processor.pull.pull_message
    offset = pulls = delivered = 0
    t0, w0 = time.process_time(), time.perf_counter()
    while offset < count:
        req = RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "BenchG", "topic": TOPIC, "queueId": 0, "queueOffset": offset, "maxMsgNums": 32,
            "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": expression,
            "subVersion": 0, "expressionType": expression_type})
        resp = pull(req, None)  # type: ignore[arg-type]
        assert resp is not None and resp.code in (ResponseCode.SUCCESS, ResponseCode.PULL_RETRY_IMMEDIATELY,
                                                  ResponseCode.PULL_NOT_FOUND), (resp.code, resp.remark)
        if resp.code == ResponseCode.SUCCESS:
            delivered += _records_in(resp.body)
        pulls += 1
        nxt = int(resp.ext_fields["nextBeginOffset"])
        if nxt <= offset:
            break
        offset = nxt
    return pulls, delivered, time.process_time() - t0, time.perf_counter() - w0


def _records_in(body: bytes) -> int:
    n = pos = 0
    while pos < len(body):
        pos += int.from_bytes(body[pos:pos + 4], "big")
        n += 1
    return n


def _evaluations_per_second(expression: str, seconds: float = 0.5) -> float:
    sel = compile_sql92(expression)
    props = _message(7).properties
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        for _ in range(1000):
            sel.matches(props)
        n += 1000
    return n / (time.process_time() - t0)


async def _run(count: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory(prefix="chronomq-filter-bench-") as d:
        values = {"storePathRootDir": d, "listenPort": str(_free_port()), "metricsPort": "-1",
                  "grpcListenPort": "-1", "enablePropertyFilter": "true", "longPollingEnable": "false"}
        config, _ = BrokerConfig.load(None, values)
        broker = BrokerController(config, SystemClock())
        await broker.start()
        try:
            fill = await asyncio.to_thread(_fill, broker, count)
            print(f"{count:,} messages of {len(BODY)} B, 5 properties, filled in {fill:.1f} s; "
                  f"load average {os.getloadavg()[0]:.2f}")
            print(f"{'scenario (per CPU second)':<30} {'pulls/s':>10} {'scanned/s':>12} {'delivered/s':>12}"
                  f" {'delivered':>10} {'vs none':>8} {'wall scanned/s':>15}")
            base = None
            for name, etype, expr in SCENARIOS:
                runs = [_pull_all(broker, etype, expr, count) for _ in range(repeat)]
                pulls, delivered, _, _ = runs[0]
                secs = min(r[2] for r in runs)
                wall = min(r[3] for r in runs)
                scan_rate = count / secs
                base = base or scan_rate
                print(f"{name:<30} {pulls / secs:>10,.0f} {scan_rate:>12,.0f} {delivered / secs:>12,.0f}"
                      f" {delivered:>10,} {scan_rate / base:>7.2f}x {count / wall:>15,.0f}")
            print("one SQL92 evaluation over a 5-property dict (Selector.matches):")
            for _, etype, expr in SCENARIOS:
                if etype == "SQL92":
                    print(f"  {expr[:60]:<60} {_evaluations_per_second(expr):>12,.0f} /s")
            print(f"load average {os.getloadavg()[0]:.2f}")
        finally:
            await broker.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20_000, help="messages in the queue (default 20,000)")
    ap.add_argument("--full", action="store_true", help="1,000,000 messages")
    ap.add_argument("--repeat", type=int, default=3, help="pulls of the whole queue per scenario (fastest)")
    args = ap.parse_args()
    asyncio.run(_run(1_000_000 if args.full else args.count, max(1, args.repeat)))


if __name__ == "__main__":
    main()
