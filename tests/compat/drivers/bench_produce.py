"""Load producer for bench/e2e.py (official 4.x client). Each body starts with the send time in ns as
20 ASCII digits and '|' (the wrapper's body getter stops at NUL, so the stamp is text), padded to
body_size.

args: namesrv, topic (required); group; mode "sync" | "batch"; count (messages, bounded); batch_size (64);
  body_size (1024); rate (messages/s for this producer, 0 = as fast as possible); start_at (epoch s: wait
  for it so that all producers begin together); deadline_s (hard bound, default 120); timeout_ms.
result: {"acked", "errors", "first_error", "t_start", "t_end"} (epoch seconds, first send / last ack)
"""

from __future__ import annotations

import time

from _common import StopFlag, emit, fail, hard_exit, load_args


def main() -> None:
    args = load_args(("namesrv", "topic"))
    mode = args.get("mode", "sync")
    if mode not in ("sync", "batch"):
        fail("mode must be sync or batch")
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
            if mode == "sync":
                sent += 1
                producer.send_sync(message())
                acked += 1
            else:
                n = min(batch_size, count - sent)
                sent += n
                producer.send_batch([message() for _ in range(n)])
                acked += n
        except Exception as e:
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            if errors > 100:
                break
    t_end = time.time()
    producer.shutdown()
    emit({"acked": acked, "errors": errors, "first_error": first_error, "t_start": t_start, "t_end": t_end})
    hard_exit(0)


if __name__ == "__main__":
    main()
