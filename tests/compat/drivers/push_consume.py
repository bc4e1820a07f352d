"""Consume with the official 4.x push consumer (rocketmq==0.4.4).

args:
  namesrv, group, topic (required); expression (default "*"); props: extra property names to report;
  expect: stop after this many successfully consumed deliveries (omit: run until deadline or SIGTERM);
  deadline_s (default 60): hard bound; orderly (bool); broadcasting (bool); thread_count;
  instance_name; settle_s (default 0.5): after `expect` is reached, wait until no callback is running
  and this long has passed, so the client has recorded the last offset before it shuts down;
  out: JSONL path, one line per delivery (written as it happens, so a test can watch a long-running
  consumer), preceded by {"event": "started"};
  fail: {"mode": "reconsume_later", "times": k}: the first k deliveries of each message id return
        RECONSUME_LATER through a raw ctypes callback, later ones CONSUME_SUCCESS;
        {"mode": "raise", "times": k}: the Python callback raises instead (the wrapper's documented path).

SIGTERM/SIGINT: shut the consumer down cleanly (it commits its offsets and unregisters), then print
the result: {"messages": [deliveries...], "consumed": n, "failed": n, "reason", "started_ms"}.
Each delivery: the fields of _common.recv_to_dict plus "consumed" (false for a RECONSUME_LATER).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from _common import (
    JsonlWriter,
    StopFlag,
    emit_around_shutdown,
    fail,
    hard_exit,
    load_args,
    now_ms,
    recv_to_dict,
)


def main() -> None:
    args = load_args(("namesrv", "group", "topic"))
    stop = StopFlag()
    expect = args.get("expect")
    expect = int(expect) if expect is not None else None
    deadline = time.monotonic() + float(args.get("deadline_s", 60))
    props = list(args.get("props") or [])
    fail_cfg = args.get("fail") or {}
    fail_mode = fail_cfg.get("mode")
    if fail_mode not in (None, "reconsume_later", "raise"):
        fail(f"fail.mode must be reconsume_later or raise, not {fail_mode!r}")
    fail_times = int(fail_cfg.get("times", 1)) if fail_mode else 0

    from rocketmq.client import PushConsumer, RecvMessage
    from rocketmq.exceptions import ffi_check
    from rocketmq.ffi import MessageModel, dll

    model = MessageModel.BROADCASTING if args.get("broadcasting") else MessageModel.CLUSTERING
    consumer = PushConsumer(args["group"], orderly=bool(args.get("orderly")), message_model=model)
    consumer.set_namesrv_addr(args["namesrv"])
    if args.get("thread_count"):
        consumer.set_thread_count(int(args["thread_count"]))
    if args.get("instance_name"):
        consumer.set_instance_name(args["instance_name"])
    out = JsonlWriter(args.get("out"))
    lock = threading.Lock()
    deliveries: list[dict[str, Any]] = []
    failures: dict[str, int] = {}
    counts = {"consumed": 0, "failed": 0, "inflight": 0}
    reached = threading.Event()

    def record(msg: Any, consumed: bool) -> None:
        d = recv_to_dict(msg, props)
        d["consumed"] = consumed
        out.write(d)
        with lock:
            deliveries.append(d)
            counts["consumed" if consumed else "failed"] += 1
            if expect is not None and counts["consumed"] >= expect:
                reached.set()

    def enter() -> None:
        with lock:
            counts["inflight"] += 1

    def leave() -> None:
        with lock:
            counts["inflight"] -= 1

    def should_fail(msg: Any) -> bool:
        if not fail_mode:
            return False
        key = str(msg.id)
        with lock:
            n = failures.get(key, 0)
            if n < fail_times:
                failures[key] = n + 1
                return True
        return False

    topic = args["topic"]
    expression = args.get("expression", "*")
    if fail_mode == "reconsume_later":
        # A raw callback: its return value is what the C++ consumer sees (1 = RECONSUME_LATER).
        def raw(_consumer: Any, cmsg: Any) -> int:
            enter()
            try:
                msg = RecvMessage(cmsg)
                bad = should_fail(msg)
                record(msg, not bad)
                return 1 if bad else 0
            except Exception as e:  # never let an exception cross the ctypes boundary silently
                import sys
                sys.stderr.write(f"callback error: {e!r}\n")
                return 1
            finally:
                leave()

        ffi_check(dll.Subscribe(consumer._handle, topic.encode(), expression.encode()))
        consumer._register_callback(raw)
    else:
        def on_message(msg: Any) -> None:
            enter()
            try:
                bad = should_fail(msg)
                record(msg, not bad)
                if bad:
                    raise RuntimeError("compat driver: asked to fail this delivery")
            finally:
                leave()

        consumer.subscribe(topic, on_message, expression)

    consumer.start()
    started = now_ms()
    out.write({"event": "started", "ms": started})
    reason = "deadline"
    while True:
        if reached.wait(0.05):
            reason = "expect"
            break
        if stop.stopped:
            reason = "signal"
            break
        if time.monotonic() > deadline:
            break
    if reason == "expect":
        settle_until = time.monotonic() + float(args.get("settle_s", 0.5))
        while time.monotonic() < deadline:
            with lock:
                idle = counts["inflight"] == 0
            if idle and time.monotonic() >= settle_until:
                break
            time.sleep(0.02)
    def result() -> dict[str, Any]:
        with lock:
            return {"messages": list(deliveries), "consumed": counts["consumed"], "failed": counts["failed"],
                    "reason": reason, "started_ms": started}

    emit_around_shutdown(result, consumer.shutdown)
    out.close()
    hard_exit(0)


if __name__ == "__main__":
    main()
