"""Official 4.x client side of bench/client.py (runs in the compat venv).

args: namesrv, topic (required); role "produce" | "consume"; group.
  produce: mode "sync" | "async" | "batch"; count; body_size (1024); body_kind "random" (base64 of random
           bytes: printable, hardly compressible) | "x" (a run of x: compresses ~100x); batch_size (64);
           window (async: max sends in flight, default 64); deadline_s (default 120)
  consume: count (stop after this many); deadline_s; thread_count
result: produce {"acked", "errors", "first_error", "elapsed_s"}; consume {"count", "elapsed_s"}
        (consume: from start() to the count-th message)
"""

from __future__ import annotations

import threading
import time

from _common import emit, fail, hard_exit, load_args


def produce(args: dict) -> None:
    from rocketmq.client import Message, Producer
    from rocketmq.ffi import dll

    mode = args.get("mode", "sync")
    if mode not in ("sync", "async", "batch"):
        fail("mode must be sync, async or batch")
    count = int(args.get("count", 1000))
    if not 0 < count <= 5_000_000:
        fail("count must be in 1..5000000")
    size = int(args.get("body_size", 1024))
    if args.get("body_kind", "random") == "random":  # printable, hardly compressible (no NUL bytes)
        import base64
        import os

        body = base64.b64encode(os.urandom(size))[:size]
    else:
        body = b"x" * size
    batch_size = max(1, int(args.get("batch_size", 64)))
    window = threading.Semaphore(max(1, int(args.get("window", 64))))
    deadline = time.monotonic() + float(args.get("deadline_s", 120))
    producer = Producer(str(args.get("group", "PG_cbench")), timeout=10000)
    producer.set_namesrv_addr(args["namesrv"])
    producer.start()
    topic = args["topic"]

    def message() -> Message:
        m = Message(topic)
        dll.SetByteMessageBody(m._handle, body, len(body))
        return m

    # warm up: route lookup and connection
    producer.send_sync(message())
    lock = threading.Lock()
    state = {"acked": 0, "errors": 0, "first_error": None}
    done = threading.Semaphore(0)
    keep = []
    t0 = time.monotonic()
    sent = 0
    while sent < count and time.monotonic() < deadline:
        try:
            if mode == "sync":
                producer.send_sync(message())
                state["acked"] += 1
                sent += 1
            elif mode == "batch":
                n = min(batch_size, count - sent)
                producer.send_batch([message() for _ in range(n)])
                state["acked"] += n
                sent += n
            else:
                window.acquire()
                msg = message()
                keep.append(msg)

                def ok(_res: object) -> None:
                    with lock:
                        state["acked"] += 1
                    window.release()
                    done.release()

                def err(e: BaseException) -> None:
                    with lock:
                        state["errors"] += 1
                        state["first_error"] = state["first_error"] or repr(e)
                    window.release()
                    done.release()

                producer.send_async(msg, ok, err)
                sent += 1
        except Exception as e:
            state["errors"] += 1
            state["first_error"] = state["first_error"] or repr(e)
            if state["errors"] > 100:
                break
    if mode == "async":
        for _ in range(sent):
            if not done.acquire(timeout=max(0.1, deadline - time.monotonic()) + 10):
                break
    elapsed = time.monotonic() - t0
    producer.shutdown()
    emit({**state, "elapsed_s": elapsed})
    hard_exit(0)


def consume(args: dict) -> None:
    from rocketmq.client import PushConsumer

    count = int(args.get("count", 1000))
    deadline = time.monotonic() + float(args.get("deadline_s", 120))
    consumer = PushConsumer(str(args.get("group", "CG_cbench")))
    consumer.set_namesrv_addr(args["namesrv"])
    if args.get("thread_count"):
        consumer.set_thread_count(int(args["thread_count"]))
    lock = threading.Lock()
    got = {"n": 0}
    reached = threading.Event()

    def on_message(_msg: object) -> None:
        with lock:
            got["n"] += 1
            if got["n"] >= count:
                reached.set()

    consumer.subscribe(args["topic"], on_message)
    t0 = time.monotonic()
    consumer.start()
    reached.wait(max(0.1, deadline - time.monotonic()))
    elapsed = time.monotonic() - t0
    consumer.shutdown()
    emit({"count": got["n"], "elapsed_s": elapsed})
    hard_exit(0)


def main() -> None:
    args = load_args(("namesrv", "topic"))
    if args.get("role", "produce") == "produce":
        produce(args)
    else:
        consume(args)


if __name__ == "__main__":
    main()
