"""Load producer for bench/e2e.py (official 4.x client). Each body starts with the send time in ns as
20 ASCII digits and '|' (the wrapper's body getter stops at NUL, so the stamp is text), padded to
body_size.

args: namesrv, topic (required); group; mode "sync" | "batch" | "async"; count (messages, bounded);
  max_inflight (async: bound on unacknowledged sends, default 256); batch_size (64);
  body_size (1024); rate (messages/s for this producer, 0 = as fast as possible); start_at (epoch s: wait
  for it so that all producers begin together); deadline_s (hard bound, default 120); timeout_ms.
result: {"acked", "errors", "first_error", "t_start", "t_end"} (epoch seconds, first send / last ack)
"""

from __future__ import annotations

import collections
import threading
import time

from _common import FirstSendGuard, StopFlag, emit, fail, hard_exit, load_args


def main() -> None:
    args = load_args(("namesrv", "topic"))
    mode = args.get("mode", "sync")
    if mode not in ("sync", "batch", "async"):
        fail("mode must be sync, batch or async")
    count = int(args.get("count", 1000))
    if not 0 < count <= 5_000_000:
        fail("count must be in 1..5000000")
    batch_size = max(1, int(args.get("batch_size", 64)))
    body_size = max(21, int(args.get("body_size", 1024)))
    rate = float(args.get("rate", 0))
    stop = StopFlag()

    from rocketmq.client import Message, Producer
    from rocketmq.ffi import dll

    producer = Producer(str(args.get("group", "PG_bench")), timeout=int(args.get("timeout_ms", 5000)))
    producer.set_namesrv_addr(args["namesrv"])
    producer.start()
    topic = args["topic"]
    pad = b"x" * (body_size - 21)

    def message() -> Message:
        m = Message(topic)
        body = b"%020d|" % time.time_ns() + pad
        dll.SetByteMessageBody(m._handle, body, len(body))
        return m

    start_at = float(args.get("start_at", 0))
    while time.time() < start_at and not stop.stopped:
        time.sleep(min(0.005, max(0.0, start_at - time.time())))
    deadline = time.monotonic() + float(args.get("deadline_s", 120))
    acked = errors = 0
    first_error = None
    guard = FirstSendGuard()
    max_inflight = max(1, int(args.get("max_inflight", 256)))
    window = threading.BoundedSemaphore(max_inflight)
    lock = threading.Lock()
    done = {"acked": 0, "errors": 0, "first_error": None, "t_last": 0.0}
    keep: collections.deque = collections.deque(maxlen=20_000)  # messages of in-flight async sends

    def on_ok(_res: object) -> None:
        with lock:
            done["acked"] += 1
            done["t_last"] = time.time()
        window.release()

    def on_err(exc: BaseException) -> None:
        with lock:
            done["errors"] += 1
            done["first_error"] = done["first_error"] or f"{type(exc).__name__}: {exc}"
        window.release()

    t_start = time.time()
    t0 = time.monotonic()
    sent = 0
    while sent < count and not stop.stopped and time.monotonic() < deadline:
        if rate > 0:
            due = t0 + sent / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        try:
            if mode == "async":
                if not window.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    break
                m = message()
                keep.append(m)
                sent += 1
                try:
                    producer.send_async(m, on_ok, on_err)
                except Exception:
                    window.release()
                    raise
            elif mode == "sync":
                sent += 1
                guard.call(producer.send_sync, message())
                acked += 1
            else:
                n = min(batch_size, count - sent)
                sent += n
                guard.call(producer.send_batch, [message() for _ in range(n)])
                acked += n
        except Exception as e:
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            if errors > 100:
                break
    t_end = time.time()
    if mode == "async":  # wait for the outstanding callbacks (bounded)
        for _ in range(max_inflight):
            if not window.acquire(timeout=max(0.0, deadline - time.monotonic()) + 10):
                break
        with lock:
            acked, errors = done["acked"], errors + done["errors"]
            first_error = first_error or done["first_error"]
            t_end = max(t_end, done["t_last"])
    producer.shutdown()
    emit({"acked": acked, "errors": errors, "first_error": first_error, "t_start": t_start, "t_end": t_end,
          "first_send_retries": guard.retries})
    hard_exit(0)


if __name__ == "__main__":
    main()
