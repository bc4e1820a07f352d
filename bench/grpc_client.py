"""The official RocketMQ 5.x Python client (PyPI rocketmq-python-client 5.1.2, gRPC) against a real
`chronomq start` with its gRPC endpoint on loopback.

  send     --count 1 KiB messages, Producer.send_async with --window sends in flight; msgs/s
  receive  the same messages with one SimpleConsumer (batch 32, ack_async each); msgs/s
  timed    --timed messages paced at --rate/s, each due --delay-ms after its send (delivery_timestamp in
           ms), to a one-queue topic read by a SimpleConsumer long-polling on it; lateness = receipt
           (the consumer's wall clock when receive() returned) - due time, p50/p99/max, and early ones

Each phase is bounded (count and a deadline). The figures depend on the machine and its load: the load
average at the start and the commit are printed with them.

    .venv/bin/python bench/grpc_client.py [--count 5000] [--timed 500] [--rate 50] [--quick]

Exit code 2 when the 5.x client cannot be installed here. `--driver` is internal: it runs the client
side in the 5.x client's venv (tests/compat/harness.py grpc5_python()).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BODY = b"x" * 1024
OPEN: list[Any] = []  # the driver's clients: shut down after its result is printed (5.x shutdowns can crash)


# --- client side: runs in the 5.x venv (python bench/grpc_client.py --driver <mode> '<json>') ----------
def _config(args: dict[str, Any]) -> Any:
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(args["endpoint"], Credentials())


def driver_send(args: dict[str, Any]) -> dict[str, Any]:
    from rocketmq import Message, Producer

    topic, count, window = args["topic"], int(args["count"]), int(args["window"])
    producer = Producer(_config(args), (topic,))
    producer.startup()
    OPEN.append(producer)
    errors: list[str] = []
    lock = threading.Lock()
    slots = threading.Semaphore(window)

    def message() -> Any:
        m = Message()
        m.topic = topic
        m.body = BODY
        return m

    def done(fut: Any) -> None:
        slots.release()
        exc = fut.exception()
        if exc is not None:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    producer.send(message())  # warm: route and channel
    deadline = time.monotonic() + float(args.get("deadline_s", 120))
    t0 = time.monotonic()
    sent = 0
    while sent < count and time.monotonic() < deadline:
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
        producer.send_async(message()).add_done_callback(done)
        sent += 1
    for _ in range(window):  # every send answered
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    seconds = time.monotonic() - t0
    return {"sent": sent, "errors": errors[:5], "error_count": len(errors), "seconds": seconds}


def driver_receive(args: dict[str, Any]) -> dict[str, Any]:
    from rocketmq import FilterExpression, SimpleConsumer

    topic, count = args["topic"], int(args["count"])
    consumer = SimpleConsumer(_config(args), args["group"], {topic: FilterExpression("*")}, await_duration=2)
    consumer.startup()
    OPEN.append(consumer)
    got = 0
    errors: list[str] = []
    sizes: list[int] = []
    idle = 0.0  # time in receives that found nothing (a drained queue's long poll)
    deadline = time.monotonic() + float(args.get("deadline_s", 120))
    t0 = time.monotonic()
    while got < count and time.monotonic() < deadline:
        t = time.monotonic()
        try:
            msgs = consumer.receive(32, 30)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if not msgs:
            idle += time.monotonic() - t
        for m in msgs:
            consumer.ack_async(m)
        got += len(msgs)
        sizes.append(len(msgs))
    seconds = time.monotonic() - t0
    return {"received": got, "seconds": seconds, "errors": errors[:5], "receives": len(sizes),
            "empty": sizes.count(0), "idle": idle}


def driver_timed(args: dict[str, Any]) -> dict[str, Any]:
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    topic, count, rate = args["topic"], int(args["count"]), float(args["rate"])
    delay_ms = int(args["delay_ms"])
    cfg = _config(args)
    consumer = SimpleConsumer(cfg, args["group"], {topic: FilterExpression("*")}, await_duration=5)
    consumer.startup()
    producer = Producer(cfg, (topic,))
    producer.startup()
    OPEN.extend((producer, consumer))
    lateness: list[float] = []
    stop = threading.Event()
    deadline = time.monotonic() + count / rate + delay_ms / 1000 + float(args.get("slack_s", 60))

    seen: set[bytes] = set()

    def consume() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())  # the client's ack_async wants one in this thread
        while len(lateness) < count and time.monotonic() < deadline and not stop.is_set():
            try:
                msgs = consumer.receive(32, 30)
                now = time.time() * 1000
                for m in msgs:
                    if m.body not in seen:  # a redelivery is not a delivery
                        seen.add(m.body)
                        lateness.append(now - int(m.body.decode()))
                    consumer.ack_async(m)
            except Exception as e:
                errors.append(f"receive: {type(e).__name__}: {e}")

    errors: list[str] = []
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        t0 = time.monotonic()
        for i in range(count):
            pause = t0 + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # the pace of the sends
            due = int(time.time() * 1000) + delay_ms
            m = Message()
            m.topic = topic
            m.body = str(due).encode()
            m.delivery_timestamp = due  # ms: chronomq reads a "seconds" value above 10^11 as ms
            try:
                producer.send(m)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        reader.join(max(0.0, deadline - time.monotonic()))
    finally:
        stop.set()
        reader.join(10)
    return {"lateness_ms": lateness, "errors": errors[:5], "error_count": len(errors)}


DRIVERS = {"send": driver_send, "receive": driver_receive, "timed": driver_timed}


# --- server side ------------------------------------------------------------------------------------------
def pct(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def run_driver(py: str, mode: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run([py, str(Path(__file__).resolve()), "--driver", mode, json.dumps(args)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0:
        if not lines or not lines[-1].startswith("{"):
            raise RuntimeError(f"driver {mode} failed ({r.returncode}): {r.stderr[-3000:]}")
        print(f"note: the {mode} driver exited {r.returncode} after its result (the client's shutdown)",
              file=sys.stderr)
    return dict(json.loads(lines[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=5000, help="messages sent, then received")
    ap.add_argument("--window", type=int, default=64, help="async sends in flight")
    ap.add_argument("--timed", type=int, default=500, help="timed messages")
    ap.add_argument("--rate", type=float, default=50.0, help="timed messages sent per second")
    ap.add_argument("--delay-ms", type=int, default=2000, help="timed: due this long after the send")
    ap.add_argument("--quick", action="store_true", help="1,000 messages and 100 timed ones")
    ap.add_argument("--driver", nargs=2, metavar=("MODE", "JSON"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.driver:
        print(json.dumps(DRIVERS[a.driver[0]](json.loads(a.driver[1]))), flush=True)
        for client in OPEN:
            client.shutdown()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: the client's threads can crash it
    if a.quick:
        a.count, a.timed = 1000, 100

    sys.path.insert(0, str(REPO))
    from tests.compat.harness import ChronomqProcess, CompatUnavailable, RawClient, free_port, grpc5_python

    try:
        py = grpc5_python()
    except CompatUnavailable as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="chronomq-bench-grpc-") as tmp:
        port = free_port()
        server = ChronomqProcess(Path(tmp) / "data", {"grpcListenPort": str(port)}).start()
        try:
            endpoint = f"127.0.0.1:{port}"
            run = uuid.uuid4().hex[:6]
            topic, timed_topic = f"BenchGrpc{run}", f"BenchGrpcTimed{run}"
            # created first: the endpoint answers a route query of a missing topic with TOPIC_NOT_FOUND
            with RawClient(server.broker_addr) as raw:  # the timed topic: one queue, read by one long poll
                for name, queues in ((topic, "4"), (timed_topic, "1")):
                    r = raw.call(17, {"topic": name, "readQueueNums": queues, "writeQueueNums": queues,
                                      "perm": "6"})
                    if r.code != 0:
                        raise RuntimeError(f"cannot create {name}: {r.remark}")
            base = {"endpoint": endpoint, "deadline_s": 240}
            sent = run_driver(py, "send", {**base, "topic": topic, "count": a.count, "window": a.window}, 300)
            got = run_driver(py, "receive", {**base, "topic": topic, "group": f"BenchG{run}",
                                             "count": sent["sent"] + 1}, 300)
            timed_args = {"endpoint": endpoint, "topic": timed_topic, "group": f"BenchT{run}",
                          "count": a.timed, "rate": a.rate, "delay_ms": a.delay_ms}
            timed = run_driver(py, "timed", timed_args, a.timed / a.rate + a.delay_ms / 1000 + 120)
        finally:
            server.stop()
    late = timed["lateness_ms"]
    print(f"commit {commit}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start, "
          f"{os.cpu_count()} CPUs")
    print(f"send:    {sent['sent']} x 1 KiB, window {a.window}: {sent['sent'] / sent['seconds']:.0f} msgs/s "
          f"({sent['seconds']:.2f} s, {sent['error_count']} errors {sent['errors']})")
    busy = got["seconds"] - got["idle"]
    print(f"receive: {got['received']} (batch 32, ack_async): {got['received'] / got['seconds']:.0f} msgs/s "
          f"({got['seconds']:.2f} s, {got['receives']} receives); without the {got['empty']} empty long polls"
          f" ({got['idle']:.1f} s on drained queues) {got['received'] / max(busy, 1e-9):.0f} msgs/s;"
          f" errors {got['errors']}")
    print(f"timed:   {len(late)}/{a.timed} at {a.rate:g}/s due {a.delay_ms} ms after the send: lateness "
          f"p50 {pct(late, 50):.0f} ms, p99 {pct(late, 99):.0f} ms, max {max(late, default=math.nan):.0f} ms,"
          f" "
          f"early {sum(1 for x in late if x < 0)} ({timed['error_count']} send errors {timed['errors']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
