"""Message traces written by the official Java client (rocketmq-client 4.9.x, enableMsgTrace on the
producer and the push consumer) and read back with Admin.message_trace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronomq.client import Admin
from chronomq.client.trace import TraceType
from tests.compat.harness import ChronomqProcess, run_driver
from tests.compat.observe import b64, uniq
from tests.conftest import wait_for

pytestmark = [pytest.mark.compat, pytest.mark.timeout(300)]


def test_java_traces_of_a_send_and_a_consume_are_found_by_message_trace(
        chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    broker = chronomq_factory()
    topic, pgroup, cgroup = uniq("JTraced"), uniq("TracePG"), uniq("TraceCG")
    [sent] = run_driver("java4:produce", {
        "namesrv": broker.namesrv_addr, "group": pgroup, "mode": "sync", "trace": True,
        "messages": [{"topic": topic, "body": b64("traced"), "keys": "TK1", "tags": "TT"}]},
        timeout=120)["results"]
    assert sent["ok"], sent
    msg_id = sent["msgId"]
    run_driver("java4:push_consume", {
        "namesrv": broker.namesrv_addr, "group": cgroup, "topic": topic, "expect": 1, "trace": True,
        "out": str(tmp_path / "deliveries.jsonl"), "maxSeconds": 60}, timeout=120)

    with Admin(broker.namesrv_addr) as admin:
        def complete() -> list[Any] | None:  # traces are sent asynchronously, each in its own time
            records = admin.message_trace(msg_id)
            types = {r.type for r in records}
            return records if {TraceType.PUB, TraceType.SUB_BEFORE, TraceType.SUB_AFTER} <= types else None

        records = wait_for(complete, timeout=60, interval=0.2,
                           message=f"the Java client's traces of {msg_id}")

    assert isinstance(records, list) and all(r.msg_id == msg_id for r in records)
    by_type = {r.type: r for r in records}
    pub, before, after = by_type[TraceType.PUB], by_type[TraceType.SUB_BEFORE], by_type[TraceType.SUB_AFTER]
    assert (pub.topic, pub.group, pub.tags, pub.keys, pub.success) == (topic, pgroup, "TT", "TK1", True)
    assert pub.offset_msg_id == sent["offsetMsgId"] and pub.msg_type_name == "Normal_Msg"
    assert pub.store_host and pub.store_host.endswith(f":{broker.broker_port}")
    assert (before.group, before.retry_times) == (cgroup, 0)
    assert after.request_id == before.request_id and after.success is True
    assert after.group == cgroup  # written by the client, or taken from its SubBefore
    order = [r.type for r in records]
    assert order.index(TraceType.PUB) < order.index(TraceType.SUB_AFTER)
