"""Send messages with the official 4.x client (rocketmq==0.4.4).

args:
  namesrv (str, required), group (str, default "PG_compat"),
  mode: "sync" | "async" | "oneway" | "orderly" | "batch"   (default "sync")
  messages: [ {topic, body | body_b64, keys, tags, props{}, delay_level, arg (orderly)} ... ]
    or messages_file: a JSONL file of such specs (one per line, for more than fits on a command line)
    or generate: {topic, count, body_size, prefix, keys (bool), tags}  (messages built from the index)
  batch_size (batch mode, default 16), timeout_ms (send timeout, default 3000),
  deadline_s (overall bound, default 60), out (optional JSONL path: one line per acknowledged send),
  stop_on_error (default false: record the error and go on), max_errors (default 50),
  interval_ms (sync/oneway/orderly: pause between sends, for a paced background producer),
  credentials: [access key, secret key, channel] for a broker with aclEnable (set_session_credentials),
  barrier: a message spec sent with send_sync after the others (same connection, so its answer means
    the broker has read every earlier oneway frame; the client may drop unsent oneway frames at shutdown)
SIGTERM/SIGINT: stop sending, shut down, print the result.

result: {"mode", "sent": attempted, "acked": n, "results": [{index, status, msg_id, offset}...],
         "errors": [{index, error}...], "elapsed_s"}
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from _common import (
    ArgError,
    FirstSendGuard,
    JsonlWriter,
    StopFlag,
    emit,
    fail,
    hard_exit,
    load_args,
    make_message,
)

MODES = ("sync", "async", "oneway", "orderly", "batch")


def build_specs(args: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages_file" in args:
        with open(str(args["messages_file"]), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if "messages" in args:
        specs = args["messages"]
        if not isinstance(specs, list):
            raise ArgError("messages must be a list")
        return specs
    gen = args.get("generate")
    if not isinstance(gen, dict) or "topic" not in gen or "count" not in gen:
        raise ArgError("give messages or generate {topic, count}")
    count = int(gen["count"])
    if count < 0 or count > 10_000_000:
        raise ArgError("generate.count out of range")
    size = int(gen.get("body_size", 0))
    prefix = str(gen.get("prefix", "m"))
    specs = []
    for i in range(count):
        head = f"{prefix}-{i}"
        body = head + "x" * max(0, size - len(head)) if size else head
        spec: dict[str, Any] = {"topic": gen["topic"], "body": body}
        if gen.get("keys"):
            spec["keys"] = head
        if gen.get("tags"):
            spec["tags"] = gen["tags"]
        if "arg" in gen:
            spec["arg"] = i
        specs.append(spec)
    return specs


def main() -> None:
    args = load_args(("namesrv",))
    mode = args.get("mode", "sync")
    if mode not in MODES:
        fail(f"mode must be one of {MODES}, not {mode!r}")
    try:
        specs = build_specs(args)
    except (ArgError, ValueError, TypeError) as e:
        fail(str(e))
    batch_size = int(args.get("batch_size", 16))
    if batch_size < 1:
        fail("batch_size must be >= 1")
    deadline = time.monotonic() + float(args.get("deadline_s", 60))
    stop_on_error = bool(args.get("stop_on_error", False))
    max_errors = int(args.get("max_errors", 50))
    interval = float(args.get("interval_ms", 0)) / 1000.0
    stop = StopFlag()

    from rocketmq.client import Producer

    producer = Producer(str(args.get("group", "PG_compat")), timeout=int(args.get("timeout_ms", 3000)))
    producer.set_namesrv_addr(args["namesrv"])
    if args.get("credentials"):  # [access key, secret key, channel]: every request signed (ACL)
        producer.set_session_credentials(*args["credentials"])
    producer.start()
    out = JsonlWriter(args.get("out"))
    guard = FirstSendGuard()
    results: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    lock = threading.Lock()
    sent = 0
    t0 = time.monotonic()

    def ack(index: int, res: Any) -> None:
        r = {"index": index, "status": int(res.status), "msg_id": res.msg_id, "offset": res.offset}
        with lock:
            results.append(r)
        out.write(r)

    def error(index: int, exc: BaseException) -> None:
        with lock:
            errors.append({"index": index, "error": f"{type(exc).__name__}: {exc}"})

    try:
        if mode == "batch":
            for start in range(0, len(specs), batch_size):
                if time.monotonic() > deadline or (errors and stop_on_error) or len(errors) >= max_errors:
                    break
                if stop.stopped:
                    break
                msgs = [make_message(s) for s in specs[start:start + batch_size]]
                sent += len(msgs)
                try:
                    res = guard.call(producer.send_batch, msgs)
                    r = {"index": start, "count": len(msgs), "status": int(res.status),
                         "msg_id": res.msg_id, "offset": res.offset}
                    results.append(r)
                    out.write(r)
                except Exception as e:
                    error(start, e)
        elif mode == "async":
            done = threading.Semaphore(0)
            keep: list[Any] = []
            for i, spec in enumerate(specs):
                if time.monotonic() > deadline or len(errors) >= max_errors:
                    break
                msg = make_message(spec)
                keep.append(msg)

                def on_ok(res: Any, i: int = i) -> None:
                    ack(i, res)
                    done.release()

                def on_err(exc: BaseException, i: int = i) -> None:
                    error(i, exc)
                    done.release()

                producer.send_async(msg, on_ok, on_err)
                sent += 1
            for _ in range(sent):  # every callback, bounded by the deadline (+ the send timeout)
                if not done.acquire(timeout=max(0.1, deadline - time.monotonic()) + 5):
                    break
            # the wrapper's callbacks drop their own references; keep messages alive until here
            del keep
        else:
            for i, spec in enumerate(specs):
                if time.monotonic() > deadline or (errors and stop_on_error) or len(errors) >= max_errors:
                    break
                if stop.stopped or (interval and i and stop.wait(interval)):
                    break
                msg = make_message(spec)
                sent += 1
                try:
                    if mode == "sync":
                        ack(i, guard.call(producer.send_sync, msg))
                    elif mode == "orderly":
                        ack(i, guard.call(producer.send_orderly, msg, int(spec.get("arg", i))))
                    else:
                        guard.call(producer.send_oneway, msg)
                except Exception as e:
                    error(i, e)
        if args.get("barrier") and not stop.stopped:
            try:
                res = producer.send_sync(make_message(args["barrier"]))
                results.append({"index": len(specs), "status": int(res.status), "msg_id": res.msg_id,
                                "offset": res.offset, "barrier": True})
            except Exception as e:
                error(len(specs), e)
    finally:
        elapsed = time.monotonic() - t0
        out.close()
    # The result is printed *before* the client's shutdown: rocketmq-client-cpp 1.2.x sometimes aborts in
    # shutdown (terminate after 'boost::thread_interrupted'), which must not lose the acknowledgements.
    # The harness accepts such a crash only after a result flagged before_shutdown, and reports it.
    with lock:
        results.sort(key=lambda r: r["index"])
        emit({"mode": mode, "sent": sent, "acked": len(results), "results": list(results),
              "errors": list(errors), "elapsed_s": elapsed, "first_send_retries": guard.retries,
              "before_shutdown": True})
    try:
        producer.shutdown()
    except Exception as e:
        sys.stderr.write(f"producer shutdown failed: {e}\n")
    hard_exit(0)


if __name__ == "__main__":
    main()
