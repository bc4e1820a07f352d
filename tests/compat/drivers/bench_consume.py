"""Latency consumer for bench/e2e.py (official 4.x push consumer). Reads the send time (ns, 20 ASCII
digits) at the start of each body; latency = receipt time - send time (same host clock).

args: namesrv, group, topic (required); deadline_s (default 300); thread_count; out: JSONL progress file
  ({"event": "started"}, then {"count": n, "warm": w} about every 0.2 s).
Bodies starting with "warm" are counted separately and excluded from the latency figures.
SIGTERM: shut down and print {"count", "warm", "p50_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms",
  "first_recv", "last_recv"}.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from _common import JsonlWriter, StopFlag, emit, hard_exit, load_args


def pct(sorted_vals: list[float], p: float) -> float | None:
    if not sorted_vals:
        return None
    k = min(len(sorted_vals) - 1, max(0, math.ceil(p / 100.0 * len(sorted_vals)) - 1))  # nearest rank
    return sorted_vals[k]


def main() -> None:
    args = load_args(("namesrv", "group", "topic"))
    stop = StopFlag()
    deadline = time.monotonic() + float(args.get("deadline_s", 300))

    from rocketmq.client import PushConsumer

    lat: list[float] = []
    state = {"warm": 0, "first": 0.0, "last": 0.0}
    lock = threading.Lock()

    def on_message(msg: Any) -> None:
        now = time.time_ns()
        body = msg.body
        with lock:
            if body[:4] == b"warm":
                state["warm"] += 1
                return
            lat.append((now - int(body[:20])) / 1e6)
            if not state["first"]:
                state["first"] = now / 1e9
            state["last"] = now / 1e9

    consumer = PushConsumer(args["group"])
    consumer.set_namesrv_addr(args["namesrv"])
    if args.get("thread_count"):
        consumer.set_thread_count(int(args["thread_count"]))
    consumer.subscribe(args["topic"], on_message)
    consumer.start()
    out = JsonlWriter(args.get("out"))
    out.write({"event": "started"})
    while not stop.wait(0.2) and time.monotonic() < deadline:
        with lock:
            out.write({"count": len(lat), "warm": state["warm"]})
    consumer.shutdown()
    with lock:
        vals = sorted(lat)
        emit({"count": len(vals), "warm": state["warm"], "p50_ms": pct(vals, 50), "p99_ms": pct(vals, 99),
              "p999_ms": pct(vals, 99.9), "max_ms": vals[-1] if vals else None,
              "mean_ms": sum(vals) / len(vals) if vals else None,
              "first_recv": state["first"], "last_recv": state["last"]})
    out.close()
    hard_exit(0)


if __name__ == "__main__":
    main()
