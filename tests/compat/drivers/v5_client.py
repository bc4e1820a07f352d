"""Drive the official RocketMQ 5.x Python client (rocketmq-python-client) against chronomq's gRPC endpoint.

args: endpoint (host:port of the gRPC endpoint, required), mode: "produce" | "receive".
produce: topic, messages: [{body, tag, keys [..], props {..}, group (FIFO), delay_s (delivery time = now +
  delay_s, epoch seconds, as the client's docs say), recall (bool: recall it right after the send)}]
  -> {"results": [{index, message_id, offset, recall_handle, recalled}], "errors": [{index, error}]}
transaction: topic, messages: [{body, decision: "commit" | "rollback" | "orphan" (sent and left undecided:
  the broker's check asks the producer's TransactionChecker, which answers check_answer, default commit)}],
  then, when verify_group is given, a SimpleConsumer of that group receives expect messages while the
  producer is still up (so the checker's EndTransaction is made before it shuts down)
  -> {"results": [{index, message_id, transaction_id, decision}], "checked": [message ids], "errors": [..],
      "received": <receive's result> | null}
push: group, topic, expect (stop after this many messages consumed successfully), fail_first [bodies whose
  first delivery the listener fails, so the client retries them], deadline_s (default 60)
  -> {"messages": [{body, attempt, message_id, result}], "errors": [..]}
receive: group, topic, expect (stop after this many acked messages), invisible_s (default 20),
  await_s (long polling, default 1: the 5.1.2 client picks a random queue for every receive, so long
  polls on empty queues could use up the deadline before it asks the queue holding the message),
  batch (default 16), deadline_s (default 60),
  hold_first (bool: do not ack a message's first delivery, so it comes back after invisible_s),
  change_first ({body: seconds}: on that body's first delivery change_invisible_duration(seconds) instead
  of the ack, then try to ack it with the handle from before the change),
  process_ms (work on each message before its ack), out (a JSONL file: each acked row as it is acked; then
  SIGTERM ends the receiving, and stop() reads the result)
  -> {"messages": [{topic, message_id, body, tag, keys, props, attempt, group, delivery_ms, asked_ms (just
       before the receive call that got it), received_ms, acked, ack_ms (just before the ack was sent),
       change_ms (just before the change was sent), stale_ack}], "errors": [..]}
auth: topic, group: a Producer starts and sends one message, then a SimpleConsumer starts, receives it (up to
  deadline_s, default 20) and acks it; each step that fails is reported and the ones after it skipped
  -> {"steps": {producer_start, send, consumer_start, receive, ack: "ok" | "<error>" | "skipped"}}
Every mode: access_key and secret_key (the client's Credentials, default none), tls (bool: the client's
tls_enable), ca_file (a PEM file the client is to trust for TLS, as GRPC_DEFAULT_SSL_ROOTS_FILE_PATH: the
client verifies the server against the default roots).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

from _common import JsonlWriter, StopFlag, emit, fail, load_args, now_ms


def produce(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    from rocketmq import Message, Producer

    topic = args["topic"]
    producer = Producer(cfg, (topic,))
    producer.startup()
    results, errors = [], []
    try:
        for i, spec in enumerate(args.get("messages") or []):
            m = Message()
            m.topic = topic
            m.body = str(spec.get("body", f"m{i}")).encode()
            if spec.get("tag"):
                m.tag = spec["tag"]
            for key in spec.get("keys") or ():
                m.keys = key  # the setter adds one key

            for k, v in (spec.get("props") or {}).items():
                m.add_property(k, v)
            if spec.get("group"):
                m.message_group = spec["group"]
            if spec.get("delay_s") is not None:
                m.delivery_timestamp = int(time.time()) + int(spec["delay_s"])
            try:
                r = producer.send(m)
                row = {"index": i, "message_id": r.message_id, "offset": r.offset,
                       "recall_handle": r.recall_handle, "recalled": None}
                if spec.get("recall"):
                    row["recalled"] = producer.recall_message(topic, r.recall_handle)
                results.append(row)
            except Exception as e:
                errors.append({"index": i, "error": f"{type(e).__name__}: {e}"})
    finally:
        producer.shutdown()
    return {"results": results, "errors": errors}


def transaction(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    import threading

    from rocketmq import Message, Producer, TransactionChecker
    from rocketmq.grpc_protocol import TransactionResolution

    topic = args["topic"]
    answer = TransactionResolution.ROLLBACK if args.get("check_answer") == "rollback" \
        else TransactionResolution.COMMIT
    checked: list[str] = []
    seen = threading.Event()

    class Checker(TransactionChecker):
        def check(self, message: Any) -> Any:
            checked.append(message.message_id)
            seen.set()
            return answer

    producer = Producer(cfg, (topic,), Checker())
    producer.startup()
    results, errors = [], []
    orphans = 0
    received = None
    try:
        for i, spec in enumerate(args.get("messages") or []):
            m = Message()
            m.topic = topic
            m.body = str(spec.get("body", f"m{i}")).encode()
            decision = spec.get("decision", "commit")
            try:
                tx = producer.begin_transaction()
                r = producer.send(m, transaction=tx)
                if decision == "commit":
                    tx.commit()
                elif decision == "rollback":
                    tx.rollback()
                else:
                    orphans += 1
                results.append({"index": i, "message_id": r.message_id, "transaction_id": r.transaction_id,
                                "decision": decision})
            except Exception as e:
                errors.append({"index": i, "error": f"{type(e).__name__}: {e}"})
        deadline = time.monotonic() + float(args.get("deadline_s", 60))
        while orphans and len(set(checked)) < orphans and time.monotonic() < deadline:
            seen.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            seen.clear()
        if args.get("verify_group"):
            received = receive({**args, "group": args["verify_group"],
                                "deadline_s": max(1.0, deadline - time.monotonic())}, cfg)
    finally:
        producer.shutdown()
    return {"results": results, "checked": checked, "errors": errors, "received": received}


def push(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    import threading

    from rocketmq import ConsumeResult, FilterExpression, MessageListener, PushConsumer

    expect = int(args.get("expect", 1))
    fail_first = set(args.get("fail_first") or ())
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    enough = threading.Event()

    class Listener(MessageListener):
        def consume(self, message: Any) -> Any:
            body = message.body.decode(errors="replace")
            ok = not (body in fail_first and message.delivery_attempt == 1)
            with lock:
                out.append({"body": body, "attempt": message.delivery_attempt,
                            "message_id": message.message_id, "result": "SUCCESS" if ok else "FAILURE",
                            "received_ms": now_ms()})
                if sum(1 for r in out if r["result"] == "SUCCESS") >= expect:
                    enough.set()
            return ConsumeResult.SUCCESS if ok else ConsumeResult.FAILURE

    consumer = PushConsumer(cfg, args["group"], Listener(), {args["topic"]: FilterExpression("*")})
    consumer.startup()
    try:
        enough.wait(float(args.get("deadline_s", 60)))
    finally:
        consumer.shutdown()
    with lock:
        return {"messages": list(out), "errors": []}


def receive(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    from rocketmq import FilterExpression, SimpleConsumer

    topic = args["topic"]
    consumer = SimpleConsumer(cfg, args["group"], {topic: FilterExpression(args.get("expression", "*"))},
                              await_duration=int(args.get("await_s", 1)))
    consumer.startup()
    expect = int(args.get("expect", 1))
    invisible = int(args.get("invisible_s", 20))
    deadline = time.monotonic() + float(args.get("deadline_s", 60))
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    acked = 0
    stop = StopFlag() if args.get("out") else None
    writer = JsonlWriter(args.get("out"))
    process_s = float(args.get("process_ms", 0)) / 1000
    change_first = args.get("change_first") or {}
    try:
        while acked < expect and time.monotonic() < deadline and not (stop and stop.stopped):
            asked_ms = now_ms()
            try:
                msgs = consumer.receive(int(args.get("batch", 16)), invisible)
            except Exception as e:
                errors.append(f"receive: {type(e).__name__}: {e}")
                continue
            for m in msgs:
                row = {"topic": m.topic, "message_id": m.message_id, "body": m.body.decode(errors="replace"),
                       "tag": m.tag, "keys": sorted(m.keys or ()), "props": dict(m.properties or {}),
                       "attempt": m.delivery_attempt, "group": m.message_group,
                       "delivery_ms": m.delivery_timestamp, "asked_ms": asked_ms, "received_ms": now_ms(),
                       "acked": False}
                if m.delivery_attempt == 1 and row["body"] in change_first:
                    before = copy.copy(m)  # keeps the handle the change replaces
                    row["change_ms"] = now_ms()
                    try:
                        consumer.change_invisible_duration(m, int(change_first[row["body"]]))
                    except Exception as e:
                        errors.append(f"change_invisible_duration: {type(e).__name__}: {e}")
                    try:
                        consumer.ack(before)
                        row["stale_ack"] = "accepted"
                    except Exception as e:
                        row["stale_ack"] = f"{type(e).__name__}: {e}"
                    out.append(row)
                    continue
                if not (args.get("hold_first") and m.delivery_attempt == 1):
                    if process_s:
                        time.sleep(process_s)  # the work a consumer does on the message
                    row["ack_ms"] = now_ms()
                    consumer.ack(m)
                    row["acked"] = True
                    acked += 1
                    writer.write(row)
                out.append(row)
    finally:
        consumer.shutdown()
        writer.close()
    return {"messages": out, "errors": errors}


def auth(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    tls, topic = bool(args.get("tls")), args["topic"]
    steps = dict.fromkeys(("producer_start", "send", "consumer_start", "receive", "ack"), "skipped")
    took: dict[str, float] = {}  # seconds per step, for a slow run's diagnosis

    def step(name: str, fn: Any) -> Any:
        t0 = time.monotonic()
        try:
            out = fn()
            steps[name] = "ok"
            return out
        except Exception as e:
            steps[name] = f"{type(e).__name__}: {e}"[:500]
            return None
        finally:
            took[name] = round(time.monotonic() - t0, 3)

    producer = Producer(cfg, (topic,), tls_enable=tls)
    step("producer_start", producer.startup)
    if steps["producer_start"] == "ok":
        m = Message()
        m.topic, m.body = topic, b"auth"
        step("send", lambda: producer.send(m))
    t0 = time.monotonic()
    producer.shutdown()
    took["producer_shutdown"] = round(time.monotonic() - t0, 3)
    consumer = SimpleConsumer(cfg, args["group"], {topic: FilterExpression("*")}, await_duration=1,
                              tls_enable=tls)
    receives = 0
    step("consumer_start", consumer.startup)
    if steps["consumer_start"] == "ok":
        deadline = time.monotonic() + float(args.get("deadline_s", 20))

        def first() -> Any:
            nonlocal receives
            while time.monotonic() < deadline:
                # invisible for 5 s: a receive whose answer reached the client after its own deadline
                # hands the message out again soon (it is acked right after it arrives)
                receives += 1
                got = consumer.receive(1, 5)
                if got:
                    return got[0]
            raise TimeoutError(f"nothing received in {receives} receives")

        got = step("receive", first)
        if got is not None:
            step("ack", lambda: consumer.ack(got))
        t0 = time.monotonic()
        consumer.shutdown()
        took["consumer_shutdown"] = round(time.monotonic() - t0, 3)
    return {"steps": steps, "seconds": took, "receives": receives}


def main() -> None:
    args = load_args(("endpoint", "mode"))
    if args.get("ca_file"):
        os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = args["ca_file"]  # read when grpc loads its roots
    from rocketmq import ClientConfiguration, Credentials

    cfg = ClientConfiguration(args["endpoint"], Credentials(args.get("access_key", ""),
                                                            args.get("secret_key", "")))
    if args["mode"] == "produce":
        emit(produce(args, cfg))
    elif args["mode"] == "transaction":
        emit(transaction(args, cfg))
    elif args["mode"] == "push":
        emit(push(args, cfg))
    elif args["mode"] == "receive":
        emit(receive(args, cfg))
    elif args["mode"] == "auth":
        emit(auth(args, cfg))
    else:
        fail(f"unknown mode {args['mode']!r}")


if __name__ == "__main__":
    main()
