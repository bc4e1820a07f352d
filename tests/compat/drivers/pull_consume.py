"""Consume with the official 4.x pull consumer (rocketmq==0.4.4), PullConsumer.pull(topic).

args: namesrv, group, topic (required); expression (default "*"); max_num (default 32); props;
  expect: keep making passes over all queues until this many messages arrived (omit: one pass);
  deadline_s (default 30); credentials: [access key, secret key, channel] (set_session_credentials).
result: {"messages": [...], "passes": n, "reason": "expect"|"pass"|"deadline", "errors": [...]}
(a pass that raises is reported in errors and the next pass goes on, until the deadline)
"""

from __future__ import annotations

import time

from _common import emit_around_shutdown, fail, hard_exit, load_args, recv_to_dict


def main() -> None:
    args = load_args(("namesrv", "group", "topic"))
    expect = args.get("expect")
    expect = int(expect) if expect is not None else None
    deadline = time.monotonic() + float(args.get("deadline_s", 30))
    max_num = int(args.get("max_num", 32))
    if not 1 <= max_num <= 1024:
        fail("max_num must be in 1..1024")
    props = list(args.get("props") or [])

    from rocketmq.client import PullConsumer

    consumer = PullConsumer(args["group"])
    consumer.set_namesrv_addr(args["namesrv"])
    if args.get("credentials"):  # [access key, secret key, channel]: every request signed (ACL)
        consumer.set_session_credentials(*args["credentials"])
    consumer.start()
    messages = []
    passes = 0
    reason = "deadline"
    errors: list[str] = []
    while time.monotonic() < deadline:
        passes += 1
        try:
            for msg in consumer.pull(args["topic"], args.get("expression", "*"), max_num):
                messages.append(recv_to_dict(msg, props))
        except Exception as e:  # reported; the next pass goes on from the offsets reached
            errors.append(f"{type(e).__name__}: {e}")
            if len(errors) > 20:
                break
            time.sleep(0.2)
            continue
        if expect is None:
            reason = "pass"
            break
        if len(messages) >= expect:
            reason = "expect"
            break
        time.sleep(0.1)  # next pass over the queues (polling, bounded by the deadline)
    emit_around_shutdown(lambda: {"messages": messages, "passes": passes, "reason": reason, "errors": errors},
                         consumer.shutdown)
    hard_exit(0)


if __name__ == "__main__":
    main()
